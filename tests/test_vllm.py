"""The vLLM pieces that run without vLLM: the weight-update worker extension, in stand-ins for two
tensor-parallel vLLM workers, receiving a gloo broadcast from a trainer and loading a directory;
the launcher's ``vllm serve`` command line; and what `RemoteVLLMEngine` refuses. (The client
itself runs every test of tests/test_remote.py against our server's vLLM routes.)"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_lite.api.config import InferenceEngineConfig, LauncherConfig, RecoverConfig
from areal_lite.engines.vllm import RemoteVLLMEngine
from areal_lite.engines.vllm_worker import WeightUpdateExtension
from areal_lite.launcher.local import LaunchPlan, server_command, trainer_gpus
from areal_lite.utils.distributed import find_free_port, init_custom_process_group
from areal_lite.utils.tiny import build_tiny_model


class StandInModel:
    """What the extension uses of a vLLM model: ``load_weights`` of (name, full tensor) pairs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.loaded: list[str] = []

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            with torch.no_grad():
                self.params[name].copy_(tensor)
            self.loaded.append(name)
        return set(self.loaded)


class StandInWorker(WeightUpdateExtension):
    """A vLLM worker as the extension sees it: its rank, its device and its model runner."""

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=StandInModel(model))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("vllm") / "m"), hidden_size=32, num_layers=2, vocab_size=260)


def perturbed_state(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path)
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.1 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_extension_receives_a_broadcast_on_every_tensor_parallel_worker(model_path: str) -> None:
    """Two workers of one server join as ranks 1 and 2 (rank_offset 1 + worker rank) of the
    trainer's gloo group and each loads every broadcast tensor."""
    workers = [StandInWorker(AutoModelForCausalLM.from_pretrained(model_path), rank) for rank in (0, 1)]
    port = find_free_port()
    spec = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": "g", "backend": "gloo"}  # fmt: skip
    errors: list[BaseException] = []

    def in_threads(call) -> list[threading.Thread]:
        def run(w: StandInWorker) -> None:
            try:
                call(w)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        threads = [threading.Thread(target=run, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        return threads

    joining = in_threads(lambda w: w.areal_join_weight_update_group(json.dumps(spec)))
    group = init_custom_process_group("gloo", "127.0.0.1", port, 0, 3, "g", timeout=60)
    for t in joining:
        t.join()
    new = perturbed_state(model_path, seed=1)
    names = list(new)
    announce = {"names": names, "dtypes": ["float32"] * len(names), "shapes": [list(new[n].shape) for n in names]}
    receiving = in_threads(lambda w: w.areal_receive_weights(json.dumps(announce)))
    for n in names:
        group.broadcast(new[n].clone())
    for t in receiving:
        t.join()
    assert not errors, errors
    for w in workers:
        assert w.model_runner.model.loaded == names
        for n in names:
            torch.testing.assert_close(w.model_runner.model.params[n], new[n], atol=0, rtol=0)
        w.areal_leave_weight_update_group(json.dumps({"group_name": "g"}))
        with pytest.raises(RuntimeError, match="no weight-update group"):
            w.areal_receive_weights(json.dumps(announce))


def test_extension_loads_a_directory_and_refuses_bad_arguments(model_path: str, tmp_path) -> None:
    new = perturbed_state(model_path, seed=2)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.save_pretrained(str(tmp_path / "v1"), state_dict=dict(new))
    worker = StandInWorker(AutoModelForCausalLM.from_pretrained(model_path), rank=0)
    worker.areal_load_weights_from_disk(json.dumps({"model_path": str(tmp_path / "v1")}))
    for n, p in worker.model_runner.model.params.items():
        torch.testing.assert_close(p, new[n], atol=0, rtol=0)
    with pytest.raises(ValueError, match="safetensors"):
        worker.areal_load_weights_from_disk(json.dumps({"model_path": str(tmp_path / "missing")}))
    with pytest.raises(ValueError, match="JSON"):
        worker.areal_load_weights_from_disk("{not json")
    with pytest.raises(ValueError, match="rank_offset"):
        worker.areal_join_weight_update_group(json.dumps(
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}))  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        worker.areal_receive_weights(json.dumps({"names": ["a"], "dtypes": ["float33"], "shapes": [[1]]}))


def test_launcher_starts_vllm_serve_with_the_extension_on_its_own_gpus(monkeypatch) -> None:
    cfg = LauncherConfig(backend="vllm", n_servers=2, server_tp_size=2, server_args=["--max-model-len", "4096"])
    plan = LaunchPlan("train.py", None, [], cfg, RecoverConfig(), "/models/m", "out", python="py")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1")
    assert server_command(plan, 9001, base_gpu_id=2) == [
        "env", "VLLM_SERVER_DEV_MODE=1", "CUDA_VISIBLE_DEVICES=6,7",
        "py", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m", "--host", "127.0.0.1", "--port", "9001",
        "--tensor-parallel-size", "2", "--worker-extension-cls", "areal_lite.engines.vllm_worker.WeightUpdateExtension",
        "--logprobs-mode", "raw_logprobs", "--max-model-len", "4096",
    ]  # fmt: skip
    assert trainer_gpus(LauncherConfig(backend="vllm", n_servers=1, server_tp_size=2, trainer_nproc=2), None) == "2,3"


def test_vllm_client_needs_pause_mode_abort() -> None:
    with pytest.raises(ValueError, match="pause_mode=abort"):
        RemoteVLLMEngine(InferenceEngineConfig(addresses=["127.0.0.1:1"], pause_mode="in_place"))
