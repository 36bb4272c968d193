"""Training's fp32 products through oneDNN (`cpu_linear`): the same values and gradients as
``F.linear`` to fp32 rounding, only the gradients autograd asks for, the cases left to
``F.linear``, the switch, and a whole HF model and an FSDP train step routed through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_lite.api.config import CPUConfig
from areal_lite.cpu import linear as cpu_linear
from areal_lite.cpu import switches

TOL = {"atol": 1e-5, "rtol": 1e-4}


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Forces the oneDNN route and records the shape of every product sent to it."""
    monkeypatch.setattr(cpu_linear, "_followed", CPUConfig(fp32_linear="onednn"))
    calls: list[tuple[int, ...]] = []
    real = cpu_linear.onednn_linear

    def counted(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((a.shape[0], a.shape[1], b_t.shape[0]))
        return real(a, b_t, bias)

    monkeypatch.setattr(cpu_linear, "onednn_linear", counted)
    return calls


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_values_and_gradients_are_fp32_exact(onednn: list, bias: bool, threads: int) -> None:
    """Output and gradients within fp32 rounding of a float64 reference, as ``F.linear``'s
    (an implicit bf16 product would be ~1e-3 off), for a 3-D input and a strided gradient."""
    gen = torch.Generator().manual_seed(threads)
    x = torch.randn(3, 70, 384, generator=gen, requires_grad=True)
    w = torch.randn(1152, 384, generator=gen, requires_grad=True)
    b = torch.randn(1152, generator=gen, requires_grad=True) if bias else None
    inputs = [x, w] + ([b] if bias else [])
    dy = torch.randn(3, 70, 1152, generator=gen)
    strided_dy = dy.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, another layout
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = cpu_linear.linear(x, w, b)
        grads = torch.autograd.grad(ours, inputs, strided_dy)
    finally:
        torch.set_num_threads(before)
    assert len(onednn) == 3  # forward, input gradient, weight gradient
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    b64 = b.detach().double() if bias else None
    assert rel_err(ours, F.linear(x64, w64, b64)) < 1e-5
    assert rel_err(grads[0], dy64 @ w64) < 1e-5
    assert rel_err(grads[1], dy64.flatten(0, 1).T @ x64.flatten(0, 1)) < 1e-5
    if bias:
        assert rel_err(grads[2], dy64.sum((0, 1))) < 1e-5


def test_a_frozen_weight_gets_no_gradient_product(onednn: list) -> None:
    x = torch.randn(256, 96, requires_grad=True)
    w = torch.randn(128, 96)  # frozen, as LoRA's base layers
    y = cpu_linear.linear(x, w)
    (dx,) = torch.autograd.grad(y.square().sum(), [x])
    torch.testing.assert_close(dx, 2 * F.linear(x, w) @ w, **TOL)
    assert onednn == [(256, 96, 128), (256, 128, 96)]  # forward and input gradient only


def test_small_bf16_and_autocast_products_stay_with_f_linear(onednn: list) -> None:
    small = torch.randn(64, 64), torch.randn(64, 64)
    assert torch.equal(cpu_linear.linear(*small), F.linear(*small))
    half = torch.randn(512, 256).bfloat16(), torch.randn(256, 256).bfloat16()
    assert torch.equal(cpu_linear.linear(*half), F.linear(*half))
    big = torch.randn(512, 256), torch.randn(256, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bf16 product, as F.linear's
        assert cpu_linear.linear(*big).dtype == torch.bfloat16
    assert onednn == []
    cpu_linear.linear(torch.randn(64, 128), torch.randn(128, 128))  # 1 << 20 multiply-adds
    assert onednn == [(64, 128, 128)]


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CPUConfig.fp32_linear`, as the last train engine on CPU follows it, and its environment
    override, which wins."""
    monkeypatch.setattr(cpu_linear, "_followed", CPUConfig())  # put back after the test
    cpu_linear.follow(CPUConfig(fp32_linear="torch"))
    assert not cpu_linear.enabled()
    assert cpu_linear.patch_for_training(torch.nn.Linear(4, 4)) == 0
    cpu_linear.follow(CPUConfig(fp32_linear="onednn"))
    assert cpu_linear.enabled()
    monkeypatch.setenv(switches.FP32_LINEAR_ENV, "torch")
    assert not cpu_linear.enabled()
    monkeypatch.setenv(switches.FP32_LINEAR_ENV, "mkl")
    with pytest.raises(ValueError, match="auto, onednn or torch"):
        cpu_linear.enabled()
    monkeypatch.setenv(switches.FP32_LINEAR_ENV, "auto")
    assert cpu_linear.enabled() == cpu_linear._this_cpu_is_full_width_amd()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN no wider than MKL's AVX2 kernels
    assert not cpu_linear.enabled()


@pytest.mark.parametrize(
    "vendor, family, flags, expected",
    [
        ("AuthenticAMD", 26, "fpu avx2 avx512f avx512_bf16", True),  # Zen 5
        ("AuthenticAMD", 25, "fpu avx2 avx512f avx512_bf16", False),  # Zen 4: 256-bit halves
        ("AuthenticAMD", 26, "fpu avx2", False),  # AVX-512 hidden by the hypervisor
        ("AuthenticAMD", 23, "fpu avx2", False),  # AVX2-only EPYC
        ("GenuineIntel", 6, "fpu avx2 avx512f", False),  # MKL runs its AVX-512 kernels there
    ],
)
def test_auto_picks_full_width_amd_cpus(vendor: str, family: int, flags: str, expected: bool) -> None:
    cpuinfo = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 2\nflags\t\t: {flags}\n"
    assert cpu_linear.full_width_amd(cpuinfo) is expected


def test_a_whole_model_is_patched_and_trains_as_hf(onednn: list, tmp_path) -> None:
    """Every linear of a tiny Qwen2 (7 a layer and the head) is patched; its loss and gradients
    equal the unpatched model's."""
    from transformers import AutoModelForCausalLM

    from areal_lite.utils.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), hidden_size=128, num_layers=2, vocab_size=512)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    patched = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert cpu_linear.patch_for_training(patched) == 2 * 7 + 1
    ids = torch.randint(3, 400, (4, 64))
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, patched)]
    for loss in losses:
        loss.backward()
    assert onednn, "no product went through oneDNN"
    torch.testing.assert_close(losses[1], losses[0], **TOL)
    for (name, a), b in zip(plain.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **TOL, msg=name)


def fsdp_step(path: str, route: str, checkpointing: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An FSDP engine's log-probabilities of a batch, then its parameters after one SGD step on
    it, with ``route`` for the products (its config's ``cpu.fp32_linear``; and activation
    checkpointing if asked)."""
    from tensordict import TensorDict

    from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
    from areal_lite.api.io import FinetuneSpec
    from areal_lite.engines.train.fsdp import FSDPEngine

    cfg = TrainEngineConfig(
        path=path,
        optimizer=OptimizerConfig(gradient_clipping=0.0),
        gradient_checkpointing=checkpointing,
        cpu=CPUConfig(fp32_linear=route),
    )
    engine = FSDPEngine(cfg)
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=4))
    engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=1.0)
    try:
        ids = torch.randint(3, 400, (4, 96), generator=torch.Generator().manual_seed(0))
        ones = torch.ones_like(ids)
        batch = TensorDict({"input_ids": ids, "attention_mask": ones, "loss_mask": ones}, batch_size=[4])
        logp = engine.forward(batch)

        def loss(lp: torch.Tensor, entropy: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, dict]:
            return -(lp * mb["loss_mask"]).sum() / mb["loss_mask"].sum(), {}

        engine.train_batch(batch, loss, lambda mb: float(mb["loss_mask"].sum()))
        return logp, {k: v.full_tensor().detach().clone() for k, v in engine.model.named_parameters()}
    finally:
        engine.destroy()


def test_an_fsdp_step_through_onednn_equals_the_torch_one(onednn: list, tmp_path) -> None:
    """`FSDPEngine` routes its layers and chunked head through `cpu_linear` as its config's
    ``cpu.fp32_linear`` says: the same log-probabilities and the same parameters after a step (SGD
    at lr 1: parameters equal gradients) as through ``F.linear``, also with activation
    checkpointing (the forward rerun in the backward)."""
    from areal_lite.utils.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), hidden_size=128, num_layers=2, vocab_size=512)
    logp_torch, params_torch = fsdp_step(path, "torch")
    assert onednn == []
    logp, params = fsdp_step(path, "onednn")
    assert len(onednn) >= 3 * 2 * 7  # every layer's linears, forward and backward
    torch.testing.assert_close(logp, logp_torch, atol=1e-5, rtol=1e-5)
    apart = max(float((params[k] - v).abs().max()) for k, v in params_torch.items())
    for k, v in params_torch.items():
        torch.testing.assert_close(params[k], v, atol=1e-5, rtol=1e-4, msg=k)
    assert apart > 0  # ... and not bit-identical: the products really went another way
    _, params_ckpt = fsdp_step(path, "onednn", checkpointing=True)
    for k, v in params_torch.items():
        torch.testing.assert_close(params_ckpt[k], v, atol=1e-5, rtol=1e-4, msg=k)
