"""Ipc weight updates on CPU: a trainer's weights handed over to our server on 127.0.0.1 through
shared memory, without a file. SGLang's ``/update_weights_from_tensor`` loads a bucket (weights,
generation log-probabilities and version after it); bad handles get a 400 with a message and leave
the weights alone; the route needs the API key and refuses callers on other machines; 1- and
2-rank torchrun FSDP trainers send from rank 0 alone, in several buckets of which at most two
live at once, free every one, and write nothing to disk; clients refuse what cannot work."""

from __future__ import annotations

import base64
import glob
import io
import json
import os
import pickle
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from aiohttp.test_utils import make_mocked_request
from transformers import AutoModelForCausalLM

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.engines.server.sglang_routes import _from_this_machine
from areal_lite.utils.tensor_handles import SEGMENT_PREFIX, SHM_DIR, TensorBucket, on_this_machine
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers
from test_fsdp import torchrun
from test_server import KEY, call, check_logprobs, run

TRAINER = Path(__file__).parent / "scripts" / "ipc_trainer.py"
PROBE = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("ipc") / "m"), hidden_size=32, num_layers=2, vocab_size=260)


@pytest.fixture(scope="module")
def server(model_path: str):
    procs, addresses = start_servers(model_path, 1, ["--api-key", KEY])
    yield addresses[0]
    stop_servers(procs)


def perturbed(model_path: str, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def own_segments() -> list[str]:
    """This process's buckets in /dev/shm (other runs on the machine may hold theirs)."""
    return glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}_*"))


def update(address: str, entry: str, version: str, **extra: object) -> tuple[int, object]:
    body = {"serialized_named_tensors": [entry], "load_format": None, "weight_version": version, **extra}
    return run(call(f"http://{address}", "/update_weights_from_tensor", body))


def served(address: str, name: str = PROBE) -> list[float]:
    status, values = run(
        call(f"http://{address}", f"/get_weights_by_name?name={name}&truncate_size=10000", method="GET")
    )
    assert status == 200, values
    return values


def test_a_bucket_of_shared_memory_becomes_the_served_weights(server: str, model_path: str) -> None:
    model = perturbed(model_path, seed=1)
    bucket = TensorBucket(list(model.state_dict().items()))
    try:
        assert os.path.exists(os.path.join(SHM_DIR, bucket.segment or ""))
        status, out = update(server, bucket.serialize(), "7")
    finally:
        bucket.free()
    assert status == 200 and out == {"success": True, "message": "Succeeded to update model weights."}
    assert own_segments() == []
    # The server copied the weights before it answered: the freed bucket took nothing with it.
    assert served(server) == model.state_dict()[PROBE].flatten().tolist()
    check_logprobs(f"http://{server}", model, "7")


