"""A drafter's model and optimizer state on disk with ``torch.distributed.checkpoint`` (DCP).

A sharded drafter (``drafter.shard``) checkpoints its FSDP2 shards as they are: every drafter
writes its own shard of the weights and of the optimizer state into one directory, and nobody
gathers the whole state (the whole fp32 state of a Qwen3.6-27B drafter is ~21 GB of host RAM).

- :func:`write_shards`: a collective of the drafter group; the directory holds one
  ``__<rank>_0.distcp`` file per drafter and DCP's ``.metadata`` (written by the drafter leader,
  the group's rank 0), which records where every slice of every tensor lives.
- :func:`read_shards`: loads into the layout of the model and optimizer given: FSDP2 shards over any
  number of drafters, or an unsharded model (DCP reshards on load: each rank reads the slices its
  tensors cover). The optimizer goes through ``get_state_dict`` / ``set_state_dict``, whatever
  optimizer it is (AdamW's moments, another optimizer's state: the same calls).
- :func:`read_model_state`: the whole weights in one process (no process group), e.g. to look at
  a finished run's last checkpoint.

Loading never unpickles arbitrary objects: DCP itself reads ``.metadata`` with ``pickle.load`` and
non-tensor entries (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``; here
``.metadata`` goes through an unpickler that constructs only DCP's metadata records, paths, sizes,
dtypes and layouts (:data:`METADATA_GLOBALS`), and the entries through ``torch.load(weights_only=True)``,
so a crafted file is refused (:class:`ShardIOError`), never executed. Tensors are read by DCP with
``weights_only=True`` already.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

METADATA_FILE = ".metadata"
"""DCP's index of the shards (the file that makes a directory a DCP checkpoint)."""

_DCP = "torch.distributed.checkpoint"
METADATA_GLOBALS = frozenset(
    {
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
    }
)
"""What DCP's ``.metadata`` pickle may construct: plain records (built field by field, no code of
theirs runs), paths, sizes and layouts; besides these only dtypes (``torch.<dtype>``)."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`METADATA_GLOBALS` and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata record")


class ShardIOError(RuntimeError):
    """Writing or reading the shards failed (the message names the drafters and the cause)."""


def _split(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` in the layout of ``model`` (DTensor shards when it is
    sharded; parameter names as keys of the optimizer state, whatever the optimizer)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


@contextmanager
def _named_failures(what: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a ``BaseException``: it would pass ``except Exception``) and
    the unpickler's refusal as a ``ShardIOError`` naming each failed rank and its error."""
    try:
        yield
    except CheckpointException as e:
        errors = {r: err[0] if isinstance(err, tuple) else err for r, err in e.failures.items()}
        causes = "; ".join(f"drafter {r}: {type(err).__name__}: {err}" for r, err in sorted(errors.items()))
        raise ShardIOError(f"{what} failed ({causes or e})") from None
    except pickle.UnpicklingError as e:
        raise ShardIOError(f"{what}: refused ({e}); nothing in it was executed") from None


@contextmanager
def _alone(alone: bool) -> Iterator[None]:
    """Without DCP's warning that a process without a process group saves or loads by itself
    (``no_dist``: what this process was asked to do)."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
            )
        yield


def write_shards(dest: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any) -> None:
    """Every drafter of ``group``: its shard of the model and optimizer state into ``dest`` (the
    same directory on every drafter, on a file system they all see; ``group=None``: this process
    alone writes the whole state). A collective: returns on every drafter once the leader has
    written ``.metadata``; a failed write on any drafter raises ``ShardIOError`` on every one. Each
    tensor is staged (copied to the host from a GPU) and written one at a time."""
    writer = dcp.FileSystemWriter(dest, single_file_per_rank=True, sync_files=True)
    with _named_failures(f"writing the drafter shards to {dest}"), _alone(group is None):
        dcp.save(_split(model, optimizer), storage_writer=writer, process_group=group, no_dist=group is None)


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with ``.metadata`` read by :class:`_MetadataUnpickler`, its data files
    only inside the directory."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise ShardIOError(f"{self.path}: per-rank metadata files are not written by dflash")
        with open(Path(self.path) / METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise ShardIOError(
                f"{Path(self.path) / METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata"
            )
        outside = sorted(
            {info.relative_path for info in (metadata.storage_data or {}).values()}
            - {p.name for p in Path(self.path).iterdir()}
        )
        if outside:
            raise ShardIOError(
                f"{Path(self.path) / METADATA_FILE} names data files not in {self.path}: {outside}"
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_shards(src: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any | None) -> None:
    """Load the state :func:`write_shards` wrote into ``model`` and ``optimizer``, in their layout
    (FSDP2 shards over ``group``, whatever the number of drafters that wrote it; or, with
    ``group=None``, a whole model read by this process alone). Every drafter of ``group`` calls it."""
    with _named_failures(f"reading {src / METADATA_FILE}"):
        _SafeReader(src).read_metadata()  # a crafted or damaged index is named before DCP starts
    state = _split(model, optimizer)
    with _named_failures(f"reading the drafter shards from {src}"), _alone(group is None):
        dcp.load(
            state,
            storage_reader=_SafeReader(src),
            planner=_SafePlanner(),
            process_group=group,
            no_dist=group is None,
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def read_model_state(src: Path) -> dict[str, Tensor]:
    """The whole weights in ``src`` (on the CPU), read by this process alone."""
    reader = _SafeReader(src)
    with _named_failures(f"reading {src / METADATA_FILE}"):
        metadata = reader.read_metadata()
    state: dict[str, Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, dcp_metadata.TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with _named_failures(f"reading the drafter shards from {src}"), _alone(True):
        dcp.load(state, storage_reader=_SafeReader(src), planner=_SafePlanner(), no_dist=True)
    return {key.removeprefix("model."): t for key, t in state.items()}
