"""A few FSDP training steps on 2 gloo ranks, then the end of the job: ``safe`` ends with
`destroy_default_group`, ``plain`` with ``dist.barrier(); dist.destroy_process_group()``, which
now and then aborts at interpreter exit (see `destroy_default_group`).

Usage: ``torchrun --nproc-per-node 2 exit_race.py safe|plain``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from areal_lite.utils.distributed import destroy_default_group

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters())
for _ in range(3):
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
if sys.argv[1] == "safe":
    destroy_default_group()
else:
    dist.barrier()
    dist.destroy_process_group()
