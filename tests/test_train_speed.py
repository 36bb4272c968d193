"""The train engine's GPU speed measures, through the parts that run on CPU: the LM head's
log-probabilities without kept logits (`areal_lite.engines.train.fused_head`) against autograd in
float64, and a smoke run of `benchmarks/train_mfu.py` (its tiny CPU mode) so it cannot rot between
GPU loans."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_lite.engines.train.fused_head import HeadLogprobs

ROOT = Path(__file__).resolve().parents[1]


def reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logq = torch.log_softmax((h @ w.t()).double(), dim=-1)
    return logq.gather(-1, y[:, None])[:, 0], -(logq.exp() * logq).sum(-1)


@pytest.mark.parametrize("keep_logits", [True, False], ids=["logits-kept", "logits-recomputed"])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_head_logprobs_and_gradients_equal_autograd(chunk: int, with_entropy: bool, keep_logits: bool) -> None:
    torch.manual_seed(chunk)
    n, hidden, vocab = 150, 24, 301
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.3).requires_grad_()
    y = torch.randint(0, vocab, (n,))
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    keep = 1 << 30 if keep_logits else 0
    lp, ent = HeadLogprobs.apply(h, w, y, chunk, with_entropy, keep)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))

    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rlp, rent = reference(h64, w64, y)
    rloss = (rlp * g_lp.double()).sum() + ((rent * g_ent.double()).sum() if with_entropy else 0)
    rgrad_h, rgrad_w = torch.autograd.grad(rloss, (h64, w64))
    torch.testing.assert_close(lp.double(), rlp, atol=2e-5, rtol=0)
    if with_entropy:
        torch.testing.assert_close(ent.double(), rent, atol=2e-5, rtol=0)
    else:
        assert not ent.any()
    torch.testing.assert_close(grad_h.double(), rgrad_h, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad_w.double(), rgrad_w, atol=2e-5, rtol=1e-4)


def test_head_logprobs_frozen_weight_gets_no_gradient() -> None:
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(50, 8)
    lp, _ = HeadLogprobs.apply(h, w, torch.randint(0, 50, (10,)), 4, False, 1 << 20)
    lp.sum().backward()
    assert h.grad is not None and w.grad is None


def test_train_mfu_benchmark_runs_on_cpu() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_mfu.py"), "--device", "cpu", "--shapes", "tiny"]
    cmd += ["--sequences", "5", "--min-len", "16", "--max-len", "64", "--max-tokens", "128", "--warmup", "1"]
    cmd += ["--steps", "1", "--variant", "logits_chunk_size=64"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = out.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ") and "mfu_tiny=" in result and "over_plain_hf_tiny=" in result
    fields = dict(kv.split("=") for kv in result.split()[1:])
    assert 0 < float(fields["mfu_tiny"]) < 1, result


def _sdpa_per_sequence(q, k, v, cu, causal_scale=None):
    outs = []
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x[a:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=causal_scale
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("torch_release", ["2.10", "2.11"])
def test_flash_varlen_calls_each_torch_release_as_it_takes_it(
    torch_release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flash_varlen.varlen_causal` against torch's two signatures of varlen attention (``is_causal``
    without native grouped-query attention; ``window_size`` with ``enable_gqa``), the kernel
    replaced by per-sequence SDPA (torch's runs on CUDA only): causal within each sequence, KV
    heads repeated where the kernel cannot group them, int32 boundaries."""
    from areal_lite.utils import flash_varlen

    seen = {}

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **kw):
        seen.update(kw, heads=(q.shape[1], k.shape[1]), dtype=cu_q.dtype, max_q=max_q)
        if kw.get("enable_gqa"):
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return _sdpa_per_sequence(q, k, v, cu_q, scale)

    params = {"2.10": {"is_causal", "scale"}, "2.11": {"window_size", "enable_gqa", "scale"}}[torch_release]
    monkeypatch.setattr(flash_varlen, "_kernel", lambda: (kernel, frozenset(params)))
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 19, 30])
    q, k, v = torch.randn(30, 4, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 8)
    out = flash_varlen.varlen_causal(q, k, v, cu, 13, scale=0.3)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, _sdpa_per_sequence(q, kk, vv, cu, 0.3))
    assert seen["dtype"] == torch.int32 and seen["max_q"] == 13
    if torch_release == "2.10":
        assert seen["is_causal"] is True and seen["heads"] == (4, 4)
    else:
        assert seen["window_size"] == (-1, 0) and seen["enable_gqa"] is True and seen["heads"] == (4, 2)
    assert not flash_varlen.available(torch.device("cpu"), torch.bfloat16)


def test_liger_kernels_off_cuda_is_refused_with_the_key(tmp_path: Path) -> None:
    from areal_lite.api.config import TrainEngineConfig
    from areal_lite.engines.train.fsdp_model import load_hf_model
    from areal_lite.utils.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), hidden_size=32, num_layers=1)
    with pytest.raises(ValueError, match="liger_kernels needs CUDA"):
        load_hf_model(path, TrainEngineConfig(path=path, liger_kernels=True), torch.device("cpu"))


@pytest.mark.slow  # make test-long: a minute of tracing on two cores
def test_compiled_layers_train_like_eager_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_layers``: every decoder layer compiled in place (parameter names unchanged), the
    varlen attention run eagerly between the graphs, and log-probabilities, a training step's loss
    and the updated weights equal to the eager layers'. The graphs are traced for real (dynamo and
    autograd's tracing, ``aot_eager``); only inductor's kernel generation, which CUDA exercises in
    `make test-gpu`, is left out to keep the test short."""
    from tensordict import TensorDict

    from areal_lite.api.config import CPUConfig, OptimizerConfig, TrainEngineConfig
    from areal_lite.api.io import FinetuneSpec
    from areal_lite.engines.train import fsdp_model
    from areal_lite.engines.train.fsdp import FSDPEngine
    from areal_lite.engines.train.multimodal import decoder_layers
    from areal_lite.utils.tiny import build_tiny_model

    monkeypatch.setattr(fsdp_model, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    path = build_tiny_model(str(tmp_path / "m"), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 17, 9, 12])
    mask = torch.arange(17)[None] < lens[:, None]
    data = TensorDict(
        {"input_ids": torch.randint(3, 400, mask.shape, generator=g) * mask, "attention_mask": mask, "loss_mask": mask},
        batch_size=[4],
    )

    def nll(logp, ent, mb):
        m = mb["loss_mask"]
        return -(logp * m).sum() / m.sum(), {}

    seen = {}
    for compiled in (False, True):
        cfg = TrainEngineConfig(
            path=path, compile_layers=compiled, optimizer=OptimizerConfig(lr=1e-2), cpu=CPUConfig(fused_ops=False)
        )
        e = FSDPEngine(cfg)
        e.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=4))
        try:
            layers = list(decoder_layers(e.model.hf))
            assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
            logp = e.forward(data)
            loss = e.train_batch(data, nll, lambda mb: mb["loss_mask"].sum())["loss"]
            weights = {n: p.full_tensor().clone() for n, p in e.model.named_parameters()}
            seen[compiled] = (logp, loss, weights)
        finally:
            e.destroy()
    (logp, loss, weights), (c_logp, c_loss, c_weights) = seen[False], seen[True]
    assert list(c_weights) == list(weights)
    torch.testing.assert_close(c_logp[mask], logp[mask], atol=1e-5, rtol=0)
    assert abs(c_loss - loss) < 1e-5
    for name, w in weights.items():
        torch.testing.assert_close(c_weights[name], w, atol=1e-5, rtol=0, msg=name)
