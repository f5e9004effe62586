"""Drafter checkpoints: atomic save, verified load, resume selection, retention.

Only the drafter leader calls ``save_checkpoint``; a sharded drafter's other drafters write their
shards into the leader's temporary directory at the same time (``shards``, below). Target ranks
hold no training state; they restart from ``TrainState.next_packet``.

Layout of one checkpoint::

    root/step_00000012/
        model.safetensors   drafter weights (safetensors, no pickle)           } whole tensors
        optimizer.pt        torch.save of tensors and primitives (loads with   } (format 1: an
                            weights_only=True)                                 } unsharded drafter)
        state/              the model and optimizer state as DCP shards, one   } format 2: a sharded
                            __<drafter>_0.distcp per drafter and .metadata     } drafter (drafter.shard)
        scheduler.json      LR scheduler state (scheduler.pt with weights_only=True if not JSON)
        train_state.json    TrainState
        rng.pt              python / numpy / torch CPU / CUDA generator states (dflash.train.rng_state)
        contract.json       what must not change across a resume (dflash.train.run_dir.check_contract)
        config.yaml         the resolved config of the run that wrote it
        COMPLETE            JSON {"format", "files": {name: {"size", "sha256"}}, ...}, written last

A sharded drafter's state is never gathered whole: each drafter writes its own shard
(``dflash.distributed.sharded_state``), and any number of drafters, sharded or not, reads it back
(DCP reshards on load). ``shards`` is the collective that writes them: the leader calls it with the
temporary directory's ``state/`` inside ``save_checkpoint``, the others at the same time with None.

The save is atomic (``dflash.files.atomic_directory``), and a checkpoint counts only once its
COMPLETE marker exists:

1. Write every file, COMPLETE last, into a hidden temp sibling ``root/.step_00000012.tmp-*``.
2. fsync every file and the directory, then put it in place as ``step_00000012`` (replacing an
   existing copy of the same step by an atomic exchange), and fsync ``root``.
3. Retention runs only after that (unless the disk is short of space: below).

A crash at any point leaves either the previous state or the complete new checkpoint; a hidden
temp directory or a ``step_*`` directory without COMPLETE is ignored.

Retention keeps the newest ``keep`` complete checkpoints. When the disk has less free space than
the newest checkpoint took, the save first removes the ones its retention would remove afterwards
(never the newest complete one), so a relaunch with a smaller ``train.keep_checkpoints`` on a disk
that checkpoints filled can save again. A checkpoint is removed by renaming it to a hidden
``.step_*.prune-*`` sibling first (it stops being a checkpoint in one step), then deleting its
COMPLETE marker, then the rest: a kill mid-removal never leaves a marked, incomplete checkpoint,
and the next save removes the hidden leftover. A full disk is a ``CheckpointDiskFull``: one line
naming the directory, the free space and the fix. Loading checks the size and
sha256 of every file against COMPLETE before deserialising anything. The only deserialisers used are
safetensors, json, ``torch.load(weights_only=True)`` and, for DCP's ``.metadata``, torch's
weights-only unpickler with DCP's metadata records allowed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle  # only for pickle.UnpicklingError; nothing is unpickled outside weights_only
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.files import DiskFull, atomic_directory, file_digest, free_bytes, fsync_path, human_bytes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Whole tensors: ``model.safetensors`` and ``optimizer.pt``."""
SHARDED_FORMAT = 2
"""The model and optimizer state as DCP shards in ``state/`` (older dflash refuses it by its format)."""
MARKER = "COMPLETE"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_DIR = "state"
STATE_INDEX = f"{STATE_DIR}/.metadata"
SCHEDULER_JSON = "scheduler.json"
SCHEDULER_PT = "scheduler.pt"
TRAIN_STATE_FILE = "train_state.json"
RNG_FILE = "rng.pt"
CONTRACT_FILE = "contract.json"
CONFIG_FILE = "config.yaml"
REQUIRED_FILES = (MODEL_FILE, OPTIMIZER_FILE, TRAIN_STATE_FILE, RNG_FILE, CONTRACT_FILE, CONFIG_FILE)
SHARDED_REQUIRED_FILES = (STATE_INDEX, TRAIN_STATE_FILE, RNG_FILE, CONTRACT_FILE, CONFIG_FILE)

ShardWriter = Callable[[Path | None], None]
"""Writes a sharded drafter's model and optimizer state: a collective of every drafter, the leader
passing the directory to write (``<checkpoint>/state``), the others None."""

