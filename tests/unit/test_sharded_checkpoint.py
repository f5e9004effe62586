"""Checkpoints of DCP shards (format 2, ``dflash.distributed.sharded_state``) in one process: the
round trip is bit-exact through ``save_checkpoint`` / ``load_checkpoint`` / ``read_shards`` (the
real drafter and its AdamW), every shard file is checksummed and a damaged one is named, a crafted
``.metadata`` or non-tensor entry is refused without running it, and a resume that would change the
packets per step is refused in one line. Several drafters: tests/multiproc/test_sharding.py and
test_drafter_shard_job.py."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from tiny_drafter import tiny_arch

from dflash.config import OptimConfig, TrainConfig, UserError
from dflash.distributed.sharded_state import (
    ShardIOError,
    _SafePlanner,
    read_model_state,
    read_shards,
    write_shards,
)
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.optim import build_optimizer
from dflash.files import file_digest
from dflash.train.checkpoint import (
    MARKER,
    CheckpointError,
    TrainState,
    find_resume_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dflash.train.rng_state import capture_rng_state
from dflash.train.run_dir import resume_checkpoint


def _trained(seed: int):
    model = DFlashDraftModel(tiny_arch())
    model.reset_parameters(seed=seed)
    opt = build_optimizer(list(model.parameters()), OptimConfig(lr=1e-2))
    for p in model.parameters():  # two AdamW steps on fixed gradients: moments and step counts exist
        p.grad = torch.full_like(p, 0.01 * (seed + 1))
    opt.step()
    opt.step()
    return model, opt


def _save(root: Path, step: int, model, opt, contract: dict | None = None) -> Path:
    return save_checkpoint(
        root,
        step,
        shards=lambda dest: write_shards(dest, model, opt, group=None),
        scheduler_state={"last_epoch": step},
        train_state=TrainState(step=step, next_packet=2 * step),
        rng_state=capture_rng_state(),
        contract=contract or {"topology.packets_per_step": 2},
        config_yaml="name: test\n",
    )


def test_round_trip_is_bit_exact_and_every_shard_file_is_listed(tmp_path):
    model, opt = _trained(seed=0)
    path = _save(tmp_path, 4, model, opt)
    marker = json.loads((path / MARKER).read_text())
    assert marker["format"] == 2
    assert {"state/.metadata", "state/__0_0.distcp"} <= marker["files"].keys()
    assert not (path / "model.safetensors").exists() and not (path / "optimizer.pt").exists()

    loaded = load_checkpoint(path)
    assert (
        loaded.model_state is None and loaded.optimizer_state is None and loaded.state_dir == path / "state"
    )
    fresh, fresh_opt = _trained(seed=1)  # other weights and moments, overwritten by the load
    read_shards(loaded.state_dir, fresh, fresh_opt, group=None)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, got = opt.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == got["param_groups"]
    for i, s in saved["state"].items():
        assert all(torch.equal(v, got["state"][i][k]) for k, v in s.items())
    whole = read_model_state(loaded.state_dir)
    assert whole.keys() == model.state_dict().keys()
    assert all(torch.equal(whole[k], v) for k, v in model.state_dict().items())


def test_a_damaged_shard_is_named_and_the_previous_checkpoint_taken(tmp_path, caplog):
    model, opt = _trained(seed=0)
    _save(tmp_path, 2, model, opt)
    newest = _save(tmp_path, 4, model, opt)
    shard = newest / "state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    found = find_resume_checkpoint(tmp_path)
    assert found is not None and found.step == 2
    assert f"{shard}: size" in caplog.text


def test_save_takes_whole_tensors_or_shards():
    model, opt = _trained(seed=0)
    common = dict(
        scheduler_state={},
        train_state=TrainState(step=1, next_packet=2),
        rng_state={},
        contract={},
        config_yaml="",
    )
    for bad in (
        {},
        {"model_state": model.state_dict()},
        {"shards": print, "model_state": {}, "optimizer_state": {}},
    ):
        with pytest.raises(ValueError, match="model_state and optimizer_state, or shards"):
            save_checkpoint(Path("unused"), 1, **bad, **common)


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_crafted_metadata_pickle_is_refused_without_running_it(tmp_path):
    model, opt = _trained(seed=0)
    path = _save(tmp_path, 3, model, opt)
    pwned = tmp_path / "pwned"
    (path / "state" / ".metadata").write_bytes(pickle.dumps(_Evil(pwned)))
    listed = json.loads((path / MARKER).read_text())  # resealed: an attacker who can write both
    listed["files"]["state/.metadata"] = file_digest(path / "state" / ".metadata")
    (path / MARKER).write_text(json.dumps(listed))
    loaded = load_checkpoint(path)
    assert loaded.state_dir is not None
    with pytest.raises(
        ShardIOError, match=r"refused \(io.open is not a DCP metadata record\); nothing in it was executed"
    ):
        read_shards(loaded.state_dir, model, opt, group=None)
    with pytest.raises(ShardIOError, match="refused"):
        read_model_state(loaded.state_dir)
    assert not pwned.exists()


def test_an_index_pointing_outside_its_directory_is_refused(tmp_path):
    model, opt = _trained(seed=0)
    state = _save(tmp_path, 3, model, opt) / "state"
    with open(state / ".metadata", "rb") as f:
        index = pickle.load(f)  # written by this test
    for info in index.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (state / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(ShardIOError, match=r"names data files not in .*\['../../secret.distcp'\]"):
        read_shards(state, model, opt, group=None)


def test_a_crafted_entry_is_refused_by_weights_only(tmp_path):
    """Non-tensor entries (the optimizer's hyperparameters) load with ``weights_only=True`` (DCP's own
    planner uses ``weights_only=False``)."""
    pwned = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Evil(pwned), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        _SafePlanner().load_bytes(None, buf)  # type: ignore[arg-type]
    assert not pwned.exists()


def test_a_resume_with_other_packets_per_step_is_refused_naming_splits_that_keep_it(tmp_path):
    """A sharded checkpoint reshards across drafter counts, but not across packets per step."""
    model, opt = _trained(seed=0)
    loaded = load_checkpoint(_save(tmp_path, 3, model, opt))
    train = TrainConfig(resume=str(loaded.path), allow_contract_change=True)  # not a contract change to allow
    same = resume_checkpoint(tmp_path, train, {"topology.packets_per_step": 2}, str, is_leader=True)
    assert same is not None and same.train_state.next_packet == 6
    with pytest.raises(UserError) as ei:
        resume_checkpoint(
            tmp_path, train, {"topology.packets_per_step": 3}, str, is_leader=True, num_drafters=3
        )
    why = str(ei.value)
    assert "topology.packets_per_step: saved=2 current=3" in why
    assert "topology.num_drafters=1 optim.grad_accum_steps=2" in why


def test_checkpoints_of_whole_tensors_are_read_as_before(tmp_path):
    """Format 1 (an unsharded drafter) keeps its files and loads its tensors at once."""
    model, opt = _trained(seed=0)
    path = save_checkpoint(
        tmp_path,
        1,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state={},
        train_state=TrainState(step=1, next_packet=2),
        rng_state=capture_rng_state(),
        contract={},
        config_yaml="",
    )
    assert json.loads((path / MARKER).read_text())["format"] == 1
    loaded = load_checkpoint(path)
    assert loaded.state_dir is None and loaded.model_state is not None
    with pytest.raises(CheckpointError, match="format 3, expected 1 or 2"):
        listed = json.loads((path / MARKER).read_text())
        (path / MARKER).write_text(json.dumps({**listed, "format": 3}))
        load_checkpoint(path)
