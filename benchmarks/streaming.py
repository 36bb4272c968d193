"""Time to the first streamed token vs the whole answer, on our server's OpenAI routes.

A streamed answer is useful only if its tokens leave the server as they are produced: the scheduler
hands each token to the route as soon as it is sampled, and the route writes it out at once. Rows:
a streamed ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` call with the
real ``openai`` SDK, 64 new tokens (``ignore_eos``), one request at a time, and one with 8 other
requests decoding beside it; for each, the median over ``--repeats`` runs of the seconds to the
first chunk that carries a token, to the last chunk, and their ratio (the acceptance bound is
0.3). Model: a tiny Qwen2 (hidden 128, 4 layers) built locally. The last line is ``RESULT
chat_ratio=... completions_ratio=... responses_ratio=... busy_chat_ratio=...``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/streaming.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

import openai

from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "scripts"))
from inference_servers import start_servers, stop_servers

NEW_TOKENS = 64


def timed(stream: Iterable[object], carries_token: Callable[[object], bool]) -> tuple[float, float]:
    """(seconds to the first chunk with a token, seconds to the last chunk) of a stream being read."""
    t0, first, last = time.perf_counter(), None, 0.0
    for chunk in stream:
        last = time.perf_counter() - t0
        if first is None and carries_token(chunk):
            first = last
    assert first is not None, "no chunk carried a token"
    return first, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cpu = subprocess.run(
        ["grep", "-o", "-m1", "avx512_bf16", "/proc/cpuinfo"], capture_output=True, text=True, check=False
    )
    print(f"CPU: {'AVX-512 BF16' if cpu.stdout.strip() else 'no AVX-512 BF16 (AVX2 kind)'}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(os.path.join(tmp, "m"), hidden_size=128, num_layers=4, max_position_embeddings=512)
        procs, addresses = start_servers(model, 1)
        try:
            client = openai.OpenAI(base_url=f"http://{addresses[0]}/v1", api_key="x")
            extra = {"ignore_eos": True, "return_token_ids": True}

            def has_ids(c: object) -> bool:
                return bool(c.choices and c.choices[0].model_extra.get("token_ids"))  # type: ignore[attr-defined]

            cases = {
                "chat": (lambda: client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=NEW_TOKENS,
                    stream=True, extra_body=extra), has_ids),
                "completions": (lambda: client.completions.create(
                    model=model, prompt="Once upon a time", max_tokens=NEW_TOKENS, stream=True, extra_body=extra),
                    has_ids),
                "responses": (lambda: client.responses.create(
                    model=model, input="Tell me a story", max_output_tokens=NEW_TOKENS, stream=True,
                    extra_body={"ignore_eos": True}), lambda e: e.type == "response.output_text.delta"),
            }  # fmt: skip
            rows: dict[str, tuple[float, float]] = {}
            for name, (call, carries) in cases.items():
                timed(call(), carries)  # warm-up
                runs = [timed(call(), carries) for _ in range(args.repeats)]
                rows[name] = (statistics.median(f for f, _ in runs), statistics.median(t for _, t in runs))

            stop = threading.Event()

            def background() -> None:
                while not stop.is_set():
                    client.completions.create(model=model, prompt="Busy", max_tokens=NEW_TOKENS, extra_body=extra)

            threads = [threading.Thread(target=background, daemon=True) for _ in range(8)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            call, carries = cases["chat"]
            runs = [timed(call(), carries) for _ in range(args.repeats)]
            rows["chat, 8 others decoding"] = (
                statistics.median(f for f, _ in runs),
                statistics.median(t for _, t in runs),
            )
            stop.set()
            for t in threads:
                t.join()
        finally:
            stop_servers(procs)

    print(f"\n{NEW_TOKENS} new tokens per answer; medians of {args.repeats} runs")
    print(f"{'call':<28}{'first token (s)':>16}{'whole answer (s)':>18}{'ratio':>8}")
    for name, (first, total) in rows.items():
        print(f"{name:<28}{first:>16.4f}{total:>18.4f}{first / total:>8.3f}")
    ratio = {name: first / total for name, (first, total) in rows.items()}
    print(f"RESULT chat_ratio={ratio['chat']:.3f} completions_ratio={ratio['completions']:.3f} "
          f"responses_ratio={ratio['responses']:.3f} busy_chat_ratio={ratio['chat, 8 others decoding']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
