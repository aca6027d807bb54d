"""Unit tests of the pure packing / micro-batching functions (single process, no model)."""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

from engines.fsdp.packing import (
    attention_width,
    count_micro_batches,
    dp_shard_indices,
    ffd_allocate,
    pack_sequences,
    partition_into_micro_batches,
    sequence_costs,
    sequence_lengths,
    shard_batch,
    split_keys,
    unpack_to_padded,
)


def _batch(lengths: list[int], left_pad: bool = False) -> TensorDict:
    b, seq_len = len(lengths), max(lengths)
    ids = torch.zeros(b, seq_len, dtype=torch.long)
    attn = torch.zeros(b, seq_len, dtype=torch.long)
    for i, n in enumerate(lengths):
        cols = slice(seq_len - n, seq_len) if left_pad else slice(0, n)
        ids[i, cols] = 100 * (i + 1) + torch.arange(n)  # row i, position p -> 100(i+1) + p
        attn[i, cols] = 1
    return TensorDict({"input_ids": ids, "attention_mask": attn, "logprobs": ids.float() / 7,
                       "rewards": torch.arange(b, dtype=torch.float32),
                       "pair": torch.arange(2 * b).reshape(b, 2)}, batch_size=[b])


@pytest.mark.parametrize("left_pad", [False, True])
def test_pack_sequences_layout(left_pad: bool) -> None:
    batch = _batch([3, 5, 1, 4], left_pad=left_pad)
    mb = pack_sequences(batch, [3, 1])
    assert mb.batch_size == torch.Size([])
    assert mb["cu_seqlens"].tolist() == [0, 4, 9]
    assert mb["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert mb["input_ids"].tolist() == [400, 401, 402, 403, 200, 201, 202, 203, 204]
    torch.testing.assert_close(mb["logprobs"], mb["input_ids"].float() / 7)
    assert mb["attention_mask"].tolist() == [1] * 9
    assert mb["rewards"].tolist() == [3.0, 1.0]  # per-sequence keys follow the row order
    assert mb["pair"].tolist() == [[6, 7], [2, 3]]


@pytest.mark.parametrize("left_pad", [False, True])
def test_unpack_restores_padded_layout(left_pad: bool) -> None:
    batch = _batch([3, 5, 1, 4], left_pad=left_pad)
    groups = [[0, 2], [1, 3]]
    per_row: dict[int, torch.Tensor] = {}
    for g in groups:
        mb = pack_sequences(batch, g)
        for row, piece in zip(g, mb["logprobs"].split(mb["cu_seqlens"].diff().tolist()),
                              strict=True):
            per_row[row] = piece
    out = unpack_to_padded([per_row[i] for i in range(4)], batch["attention_mask"])
    expected = batch["logprobs"] * batch["attention_mask"]
    torch.testing.assert_close(out, expected)


def test_bad_batches_name_the_problem() -> None:
    batch = _batch([3, 2])
    batch["attention_mask"][0] = torch.tensor([1, 0, 1])
    with pytest.raises(ValueError, match="row 0 has gaps"):
        sequence_lengths(batch["attention_mask"])
    with pytest.raises(KeyError, match="'input_ids'"):
        split_keys(TensorDict({"attention_mask": torch.ones(2, 3)}, batch_size=[2]))
    reserved = _batch([3, 2])
    reserved["position_ids"] = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="reserved"):
        split_keys(reserved)
    per_seq = _batch([3, 2])
    per_seq["extra"] = torch.zeros(2, 4, 5)  # [B, not L, ...]: a per-sequence key
    assert "extra" in split_keys(per_seq)[1]
    loose = TensorDict({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                        "attention_mask": torch.ones(2, 3), "weird": torch.zeros(7)},
                       batch_size=[])
    with pytest.raises(ValueError, match="'weird' has shape \\(7,\\)"):
        split_keys(loose)
    empty_row = _batch([3, 2])
    empty_row["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="row 1 of the batch has no real tokens"):
        pack_sequences(empty_row, [0, 1])


def test_ffd_respects_capacity_and_places_every_sequence() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    bins = ffd_allocate(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    lower_bound = -(-sum(lengths) // 64)
    assert len(bins) <= lower_bound + 2  # FFD is near-optimal on this kind of input
    with pytest.raises(ValueError, match="sequence 1 has 70 tokens.*max_tokens_per_mb=64"):
        ffd_allocate([10, 70], 64)


def test_partition_gives_exact_count_within_budget() -> None:
    lengths = [30, 5, 12, 18, 7, 25]
    for count in range(count_micro_batches(lengths, 40), 7):
        groups = partition_into_micro_batches(lengths, 40, count)
        assert len(groups) == count
        assert sorted(i for g in groups for i in g) == list(range(6))
        assert all(sum(lengths[i] for i in g) <= 40 for g in groups)
    # more micro-batches than sequences: the extra ones are empty (run as dummies)
    groups = partition_into_micro_batches([4, 3], 100, 4)
    assert sorted(len(g) for g in groups) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="more than the requested 1"):
        partition_into_micro_batches(lengths, 40, 1)


def test_partition_is_balanced() -> None:
    lengths = [10] * 8
    groups = partition_into_micro_batches(lengths, 1000, 4)
    assert [sum(lengths[i] for i in g) for g in groups] == [20, 20, 20, 20]


def test_count_micro_batches_honours_minimum() -> None:
    assert count_micro_batches([5, 5, 5], 100, 1) == 1
    assert count_micro_batches([5, 5, 5], 100, 3) == 3
    assert count_micro_batches([60, 60, 60], 100, 1) == 3


def test_dp_shard_keeps_groups_and_balances_tokens() -> None:
    lengths = [50, 48, 2, 3, 20, 22, 30, 31]
    shards = dp_shard_indices(lengths, world_size=2, group_size=2)
    assert sorted(i for s in shards for i in s) == list(range(8))
    for s in shards:
        assert all((i ^ 1) in s for i in s)  # rows 2k and 2k+1 stay together
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 10
    with pytest.raises(ValueError, match="group_size=3"):
        dp_shard_indices(lengths, 2, group_size=3)


def test_balance_by_compute_counts_each_long_answers_attention() -> None:
    """A long-tail batch: one 2400-token answer and 18 of 200. By tokens the long one's rank
    also gets 3 short ones (3000 tokens each); its attention, which grows with the square of
    its length, makes that rank the straggler. By compute (`sequence_costs`, with the 10m
    model's attention width 4 * 256 + 3 * 768) it runs alone."""
    lengths = [2400] + [200] * 18
    width = attention_width({"hidden_size": 256, "intermediate_size": 768})
    assert width == 4 * 256 + 3 * 768
    costs = sequence_costs(lengths, width)
    assert costs[0] == pytest.approx(2400 * (1 + 2400 / width))
    assert sequence_costs(lengths) == [float(n) for n in lengths]
    by_tokens = dp_shard_indices(lengths, 2)
    by_compute = dp_shard_indices(costs, 2)

    def heaviest(shards: list[list[int]]) -> float:
        return max(sum(costs[i] for i in s) for s in shards)

    assert sorted(len(s) for s in by_tokens) == [4, 15]  # the long answer and 3 short ones
    assert sorted(len(s) for s in by_compute) == [1, 18]
    assert heaviest(by_compute) < 0.9 * heaviest(by_tokens)


def test_shard_batch_returns_this_ranks_rows() -> None:
    batch = _batch([3, 5, 1, 4, 2])
    parts = [shard_batch(batch, r, 2) for r in range(2)]
    assert sum(p.shape[0] for p in parts) == 5
    firsts = sorted(int(p["input_ids"][i, 0]) for p in parts for i in range(p.shape[0]))
    assert firsts == [100, 200, 300, 400, 500]


def test_groups_of_any_size_stay_on_one_rank_by_group_id() -> None:
    """A group without its failed samples (3 of 4 rows) or an agent's variable-length groups:
    the rows sharing a group_id go to one rank, whatever their count and order."""
    batch = _batch([3, 5, 1, 4, 2, 6, 2])
    batch["group_id"] = torch.tensor([7, 7, 9, 7, 9, 11, 11])
    parts = [shard_batch(batch, r, 2, group_size=4) for r in range(2)]  # group_size ignored
    assert sum(p.shape[0] for p in parts) == 7
    for p in parts:
        for gid in p["group_id"].unique().tolist():
            assert int((p["group_id"] == gid).sum()) == int((batch["group_id"] == gid).sum())
    with pytest.raises(ValueError, match="2 group ids for 3 rows"):
        dp_shard_indices([1, 2, 3], 2, group_ids=[1, 2])


@pytest.mark.torchrun
def test_each_trainer_rank_receives_exactly_its_shard(tmp_path):
    """`RunContext.scatter_batch` under a real 2-rank torchrun job: rank 0 sends each rank
    its rows only, and they are the rows `shard_batch` picks from the whole batch (groups
    whole, token counts balanced); the two ranks of a sequence-parallel group (one data rank)
    both receive the whole batch."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from areal_like.utils.network import find_free_port

    out = tmp_path / "scatter"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
         str(Path(__file__).parent / "scatter_worker.py"), str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    data = [r["data"] for r in results]
    assert all(r["same"] for r in data), results
    assert sum(r["rows"] for r in data) == 12 and all(r["rows"] < 12 for r in data)
    assert all(r["sequence"]["same"] and r["sequence"]["rows"] == 12 for r in results), results
