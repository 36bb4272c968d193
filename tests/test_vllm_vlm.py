"""`RemoteVLLMEngine` with images against vLLM itself. Marked ``vllm``: `make test-vllm` runs it.

What vLLM's own code says of our requests: the body `RemoteVLLMEngine` sends for a prompt with
images is a valid ``GenerateRequest`` of vLLM's token-in route (its pydantic model, in vLLM's
venv), and an answer vLLM's ``GenerateTokensResponse`` writes is read back right.

A real server on the tiny VLM: where vLLM's venv can import torchvision, generation with an image
is scored by a HF forward before and after a disk weight update. vLLM's CPU build here cannot: its
Qwen2-VL model module imports transformers' torchvision image processor, the package index has
only CUDA builds of torchvision (whose ops do not load against torch's CPU build), and so the
server dies while inspecting the model. That test then checks that this is still the reason
(``No module named 'torchvision'`` in the server's log) and skips saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForImageTextToText

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.experiment_config import LauncherConfig
from areal_lite.api.io import GenerationConfig, WeightUpdateMeta
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.launcher.commands import vllm_python
from areal_lite.utils.tiny_vlm import VISION_TOKENS, build_tiny_vlm
from areal_lite.utils.vision import load_processor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from test_vlm_serving import GREEN, RED, Prompt, hf_logprobs
from vllm_servers import start_vllm_servers, stop_vllm_servers

pytestmark = pytest.mark.vllm

PROTOCOL = "vllm.entrypoints.scale_out.token_in_token_out.protocol"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "tiny"), seed=9)


VLLM_SIDE = f"""
import json, sys
from {PROTOCOL} import GenerateRequest, GenerateTokensResponse, GenerateTokensChoice, GenerateLogProbs
from {PROTOCOL} import GenerateLogProbsContent as C
r = GenerateRequest.model_validate(json.load(open(sys.argv[1])))
sp = r.sampling_params
read = {{"ids": r.token_ids, "parts": r.content_parts, "id": r.request_id,
        "sampling": [sp.max_tokens, sp.min_tokens, sp.logprobs, sp.stop_token_ids, sp.top_k, round(sp.min_p, 6)]}}
content = [C(token_id=7, logprob=-0.5), C(token_id=8, logprob=-1.25)]
choice = GenerateTokensChoice(index=0, token_ids=[7, 8], finish_reason="length", logprobs=GenerateLogProbs(content=content))
print(json.dumps({{"read": read, "answer": json.loads(GenerateTokensResponse(choices=[choice]).model_dump_json())}}))
"""
"""vLLM's side, in vLLM's venv: our request body (a file) read as its ``GenerateRequest``, and an
answer written by its ``GenerateTokensResponse``."""


def test_image_requests_are_what_vllms_token_in_route_takes(vlm_dir: str, tmp_path) -> None:
    processor = load_processor(vlm_dir)
    prompt = Prompt(processor, "What colour?", [RED])
    engine = RemoteVLLMEngine(InferenceEngineConfig(addresses=["127.0.0.1:1"]))
    g = GenerationConfig(max_new_tokens=8, min_new_tokens=2, stop_token_ids=[3], top_k=5, min_p=0.1)
    path, body = engine._generate_call([prompt.ids], ["rid-1"], g, 0, 8, [prompt.images])
    assert path == "/inference/v1/generate"
    sent = tmp_path / "body.json"
    sent.write_text(json.dumps(body))
    python = vllm_python(LauncherConfig(backend="vllm"))
    done = subprocess.run(
        [python, "-c", VLLM_SIDE, str(sent)], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    read = out["read"]
    assert read["ids"] == prompt.ids and read["id"] == "rid-1"
    assert [(p["type"], p["url"][:22]) for p in read["parts"]] == [("image_url", "data:image/png;base64,")]
    assert read["sampling"] == [8, 2, 0, [3], 5, 0.1]
    [answer] = engine._answers(out["answer"], 1)
    assert (answer.output_ids, answer.logprobs, answer.finish) == ([7, 8], [-0.5, -1.25], "length")


def test_vllm_serves_the_tiny_vlm_with_images_and_a_weight_update(vlm_dir: str, tmp_path) -> None:
    probe = subprocess.run(
        [vllm_python(LauncherConfig(backend="vllm")), "-c", "import torchvision.transforms.v2"],
        capture_output=True,
        text=True,
        check=False,
    )
    logs = str(tmp_path / "logs")
    if probe.returncode != 0:
        with pytest.raises(RuntimeError, match="exited") as failed:
            procs, _ = start_vllm_servers(vlm_dir, 1, logs, 512)
            stop_vllm_servers(procs)
        assert "failed to be inspected" in str(failed.value)
        with open(os.path.join(logs, "vllm0.log")) as f:
            assert "No module named 'torchvision'" in f.read()
        pytest.skip(
            "vLLM's CPU build cannot serve Qwen2.5-VL here: its qwen2_vl model module imports transformers' "
            "torchvision image processor, and torchvision does not import in its venv "
            f"({probe.stderr.strip().splitlines()[-1]})"
        )
    processor = load_processor(vlm_dir)
    prompts = [Prompt(processor, "What colour?", [RED]), Prompt(processor, "And this?", [GREEN])]
    hf = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    new = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    new.save_pretrained(str(tmp_path / "v1"))
    vision = set(processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS))
    procs, addresses = start_vllm_servers(vlm_dir, 1, logs, 512)
    engine = RemoteVLLMEngine(InferenceEngineConfig(addresses=addresses, request_timeout=300, setup_timeout=300))
    engine.initialize()

    async def run():
        return await asyncio.gather(*[engine.agenerate(p.request(8, greedy=True, ignore_eos=True)) for p in prompts])

    try:
        for model, version, path in ((hf, 0, vlm_dir), (new, 1, str(tmp_path / "v1"))):
            engine.update_weights(WeightUpdateMeta(type="disk", path=path, version=version)).result()
            engine.set_version(version)
            for prompt, answer in zip(prompts, asyncio.run(run())):
                assert not set(answer.output_tokens) & vision
                assert answer.output_versions == [version] * 8
                expected = hf_logprobs(model, prompt, answer.output_tokens)
                torch.testing.assert_close(torch.tensor(answer.output_logprobs), expected, atol=1e-4, rtol=0)
    finally:
        engine.destroy()
        stop_vllm_servers(procs)
