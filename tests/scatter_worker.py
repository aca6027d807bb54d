"""Run under torchrun (2 ranks, gloo): rank 0 scatters a batch with `RunContext.scatter_batch`;
each rank writes whether what it received is exactly its shard of the whole batch: its own
rows with two data-parallel ranks, the whole batch on both ranks of one sequence-parallel
group."""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.api.parallel_config import ParallelConfig
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
results = {}
for layout, parallel in (("data", ParallelConfig()),
                         ("sequence", ParallelConfig(sequence_parallel_size=2))):
    dp_size, dp_rank = parallel.data_parallel_size(world), parallel.data_parallel_rank(rank)
    ctx = SimpleNamespace(rank=rank, world_size=world, data_parallel_size=dp_size,
                          balance_width=0.0,  # by tokens, as shard_batch
                          config=SimpleNamespace(actor=SimpleNamespace(parallel=parallel)))
    got = RunContext.scatter_batch(ctx, whole if rank == 0 else None,  # type: ignore[arg-type]
                                   group_size)
    want = shard_batch(whole, dp_rank, dp_size, group_size)
    same = set(got.keys()) == set(want.keys()) and all(
        torch.equal(got[k], want[k]) for k in want.keys())
    results[layout] = {"same": same, "rows": int(got.batch_size[0]), "whole": rows}
with open(f"{sys.argv[1]}.{rank}", "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
