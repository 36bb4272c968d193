# `make demo` and `make test` set everything up on a fresh machine: a .venv with torch==2.13.0
# (the CPU build) installed first, then the package with constraints.txt pinning torch so that no
# dependency pulls a CUDA build. The install is skipped while pyproject.toml and constraints.txt
# are unchanged (the stamp file records the last install).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: install test test-all test-gpu demo clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,megatron]"
	touch $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "" $(PYTEST_ARGS)

# The CUDA paths (tests/gpu): FSDP on NCCL in bf16, the engine on CUDA, NCCL weight updates, the
# quickstart on CUDA. On a GPU machine, install torch for its CUDA first (not the CPU build above).
test-gpu: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

# A fresh run each time (recover.mode=auto would otherwise resume the previous demo). One thread
# per process: the trainer and the rollout server share the cores.
demo: $(STAMP)
	rm -rf outputs/quickstart/demo
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/quickstart.py --config configs/quickstart.yaml

clean:
	rm -rf $(VENV) outputs
