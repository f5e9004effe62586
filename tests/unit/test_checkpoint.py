"""Drafter checkpoints: bit-exact round trip, atomicity, retention, damage fallback (R9),
safe loading (R11), contract check (R8) and RNG state."""

from __future__ import annotations

import errno
import json
import logging
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import dflash.train.checkpoint as ckpt_mod
from dflash.files import file_digest
from dflash.train.checkpoint import (
    MARKER,
    CheckpointDiskFull,
    CheckpointError,
    TrainState,
    find_resume_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dflash.train.rng_state import capture_rng_state, restore_rng_state
from dflash.train.run_dir import check_contract

CONTRACT = {"hidden_size": 128, "layer_ids": [1, 3], "num_targets": 2, "data": {"fingerprint": "abc"}}


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(3):
        loss = model(torch.randn(5, 8)).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _save(root: Path, step: int, *, seed: int = 0, keep: int = 2, **over) -> Path:
    model, opt, sched = _trained(seed)
    kw = dict(
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        train_state=TrainState(
            step=step, next_packet=3 * step, tokens_seen=100 * step, skipped={"empty_mask": 2}
        ),
        rng_state=capture_rng_state(),
        contract=CONTRACT,
        config_yaml="name: test\n",
        keep=keep,
    )
    kw.update(over)
    return save_checkpoint(root, step, **kw)


def _equal_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal_tree(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ------------------------------------------------------------------------------------------------
# Round trip


def test_round_trip_is_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    model, opt, sched = _trained()
    state = model.state_dict()
    state["extra.bf16"] = torch.randn(3, 5).to(torch.bfloat16)
    ts = TrainState(
        step=12,
        next_packet=40,
        tokens_seen=12345,
        skipped={"id_oob": 3},
        nonfinite_steps=1,
        wandb_run_id="abcd1234",
    )
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    rng = capture_rng_state()
    expect = (torch.rand(5), random.random(), np.random.rand(3))

    path = save_checkpoint(
        tmp_path,
        12,
        model_state=state,
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        train_state=ts,
        rng_state=rng,
        contract=CONTRACT,
        config_yaml="a: 1\n",
    )
    assert path == tmp_path / "step_00000012"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [
            "model.safetensors",
            "optimizer.pt",
            "scheduler.json",
            "train_state.json",
            "rng.pt",
            "contract.json",
            "config.yaml",
            MARKER,
        ]
    )
    marker = json.loads((path / MARKER).read_text())
    assert set(marker["files"]) == {p.name for p in path.iterdir()} - {MARKER}
    assert all(len(v["sha256"]) == 64 and v["size"] > 0 for v in marker["files"].values())
    assert _steps(tmp_path) == ["step_00000012"]  # no tmp dir left

    torch.rand(100), random.random(), np.random.rand(7)  # move every generator on
    loaded = load_checkpoint(path)
    assert _equal_tree(state, loaded.model_state)
    assert _equal_tree(opt.state_dict(), loaded.optimizer_state)
    assert loaded.scheduler_state == sched.state_dict()
    assert loaded.train_state == ts
    assert loaded.contract == CONTRACT and loaded.config_yaml == "a: 1\n" and loaded.step == 12

    restore_rng_state(loaded.rng_state)
    got = (torch.rand(5), random.random(), np.random.rand(3))
    assert torch.equal(got[0], expect[0]) and got[1] == expect[1] and np.array_equal(got[2], expect[2])

    # The restored optimizer continues exactly like the original.
    model2, opt2, sched2 = _trained(seed=7)
    model2.load_state_dict({k: v for k, v in loaded.model_state.items() if k != "extra.bf16"})
    opt2.load_state_dict(loaded.optimizer_state)
    sched2.load_state_dict(loaded.scheduler_state)
    x = torch.randn(5, 8)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        m(x).square().mean().backward()
        o.step()
        s.step()
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_non_json_scheduler_state_uses_weights_only_file(tmp_path):
    sched_state = {1: torch.tensor([1.5]), "last_epoch": 3}
    path = _save(tmp_path, 1, scheduler_state=sched_state)
    assert (path / "scheduler.pt").exists() and not (path / "scheduler.json").exists()
    assert _equal_tree(load_checkpoint(path).scheduler_state, sched_state)


def test_unsafe_state_rejected_before_writing(tmp_path):
    with pytest.raises(TypeError, match=r"optimizer_state\['bad'\]"):
        _save(tmp_path, 1, optimizer_state={"bad": object()})
    with pytest.raises(ValueError, match="train_state.step"):
        _save(tmp_path, 2, train_state=TrainState(step=3, next_packet=0))
    with pytest.raises(ValueError, match="train.keep_checkpoints"):
        _save(tmp_path, 2, keep=1)
    assert not tmp_path.exists() or _steps(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# Retention and re-saving


def test_keeps_newest_two(tmp_path):
    for s in (5, 10, 15, 20):
        _save(tmp_path, s)
    assert _steps(tmp_path) == ["step_00000015", "step_00000020"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000020"
    _save(tmp_path, 25, keep=3)
    assert _steps(tmp_path) == ["step_00000015", "step_00000020", "step_00000025"]


def test_resave_same_step_replaces_cleanly(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 10, seed=0)
    path = _save(tmp_path, 10, seed=1)
    assert _steps(tmp_path) == ["step_00000005", "step_00000010"]
    expect = _trained(seed=1)[0].state_dict()
    assert _equal_tree(expect, load_checkpoint(path).model_state)


def test_failed_resave_keeps_previous_copy(tmp_path, monkeypatch):
    _save(tmp_path, 5)
    _save(tmp_path, 10, seed=0)
    real = ckpt_mod._write_bytes

    def no_space_for_marker(path, data):
        if path.name == MARKER:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_bytes", no_space_for_marker)
    with pytest.raises(CheckpointError, match="(?i)no space left"):
        _save(tmp_path, 10, seed=1)
    assert _steps(tmp_path) == ["step_00000005", "step_00000010"]
    assert _equal_tree(
        _trained(seed=0)[0].state_dict(), load_checkpoint(tmp_path / "step_00000010").model_state
    )


def test_enospc_during_payload_leaves_previous_intact(tmp_path, monkeypatch):
    _save(tmp_path, 5)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", full)
    with pytest.raises(CheckpointError, match="step 10"):
        _save(tmp_path, 10)
    monkeypatch.undo()
    assert _steps(tmp_path) == ["step_00000005"]
    assert find_resume_checkpoint(tmp_path).step == 5


def _du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_disk_checkpoints_filled_takes_a_save_with_fewer_kept(tmp_path, monkeypatch, caplog):
    """The disk filled with 4 checkpoints (it holds 4.5); a save that may remove none fails in one
    line, leaving nothing partial; relaunched with train.keep_checkpoints=2, the save first removes
    the checkpoints its retention would remove anyway."""
    for s in (1, 2, 3, 4):
        _save(tmp_path, s, keep=4)
    capacity = _du(tmp_path) + _du(tmp_path / "step_00000004") // 2
    real = ckpt_mod._write_bytes

    def disk(path, data):  # the files written so far must fit on the disk
        if _du(tmp_path) + len(data) > capacity:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_bytes", disk)
    monkeypatch.setattr(ckpt_mod, "free_bytes", lambda _: capacity - _du(tmp_path))
    with pytest.raises(CheckpointDiskFull) as err:  # keep=5: nothing may go, the save cannot fit
        _save(tmp_path, 5, keep=5)
    line = str(err.value)
    assert (
        "\n" not in line and f"writing {tmp_path / 'step_00000005'} failed: no space left on device (" in line
    )
    assert " free there); free space there (the checkpoints beyond train.keep_checkpoints=5" in line
    assert _steps(tmp_path) == [f"step_0000000{s}" for s in (1, 2, 3, 4)]  # nothing partial left
    with caplog.at_level(logging.WARNING, logger="dflash.train.checkpoint"):
        _save(tmp_path, 5, keep=2)  # was: the same failure (old checkpoints went only after a save)
    assert _steps(tmp_path) == ["step_00000004", "step_00000005"]
    assert "removing step_00000001 before saving step 5" in caplog.text
    assert find_resume_checkpoint(tmp_path).step == 5


def test_with_room_to_spare_old_checkpoints_go_only_after_the_save(tmp_path, monkeypatch):
    for s in (1, 2, 3):
        _save(tmp_path, s, keep=3)
    seen: list[list[str]] = []
    real = ckpt_mod._write_bytes

    def spy(path, data):
        seen.append(_steps(tmp_path))
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_bytes", spy)
    _save(tmp_path, 4, keep=2)
    assert [n for n in seen[0] if n.startswith("step_")] == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ]
    assert _steps(tmp_path) == ["step_00000003", "step_00000004"]


def test_abandoned_newer_checkpoints_are_moved_aside_on_save(tmp_path, caplog):
    for s in (5, 10, 15):
        _save(tmp_path, s, keep=3)
    with caplog.at_level(logging.WARNING, logger="dflash.train.checkpoint"):
        _save(tmp_path, 10, keep=3)  # resumed from 10 and saved again
    assert [n for n in _steps(tmp_path) if n.startswith("step_")] == ["step_00000005", "step_00000010"]
    assert "step_00000015" in caplog.text
    (aside,) = tmp_path.glob("abandoned-*/step_00000015")  # moved, not deleted, and still loadable
    assert load_checkpoint(aside).step == 15
    assert find_resume_checkpoint(tmp_path).step == 10  # never picked by auto-resume


# ------------------------------------------------------------------------------------------------
# Damage and fallback


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "fname", "problem"),
    [
        (_truncate, "model.safetensors", "size"),
        (_flip, "optimizer.pt", "sha256"),
        (_flip, "rng.pt", "sha256"),
    ],
)
def test_damaged_newest_falls_back_with_warning(tmp_path, caplog, damage, fname, problem):
    _save(tmp_path, 5)
    _save(tmp_path, 10)
    damage(tmp_path / "step_00000010" / fname)
    with caplog.at_level(logging.WARNING, logger="dflash.train.checkpoint"):
        loaded = find_resume_checkpoint(tmp_path)
    assert loaded is not None and loaded.step == 5 and loaded.path == tmp_path / "step_00000005"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"step_00000010/{fname}" in w and problem in w for w in warnings), warnings
    with pytest.raises(CheckpointError, match=fname):
        load_checkpoint(tmp_path / "step_00000010")


