"""Runs an example script (``$RECORD_EXAMPLE``) with this script's arguments, recording every item
each trainer rank draws from its `areal_lite.kit.rank_dataloader` to
``$RECORD_DIR/rank<data-parallel rank>.jsonl``, one JSON item per line.

The launcher runs it in place of the example (``python -m areal_lite.launcher.local
tests/scripts/record_prompts.py --config ...``); the example itself is unchanged.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Iterator

from areal_lite import kit


class RecordingLoader:
    """A data loader that appends each item it yields to a file, and otherwise is the loader."""

    def __init__(self, loader: object, path: str) -> None:
        self.loader = loader
        self.path = path

    def __iter__(self) -> Iterator[list[object]]:
        for batch in self.loader:  # type: ignore[attr-defined]
            with open(self.path, "a") as f:
                f.writelines(json.dumps(item, sort_keys=True) + "\n" for item in batch)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, object]:
        return self.loader.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]


def main() -> None:
    example, out = os.environ["RECORD_EXAMPLE"], os.environ["RECORD_DIR"]
    original = kit.rank_dataloader

    def recording(items, dataset, engine, **kwargs):  # type: ignore[no-untyped-def]
        loader = original(items, dataset, engine, **kwargs)
        return RecordingLoader(loader, os.path.join(out, f"rank{engine.data_parallel_rank}.jsonl"))

    kit.rank_dataloader = recording  # type: ignore[assignment]
    sys.argv = [example, *sys.argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(example)))
    runpy.run_path(example, run_name="__main__")


if __name__ == "__main__":
    main()
