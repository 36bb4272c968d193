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

.PHONY: install lint test test-all test-moe test-cluster test-gpu test-verifiers verifiers-example demo demo-moe clean

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

# Mixture-of-experts models and routing replay, the slow tests included (torchrun: FSDP on 2 ranks,
# Megatron with expert parallelism; the MoE quickstart's smoke run).
test-moe: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "" tests/test_moe.py $(PYTEST_ARGS)

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

# verifiers (environments as a source of training) needs openai<3, while the dev extra's
# openai-agents 0.24 needs openai>=3: it gets an environment of its own, .venv-verifiers (Python >=
# 3.11), with the package, its `verifiers` extra, the test runner and openai-agents 0.20 (the
# release that agrees with openai 2), so the OpenAI and agent tests run on openai 2 there too.
VF_VENV := .venv-verifiers
VF_PY := $(VF_VENV)/bin/python
VF_STAMP := $(VF_VENV)/.installed

$(VF_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VF_VENV)
	$(VF_PY) -m pip --disable-pip-version-check install -q --upgrade pip
	$(VF_PY) -m pip --disable-pip-version-check install -q torch==2.13.0
	$(VF_PY) -m pip --disable-pip-version-check install -q -c constraints.txt -e ".[verifiers]" \
		"pytest>=8" "pytest-timeout>=2.3" "openai-agents>=0.20,<0.21"
	touch $(VF_STAMP)

test-verifiers: $(VF_STAMP)
	OMP_NUM_THREADS=1 $(VF_PY) -m pytest -q -m verifiers tests/test_verifiers.py $(PYTEST_ARGS)
	OMP_NUM_THREADS=1 $(VF_PY) -m pytest -q tests/test_openai_api.py tests/test_agent.py $(PYTEST_ARGS)

# RL on a small verifiers environment (examples/verifiers_rl.py), a fresh run each time.
verifiers-example: $(VF_STAMP)
	rm -rf outputs/verifiers/example
	OMP_NUM_THREADS=1 $(VF_PY) -m areal_lite.launcher.local examples/verifiers_rl.py --config configs/verifiers.yaml \
		trial_name=example

# A fresh run each time (recover.mode=auto would otherwise resume the previous demo). One thread
# per process: the trainer and the rollout server share the cores.
demo: $(STAMP)
	rm -rf outputs/quickstart/demo
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/quickstart.py --config configs/quickstart.yaml

# The same on a mixture-of-experts model (Qwen3-MoE, 8 experts, 2 per token) with routing replay.
demo-moe: $(STAMP)
	rm -rf outputs/quickstart/moe
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/quickstart.py --config configs/quickstart_moe.yaml

clean:
	rm -rf $(VENV) $(VF_VENV) outputs
