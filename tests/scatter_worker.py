"""Run under torchrun (2 ranks, gloo): rank 0 scatters a batch with `RunContext.scatter_batch`;
each rank writes whether what it received is exactly its shard of the whole batch."""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.runtime.context import RunContext
from engines.fsdp.packing import shard_batch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gen = torch.Generator().manual_seed(0)
rows, width, group_size = 12, 9, 3
lengths = torch.randint(2, width + 1, (rows,), generator=gen)
mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
whole = TensorDict({
    "input_ids": torch.randint(0, 100, (rows, width), generator=gen) * mask,
    "attention_mask": mask,
    "logprobs": torch.randn(rows, width, generator=gen, dtype=torch.float64) * mask,
    "rewards": torch.randn(rows, generator=gen),
}, batch_size=[rows])
ctx = SimpleNamespace(rank=rank, world_size=world)
got = RunContext.scatter_batch(ctx, whole if rank == 0 else None, group_size)  # type: ignore[arg-type]
want = shard_batch(whole, rank, world, group_size)
same = set(got.keys()) == set(want.keys()) and all(
    torch.equal(got[k], want[k]) for k in want.keys())
with open(f"{sys.argv[1]}.{rank}", "w") as f:
    json.dump({"same": same, "rows": int(got.batch_size[0]), "whole": rows}, f)
dist.destroy_process_group()
