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

from areal_lite.api.config import CPUConfig
from areal_lite.cpu import fused_ops, switches

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 0.0, "rtol": 0.0}}


def load(dtype: torch.dtype, config: CPUConfig | None = None) -> fused_ops.FusedOps:
    ops = fused_ops.load(torch.device("cpu"), dtype, config)
    assert ops is not None, "the fused ops did not build (see the warning logged)"
    return ops


def check_ops(dtype: torch.dtype, rows: int, threads: int, cpu: CPUConfig | None = None) -> None:
    gen = torch.Generator().manual_seed(rows)
    nq, nkv, hd, hidden, inter = 6, 2, 32, 72, 100  # widths that are not whole vectors
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd)
    ops = load(dtype, cpu)
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
def test_the_avx2_build_matches_too(dtype: torch.dtype) -> None:
    check_ops(dtype, 37, 1, CPUConfig(kernel_arch="x86-64-v3"))


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
    assert fused_ops.load(cpu, torch.float32, CPUConfig(fused_ops=False)) is None
    assert fused_ops.patch_for_training(torch.nn.Linear(4, 4), CPUConfig(fused_ops=False)) == 0
    monkeypatch.setenv(switches.FUSED_OPS_ENV, "0")  # the override, over a config that has them on
    assert fused_ops.load(cpu, torch.float32, CPUConfig(fused_ops=True)) is None
    monkeypatch.delenv(switches.FUSED_OPS_ENV)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(fused_ops, "_loaded", {})
    assert fused_ops.load(cpu, torch.float32) is None


def check_training(module_class: type, make_args, threads: int) -> None:
    """A patched copy of an HF module against the module itself: output, input gradient and
    parameter gradients of one forward and backward in fp32."""
    torch.manual_seed(threads)
    plain, patched = module_class(*make_args()), module_class(*make_args())
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(mean=1.0 if p.dim() == 1 else 0.0, std=0.2)  # a norm's scale, a layer's weights
    patched.load_state_dict(plain.state_dict())
    assert fused_ops.patch_for_training(patched) == 1
    width = next(plain.parameters()).shape[-1]
    x = torch.randn(2, 37, width)
    grad_out = torch.randn(2, 37, width)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        grads = []
        for module in (plain, patched):
            xi = x.clone().requires_grad_()
            out = module(xi)
            out.backward(grad_out)
            grads.append((out, xi.grad, [p.grad for p in module.parameters()]))
    finally:
        torch.set_num_threads(previous)
    (out_a, dx_a, dp_a), (out_b, dx_b, dp_b) = grads
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_b, dx_a, atol=1e-5, rtol=1e-5)
    for a, b in zip(dp_a, dp_b):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_training_norm_matches_hf_forward_and_backward(threads: int) -> None:
    check_training(LlamaRMSNorm, lambda: (72,), threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_training_silu_mlp_matches_hf_forward_and_backward(threads: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=72, intermediate_size=100, num_attention_heads=6)
    check_training(LlamaMLP, lambda: (config,), threads)


def test_patched_modules_leave_bf16_to_hf() -> None:
    """Inputs the fused functions do not take (bf16 here) run the module's own forward."""
    norm = LlamaRMSNorm(16).to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16)
    with torch.no_grad():
        expected = norm(x)
        fused_ops.patch_for_training(norm)
        torch.testing.assert_close(norm(x), expected, atol=0, rtol=0)


def test_a_whole_model_is_patched_and_trains_as_hf(tmp_path) -> None:
    """Every norm and MLP of a tiny Qwen2 is patched; its loss and gradients equal the unpatched
    model's."""
    from transformers import AutoModelForCausalLM

    from areal_lite.utils.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), hidden_size=64, num_layers=3)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    patched = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert fused_ops.patch_for_training(patched) == 3 * 3 + 1  # two norms and an MLP a layer, the final norm
    ids = torch.randint(3, 200, (2, 20))
    for model in (plain, patched):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
