"""Run under torchrun with 2 ranks: each rank records different statistics; rank 0 writes the
reduced export to the JSON file named by argv[1]."""

import json
import sys

import torch
import torch.distributed as dist

from areal_lite.utils.distributed import destroy_default_group
from areal_lite.utils.stats import StatsTracker

dist.init_process_group("gloo")
rank = dist.get_rank()
tracker = StatsTracker()
tracker.scalar(loss=1.0 + rank)
tracker.stat("reward", torch.tensor([0.0, 1.0, 2.0]) + 10 * rank, mask=torch.tensor([True, True, rank == 0]))
tracker.total(n_tokens=100 * (rank + 1))
tracker.dist("staleness", [rank, rank + 1])
if rank == 1:
    tracker.scalar(only_rank1=7.0)
out = tracker.export()
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"scalars": out.scalars, "histograms": out.histograms}, f)
destroy_default_group()
