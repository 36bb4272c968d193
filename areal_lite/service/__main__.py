"""Serve the Tinker API over areal-lite's engines.

    python -m areal_lite.service --model /path/to/hf_model [--model NAME=/path/to/other] --port 8000

then point the ``tinker`` SDK at it: ``tinker.ServiceClient(base_url="http://127.0.0.1:8000",
api_key="tml-local")`` (or ``TINKER_BASE_URL`` and ``TINKER_API_KEY``). docs/service.md has the rest.
"""

from __future__ import annotations

import argparse
import logging
import os

from aiohttp import web

from areal_lite.service.app import Service
from areal_lite.service.config import ServiceConfig

logger = logging.getLogger("areal_lite.service")


def _model(text: str) -> tuple[str, str]:
    name, sep, path = text.rpartition("=")
    if not sep:
        name, path = text, text
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a model directory")
    return name, os.path.abspath(path)


def argument_parser() -> argparse.ArgumentParser:
    defaults = ServiceConfig()
    p = argparse.ArgumentParser(prog="python -m areal_lite.service", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        action="append",
        type=_model,
        required=True,
        help="a HF model directory to serve, named by its path, or NAME=PATH to serve it as NAME (repeatable)",
    )
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--workdir", default=defaults.workdir, help="checkpoints and run metadata")
    p.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "auto"])
    p.add_argument("--lora-alpha", type=float, default=defaults.lora_alpha)
    p.add_argument("--max-tokens-per-mb", type=int, default=defaults.max_tokens_per_mb)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--api-key", default=None, help="require this key (default: accept any)")
    p.add_argument("--session-timeout", type=float, default=defaults.session_timeout)
    p.add_argument("--poll-timeout", type=float, default=defaults.poll_timeout)
    p.add_argument(
        "--compress-requests",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=defaults.compress_requests,
        help="ask the SDK for zstd-compressed forward_backward bodies (true/false)",
    )
    return p


def config_from_args(argv: list[str] | None = None) -> ServiceConfig:
    args = argument_parser().parse_args(argv)
    return ServiceConfig(
        models=dict(args.model),
        workdir=args.workdir,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        lora_alpha=args.lora_alpha,
        max_tokens_per_mb=args.max_tokens_per_mb,
        seed=args.seed,
        api_key=args.api_key,
        session_timeout=args.session_timeout,
        poll_timeout=args.poll_timeout,
        compress_requests=args.compress_requests,
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(argv)
    service = Service(cfg)
    app = service.build_app()

    async def ready(_: web.Application) -> None:
        logger.info("serving %s on http://%s:%d (workdir %s)", ", ".join(cfg.models), cfg.host, cfg.port, cfg.workdir)

    app.on_startup.append(ready)
    web.run_app(app, host=cfg.host, port=cfg.port, print=None, access_log=None, shutdown_timeout=1.0)


if __name__ == "__main__":
    main()
