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

from areal_lite.engines.train.fused_head import head_logprobs

ROOT = Path(__file__).resolve().parents[1]


def reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logq = torch.log_softmax((h @ w.t()).double(), dim=-1)
    return logq.gather(-1, y[:, None])[:, 0], -(logq.exp() * logq).sum(-1)


@pytest.mark.parametrize("chunk", [7, 64, 1000])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_head_logprobs_and_gradients_equal_autograd(chunk: int, with_entropy: bool) -> None:
    torch.manual_seed(chunk)
    n, hidden, vocab = 150, 24, 301
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.3).requires_grad_()
    y = torch.randint(0, vocab, (n,))
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    lp, ent = head_logprobs(h, w, y, chunk_size=chunk, with_entropy=with_entropy)
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
        assert ent is None
    torch.testing.assert_close(grad_h.double(), rgrad_h, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad_w.double(), rgrad_w, atol=2e-5, rtol=1e-4)


def test_head_logprobs_frozen_weight_gets_no_gradient() -> None:
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(50, 8)
    lp, _ = head_logprobs(h, w, torch.randint(0, 50, (10,)), chunk_size=4)
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
