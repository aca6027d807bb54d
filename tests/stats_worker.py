"""Run under torchrun: each rank records different data; rank 0 writes the reduced stats."""

import json
import sys

import torch
import torch.distributed as dist

from areal_like.utils.stats_tracker import StatsTracker

dist.init_process_group("gloo")
rank = dist.get_rank()
tracker = StatsTracker("w")
values = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)  # rank0: 1,2,3  rank1: 2,4,6
mask = torch.tensor([True, rank == 0, True])          # rank0 keeps all, rank1 drops 4
tracker.denominator(n=mask)
tracker.stat(denominator="n", v=values)
tracker.scalar(s=float(rank))
tracker.add(c=1.0)
if rank == 0:  # keys only one rank records (rank 0 runs rollout) are reduced too
    tracker.scalar(only0=5.0)
else:
    tracker.denominator(m=torch.tensor([True, True]))
    tracker.stat(denominator="m", only1=torch.tensor([7.0, 9.0]))
out = tracker.export()
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
dist.destroy_process_group()
