"""The embedded engine's decode step as CUDA graphs: one launch a step instead of one per kernel.

A decode step of a 30-layer model is about 900 small kernels, and on a GPU launching them from
Python costs more than their arithmetic (docs/performance.md, "Generation on the GPU"). A CUDA
graph records the step's kernels once and replays them with one call, as vLLM and SGLang do.

A graph replays fixed shapes on fixed memory, so the step it records is the runner's static decode
(`ModelRunner.static_decode_step`): the rows padded to a bucket (powers of two up to the
runner's row count), attention over the whole cache capacity with a mask from the cached lengths,
inputs read from the runner's own ``last`` and ``lens`` tensors, which it updates in place. Where
every row's token can be chosen on the device (all greedy, or all sampled as the policy stands:
`areal_lite.engines.local.sampling.graph_mode`), the choice is part of the graph too, and the
host reads back one ``[rows, 2]`` tensor a step; otherwise the graph gives the logits and the
sampling runs after it. One graph per (bucket, mode, capacity), captured on first use; all of
them are dropped when the cache grows (its tensors are new). Weight updates copy into the
parameters in place, so a graph stays valid across them. Only the pure decode step is a graph: a
step that also prefills runs as before.

``eager`` runs the same static step without capturing: the CPU tests check it against the
engine's own decode, so the graphs replay a computation tested where no GPU is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Eager runs on the capture stream before a capture (cuBLAS and the allocator set up outside it)."""


def buckets(max_rows: int) -> list[int]:
    """The padded row counts: powers of two below ``max_rows``, then ``max_rows`` itself."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return [*out, max_rows]


class DecodeGraphs:
    """The decode step ``step(bucket, mode)`` (of rows ``0..bucket-1``, every shape fixed by
    ``bucket``, ``mode`` and the cache capacity ``capacity()``) of up to ``max_rows`` rows on
    ``device``, replayed from a CUDA graph per (bucket, mode, capacity), or with ``eager`` run as is."""

    def __init__(
        self,
        step: Callable[[int, str], torch.Tensor],
        capacity: Callable[[], int],
        max_rows: int,
        device: torch.device,
        eager: bool = False,
    ) -> None:
        self.step = step
        self.capacity = capacity
        self.device = device
        self.eager = eager
        self.buckets = buckets(max_rows)
        self.captures = 0
        """Graphs captured so far (for tests and logs)."""
        self._graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._cap = capacity()
        self._pool = None if eager else torch.cuda.graph_pool_handle()

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, rows: int, mode: str = "logits") -> torch.Tensor:
        """One decode step of rows ``0..rows-1`` (their keys and values written to the cache; the
        caller advances the lengths): fp32 logits [rows, vocab] in mode ``logits``, else the
        chosen tokens and their log-probabilities [rows, 2]."""
        bucket = self.bucket(rows)
        if self.eager:
            return self.step(bucket, mode)[:rows]
        if self._cap != self.capacity():  # the cache grew: every graph reads the old tensors
            self._graphs.clear()
            self._cap = self.capacity()
        entry = self._graphs.get((bucket, mode))
        if entry is None:
            entry = self._graphs[bucket, mode] = self._capture(bucket, mode)
        graph, out = entry
        graph.replay()
        return out[:rows]

    def _capture(self, bucket: int, mode: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Writing the same keys and values to the same positions each time: the runs leave
            # the cache as the replay will.
            for _ in range(WARMUP_RUNS):
                self.step(bucket, mode)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the process (a trainer) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            out = self.step(bucket, mode)
        self.captures += 1
        logger.info("captured the decode step for %d rows, %s (cache capacity %d)", bucket, mode, self._cap)
        return graph, out