def test_stray_tmp_and_unmarked_dirs_ignored(tmp_path):
    _save(tmp_path, 5)
    stray = tmp_path / ".step_00000010.tmp-4242"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"partial")
    unmarked = tmp_path / "step_00000015"
    shutil.copytree(tmp_path / "step_00000005", unmarked)
    (unmarked / MARKER).unlink()

    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000005"
    assert find_resume_checkpoint(tmp_path).step == 5
    _save(tmp_path, 10)  # the next save clears the stray temp dir; the unmarked one is not its own
    assert _steps(tmp_path) == ["step_00000005", "step_00000010", "step_00000015"]
    assert not stray.exists() and (unmarked / "model.safetensors").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000010"


def test_all_damaged_raises_naming_files(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 10)
    _truncate(tmp_path / "step_00000005" / "optimizer.pt")
    _flip(tmp_path / "step_00000010" / "model.safetensors")
    with pytest.raises(CheckpointError) as ei:
        find_resume_checkpoint(tmp_path)
    msg = str(ei.value)
    assert "step_00000005/optimizer.pt" in msg and "step_00000010/model.safetensors" in msg


def test_damaged_marker_is_reported(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 10)
    (tmp_path / "step_00000010" / MARKER).write_text("{not json")
    assert find_resume_checkpoint(tmp_path).step == 5


