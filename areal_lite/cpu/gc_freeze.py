"""Keeping the cyclic garbage collector off the objects a process loads at start-up.

A process with torch and transformers imported and a model loaded tracks ~370K objects; a full
collection walks them all (0.14 s on the CPU demo's machine) and happens every few seconds in a
loop that allocates (tensors, JSON answers, TensorDicts). In RL those pauses are stalls of the
training step, of a rollout server's generation or of the rollout client, and in asynchronous RL
each one delays the other side too. `gc.freeze` moves everything alive into a permanent generation
the collector skips; objects made later are collected as usual, and frozen ones are still freed
by reference counting.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect once, then exempt every object alive now from later collections. Call when the
    process has finished loading (engine ``initialize``, a server's model load); calling again
    later adds what was loaded since."""
    gc.collect()
    gc.freeze()
