"""Our server's command line (``python -m areal_lite.engines.server --help``): `ServerArgs`, whose
names follow SGLang's ``launch_server``, read by `parse_args`; the launcher checks
``launcher.server_args`` against `argument_parser`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DESCRIPTION = (
    "An HTTP server over the embedded engine that answers like an SGLang server and like vLLM's OpenAI server."
)


@dataclass
class ServerArgs:
    """Command-line arguments (names follow SGLang's ``launch_server``)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    max_running_requests: int = 128
    context_length: int = 0
    random_seed: int = 0
    weight_version: str = "0"
    keep_cache_on_update: bool = False
    served_model_name: list[str] | None = None
    allow_auto_truncate: bool = False


def argument_parser() -> argparse.ArgumentParser:
    """The server's command line (the launcher also checks ``launcher.server_args`` against it)."""
    p = argparse.ArgumentParser(prog="python -m areal_lite.engines.server", description=DESCRIPTION)
    p.add_argument("--model-path", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (except /health*)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--context-length", type=int, default=0, help="0 = the model's max_position_embeddings")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="0", help="initial weight version (an integer)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names the OpenAI routes answer to (e.g. a hub name that clients send); default: the model path",
    )
    p.add_argument(
        "--allow-auto-truncate",
        action="store_true",
        help="as SGLang: cut a prompt that fills the context and shrink a max_new_tokens past it, instead of a 400",
    )
    p.add_argument(
        "--keep-cache-on-update",
        type=_true_or_false,
        default=False,
        help="true: running requests keep their KV caches across a weight update (no recompute)",
    )
    return p


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    return ServerArgs(**vars(argument_parser().parse_args(argv)))
