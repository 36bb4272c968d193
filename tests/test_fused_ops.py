"""The engine's fused CPU ops (residual add and RMS norm, rotary embedding with the q/k/v split,
SiLU times up) against HF's own modules: bit for bit in bf16, where each op rounds where HF's
eager modules round, and to float32 rounding in fp32; one thread and two; the AVX2 build; and the
conditions that turn them off."""

from __future__ import annotations

import platform

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from areal_lite.engines import fused_ops

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 0.0, "rtol": 0.0}}


def load(dtype: torch.dtype) -> fused_ops.FusedOps:
    ops = fused_ops.load(torch.device("cpu"), dtype)
    assert ops is not None, "the fused ops did not build (see the warning logged)"
    return ops


def check_ops(dtype: torch.dtype, rows: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    nq, nkv, hd, hidden, inter = 6, 2, 32, 72, 100  # widths that are not whole vectors
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd)
    ops = load(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Residual add and RMS norm.
        norm = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden, generator=gen))
        h = torch.randn(rows, hidden, generator=gen).to(dtype)
        delta = torch.randn(rows, hidden, generator=gen).to(dtype)
        expected_h = h + delta
        with torch.no_grad():
            expected = norm(expected_h)
        got = ops.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        torch.testing.assert_close(h, expected_h, atol=0, rtol=0)  # added in place
        torch.testing.assert_close(got, expected, **TOL[dtype])
        with torch.no_grad():
            torch.testing.assert_close(ops.add_rms_norm(h, None, norm.weight, 1e-6), norm(h), **TOL[dtype])

        # SiLU times up, from the fused gate/up projection (rows strided, as a slice gives them).
        gate_up = torch.randn(rows, 2 * inter + 8, generator=gen).to(dtype)[:, : 2 * inter]
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(ops.silu_mul(gate_up), ACT2FN["silu"](gate) * up, **TOL[dtype])

        # Rotary embedding of q and k at each row's position, and the split.
        table = 300
        cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), torch.arange(table)[None])
        positions = torch.randint(0, table, (rows,), generator=gen)
        qkv = torch.randn(rows, (nq + 2 * nkv) * hd, generator=gen).to(dtype)
        q, k, v = qkv.view(rows, nq + 2 * nkv, hd).split([nq, nkv, nkv], dim=1)
        # HF's layout: [batch, heads, tokens, hd], one token per batch row here.
        eq, ek = apply_rotary_pos_emb(
            q[:, :, None], k[:, :, None], cos[0][positions][:, None], sin[0][positions][:, None], unsqueeze_dim=1
        )
        gq, gk, gv = ops.rope_split(qkv, cos[0], sin[0], positions, nq, nkv)
        torch.testing.assert_close(gq, eq[:, :, 0], **TOL[dtype])
        torch.testing.assert_close(gk, ek[:, :, 0], **TOL[dtype])
        torch.testing.assert_close(gv, v, atol=0, rtol=0)
        assert gq.is_contiguous() and gk.is_contiguous() and gv.is_contiguous()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, threads", [(1, 1), (37, 1), (64, 2)])
def test_fused_ops_compute_what_hf_modules_compute(dtype: torch.dtype, rows: int, threads: int) -> None:
    check_ops(dtype, rows, threads)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86 instruction set")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_avx2_build_matches_too(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setenv(fused_ops.cpu_kernels.ARCH_ENV, "x86-64-v3")
    check_ops(dtype, 37, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_nan_stays_a_nan(dtype: torch.dtype) -> None:
    """A diverged model shows as NaN, not as finite numbers made up by the rounding."""
    ops = load(dtype)
    h = torch.ones(3, 40, dtype=dtype)
    h[1, 5] = float("nan")
    x = ops.add_rms_norm(h, None, torch.ones(40, dtype=dtype), 1e-6)
    assert x[1].isnan().all() and not x[[0, 2]].isnan().any()
    gate_up = torch.ones(2, 8, dtype=dtype)
    gate_up[0, 1] = float("nan")
    out = ops.silu_mul(gate_up)
    assert out[0, 1].isnan() and out.isnan().sum() == 1


def test_fused_ops_are_off_where_they_do_not_apply(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    cpu = torch.device("cpu")
    assert fused_ops.load(torch.device("meta"), torch.float32) is None
    assert fused_ops.load(cpu, torch.float16) is None
    monkeypatch.setenv(fused_ops.ENV, "0")
    assert fused_ops.load(cpu, torch.float32) is None
    monkeypatch.delenv(fused_ops.ENV)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(fused_ops, "_loaded", {})
    assert fused_ops.load(cpu, torch.float32) is None
