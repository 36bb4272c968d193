"""Every CUDA path, on a real GPU (marker ``gpu``; deselected without CUDA): FSDP on NCCL in bf16,
the embedded engine on CUDA, NCCL weight updates into it, ipc updates (CUDA IPC handles) into our
server on the same GPU, and the quickstart on CUDA."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import SamplingParams
from areal_lite.launcher.commands import checkout_pythonpath
from areal_lite.utils.tensor_handles import SEGMENT_PREFIX, SHM_DIR, TensorBucket
from areal_lite.utils.tiny import build_tiny_model

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("fsdp_nccl_worker.py")
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": checkout_pythonpath(),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("gpu") / "model"), hidden_size=128, num_layers=2)


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probabilities of ``output`` after ``prompt`` from one plain HF forward (on the model's device)."""
    ids = torch.tensor([prompt + output], device=next(model.parameters()).device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logp.gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()


def generate(engine: LocalInferenceEngine, jobs: list[tuple[list[int], SamplingParams]]) -> list:
    async def run() -> list:
        return await asyncio.gather(*[engine.scheduler.generate(p, sp) for p, sp in jobs])

    return asyncio.run(run())


def test_engine_on_cuda_matches_hf_forward(model_dir: str) -> None:
    """The embedded engine on CUDA: continuous batching over mixed lengths, every reported
    log-probability equal to a HF forward of the same tokens on the same GPU."""
    from transformers import AutoModelForCausalLM

    engine = LocalInferenceEngine(LocalEngineConfig(path=model_dir, device="cuda", max_running_requests=8))
    engine.initialize()
    try:
        assert engine.model is not None and next(engine.model.parameters()).is_cuda
        jobs = [
            (list(range(5, 8 + 3 * i)), SamplingParams(max_new_tokens=4 + 5 * i, ignore_eos=True)) for i in range(12)
        ]
        results = generate(engine, jobs)
        hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
        for (prompt, sp), r in zip(jobs, results):
            assert len(r.output_ids) == sp.max_new_tokens
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), hf_logprobs(hf, prompt, r.output_ids), atol=2e-3, rtol=0
            )
    finally:
        engine.destroy()


def test_engine_on_cuda_greedy_equals_hf_greedy(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    engine = LocalInferenceEngine(LocalEngineConfig(path=model_dir, device="cuda"))
    engine.initialize()
    try:
        prompt = [5, 6, 7, 8, 9]
        (r,) = generate(engine, [(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))])
        hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
        ids = torch.tensor([prompt], device="cuda")
        expected = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(prompt) :]
        assert r.output_ids == expected.tolist()
    finally:
        engine.destroy()


def test_decode_graphs_replay_the_eager_steps(model_dir: str) -> None:
    """The decode steps replayed from CUDA graphs (the default on CUDA) against the same model
    with ``cuda_graphs`` off: the graphs were captured (no fallback to eager), the same tokens for
    the same seeds, log-probabilities equal to a HF forward, as rows finish and are refilled
    (buckets of 1-8 rows) and as the cache grows past its first 256 positions."""
    from transformers import AutoModelForCausalLM

    jobs = [
        (list(range(3, 5 + 2 * i)), SamplingParams(max_new_tokens=3 + 7 * i, seed=i, ignore_eos=True))
        for i in range(11)
    ] + [([1, 2, 3], SamplingParams(max_new_tokens=300, seed=99, ignore_eos=True))]
    engines = [
        LocalInferenceEngine(LocalEngineConfig(path=model_dir, device="cuda", max_running_requests=8, cuda_graphs=g))
        for g in (True, False)
    ]
    for engine in engines:
        engine.initialize()
    try:
        got, expected = (generate(engine, jobs) for engine in engines)
        graphs = engines[0].scheduler._runner.graphs
        assert graphs is not None and graphs.captures >= 4, "the decode step fell back to eager"
        assert engines[1].scheduler._runner.graphs is None
        hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
        for (prompt, _), g, e in zip(jobs, got, expected):
            assert g.output_ids == e.output_ids
            torch.testing.assert_close(
                torch.tensor(g.output_logprobs), hf_logprobs(hf, prompt, g.output_ids), atol=2e-3, rtol=0
            )
    finally:
        for engine in engines:
            engine.destroy()


