"""Seconds of one weight update into our server in a process of its own, by disk and by ipc, for
the same model.

The trainer side is `WeightSender` (what `TrainEngine.update_weights` runs) in a one-rank gloo
group of this process, holding the model's full tensors; the server is ``python -m
areal_lite.engines.server`` on 127.0.0.1 (on ``--device``), driven by `RemoteSGLangEngine`:

- ``disk``: the tensors written as one safetensors file (as `FSDPEngine`'s disk update writes
  them), then ``/update_weights_from_disk``, which reads and loads them;
- ``ipc``: buckets of at most ``--bucket-mib`` (shared memory on CPU, CUDA IPC handles of GPU
  memory with ``--device cuda``), ``/update_weights_from_tensor`` each, freed once loaded.

Each update returns once the server has loaded the weights. Every version differs (noise added
between updates) and the server's copy of one tensor is read back after each; the figure of each
way is the best of ``--repeats`` after a warm-up update.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_handover.py [--hidden 768 --layers 12] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

import torch
from safetensors.torch import save_file

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.cpu.precision import cpu_kind
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.train.weight_sync import WeightSender
from areal_lite.launcher.processes import is_healthy, spawn, stop
from areal_lite.utils.distributed import destroy_default_group, find_free_port, init_default_group
from areal_lite.utils.tiny import build_tiny_model


def start_server(path: str, device: str, log: str) -> tuple[object, str]:
    port = find_free_port()
    cmd = [sys.executable, "-m", "areal_lite.engines.server", "--model-path", path, "--port", str(port)]
    server = spawn(
        [*cmd, "--device", device, "--max-running-requests", "4"], cores=[], env=dict(os.environ), log_path=log
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not is_healthy(address):
        if server.poll() is not None or time.monotonic() > deadline:
            stop([server])
            raise RuntimeError(f"our server did not start; see {log}")
        time.sleep(0.5)
    return server, address


def served_values(address: str, name: str, n: int) -> list[float]:
    with urllib.request.urlopen(f"http://{address}/get_weights_by_name?name={name}&truncate_size={n}") as r:
        return json.loads(r.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the trainer's tensors and the server are"
    )
    parser.add_argument("--bucket-mib", type=int, default=256, help="ipc: the most MiB one bucket holds")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    init_default_group()
    with tempfile.TemporaryDirectory() as workdir:
        path = build_tiny_model(
            f"{workdir}/model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=12,
            num_kv_heads=12,
            vocab_size=512,
        )
        from transformers import AutoModelForCausalLM

        state = {n: t.to(args.device) for n, t in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
        n_params = sum(t.numel() for t in state.values())
        server, address = start_server(path, args.device, f"{workdir}/server.log")
        client = RemoteSGLangEngine(InferenceEngineConfig(addresses=[address], request_timeout=600, setup_timeout=60))
        client.initialize()
        sender = WeightSender()
        metas = {
            "disk": WeightUpdateMeta(type="disk", path=f"{workdir}/update"),
            "ipc": WeightUpdateMeta(type="ipc", chunk_bytes=args.bucket_mib * 1024**2),
        }
        sender.connect(client, metas["ipc"])

        def write_disk(target: str) -> None:
            os.makedirs(target, exist_ok=True)
            save_file({n: t.cpu().contiguous() for n, t in state.items()}, f"{target}/model.safetensors")

        probe = next(n for n in state if n.endswith("mlp.up_proj.weight"))
        best = {way: float("inf") for way in metas}
        version = 0
        try:
            for _ in range(args.repeats + 1):
                for way, meta in metas.items():
                    version += 1
                    with torch.no_grad():
                        for t in state.values():
                            t.add_(1e-3)
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    client.pause()
                    sender.send(meta, version, lambda: iter(state.items()), write_disk)
                    client.resume()
                    seconds = time.perf_counter() - t0
                    if version > len(metas):  # the first round warms up
                        best[way] = min(best[way], seconds)
                    expected = state[probe].flatten()[:64].float().cpu().tolist()
                    assert served_values(address, probe, 64) == expected, f"{way}: the server holds other weights"
        finally:
            client.destroy()
            stop([server])
            destroy_default_group()
    where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_kind()
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 1024**2
    print(f"{where}; {n_params / 1e6:.0f}M parameters, fp32 ({mib:.0f} MiB); our server in its own process")
    print(f"{'weight update':<14}{'seconds':>10}")
    for way, s in best.items():
        print(f"{way:<14}{s:>10.3f}")
    print(
        f"RESULT device={args.device} params_m={n_params / 1e6:.0f} handover_disk_s={best['disk']:.3f} "
        f"handover_ipc_s={best['ipc']:.3f} disk_over_ipc={best['disk'] / best['ipc']:.2f}"
    )


if __name__ == "__main__":
    main()
