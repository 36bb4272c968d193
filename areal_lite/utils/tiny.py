"""Tiny causal language models and tokenizers built locally, for tests, benchmarks and the demo.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a small corpus with the
`tokenizers` library and wrapped as a HF fast tokenizer with a ChatML chat template (tool calls
in the Hermes format); the model is a randomly initialised Qwen2 or Llama config, or a Qwen3-MoE
config for a mixture-of-experts model. Both are saved as
one HF model directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load, so every code path that takes a real model directory is
exercised unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}{% endif %}"
    "{{ 'Tools:\n' }}{% for tool in tools %}{{ tool['function'] | tojson }}{{ '\n' }}{% endfor %}"
    '{{ \'Call a tool as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n\' }}{% endif %}'
    "{% for message in messages %}{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' + call['function']['name'] | tojson + ', \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson + '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML; with ``tools``, a system message lists them (the first system message's text first) and
an assistant's ``tool_calls`` are written in the Hermes format that `areal_lite.openai_format.tool_calls`
reads, so a tiny model can be taught to call tools and its calls read back as it wrote them."""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

DEFAULT_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "Solve step by step: 7 * 6 = 42, then 42 - 2 = 40. #### 40",
    "user assistant system: please reason carefully and put the final answer in \\boxed{}.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) , . ? ! #",
    "Reinforcement learning from verifiable rewards trains language models with a grader.",
]


def build_tokenizer(
    save_dir: str | None = None,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
):
    """Train a byte-level BPE tokenizer on ``corpus`` and return it as a ``PreTrainedTokenizerFast``.

    ``vocab_size`` counts the 256 byte tokens and the special tokens; with
    ``vocab_size <= 256 + len(SPECIAL_TOKENS)`` no merges are learned and every character of ASCII
    text is one token. eos is ``<|im_end|>``, pad is ``<|endoftext|>``. Saved to ``save_dir`` when given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus if corpus is not None else DEFAULT_CORPUS) * 4, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.padding_side = "right"
    if save_dir is not None:
        hf_tok.save_pretrained(save_dir)
    return hf_tok


def build_tiny_model(
    save_dir: str,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    vocab_size: int = 512,
    corpus: Iterable[str] | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
) -> str:
    """Build a random-init causal LM and a locally trained tokenizer into ``save_dir``.

    ``arch`` is ``qwen2`` (biases on q/k/v), ``llama``, ``qwen3`` (norms on q and k), or
    ``qwen3_moe``, Qwen3 whose every layer is a
    mixture of ``num_experts`` experts of width ``moe_intermediate_size`` (default
    ``intermediate_size / num_experts_per_tok``, so that a token's active MLP width is the dense
    one's), ``num_experts_per_tok`` routed per token, top-k weights renormalised. The model's
    vocabulary is the tokenizer's length. Returns ``save_dir``, a HF model directory.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    os.makedirs(save_dir, exist_ok=True)
    tokenizer = build_tokenizer(save_dir, corpus=corpus, vocab_size=vocab_size)
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common, attention_bias=False)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=hidden_size // num_heads)
    elif arch == "qwen3_moe":
        if not 0 < num_experts_per_tok <= num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {num_experts_per_tok}"
            )
        config = Qwen3MoeConfig(
            **common,
            head_dim=hidden_size // num_heads,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size or common["intermediate_size"] // num_experts_per_tok,
            norm_topk_prob=True,
        )
    else:
        raise ValueError(f"arch must be qwen2, llama, qwen3 or qwen3_moe, got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(save_dir)
    return save_dir


def with_random_weights(path: str, out_dir: str, *, seed: int = 0) -> str:
    """``path`` if it holds weights; else ``out_dir``: a copy of its files (a config and a
    tokenizer) with random weights drawn by transformers' own initialisation. A pretrained
    model's config and tokenizer (a few MB) then stand in for its weights where they cannot be
    had: the same shapes, so the same work per token."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    if any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path)):
        return path
    shutil.copytree(path, out_dir)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(out_dir)
    return out_dir


def teach(model_dir: str, sequences: list[tuple[list[int], list[int]]], *, lr: float, max_steps: int = 400) -> None:
    """Fine-tune the model in ``model_dir`` on ``(input_ids, loss_mask)`` sequences until greedy
    decoding reproduces each one's trained tokens (``loss_mask`` 1) at a loss below 0.05, and save
    it back: a tiny model that says exact things, for tests. Raises RuntimeError when ``max_steps``
    Adam steps do not get there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = []
    for input_ids, loss_mask in sequences:
        ids = torch.tensor([input_ids])
        labels = ids.masked_fill(torch.tensor([loss_mask]) == 0, -100)
        data.append((ids, labels, labels[0, 1:] != -100))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(max_steps):
        outs = [(model(ids, labels=labels), ids, trained) for ids, labels, trained in data]
        if all((o.logits[0, :-1].argmax(-1)[t] == ids[0, 1:][t]).all() and o.loss.item() < 0.05 for o, ids, t in outs):
            break
        opt.zero_grad()
        sum(o.loss for o, _, _ in outs).backward()
        opt.step()
    else:
        raise RuntimeError(f"the model did not learn the sequences in {max_steps} steps")
    model.save_pretrained(model_dir)