def torchrun(nproc: int, *args: str, timeout: float = 600, script: Path = SCRIPT) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    out = subprocess.run([*cmd, *args], env=ENV, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp_on_nccl_in_bf16_trains_and_matches_hf(model_dir: str, nproc: int) -> None:
    """FSDP2 on NCCL with bf16 mixed precision (fp32 master weights): log-probabilities close to a
    bf16 HF forward, every parameter changed by a step, the loss falling on a fixed batch."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    out = torchrun(nproc, "train", model_dir)
    assert "TRAIN OK" in out


def test_megatron_on_cuda_in_bf16_matches_fsdp_and_trains(model_dir: str) -> None:
    """MegatronEngine on one GPU in bf16 (megatron-core's local layers, TP=1): log-probabilities
    close to FSDPEngine's on the same model and batch, the loss falling over a few steps, every
    parameter changed in its HF export."""
    out = torchrun(1, model_dir, script=SCRIPT.with_name("megatron_cuda_worker.py"))
    assert "MEGATRON CUDA OK" in out


def test_nccl_weight_update_into_the_engine(model_dir: str) -> None:
    """The trainer (rank 0 of a weight-update group, GPU 0) broadcasts its weights over NCCL into
    an embedded engine on GPU 1; generation afterwards scores with the new weights."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: the trainer on GPU 0, the engine on GPU 1")
    out = torchrun(1, "nccl_update", model_dir)
    assert "UPDATE OK" in out


def test_server_on_the_same_gpu_takes_cuda_ipc_handles(model_dir: str) -> None:
    """Our server on the trainer's GPU gets an ipc update: CUDA IPC handles of one bucket on the
    device (no copy to the host, no shared-memory segment). Once it answers, the bucket is freed
    and its memory overwritten; the server then generates with the new weights: log-probabilities
    equal to a HF forward of the updated model on the same GPU, tokens tagged with the version."""
    from transformers import AutoModelForCausalLM

    from areal_lite.engines.remote.sglang import RemoteSGLangEngine

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from inference_servers import start_servers, stop_servers

    procs, addresses = start_servers(model_dir, 1, ["--device", "cuda"])
    client = RemoteSGLangEngine(InferenceEngineConfig(addresses=addresses, setup_timeout=120, request_timeout=120))
    try:
        client.initialize()
        hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
        g = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, device="cuda"))
        bucket = TensorBucket(list(hf.state_dict().items()))
        assert bucket.segment is None and all(t.is_cuda for _, t in bucket.named)
        client.update_weights(WeightUpdateMeta(type="ipc", serialized_tensors=bucket.serialize(), version=3)).result()
        size = bucket.nbytes
        bucket.free()
        scribble = torch.full((size,), 255, dtype=torch.uint8, device="cuda")  # reuses the freed block, likely
        torch.cuda.synchronize()
        assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")]

        async def run() -> list:
            gconfig = GenerationConfig(max_new_tokens=10, ignore_eos=True)
            reqs = [ModelRequest(input_ids=[5 + i, 17, 30 + 2 * i], gconfig=gconfig) for i in range(6)]
            return await asyncio.gather(*[client.agenerate(r) for r in reqs])

        for r in asyncio.run(run()):
            assert r.output_versions == [3] * 10
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), hf_logprobs(hf, r.input_tokens, r.output_tokens), atol=2e-3, rtol=0
            )
        del scribble
    finally:
        client.destroy()
        stop_servers(procs)


def test_quickstart_on_cuda(tmp_path: Path) -> None:
    """The demo's script end to end on one GPU: embedded engine on CUDA, FSDP in bf16."""
    cmd = [sys.executable, "-m", "areal_lite.launcher.local", "examples/quickstart.py"]
    cmd += ["--config", "configs/quickstart.yaml", f"cluster.fileroot={tmp_path}", "launcher.backend=local"]
    cmd += ["local_engine.device=cuda", "actor.dtype=bfloat16", "launcher.gpus_per_node=1"]
    cmd += ["task.sft_steps=10", "task.sft_eval_every=5", "task.sft_batch_size=16", "task.n_dev=8", "task.n_eval=8"]
    cmd += ["task.n_train_prompts=64", "total_train_steps=2", "train_dataset.batch_size=4"]
    cmd += ["rollout.consumer_batch_size=4", "stats_logger.console=false", "stats_logger.tensorboard=false"]
    cmd += ["stats_logger.wandb_mode=disabled", "recover.mode=disabled"]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "RESULT acc_before=" in out.stdout