def test_nothing_to_resume(tmp_path):
    assert find_resume_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "step_00000003").mkdir()  # a save that died before its marker
    assert find_resume_checkpoint(tmp_path) is None


# ------------------------------------------------------------------------------------------------
# Safe loading (R11)


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _reseal(path: Path, fname: str) -> None:
    """Rewrite COMPLETE so that ``fname`` passes the checksum (an attacker who can edit both)."""
    marker = json.loads((path / MARKER).read_text())
    marker["files"][fname] = file_digest(path / fname)
    (path / MARKER).write_text(json.dumps(marker))


def test_crafted_pickle_is_live(tmp_path):
    """The payload used below really runs when unpickled without weights_only."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Evil(marker))).close()
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("fname", ["optimizer.pt", "rng.pt"])
@pytest.mark.parametrize("fmt", ["torch_zip", "raw_pickle"])
def test_crafted_pickle_rejected_without_running_payload(tmp_path, fname, fmt):
    marker = tmp_path / "pwned"
    path = _save(tmp_path / "ckpt", 5)
    target = path / fname
    if fmt == "torch_zip":
        torch.save({"state": _Evil(marker)}, target)
    else:
        target.write_bytes(pickle.dumps(_Evil(marker)))

    with pytest.raises(CheckpointError, match=f"{fname}: sha256|{fname}: size"):
        load_checkpoint(path)
    assert not marker.exists()

    _reseal(path, fname)  # checksum now passes: weights_only must still refuse it
    with pytest.raises(CheckpointError, match=f"{fname}: cannot load") as ei:
        load_checkpoint(path)
    assert "weights_only" in str(ei.value) or "Unsupported" in str(ei.value)
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        find_resume_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------
# Contract (R8)


def test_contract_change_refused_naming_fields():
    current = {"hidden_size": 256, "layer_ids": [1, 4], "num_targets": 2, "data": {"fingerprint": "def"}}
    with pytest.raises(ValueError) as ei:
        check_contract(CONTRACT, current, allow_change=False)
    msg = str(ei.value)
    assert "hidden_size: saved=128 current=256" in msg
    assert "layer_ids: saved=[1, 3] current=[1, 4]" in msg
    assert 'data.fingerprint: saved="abc" current="def"' in msg
    assert "num_targets" not in msg
    assert "train.allow_contract_change=true" in msg


def test_contract_change_allowed_with_flag():
    current = dict(CONTRACT, hidden_size=256, batch_tokens=4096)
    diffs = check_contract(CONTRACT, current, allow_change=True)
    assert diffs == ["batch_tokens: saved=<missing> current=4096", "hidden_size: saved=128 current=256"]


def test_a_contract_field_the_checkpoint_predates_matches_at_its_default():
    """A checkpoint written before a contract field existed (a new loss term) resumes when the run
    leaves the field at its schema default, and is refused when it sets another value."""
    saved = {"loss.ce": 1.0, "loss.gamma": 7.0}
    current = {**saved, "loss.kl": 0.0, "loss.verifier_ce": 0.0}
    assert check_contract(saved, current, allow_change=False) == []
    with pytest.raises(ValueError, match="loss.kl: saved=<missing> current=0.5"):
        check_contract(saved, {**current, "loss.kl": 0.5}, allow_change=False)


def test_contract_round_trip_matches(tmp_path):
    contract = {"layer_ids": (1, 3), "hidden_size": 128, "dtype": "float32", "ratio": 0.1}
    loaded = load_checkpoint(_save(tmp_path, 1, contract=contract))
    assert check_contract(loaded.contract, contract, allow_change=False) == []


def test_train_state_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown"):
        TrainState.from_dict({"step": 1, "next_packet": 2, "bogus": 3})
    assert TrainState.from_dict({"step": 1, "next_packet": 2}).skipped == {}


def test_a_change_of_packets_per_step_is_refused_even_when_changes_are_allowed(tmp_path):
    """Allowed, it crashed every drafter (targets and drafters disagree on the next packet); refused, the
    advice names only splits that keep the saved packets per step, and the run's export when it has one."""
    saved = {"topology.packets_per_step": 4, "train.num_steps": 10}
    now = {"topology.packets_per_step": 6, "train.num_steps": 7}
    for allow in (False, True):
        with pytest.raises(ValueError) as ei:
            check_contract(saved, now, allow_change=allow, num_drafters=2, run_dir=tmp_path)
        msg = str(ei.value)
        assert (
            "topology.packets_per_step: saved=4 current=6" in msg
            and "even with train.allow_contract_change" in msg
        )
        assert "topology.num_drafters=2 optim.grad_accum_steps=2 or topology.num_drafters=1" in msg
        assert "set train.allow_contract_change=true" not in msg and "init_from" not in msg  # no export yet
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"drafter.init_from={tmp_path}/drafter"):
        check_contract(saved, now, allow_change=True, num_drafters=3, run_dir=tmp_path)
