# One entry point for the common jobs.  Each target does its own set-up and skips what is
# already there, so they work on a fresh machine and offline where the dependencies exist.
#
#   make test     build the extension in place, compile-check the CUDA sources (incremental;
#                 CUDA_CHECK=0 skips it), run the tests (what CI runs)
#   make train    run the main job: examples/train_gpt.py (ours vs PyTorch's attention)
#   make bench    CPU benchmark (benchmarks/bench_cpu.py)
#   make info     python -m flash_attn_ext info

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# What build/train/bench/info need (torch, tqdm, build tools), and what the tests add.
RUN_STAMP := $(VENV)/.run-deps-installed
DEV_STAMP := $(VENV)/.dev-deps-installed

.PHONY: setup build cuda-check test train bench info clean

# A venv that sees the system's packages: a torch that is already installed is reused.
$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(RUN_STAMP): requirements-run.txt | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements-run.txt
	@touch $(RUN_STAMP)

$(DEV_STAMP): requirements-dev.txt $(RUN_STAMP)
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $(DEV_STAMP)

setup: $(RUN_STAMP)

# Incremental: ninja recompiles only what changed.  torch's build runs ninja verbosely (each
# compiler command line in full); a line per source is printed instead (errors pass unchanged;
# VERBOSE=1 keeps the full lines).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
NINJA_LINES := $(if $(filter 1,$(VERBOSE)),cat,sed -E 's@^(\[[0-9]+/[0-9]+\]) .* -c ([^- ][^ ]*) -o .*@\1 \2@; s@$(CURDIR)/@@')
build: setup
	MAX_JOBS=$${MAX_JOBS:-$$(nproc)} $(PY) setup.py -q build_ext --inplace 2>&1 | $(NINJA_LINES)

# Compiles every CUDA source (no GPU needed; skipped without nvcc or with CUDA_CHECK=0); only
# what changed since it last passed (scripts/check_cuda_compile.sh).
cuda-check: setup
	PY=$(PY) bash scripts/check_cuda_compile.sh

test: build cuda-check $(DEV_STAMP)
	$(PY) -m pytest tests -q

# Built in place, not installed: the scripts find the package through PYTHONPATH.
train: build
	PYTHONPATH=$(CURDIR) $(PY) examples/train_gpt.py $(ARGS)

# (its JSON goes to build/, which git ignores; pass ARGS="--out ..." to keep it elsewhere)
bench: build
	PYTHONPATH=$(CURDIR) $(PY) benchmarks/bench_cpu.py --out build/bench_cpu.json $(ARGS)

info: build
	PYTHONPATH=$(CURDIR) $(PY) -m flash_attn_ext info

clean:
	rm -rf build flash_attn_ext/*.so *.egg-info
