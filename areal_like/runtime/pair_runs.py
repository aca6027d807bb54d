"""What the preference recipes (`recipes.rm`, `recipes.dpo`) share: their pairs loaded on every
rank, each data-parallel rank's rows of a pair batch, and a frozen model's response
log-probabilities computed once for every pair (DPO's reference)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoConfig

from areal_like.algorithms.actors.preference import DPOActor
from areal_like.data.preference import PreferencePair, build_pair_batch, load_pairs
from areal_like.runtime.context import RunContext
from engines.fsdp.packing import shard_batch


def load_train_valid_pairs(config: Any, tokenizer: Any
                           ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(`pairs`, the first `evaluation.n_prompts` of `valid_pairs`), checked and tokenised;
    sequences are bounded by the trained model's context too."""
    model_config = AutoConfig.from_pretrained(config.actor.model.path)
    add_eos = config.RESPONSES_END_WITH_EOS
    train = load_pairs(config.pairs, tokenizer, model_config, "pairs", add_eos)
    valid = load_pairs(config.valid_pairs, tokenizer, model_config, "valid_pairs", add_eos)
    return train, valid[:config.evaluation.n_prompts]


def local_rows(run: RunContext, batch: TensorDict) -> TensorDict:
    """This data-parallel rank's pairs of a batch every rank holds (a pair never split)."""
    return shard_batch(batch, run.data_parallel_rank, run.data_parallel_size,
                       width=run.balance_width)


def pair_logprobs_once(run: RunContext, model: Any, pairs: list[PreferencePair],
                       pairs_per_forward: int) -> torch.Tensor:
    """[2 * len(pairs)] response log-probs (chosen, rejected per pair) under `model` (an
    engine or a LoRA engine's frozen base view), the pairs split over the data-parallel ranks
    and the results shared: every rank ends with the whole table."""
    world, rank = run.data_parallel_size, run.data_parallel_rank
    mine: list[tuple[list[int], list[float]]] = []
    step = pairs_per_forward * world
    for start in range(0, len(pairs), step):  # every rank runs the same number of forwards
        chunk = list(range(start, min(len(pairs), start + step)))[rank::world]
        batch = build_pair_batch([pairs[i] for i in (chunk or [start])])
        values = DPOActor.response_logprobs(model, batch).tolist()
        if chunk:
            mine.append((chunk, values))
    everyone: list[Any] = [mine]
    if world > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    table = torch.full((2 * len(pairs),), float("nan"))
    for per_rank in everyone:
        for chunk, values in per_rank:
            index = torch.tensor([2 * i + k for i in chunk for k in (0, 1)])
            table[index] = torch.tensor(values, dtype=table.dtype)
    if torch.isnan(table).any():
        raise RuntimeError("reference log-probs missing for some pairs (a rank sent none)")
    return table


def with_reference(batch: TensorDict, table: torch.Tensor, indices: list[int]) -> TensorDict:
    """`batch` (pairs `indices`, in order) with each row's `ref_logp` from `table`."""
    rows = torch.tensor([2 * i + k for i in indices for k in (0, 1)])
    batch["ref_logp"] = table[rows].to(batch["input_ids"].device)
    return batch
