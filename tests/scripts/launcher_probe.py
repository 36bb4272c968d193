"""A trainer stand-in for the launcher tests: records how it was started (arguments, attempt,
CPU affinity, the parsed server addresses and whether they answer /health) to ``probe.out`` and then fails, waits for a signal, or
exits 0, as the config asks."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from areal_lite.api.config import READS_MODEL, InferenceEngineConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import BaseExperimentConfig
from areal_lite.launcher.processes import is_healthy


@dataclass
class ProbeConfig:
    out: str = ""
    fail_attempts: int = 0
    """Exit with 3 on attempts below this."""
    recurring_error: bool = False
    """Fail with an error that a restart would meet again (`RecurringError`)."""
    wait_for_signal: bool = False
    tag: str = "main"
    """Recorded, to tell the prepare run from the main one."""
    model: str = field(default="", metadata=READS_MODEL)
    """A model the probe would read (it reads nothing): for the launcher's path check."""


@dataclass
class Config(BaseExperimentConfig):
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)


cfg = load_config(sys.argv[1:], Config, save=False)
healthy = [is_healthy(a) for a in cfg.rollout.addresses]
attempt = int(os.environ.get("AREAL_LITE_ATTEMPT", "-1"))
record = {
    "argv": sys.argv[1:],
    "attempt": attempt,
    "pid": os.getpid(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "addresses": cfg.rollout.addresses,
    "rank": os.environ.get("RANK"),
    "tag": cfg.probe.tag,
    "healthy": healthy,
}
with open(cfg.probe.out, "a") as f:
    f.write(json.dumps(record) + "\n")
if cfg.probe.recurring_error:
    from areal_lite.api.errors import RecurringError

    raise RecurringError(f"bad data row at data.jsonl:{attempt + 3}: field 'question' is missing")
if attempt < cfg.probe.fail_attempts:
    sys.exit(3)
if cfg.probe.wait_for_signal:
    got = []
    signal.signal(signal.SIGTERM, lambda s, _: got.append(s))
    with open(cfg.probe.out + ".ready", "w") as f:
        f.write("ready")
    while not got:
        time.sleep(0.05)
    with open(cfg.probe.out + ".signal", "w") as f:
        f.write(str(got[0]))
    sys.exit(0)
