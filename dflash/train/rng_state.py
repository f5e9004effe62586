"""The state of every random generator a training step uses (Python, numpy, torch CPU, CUDA), as
tensors and primitives only, so that a checkpoint's ``rng.pt`` loads with ``weights_only=True``."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and (if CUDA is initialised) every CUDA generator, as tensors and
    primitives only, so that ``rng.pt`` loads with ``weights_only=True``."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "torch": torch.get_rng_state(),
    }
    s = np.random.get_state(legacy=False)
    state["numpy"] = {
        "bit_generator": s["bit_generator"],
        "key": torch.from_numpy(s["state"]["key"].astype(np.int64)),
        "pos": int(s["state"]["pos"]),
        "has_gauss": int(s["has_gauss"]),
        "gauss": float(s["gauss"]),
    }
    # Only when CUDA is already initialised: touching the generators would create a context on
    # every visible GPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``."""
    py = state["python"]
    internal = py["internal"]
    internal = tuple(int(x) for x in (internal.tolist() if isinstance(internal, torch.Tensor) else internal))
    random.setstate((int(py["version"]), internal, py["gauss_next"]))
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        s = state["numpy"]
        key = s["key"].numpy() if isinstance(s["key"], torch.Tensor) else np.asarray(s["key"])
        np.random.set_state(
            {
                "bit_generator": s["bit_generator"],
                "state": {"key": key.astype(np.uint32), "pos": int(s["pos"])},
                "has_gauss": int(s["has_gauss"]),
                "gauss": float(s["gauss"]),
            }
        )
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            logger.warning("checkpoint has CUDA RNG states but CUDA is not available; not restored")
            return
        n = torch.cuda.device_count()
        if len(cuda) != n:
            logger.warning("checkpoint has %d CUDA RNG states, %d devices visible", len(cuda), n)
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s.cpu(), i)