def test_fused_head_on_cuda_matches_autograd_in_bf16() -> None:
    """The LM head of the train engines on CUDA (`fused_head.HeadLogprobs`, its passes compiled):
    log-probabilities, entropies and both gradients against autograd through full fp32 logits of
    the same bf16 product, at a vocabulary like Qwen2.5's."""
    from areal_lite.engines.train.fused_head import HeadLogprobs

    torch.manual_seed(0)
    n, hidden, vocab = 3000, 256, 151936
    h = (torch.randn(n, hidden, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * 0.05).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    lp, ent = HeadLogprobs.apply(h, w, y, 1024, True, 8 << 30)
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))
    logq = torch.log_softmax((h @ w.t()).float(), dim=-1)
    rlp = logq.gather(-1, y[:, None])[:, 0]
    rent = -(logq.exp() * logq).sum(-1)
    rgrads = torch.autograd.grad((rlp * g_lp).sum() + (rent * g_ent).sum(), (h, w))
    torch.testing.assert_close(lp, rlp, atol=1e-3, rtol=0)
    torch.testing.assert_close(ent, rent, atol=1e-3, rtol=0)
    for got, ref in zip(grads, rgrads):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_flash_varlen_matches_per_sequence_sdpa_on_cuda() -> None:
    """torch's varlen flash attention through `flash_varlen.varlen_causal` (grouped-query heads,
    bf16) against causal SDPA run on each sequence alone, forward and backward."""
    from areal_lite.utils import flash_varlen

    assert flash_varlen.available(torch.device("cuda"), torch.bfloat16), "this torch has no varlen attention"
    torch.manual_seed(0)
    cu = torch.tensor([0, 17, 18, 300, 1024], device="cuda")
    q = torch.randn(1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1024, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1024, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_varlen.varlen_causal(q, k, v, cu, 724)
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                *(x[a:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
            )[0].transpose(0, 1)
            for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


def test_engine_on_cuda_in_bf16_prefills_groups_packed(model_dir: str) -> None:
    """The embedded engine in bf16 on CUDA: GRPO-like groups (rows sharing a prompt) prefilled in
    one varlen call per layer, decode steps from graphs choosing their tokens on the device; the
    log-probabilities close to a bf16 HF forward of the same tokens."""
    from transformers import AutoModelForCausalLM

    from areal_lite.utils import flash_varlen

    engine = LocalInferenceEngine(
        LocalEngineConfig(path=model_dir, device="cuda", dtype="bfloat16", max_running_requests=16)
    )
    engine.initialize()
    runner = engine.scheduler._runner
    packed = []
    real = runner.cache.scatter
    runner.cache.scatter = lambda *a: packed.append(1) or real(*a)
    try:
        jobs = [
            (list(range(5, 12 + 4 * (i // 4))), SamplingParams(max_new_tokens=20, ignore_eos=True)) for i in range(16)
        ]
        results = generate(engine, jobs)
        assert flash_varlen.available(torch.device("cuda"), torch.bfloat16) and packed
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        for (prompt, _), r in zip(jobs, results):
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), hf_logprobs(hf, prompt, r.output_ids), atol=0.05, rtol=0
            )
    finally:
        engine.destroy()


def train_with_and_without(model_dir: str, key: str, lens: list[int], seed: int, **extra: object) -> tuple:
    """FSDPEngine on CUDA in bf16 with the config field ``key`` False, then True: for each, the
    parameter names, the log-probabilities of a batch of sequences of ``lens`` tokens, and the
    losses of three training steps on it. Returns (mask, names, log-probs, losses)."""
    from tensordict import TensorDict
    from transformers import AutoConfig

    from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
    from areal_lite.api.io import FinetuneSpec
    from areal_lite.engines.train.fsdp import FSDPEngine

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]
    data = TensorDict(
        {
            "input_ids": torch.randint(3, vocab, mask.shape, generator=g) * mask,
            "attention_mask": mask,
            "loss_mask": mask.int(),
        },
        batch_size=[len(lens)],
    )

    def nll(logp, ent, mb):
        m = mb["loss_mask"]
        return -(logp * m).sum() / m.sum(), {}

    names, outs, losses = [], [], []
    for on in (False, True):
        cfg = TrainEngineConfig(path=model_dir, dtype="bfloat16", optimizer=OptimizerConfig(lr=1e-3), **extra)
        e = FSDPEngine(replace(cfg, **{key: on}))
        e.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=2 * len(lens), train_batch_size=len(lens)))
        try:
            names.append([n for n, _ in e.model.named_parameters()])
            outs.append(e.forward(data))
            losses.append([e.train_batch(data, nll, lambda mb: mb["loss_mask"].sum())["loss"] for _ in range(3)])
        finally:
            e.destroy()
    return mask, names, outs, losses


def test_liger_kernels_train_like_the_hf_modules(model_dir: str) -> None:
    """FSDPEngine on CUDA in bf16 with Liger's RMS norm, rotary and SwiGLU kernels
    (``liger_kernels``): log-probabilities close to the engine's with HF's modules, and a step of
    training lowers the loss."""
    mask, _, outs, losses = train_with_and_without(model_dir, "liger_kernels", [9, 31, 17, 64], seed=0)
    torch.testing.assert_close(outs[1][mask], outs[0][mask], atol=0.05, rtol=0)
    assert losses[1][-1] < losses[1][0], losses


def test_compiled_layers_on_cuda_train_like_eager_layers(model_dir: str) -> None:
    """FSDPEngine on CUDA in bf16 with every decoder layer compiled by inductor
    (``compile_layers``): parameter names unchanged, log-probabilities close to the eager layers'
    over micro-batches of new lengths (dynamic shapes, no recompilation error), and training lowers
    the loss."""
    from areal_lite.api.io import MicroBatchSpec

    lens = [9, 31, 17, 64, 40, 5]
    mask, names, outs, losses = train_with_and_without(
        model_dir, "compile_layers", lens, seed=1, mb_spec=MicroBatchSpec(max_tokens_per_mb=100)
    )
    assert names[1] == names[0]
    torch.testing.assert_close(outs[1][mask], outs[0][mask], atol=0.05, rtol=0)
    assert abs(losses[1][0] - losses[0][0]) < 0.02, losses
    assert losses[1][-1] < losses[1][0], losses


def test_engine_on_cuda_with_images_matches_hf_forward(tmp_path: Path) -> None:
    """A vision-language model on CUDA: image and text requests in one batch, the vision tower at
    prefill, decode steps replayed from CUDA graphs with each row's multimodal offset; every
    log-probability equal to a HF forward with the same images on the same GPU."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from areal_lite.utils.tiny_vlm import VISION_TOKENS, build_tiny_vlm
    from areal_lite.utils.vision import encode_image, load_processor

    path = build_tiny_vlm(str(tmp_path / "vlm"), seed=2)
    processor = load_processor(path)
    banned = dict.fromkeys(processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS), -100.0)
    pictures = [[Image.new("RGB", (84, 140), (200, 10, 10))], [], [Image.new("RGB", (112, 56), (9, 9, 200))] * 2]
    prompts = []
    for images in pictures:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is it?"}]
        messages = [{"role": "user", "content": content}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(processor(text=[text], images=images or None, return_tensors="pt"))
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, device="cuda", max_running_requests=4))
    engine.initialize()

    async def run() -> list:
        jobs, inputs = [], []
        for enc, images in zip(prompts, pictures):
            ids = enc["input_ids"][0].tolist()
            _, prepared = await engine.scheduler.prepare_images(ids, [encode_image(i) for i in images])
            jobs.append((ids, SamplingParams(max_new_tokens=40, ignore_eos=True, logit_bias=banned), None))
            inputs.append(prepared)
        return await engine.scheduler.generate_many(jobs, images=inputs)

    try:
        results = asyncio.run(run())
        graphs = engine.scheduler._runner.graphs
        assert graphs is not None and graphs.captures >= 1, "the decode step fell back to eager"
        hf = AutoModelForImageTextToText.from_pretrained(path).cuda().eval()
        for enc, r in zip(prompts, results):
            ids = torch.tensor([r.input_ids + r.output_ids], device="cuda")
            kw = {k: enc[k].cuda() for k in ("pixel_values", "image_grid_thw") if k in enc}
            with torch.no_grad():
                logits = hf(input_ids=ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(), **kw).logits
            logp = torch.log_softmax(logits[0, len(r.input_ids) - 1 : -1].float(), dim=-1)
            expected = logp.gather(1, ids[0, len(r.input_ids) :, None])[:, 0].cpu()
            torch.testing.assert_close(torch.tensor(r.output_logprobs), expected, atol=2e-3, rtol=0)
    finally:
        engine.destroy()
