"""A Tinker-compatible training service over areal-lite's engines: ``python -m areal_lite.service``.

The ``tinker`` SDK (``ServiceClient(base_url=...)``) and the programs written against it, such as
the tinker-cookbook's loops, train and sample through it unchanged: sessions, LoRA or full
fine-tuning runs, ``forward`` / ``forward_backward`` with the built-in losses, ``optim_step``,
checkpoints, sampler snapshots and sampling. docs/service.md says how to run it and what differs
from the hosted service.

- `areal_lite.service.app`: the routes, sessions and the engine thread;
- `areal_lite.service.rest_routes`: the ``RestClient``'s listings of runs, checkpoints, sessions;
- `areal_lite.service.sessions`: a client's session, and the samples recorded for it;
- `areal_lite.service.runs`: training runs over `MultiLoRAEngine` (LoRA runs sharing a base model)
  or `FSDPEngine` (full fine-tuning), and their checkpoints;
- `areal_lite.service.losses`: the built-in losses, from `areal_lite.algorithms.functional`;
- `areal_lite.service.sampler`: sampling, one base model with the snapshots' LoRA adapters;
- `areal_lite.service.samplers`: the sampling sessions and the generators that serve them;
- `areal_lite.service.wire`: the SDK's protobuf and JSON bodies;
- `areal_lite.service.futures`: request futures, each client's request order, the engine thread;
- `areal_lite.service.launch`: the service as a child process, for scripts and tests.
"""
