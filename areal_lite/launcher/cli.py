"""The launchers' command line, written once for `areal_lite.launcher.local`, `.ray` and `.slurm`:

    python -m areal_lite.launcher.<local|ray|slurm> SCRIPT --config CONFIG [key=value ...]

`launcher_main` parses it (a launcher may add flags of its own to `argument_parser`), reads the
run's `LaunchPlan` and hands it to the launcher. A config error is the user's to fix and would fail
every restart the same way: the launch prints it as one line and exits with `CONFIG_ERROR_EXIT`
without starting (or restarting) anything.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable

from areal_lite.api.config_loader import ConfigError
from areal_lite.launcher.plan import LaunchPlan, read_plan

CONFIG_ERROR_EXIT = 78
"""Exit code of a launch stopped by a config error (sysexits' EX_CONFIG): it is never retried."""


def stopped_on(error: str) -> str:
    """What a launcher says when the trainer stopped on ``error``, which a restart would meet again."""
    return f"[launcher] the trainer stopped on: {error} (a restart would meet it again)"


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every launcher takes; the first paragraph of ``doc`` (the launcher module's
    docstring) describes it."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("--config", default=None, help="YAML config of the run")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def launcher_main(
    parser: argparse.ArgumentParser,
    launch: Callable[[LaunchPlan, argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """Parse ``argv`` with ``parser``, read the plan and return ``launch(plan, args)``, the exit
    code; a `ConfigError` becomes one line on stderr (no traceback) and `CONFIG_ERROR_EXIT`."""
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="[launcher] %(levelname)s %(message)s")
    try:
        return launch(read_plan(args.script, args.config, args.overrides), args)
    except ConfigError as e:
        print(f"[launcher] config error: {e}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    except KeyboardInterrupt:  # before the launcher's own handlers are in place: nothing to stop
        return 128 + signal.SIGINT
