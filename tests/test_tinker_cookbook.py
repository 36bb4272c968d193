"""The tinker-cookbook's own loops (``recipes.sl_loop``, ``recipes.rl_loop``), unmodified, against
the service on a local tiny model and local data (examples/tinker/cookbook_loops.py): the supervised
loop's NLL falls and the RL loop's reward rises. Marked ``cookbook`` (deselected by ``make test``):
``make test-tinker-cookbook`` installs the cookbook (``--no-deps``: its ``tml-renderers``
dependency is not on the package index) and the few packages its loops import, then runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cookbook

SCRIPT = Path(__file__).parents[1] / "examples" / "tinker" / "cookbook_loops.py"


def test_cookbook_sl_and_rl_loops_learn_against_the_service(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    result = dict(re.findall(r"(\w+)=([\d.]+)", out.stdout.splitlines()[-1]))
    assert out.stdout.splitlines()[-1].startswith("RESULT"), out.stdout[-3000:]
    assert float(result["sl_nll_last"]) < 0.2 * float(result["sl_nll_first"]), result
    assert float(result["rl_reward_last5"]) > float(result["rl_reward_first3"]) + 0.05, result
