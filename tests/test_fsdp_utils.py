"""The pieces FSDPEngine (and MegatronEngine) build on: chunked log-probabilities from hidden
states, token alignment of packed predictions, attention over packed sequences, compute dtypes
and LR schedules."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from areal_lite.cpu.precision import compute_dtype, cpu_kind, native_bf16
from areal_lite.engines.train import logprob, varlen_attention
from areal_lite.engines.train.logprob import align_to_tokens, logprobs_from_hidden, next_token_labels
from areal_lite.engines.train.lr_schedule import lr_multiplier
from areal_lite.engines.train.shared_prefix import shared_prefix_layout
from areal_lite.engines.train.varlen_attention import varlen_sdpa_attention


def reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(hidden @ weight.t(), -1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("recompute", [True, False], ids=["checkpointed", "kept"])
@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
def test_chunked_logprobs_and_grads_equal_full(chunk: int, recompute: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same values and gradients whether each chunk's logits are recomputed in backward or kept."""
    monkeypatch.setattr(logprob, "CHECKPOINT_MIN_BYTES", 0 if recompute else 1 << 40)
    torch.manual_seed(0)
    h = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 30, (16,))
    lp, ent = logprobs_from_hidden(h, w, y, chunk_size=chunk, with_entropy=True)
    ref_lp, ref_ent = reference(h, w, y)
    torch.testing.assert_close(lp, ref_lp.float())
    torch.testing.assert_close(ent, ref_ent.float())
    g = torch.autograd.grad((lp * 1.3 + ent * 0.7).sum(), (h, w))
    ref_g = torch.autograd.grad((ref_lp * 1.3 + ref_ent * 0.7).sum(), (h, w))
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_entropy_requested() -> None:
    lp, ent = logprobs_from_hidden(torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 1, 2, 3]), with_entropy=False)
    assert lp.shape == (4,) and ent is None


def test_alignment_to_the_token() -> None:
    # Two packed sequences [10, 11, 12] and [20, 21]; position t predicts token t + 1.
    ids = torch.tensor([10, 11, 12, 20, 21])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert next_token_labels(ids).tolist() == [11, 12, 20, 21, 10]
    pred = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # pred[t] scores token t + 1
    assert align_to_tokens(pred, cu).tolist() == [0.0, 1.0, 2.0, 0.0, 4.0]


@pytest.mark.parametrize("lens", [[5, 1, 9, 3], [7, 8, 6, 8, 7], [30, 2, 3]], ids=["loop", "padded", "long-tail"])
def test_varlen_attention_equals_block_causal_mask(lens: list[int]) -> None:
    # [7, 8, 6, 8, 7] takes the padded single-call path, the others the per-sequence loop.
    torch.manual_seed(0)
    t = sum(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q, k, v = (torch.randn(1, h, t, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    out, _ = varlen_sdpa_attention(torch.nn.Module().eval(), q, k, v, None, cu_seq_lens_q=cu)
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        varlen_sdpa_attention(torch.nn.Module(), q, k, v, None)


def packed(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``seqs`` as a packed micro-batch: input ids, position ids restarting per sequence, cu_seqlens."""
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0, *itertools.accumulate(len(s) for s in seqs)], dtype=torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("dense_max", [128, 0], ids=["dense-mask", "rows"])
@pytest.mark.parametrize("tail", [[], [list(range(30, 50))]], ids=["trees", "with-a-long-unshared-sequence"])
def test_shared_prefix_layout_and_tree_attention(
    tail: list[list[int]], dense_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of sequences with a common prefix become trees (each suffix keeps a token); attention
    over the trees (a dense tree mask, or a row per prefix and per suffix), read back through
    token_index, equals attention over the packed sequences, gradients included."""
    monkeypatch.setattr(varlen_attention, "DENSE_TREE_MAX", dense_max)
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9], [5, 6, 1], [5, 6, 2, 3], *tail]
    ids, pos, cu = packed(seqs)
    tree = shared_prefix_layout(ids, pos, cu)
    assert tree is not None
    lens = [3 + 2 + 1 + 3, 4, 2 + 1 + 2] + [len(s) for s in tail]
    assert (tree.cu_seqlens[1:] - tree.cu_seqlens[:-1]).tolist() == lens
    assert torch.equal(tree.input_ids[tree.token_index], ids) and torch.equal(tree.position_ids[tree.token_index], pos)
    starts = set(cu[:-1].tolist())
    for j in range(len(ids)):  # each token is predicted from the one before it in its sequence
        expected = -1 if j in starts else int(tree.token_index[j - 1])
        assert int(tree.source[tree.token_index[j]]) == expected
    assert tree.branches[: lens[0]].tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3]

    # Queries, keys and values per tree token; a shared prefix's are the same in every sequence.
    torch.manual_seed(0)
    q_t, k_t, v_t = (
        torch.randn(1, h, tree.input_ids.shape[0], 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)
    )
    q, k, v = (x[:, :, tree.token_index] for x in (q_t, k_t, v_t))
    ref, _ = varlen_sdpa_attention(torch.nn.Module().eval(), q, k, v, None, cu_seq_lens_q=cu)
    out, _ = varlen_sdpa_attention(
        torch.nn.Module().eval(), q_t, k_t, v_t, None, cu_seq_lens_q=tree.cu_seqlens, tree_branches=tree.branches
    )
    torch.testing.assert_close(out[:, tree.token_index], ref)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out[:, tree.token_index] * w).sum(), (q_t, k_t, v_t))
    for a, b in zip(grads, torch.autograd.grad((ref * w).sum(), (q_t, k_t, v_t))):
        torch.testing.assert_close(a, b)
    assert (
        shared_prefix_layout(torch.tensor([1, 2, 3, 1, 4]), torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 3, 5]))
        is None
    )


