"""The engine's CPU decode attention kernel: the attention of one query per row over that row's
cached keys and values (blocked key layout), against a float64 reference, in fp32 and bf16, with
grouped queries and row lengths on and off the block edges; and the conditions that turn it off."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from areal_lite.api.config import CPUConfig
from areal_lite.cpu import decode_attention, switches
from areal_lite.cpu.decode_attention import BLOCK

LENS = [1, 15, 16, 17, 63, 64, 65, 130]


def blocked_keys(keys: torch.Tensor) -> torch.Tensor:
    """[rows, kv heads, cap, D] -> the runner's layout [rows, kv heads, cap / BLOCK, D, BLOCK]."""
    rows, nkv, cap, hd = keys.shape
    return keys.view(rows, nkv, cap // BLOCK, BLOCK, hd).transpose(3, 4).contiguous()


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: torch.Tensor, scale: float):
    group = q.shape[1] // keys.shape[1]
    cap = keys.shape[2]
    visible = torch.arange(cap)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.double()[:, :, None],
        keys.double().repeat_interleave(group, 1),
        values.double().repeat_interleave(group, 1),
        attn_mask=visible[:, None, None],
        scale=scale,
    )
    return out[:, :, 0]


ATOL = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("dtype, atol", ATOL)
@pytest.mark.parametrize("nkv, group, hd", [(3, 3, 64), (2, 1, 16), (1, 4, 32)])
def test_kernel_matches_attention_in_float64(dtype: torch.dtype, atol: float, nkv: int, group: int, hd: int) -> None:
    check_kernel(dtype, atol, nkv, group, hd)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86 instruction set")
@pytest.mark.parametrize("dtype, atol", ATOL)
def test_the_avx2_build_matches_too(dtype: torch.dtype, atol: float) -> None:
    """Built for x86-64-v3 (AVX2 and FMA, the CPUs without AVX-512), as it is on those CPUs, and run
    here (the shapes of the 20M benchmark model: 2 KV heads of 3 queries, head dim 64)."""
    check_kernel(dtype, atol, 2, 3, 64, CPUConfig(kernel_arch="x86-64-v3"))


def check_kernel(
    dtype: torch.dtype, atol: float, nkv: int, group: int, hd: int, config: CPUConfig | None = None
) -> None:
    kernel = decode_attention.load(torch.device("cpu"), dtype, hd, group, config)
    if kernel is None:
        pytest.skip("the kernel cannot be built here (no C++ compiler); the engine runs batched matmuls")
    g = torch.Generator().manual_seed(0)
    rows, cap = len(LENS) + 2, 160  # the cache holds more rows than decode
    keys = torch.randn(rows, nkv, cap, hd, generator=g).to(dtype)
    values = torch.randn(rows, nkv, cap, hd, generator=g).to(dtype)
    q = torch.randn(len(LENS), nkv * group, hd, generator=g).to(dtype)
    new_k = torch.randn(len(LENS), nkv, hd, generator=g).to(dtype)
    new_v = torch.randn(len(LENS), nkv, hd, generator=g).to(dtype)
    lens = torch.tensor(LENS)
    scale = hd**-0.5
    k_cache, v_cache = blocked_keys(keys), values.clone()
    out = kernel(q, new_k, new_v, k_cache, v_cache, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    # The new keys and values went into the cache at each row's last position, and nowhere else.
    rows = torch.arange(len(LENS))
    keys[rows, :, lens - 1] = new_k
    values[rows, :, lens - 1] = new_v
    assert torch.equal(k_cache, blocked_keys(keys)) and torch.equal(v_cache, values)
    expected = reference(q, keys[: len(LENS)], values[: len(LENS)], lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    # Positions past a row's length do not count, whatever they hold.
    keys[:, :, 140:] = 1e4
    values[:, :, 140:] = 1e4
    again = kernel(q, new_k, new_v, blocked_keys(keys), values, lens, scale)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_kernel_is_off_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert decode_attention.load(torch.device("meta"), torch.float32, 64, 1) is None
    assert decode_attention.load(cpu, torch.float16, 64, 1) is None
    assert decode_attention.load(cpu, torch.float32, 24, 1) is None  # head dim not a multiple of 16
    assert decode_attention.load(cpu, torch.float32, 64, 1, CPUConfig(decode_attention=False)) is None
    monkeypatch.setenv(switches.DECODE_ATTENTION_ENV, "0")  # the override, over a config that has it on
    assert decode_attention.load(cpu, torch.float32, 64, 1, CPUConfig(decode_attention=True)) is None


@pytest.mark.parametrize("by", ["config", "environment"])
def test_an_architecture_the_compiler_refuses_means_no_kernel(
    by: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr(decode_attention, "_loaded", {})
    config = CPUConfig(kernel_arch="no-such-cpu", kernel_cache=str(tmp_path))
    if by == "environment":
        monkeypatch.setenv(switches.KERNEL_ARCH_ENV, config.kernel_arch)
        monkeypatch.setenv(switches.KERNEL_CACHE_ENV, config.kernel_cache)
        config = CPUConfig()
    else:  # the variables win over the config (make test-avx2 sets the architecture), so clear them
        monkeypatch.delenv(switches.KERNEL_ARCH_ENV, raising=False)
        monkeypatch.delenv(switches.KERNEL_CACHE_ENV, raising=False)
    assert decode_attention.load(torch.device("cpu"), torch.float32, 64, 1, config) is None
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind


def test_no_compiler_means_no_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(decode_attention, "_loaded", {})
    assert decode_attention.load(torch.device("cpu"), torch.float32, 48, 2) is None