_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
_STRAY_RE = re.compile(r"^\.step_(\d{8,})\.(tmp|old|prune)-\d+(-[0-9a-f]+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or cannot be written."""


class CheckpointDiskFull(CheckpointError, DiskFull):
    """A checkpoint the disk could not take; the message is one line (directory, free space, fix)."""


@dataclass
class TrainState:
    """Training progress, stored as JSON in every checkpoint."""

    step: int = 0
    """Optimizer steps completed."""
    next_packet: int = 0
    """Global packet counter: packets < next_packet are consumed; targets restart here."""
    tokens_seen: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Bad-input counters by reason, kept across resume."""
    nonfinite_steps: int = 0
    wandb_run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainState:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TrainState fields {unknown}")
        for required in ("step", "next_packet"):
            if required not in d:
                raise ValueError(f"TrainState field {required!r} is missing")
        return cls(**{k: d[k] for k in names if k in d})


@dataclass
class LoadedCheckpoint:
    model_state: dict[str, torch.Tensor] | None
    """Whole weights (format 1); None for DCP shards, which ``state_dir`` holds."""
    optimizer_state: dict | None
    scheduler_state: dict
    train_state: TrainState
    rng_state: dict
    contract: dict
    path: Path
    config_yaml: str = ""
    state_dir: Path | None = None
    """The DCP shards of the model and optimizer state (format 2), read once the model exists
    (``dflash.distributed.sharded_state.read_shards``); None for whole tensors."""

    @property
    def step(self) -> int:
        return self.train_state.step


# --------------------------------------------------------------------------------------------
# Small filesystem helpers


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _write_bytes(path: Path, data: bytes) -> None:
    """A file inside the checkpoint's temp directory (``atomic_directory`` fsyncs it before the rename)."""
    with open(path, "wb") as f:
        f.write(data)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR_RE.match(path.name)
    return int(m.group(1)) if m else None


def _list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` for every ``step_*`` directory, newest first (complete or not)."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        step = _step_of(p)
        if step is not None and p.is_dir() and not p.is_symlink():
            out.append((step, p))
    return sorted(out, reverse=True)


def _is_marked(path: Path) -> bool:
    return (path / MARKER).is_file()


# --------------------------------------------------------------------------------------------
# Validation of what goes into torch.save (so it always loads back with weights_only=True)

_PRIMITIVES = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _check_weights_only_tree(obj: Any, where: str) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.layout != torch.strided:
            raise TypeError(f"{where}: only dense tensors can be checkpointed (got layout {obj.layout})")
        return
    if isinstance(obj, _PRIMITIVES):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str | int):
                raise TypeError(f"{where}: key {k!r} has type {type(k).__name__}; only str/int keys")
            _check_weights_only_tree(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_weights_only_tree(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where}: {type(obj).__name__} cannot be checkpointed; only tensors, numbers, strings, "
        "None and dicts/lists/tuples of them load with torch.load(weights_only=True)"
    )


def _plain(obj: Any) -> Any:
    """Convert mapping subclasses (OrderedDict, defaultdict) to dict and tuples kept as is."""
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj


def _model_tensors(model_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors; tensors sharing storage are cloned (safetensors refuses them)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model_state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model_state[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key in seen:
            t = t.clone()
        elif t.numel():
            seen.add(key)
        out[name] = t
    return out


def _json_roundtrips(obj: Any) -> str | None:
    """JSON text of ``obj`` if it reads back equal (with tuples allowed to become lists)."""
    try:
        text = json.dumps(obj, indent=1, sort_keys=True)
    except (TypeError, ValueError):
        return None
    try:
        if json.loads(text) == tuples_to_lists(obj):
            return text
    except Exception:
        pass
    return None


def tuples_to_lists(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: tuples_to_lists(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [tuples_to_lists(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# Save


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
    shards: ShardWriter | None = None,
    scheduler_state: dict,
    train_state: TrainState,
    rng_state: dict,
    contract: dict,
    config_yaml: str,
    keep: int = 2,
) -> Path:
    """Write ``root/step_<step>`` atomically and return its path. Older checkpoints beyond the
    newest ``keep`` and leftovers of interrupted saves are removed after the new one is complete,
    or before it when the disk is short of space (:func:`_make_room`).

    The drafter state is either whole (``model_state`` and ``optimizer_state``, format 1) or written
    by ``shards`` into ``state/`` (format 2; the other drafters call their ``shards`` with None
    meanwhile).

    Raises ``CheckpointError`` (the temporary directory is removed) when writing fails,
    ``CheckpointDiskFull`` on a full disk, and ``TypeError``/``ValueError`` for state that cannot be
    checkpointed safely.
    """
    if keep < 2:
        raise ValueError(f"train.keep_checkpoints={keep} must be >= 2; set train.keep_checkpoints=2")
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if train_state.step != step:
        raise ValueError(f"train_state.step={train_state.step} differs from the checkpoint step {step}")

    whole = model_state is not None and optimizer_state is not None
    if whole == (shards is not None) or (model_state is None) != (optimizer_state is None):
        raise ValueError("save_checkpoint takes model_state and optimizer_state, or shards")
    # Validate everything before touching the disk.
    if optimizer_state is not None:
        optimizer_state = _plain(optimizer_state)
        _check_weights_only_tree(optimizer_state, "optimizer_state")
    rng_state = _plain(rng_state)
    _check_weights_only_tree(rng_state, "rng_state")
    scheduler_state = _plain(scheduler_state)
    scheduler_json = _json_roundtrips(scheduler_state)
    if scheduler_json is None:
        _check_weights_only_tree(scheduler_state, "scheduler_state")
    train_state_json = json.dumps(train_state.to_dict(), indent=1, sort_keys=True)
    contract_json = json.dumps(contract, indent=1, sort_keys=True)
    tensors = _model_tensors(model_state) if model_state is not None else None

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    t0 = time.perf_counter()
    _make_room(root, step, keep)
    fix = (
        f"free space there (the checkpoints beyond train.keep_checkpoints={keep} are removed before a save "
        "that needs their room), or put the run on a larger disk (hydra.run.dir=...), and relaunch to resume"
    )
    try:
        with atomic_directory(final, fix=fix) as tmp:
            if shards is not None:
                shards(tmp / STATE_DIR)
            else:
                from safetensors.torch import save_file

                assert tensors is not None
                save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt", "step": str(step)})
                del tensors
                torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
            if scheduler_json is not None:
                _write_bytes(tmp / SCHEDULER_JSON, scheduler_json.encode())
            else:
                torch.save(scheduler_state, tmp / SCHEDULER_PT)
            _write_bytes(tmp / TRAIN_STATE_FILE, train_state_json.encode())
            torch.save(rng_state, tmp / RNG_FILE)
            _write_bytes(tmp / CONTRACT_FILE, contract_json.encode())
            _write_bytes(tmp / CONFIG_FILE, config_yaml.encode())
            files = {}
            for p in sorted(tmp.rglob("*")):
                if p.is_file():
                    files[p.relative_to(tmp).as_posix()] = file_digest(p)
            fmt = FORMAT_VERSION if shards is None else SHARDED_FORMAT
            marker = {"format": fmt, "step": step, "created": time.time(), "files": files}
            _write_bytes(tmp / MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
    except (TypeError, ValueError):
        raise
    except DiskFull as e:
        raise CheckpointDiskFull(f"checkpoint step {step}: {e}") from None
    except Exception as e:
        raise CheckpointError(f"writing checkpoint step {step} under {root} failed: {e!r}") from e

    _apply_retention(root, step, keep)
    logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - t0)
    return final


def _checkpoint_bytes(path: Path) -> int:
    """Bytes the files of one checkpoint directory take."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _prune(root: Path, path: Path) -> None:
    """Remove one checkpoint so that a kill at any moment leaves no marked, incomplete checkpoint:
    rename it to a hidden stray (no longer a ``step_*`` directory), delete its marker, then the rest."""
    stray = root / f".{path.name}.prune-{os.getpid()}-{os.urandom(4).hex()}"
    os.rename(path, stray)
    try:
        fsync_path(root)
    except OSError:
        pass
    (stray / MARKER).unlink(missing_ok=True)
    _rmtree(stray)


def _remove_strays(root: Path) -> None:
    """Leftovers of interrupted saves and removals (hidden ``.step_*.tmp/old/prune-*`` directories)."""
    for p in root.iterdir():
        if _STRAY_RE.match(p.name) and p.is_dir():
            logger.info("removing leftover of an interrupted save: %s", p)
            _rmtree(p)


def _make_room(root: Path, new_step: int, keep: int) -> None:
    """Before saving ``new_step``: remove the leftovers of interrupted saves, and, while the disk has
    less free space than the newest complete checkpoint takes (+5% and 16 MiB), the complete
    checkpoints the retention after this save would remove anyway, oldest first. The newest
    ``keep - 1`` (>= 1) older complete checkpoints are never touched here."""
    _remove_strays(root)
    older = [(s, p) for s, p in _list_step_dirs(root) if s < new_step and _is_marked(p)]
    if len(older) < keep:
        return
    size = _checkpoint_bytes(older[0][1])
    need = int(size * 1.05) + (16 << 20)
    for _, path in reversed(older[keep - 1 :]):
        free = free_bytes(root)
        if free is None or free >= need:
            return
        logger.warning(
            "%s free under %s, the last checkpoint took %s: removing %s before saving step %d "
            "(train.keep_checkpoints=%d)",
            human_bytes(free),
            root,
            human_bytes(size),
            path.name,
            new_step,
            keep,
        )
        _prune(root, path)


def _apply_retention(root: Path, new_step: int, keep: int) -> None:
    """Delete the stray temp dirs of interrupted saves and the complete checkpoints beyond the
    newest ``keep`` (the only things this deletes are what ``save_checkpoint`` wrote). Complete
    checkpoints newer than the one just saved (an abandoned timeline, after a resume from an older
    checkpoint) would be picked by the next auto-resume: they are moved to
    ``root/abandoned-<time>/``, never deleted. A ``step_*`` directory without a COMPLETE marker was
    not written by a save (a save puts only complete directories in place): it is left alone."""
    marked: list[tuple[int, Path]] = []
    for step, path in _list_step_dirs(root):
        if step > new_step and _is_marked(path):
            dest = root / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}" / path.name
            dest.parent.mkdir(exist_ok=True)
            os.rename(path, dest)
            logger.warning(
                "moved checkpoint %s to %s: it is newer than the step %d just saved (a timeline "
                "abandoned by a resume from an older checkpoint)",
                path,
                dest,
                new_step,
            )
        elif not _is_marked(path):
            logger.warning("leaving %s alone: no %s marker, so no save of this run wrote it", path, MARKER)
        else:
            marked.append((step, path))
    for _, path in marked[keep:]:
        _prune(root, path)
    _remove_strays(root)
    try:
        fsync_path(root)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Load


def latest_checkpoint(root: Path) -> Path | None:
    """The newest ``step_*`` directory with a COMPLETE marker (not verified), or None."""
    for _, path in _list_step_dirs(Path(root)):
        if _is_marked(path):
            return path
    return None


def _read_marker(path: Path) -> dict:
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} is incomplete: no {MARKER} marker")
    try:
        meta = json.loads(marker.read_text())
        files = meta["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise ValueError("bad 'files' table")
    except Exception as e:
        raise CheckpointError(f"{marker}: unreadable marker ({e!r})") from e
    if meta.get("format") not in (FORMAT_VERSION, SHARDED_FORMAT):
        raise CheckpointError(
            f"{marker}: format {meta.get('format')!r}, expected {FORMAT_VERSION} or {SHARDED_FORMAT} "
            "(written by a newer dflash? resume it with that version)"
        )
    step = _step_of(path)
    if step is not None and meta.get("step") != step:
        raise CheckpointError(f"{marker}: step {meta.get('step')!r} does not match directory {path.name}")
    return meta


def _good_name(fname: str, sharded: bool) -> bool:
    """A name COMPLETE may list: a plain file of the checkpoint, or (format 2) one inside ``state/``."""
    parts = fname.split("/")
    if sharded and len(parts) == 2 and parts[0] == STATE_DIR:
        return parts[1] not in ("", ".", "..")
    return len(parts) == 1 and not fname.startswith(".") and fname != ""


def verify_checkpoint(path: Path) -> dict:
    """Check every file against COMPLETE (presence, size, sha256). Returns the marker; raises
    ``CheckpointError`` naming each bad file and its problem."""
    path = Path(path)
    meta = _read_marker(path)
    files: dict[str, dict] = meta["files"]
    sharded = meta["format"] == SHARDED_FORMAT
    problems = []
    for req in SHARDED_REQUIRED_FILES if sharded else REQUIRED_FILES:
        if req not in files:
            problems.append(f"{path / req}: not listed in {MARKER}")
    if SCHEDULER_JSON not in files and SCHEDULER_PT not in files:
        problems.append(f"{path / SCHEDULER_JSON}: not listed in {MARKER}")
    for fname, expect in files.items():
        if not _good_name(fname, sharded):
            problems.append(f"{path}: bad file name {fname!r} in {MARKER}")
            continue
        p = path / fname
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size = p.stat().st_size
        if size != expect["size"]:
            problems.append(f"{p}: size {size} bytes, {MARKER} says {expect['size']} (truncated or modified)")
            continue
        if file_digest(p)["sha256"] != expect["sha256"]:
            problems.append(f"{p}: sha256 mismatch (corrupted or modified)")
    if problems:
        raise CheckpointError("checkpoint failed verification:\n  " + "\n  ".join(problems))
    return meta


def _deserialise(p: Path, what: str, fn: Any) -> Any:
    try:
        return fn()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        # torch's message advises weights_only=False; never do that. Keep only the reason.
        text = str(e)
        m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. Please use|\n\n|$)", text, re.S)
        reason = " ".join((m.group(1) if m else text.splitlines()[0]).split())
        raise CheckpointError(
            f"{p}: cannot load {what}: refused by torch.load(weights_only=True) ({reason}); the file "
            "holds more than tensors and primitives (a foreign or crafted pickle) and was not executed"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{p}: cannot load {what} ({type(e).__name__}: {e})") from e


def _torch_load(p: Path, map_location: Any) -> Any:
    # weights_only=True explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD cannot override it.
    return torch.load(p, map_location=map_location, weights_only=True, mmap=False)


def load_checkpoint(path: Path, *, map_location: Any = "cpu") -> LoadedCheckpoint:
    """Verify (sizes + sha256 against COMPLETE), then deserialise one checkpoint directory."""
    path = Path(path)
    meta = verify_checkpoint(path)
    files = meta["files"]

    from safetensors.torch import load_file

    device = str(map_location) if isinstance(map_location, str | torch.device) else "cpu"
    model_state, optimizer_state, state_dir = None, None, None
    if meta["format"] == SHARDED_FORMAT:
        state_dir = path / STATE_DIR
    else:
        model_state = _deserialise(
            path / MODEL_FILE, "model weights", lambda: load_file(path / MODEL_FILE, device=device)
        )
        optimizer_state = _deserialise(
            path / OPTIMIZER_FILE, "optimizer state", lambda: _torch_load(path / OPTIMIZER_FILE, map_location)
        )
    if SCHEDULER_JSON in files:
        scheduler_state = _deserialise(
            path / SCHEDULER_JSON, "scheduler state", lambda: json.loads((path / SCHEDULER_JSON).read_text())
        )
    else:
        scheduler_state = _deserialise(
            path / SCHEDULER_PT, "scheduler state", lambda: _torch_load(path / SCHEDULER_PT, "cpu")
        )
    train_state = _deserialise(
        path / TRAIN_STATE_FILE,
        "train state",
        lambda: TrainState.from_dict(json.loads((path / TRAIN_STATE_FILE).read_text())),
    )
    rng_state = _deserialise(path / RNG_FILE, "RNG state", lambda: _torch_load(path / RNG_FILE, "cpu"))
    contract = _deserialise(
        path / CONTRACT_FILE, "contract", lambda: json.loads((path / CONTRACT_FILE).read_text())
    )
    config_yaml = _deserialise(path / CONFIG_FILE, "config", lambda: (path / CONFIG_FILE).read_text())
    if (
        not isinstance(optimizer_state, dict | None)
        or not isinstance(rng_state, dict)
        or not isinstance(contract, dict)
    ):
        raise CheckpointError(f"{path}: optimizer, rng and contract states must be dicts")
    step = _step_of(path)
    if step is not None and train_state.step != step:
        raise CheckpointError(
            f"{path / TRAIN_STATE_FILE}: step {train_state.step} does not match {path.name}"
        )
    return LoadedCheckpoint(
        model_state=model_state,
        optimizer_state=optimizer_state,
        scheduler_state=scheduler_state,
        train_state=train_state,
        rng_state=rng_state,
        contract=contract,
        path=path,
        config_yaml=config_yaml,
        state_dir=state_dir,
    )


def find_resume_checkpoint(root: Path, *, map_location: Any = "cpu") -> LoadedCheckpoint | None:
    """The newest complete checkpoint under ``root`` that verifies and loads.

    Directories without COMPLETE (a save that was interrupted) and hidden tmp dirs are skipped.
    A damaged complete checkpoint is reported with ``logger.warning`` (naming the file and the
    problem), and the previous one is tried. Returns None when there is no complete checkpoint.
    Raises ``CheckpointError`` naming every file when complete checkpoints exist but none loads.
    """
    root = Path(root)
    failures: list[str] = []
    for _, path in _list_step_dirs(root):
        if not _is_marked(path):
            logger.warning("ignoring %s: no %s marker (an interrupted save)", path, MARKER)
            continue
        try:
            ckpt = load_checkpoint(path, map_location=map_location)
        except CheckpointError as e:
            logger.warning("checkpoint %s is damaged, trying the previous one: %s", path, e)
            failures.append(str(e))
            continue
        if failures:
            logger.warning(
                "resuming from %s (step %d) after skipping %d damaged checkpoint(s)",
                path,
                ckpt.step,
                len(failures),
            )
        return ckpt
    if failures:
        raise CheckpointError(
            f"no checkpoint under {root} can be loaded; every complete one is damaged:\n"
            + "\n".join(failures)
        )
    return None
