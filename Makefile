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

.PHONY: install lint test test-all test-cluster test-gpu test-tinker-cookbook demo clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,megatron,tinker]"
	touch $(STAMP)

# ruff's checks and its formatter over the whole tree (the rules are in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "" $(PYTEST_ARGS)

# The Ray and Slurm launchers on real clusters started here (tests marked `cluster`, which `make
# test` deselects): a 2-node Ray cluster (tests/clusters/ray.sh) and a one-node Slurm cluster
# (tests/clusters/slurm.sh, as root). What is missing is installed first: the `ray` extra into the
# venv, Debian's slurm-wlm and munge with apt-get. Both clusters are stopped at the end, whatever
# the tests did.
RAY_PORT ?= 6390
SLURM_DIR ?= /tmp/areal_lite_slurm

test-cluster: $(STAMP)
	$(PY) -c "import ray" 2> /dev/null || $(PIP) install -q -c constraints.txt -e ".[dev,megatron,ray]"
	command -v sbatch > /dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; }
	export PATH="$(abspath $(VENV))/bin:$$PATH" AREAL_LITE_RAY_PORT=$(RAY_PORT) AREAL_LITE_SLURM_DIR=$(SLURM_DIR); \
	trap 'tests/clusters/ray.sh down; tests/clusters/slurm.sh down' EXIT; \
	tests/clusters/ray.sh up && tests/clusters/slurm.sh up && \
	RAY_ADDRESS=127.0.0.1:$(RAY_PORT) SLURM_CONF=$(SLURM_DIR)/slurm.conf OMP_NUM_THREADS=1 \
	$(PY) -m pytest -q -m cluster $(PYTEST_ARGS)

# The CUDA paths (tests/gpu): FSDP on NCCL in bf16, the engine on CUDA, NCCL weight updates, the
# quickstart on CUDA. On a GPU machine, install torch for its CUDA first (not the CPU build above).
test-gpu: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

# The tinker-cookbook's sl_loop and rl_loop, unmodified, against the Tinker-compatible service on a
# local tiny model and local data (examples/tinker/cookbook_loops.py, docs/service.md). The cookbook
# goes in with --no-deps (its tml-renderers dependency is not on the package index), then the few
# packages its two loops import.
test-tinker-cookbook: $(STAMP)
	$(PIP) install -q -c constraints.txt --no-deps "tinker-cookbook==0.6.1"
	$(PIP) install -q -c constraints.txt chz termcolor blobfile pylatexenc sympy
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m cookbook tests/test_tinker_cookbook.py $(PYTEST_ARGS)

# A fresh run each time (recover.mode=auto would otherwise resume the previous demo). One thread
# per process: the trainer and the rollout server share the cores.
demo: $(STAMP)
	rm -rf outputs/quickstart/demo
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/quickstart.py --config configs/quickstart.yaml

clean:
	rm -rf $(VENV) outputs