def _pickled(obj: object) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _handle(segment: str, offset: int = 0, shape: list[int] | None = None) -> str:
    """A pickle whose tensor is a shared-memory handle, as a bucket writes it."""

    class Handle(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("shm", segment, offset, "float32", shape or [2, 2]) if obj == "T" else None

    buf = io.BytesIO()
    Handle(buf).dump([(PROBE, "T")])
    return base64.b64encode(buf.getvalue()).decode()


def test_bad_handles_get_a_400_with_a_message_and_change_nothing(server: str, model_path: str) -> None:
    before = served(server)
    wrong_shape = TensorBucket([(PROBE, torch.zeros(3, 3))])
    small = TensorBucket([("x", torch.zeros(2))])
    try:
        cases = {
            "not base64!": "must be base64",
            _pickled(os.system): "is not allowed in a tensor handle",
            _handle(f"{SEGMENT_PREFIX}1_dead"): "No such file",
            _handle("../../etc/passwd"): "is not a weight bucket's",
            _handle(small.segment or "", offset=0, shape=[100, 100]): "past the end of its segment",
            wrong_shape.serialize(): "has shape",
        }
        for entry, message in cases.items():
            status, out = update(server, entry, "9")
            assert status == 400 and out["success"] is False and message in out["message"], (message, out)
        status, out = update(server, small.serialize(), "9", load_format="flattened_bucket")
        assert status == 400 and "load_format" in out["message"]
        status, out = run(call(f"http://{server}", "/update_weights_from_tensor", {"serialized_named_tensors": []}))
        assert status == 400 and "non-empty list" in out["error"]["message"]
    finally:
        wrong_shape.free()
        small.free()
    assert served(server) == before
    assert run(call(f"http://{server}", "/model_info", method="GET"))[1]["weight_version"] != "9"


def test_the_route_needs_the_api_key(server: str) -> None:
    body = {"serialized_named_tensors": ["x"]}
    status, out = run(call(f"http://{server}", "/update_weights_from_tensor", body, headers={}))
    assert status == 401 and "Unauthorized" in out["error"]["message"]


def test_callers_on_other_machines_are_refused() -> None:
    def request(peer: str, local: str):
        info = {"peername": (peer, 5000), "sockname": (local, 30000)}
        transport = mock.Mock(get_extra_info=lambda key, default=None: info.get(key, default))
        return make_mocked_request("POST", "/update_weights_from_tensor", transport=transport)

    assert _from_this_machine(request("127.0.0.1", "127.0.0.1"))
    assert _from_this_machine(request("::1", "::1"))
    assert _from_this_machine(request("10.1.2.3", "10.1.2.3"))  # this machine, by its own address
    assert not _from_this_machine(request("10.1.2.4", "10.1.2.3"))


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_trainer_hands_weights_over_from_rank0_without_disk(
    server: str, model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int
) -> None:
    """Rank 0 alone makes buckets (several: 16 KiB each), at most two alive at once, none left
    after an update; the server holds exactly what they carried, and scores freshly generated
    tokens as the trainer does; the trainer writes no file but its report."""
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    code, output = torchrun(nproc, TRAINER, model_path, server, str(work), KEY)
    assert code == 0, output[-6000:]
    report = json.loads((work / "trainer.json").read_text())
    for version in (1, 2):
        r = report[f"v{version}"]
        assert r["versions"] == [version] and r["max_err"] < 1e-4, r
        assert r["max_weight_err"] == 0.0 and r["tensors"] > 10
        assert r["buckets_per_rank"][0] > 2 and r["buckets_per_rank"][1:] == [0] * (nproc - 1)
        assert r["max_alive_at_make"] <= 1 and r["leaked"] == []
    assert [p.name for p in work.iterdir()] == ["trainer.json"]
    written = [p for p in tmp.rglob("*") if p.is_file() and not p.relative_to(tmp).parts[0].startswith("torchelastic")]
    assert written == [], written


def test_on_this_machine() -> None:
    assert on_this_machine("http://127.0.0.1:30000") and on_this_machine("http://localhost:1")
    assert not on_this_machine("http://192.0.2.7:30000")  # TEST-NET-1: never an address of this machine
    assert not on_this_machine("http://no-such-host.invalid:1")


def test_clients_refuse_ipc_updates_that_cannot_work(model_path: str) -> None:
    meta = WeightUpdateMeta(type="ipc", serialized_tensors="x")
    far = RemoteSGLangEngine(InferenceEngineConfig(addresses=["127.0.0.1:1", "192.0.2.7:30000"]))
    with pytest.raises(ValueError, match=r"weight_update=ipc .* http://192\.0\.2\.7:30000 is not on it"):
        far.update_weights(meta)
    near = RemoteSGLangEngine(InferenceEngineConfig(addresses=["127.0.0.1:1"]))
    with pytest.raises(ValueError, match="LoRA adapter updates go by"):
        near.update_weights(WeightUpdateMeta(type="ipc", serialized_tensors="x", lora_config={"r": 4}))
    with pytest.raises(ValueError, match="carries its bucket's handles"):
        near.update_weights(WeightUpdateMeta(type="ipc"))
    with pytest.raises(ValueError, match="vLLM servers take weight_update=disk or distributed"):
        RemoteVLLMEngine(InferenceEngineConfig(addresses=["127.0.0.1:1"])).update_weights(meta)
    with pytest.raises(ValueError, match="in_process updates, not ipc"):
        LocalInferenceEngine(LocalEngineConfig(path=model_path)).update_weights(meta)