def test_groups_whose_prompts_start_alike_each_share_their_own_prompt() -> None:
    """GRPO groups whose prompts begin with the same words ("What is ...", a system prompt): each
    group's whole prompt is shared by its samples, not only the words all groups begin with (one
    tree of all 32 sequences would save 3 tokens per sequence instead of 15)."""
    common = [7, 7, 7]
    seqs = [common + [g] * 12 + [100 + s, 200 + s] for g in range(4) for s in range(8)]
    ids, pos, cu = packed(seqs)
    tree = shared_prefix_layout(ids, pos, cu)
    assert tree is not None
    assert (tree.cu_seqlens[1:] - tree.cu_seqlens[:-1]).tolist() == [15 + 8 * 2] * 4
    assert torch.equal(tree.input_ids[tree.token_index], ids) and torch.equal(tree.position_ids[tree.token_index], pos)
    # A group whose samples end within the shared words still shares them with its neighbours.
    seqs = [common + [1], common + [2], common + [3, 4], common + [3, 5]]
    ids, pos, cu = packed(seqs)
    tree = shared_prefix_layout(ids, pos, cu)
    assert tree is not None and tree.input_ids.tolist() == [7, 7, 7, 1, 2, 3, 4, 3, 5]


@pytest.mark.parametrize("lens", [[5, 1, 9, 3], [7, 8, 6, 8, 7]], ids=["loop", "padded"])
def test_varlen_attention_of_bf16_inputs_is_computed_in_fp32(lens: list[int]) -> None:
    torch.manual_seed(0)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q, k, v = (torch.randn(1, 2, sum(lens), 8) for _ in range(3))
    ref, _ = varlen_sdpa_attention(torch.nn.Module().eval(), q, k, v, None, cu_seq_lens_q=cu)
    half = [x.bfloat16().requires_grad_(True) for x in (q, k, v)]
    out, _ = varlen_sdpa_attention(torch.nn.Module().eval(), *half, None, cu_seq_lens_q=cu)
    assert out.dtype == torch.bfloat16
    # only the inputs' and the output's roundings: bf16 keeps 8 bits of mantissa
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02)
    grads = torch.autograd.grad(out.float().sum(), half)
    assert all(g.dtype == torch.bfloat16 and g.abs().sum() > 0 for g in grads)


def test_compute_dtype_names_and_auto() -> None:
    cpu = torch.device("cpu")
    assert compute_dtype("float32", cpu) is torch.float32 and compute_dtype("bfloat16", cpu) is torch.bfloat16
    assert compute_dtype("auto", cpu) is (torch.bfloat16 if native_bf16(cpu) else torch.float32)
    assert compute_dtype("auto", cpu, allowed=("float32",)) is torch.float32
    assert compute_dtype("auto", torch.device("meta")) is torch.float32
    with pytest.raises(ValueError, match="float16"):
        compute_dtype("float16", cpu, allowed=("float32", "bfloat16"))
    with pytest.raises(ValueError, match="fp8"):
        compute_dtype("fp8", cpu)


@pytest.mark.parametrize("var", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_auto_is_fp32_where_onednn_is_capped_below_bf16(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    """Capped at AVX2 or plain AVX-512, oneDNN emulates bf16 (0.9 and 38 GFLOP/s against ~90 in
    fp32 on the Zen 4 CPU), whatever the CPU has: ``auto`` is fp32 and the kind says so."""
    cpu = torch.device("cpu")
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    native = native_bf16(cpu)
    for cap in ("avx2", "AVX512_CORE", " avx512_core_vnni "):
        monkeypatch.setenv(var, cap)
        assert not native_bf16(cpu) and compute_dtype("auto", cpu) is torch.float32
        assert f"oneDNN capped at {cap.strip().upper()}" in cpu_kind() and "(bf16 emulated)" in cpu_kind()
    monkeypatch.setenv(var, "AVX512_CORE_AMX")  # a cap above bf16 leaves the CPU as it is
    assert native_bf16(cpu) is native
    assert ("(bf16 native)" in cpu_kind()) is native


def test_lr_schedules() -> None:
    warm = lr_multiplier("constant", total_steps=10, warmup_steps=4)
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lin = lr_multiplier("linear", total_steps=11, warmup_steps=0, min_lr_ratio=0.1)
    assert lin(0) == 1.0 and lin(10) == pytest.approx(0.1) and lin(5) == pytest.approx(0.55)
    cos = lr_multiplier("cosine", total_steps=12, warmup_steps=2, min_lr_ratio=0.0)
    assert cos(1) == 1.0 and cos(2) == 1.0 and cos(11) == pytest.approx(0.0, abs=1e-12)
    assert cos(2 + 4.5) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    with pytest.raises(ValueError, match="constant, linear or cosine"):
        lr_multiplier("step", 10)
