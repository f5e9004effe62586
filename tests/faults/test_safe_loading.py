"""R10: a crafted pickle passed as the checkpoint to resume from is refused without running its
payload; the W&B key of the environment ends up in no file a run writes, nor in its output."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil

import pytest
import torch
from faultkit import SENTINEL, STEPS, figure
from runner import env_for, launch, no_leftover_processes

from dflash.train.checkpoint import CheckpointError, load_checkpoint

pytestmark = pytest.mark.faults


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: the marker file proves the pickle was executed."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_pickle_checkpoint_is_refused_without_running_it(tmp_path, run_cache, reference):
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Payload(live))).close()
    assert live.exists()  # the payload is real
    marker = tmp_path / "pwned"
    # A copy of a real checkpoint whose optimizer.pt is the payload, with COMPLETE rewritten to match it
    # (an attacker who can write both): only torch.load(weights_only=True) stands in the way.
    evil = tmp_path / "evil" / "step_00000012"
    shutil.copytree(reference.run_dir / "checkpoints" / "step_00000012", evil)
    torch.save({"state": _Payload(marker)}, evil / "optimizer.pt")
    complete = json.loads((evil / "COMPLETE").read_text())
    data = (evil / "optimizer.pt").read_bytes()
    complete["files"]["optimizer.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (evil / "COMPLETE").write_text(json.dumps(complete))

    run = launch(tmp_path / "run", [*STEPS, f"train.resume={evil}", "logging.mode=disabled"], run_cache)
    assert run.returncode != 0
    log = run.rank_log(2)
    refused = (
        f"{evil / 'optimizer.pt'}: cannot load optimizer state: refused by torch.load(weights_only=True)"
    )
    assert refused in log, log[-3000:]
    assert not marker.exists()
    # A bare pickle given as the checkpoint is not even opened as one.
    bare = tmp_path / "evil.pt"
    bare.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        load_checkpoint(bare)
    assert not marker.exists()
    figure("R10 crafted pickle", exit_code=run.returncode, payload_ran=marker.exists(), error=refused)
    assert no_leftover_processes(run)


def test_wandb_key_is_in_no_file_the_run_writes(reference):
    assert (
        env_for(reference.run_dir, {"WANDB_API_KEY": SENTINEL})["WANDB_API_KEY"] == SENTINEL
    )  # it was passed
    files = [p for p in reference.run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "model.safetensors" for p in files)
    hits = [str(p) for p in files if SENTINEL.encode() in p.read_bytes()]
    assert hits == []
    assert SENTINEL not in reference.stdout and SENTINEL not in reference.stderr
    figure(
        "R10 W&B key",
        files_scanned=len(files),
        bytes_scanned=sum(p.stat().st_size for p in files),
        sentinel_hits=len(hits),
    )
