"""Shared prefixes computed once: a packed micro-batch's sequences as a prefix tree.

A GRPO group is one prompt with n answers; a multi-turn agent's trajectories share their
history. Packed whole, a prompt of P tokens in a group of n is forwarded and back-propagated n
times. With `actor.shared_prefix` the engine merges a micro-batch's sequences into a token
trie instead: each distinct prefix is one row of the model's input, a token attends to its
ancestors and itself only (a tree mask, one batched SDPA call per bucket of trees of similar
size), and its position is its depth, so RoPE sees the positions of the unshared sequence. The
model's per-row outputs are gathered back into the packed layout (`PrefixTree.unshared`): the
log-probs, entropy, values and every loss see the tensors of the unshared computation, and
the gather's backward sums a shared row's gradient over the sequences that share it.

Sharing pays where prefixes are long against what follows them. A micro-batch whose tree
would keep more than `SHARED_FRACTION_BREAK_EVEN` of its tokens is packed whole as before: with
nothing shared the tree costs what packing does within this machine's noise (the explicit mask
against causal attention, the trie's build), so where the gain is small the packed path stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from tensordict import TensorDictBase

from engines.fsdp.attention import Bucket, BucketPlan, similar_lengths

logger = logging.getLogger(__name__)

# a micro-batch is forwarded as a tree when the tree has at most this fraction of its tokens
# (docs/benchmarks.md, "The trainer's core": benchmarks/shared_prefix.py --forced)
SHARED_FRACTION_BREAK_EVEN = 0.8


@dataclass(frozen=True)
class PrefixTree:
    """A micro-batch as a forest of token tries, rows of each tree contiguous."""

    input_ids: torch.Tensor  # [R] one token per distinct prefix
    position_ids: torch.Tensor  # [R] its depth: its position in every sequence through it
    unshared: torch.Tensor  # [T] the row each packed token's prefix ends at
    attention: BucketPlan  # trees of similar size right-padded together, with their masks

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])


def _trie(ids: list[int], bounds: list[int]) -> tuple[list[int], list[int], list[int],
                                                      list[int], list[int]]:
    """(parent, token, depth, root, row of each packed token), rows in creation order."""
    child: dict[tuple[int, int], int] = {}
    parent: list[int] = []
    token: list[int] = []
    depth: list[int] = []
    root: list[int] = []
    unshared: list[int] = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        node = -1
        for d in range(end - start):
            tok = ids[start + d]
            row = child.get((node, tok))
            if row is None:
                row = len(token)
                child[(node, tok)] = row
                parent.append(node)
                token.append(tok)
                depth.append(d)
                root.append(row if node < 0 else root[node])
            unshared.append(row)
            node = row
    return parent, token, depth, root, unshared


def build_prefix_tree(input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      break_even: float = SHARED_FRACTION_BREAK_EVEN) -> Optional[PrefixTree]:
    """The micro-batch's prefix tree, or None when it would keep more than `break_even` of
    the tokens (then the packed layout is cheaper)."""
    ids, bounds = input_ids.tolist(), cu_seqlens.tolist()
    parent, token, depth, root, unshared = _trie(ids, bounds)
    if len(token) > break_even * len(ids):
        return None
    # rows grouped by tree (roots in order of appearance), creation order inside a tree:
    # a parent always comes before its children
    order = sorted(range(len(token)), key=lambda r: (root[r], r))
    new_row = np.empty(len(order), dtype=np.int64)
    new_row[order] = np.arange(len(order))
    trees: list[list[int]] = []
    for r in order:
        if parent[r] < 0:
            trees.append([])
        trees[-1].append(r)
    device = input_ids.device
    total = len(order)
    buckets = []
    restore = torch.empty(total, dtype=torch.long)
    placed = 0
    for group in similar_lengths([len(t) for t in trees]):
        length = max(len(trees[i]) for i in group)
        gather = np.full((len(group), length), total, dtype=np.int64)
        mask = np.zeros((len(group), length, length), dtype=bool)
        for slot, i in enumerate(group):
            rows = trees[i]
            local = {r: j for j, r in enumerate(rows)}
            visible = mask[slot]
            for j, r in enumerate(rows):
                if parent[r] >= 0:
                    visible[j] = visible[local[parent[r]]]  # a parent's row is complete
                visible[j, j] = True
            for j in range(len(rows), length):
                visible[j, j] = True  # a pad sees itself only (no empty softmax row)
            gather[slot, :len(rows)] = new_row[rows]
        flat = torch.from_numpy(gather.reshape(-1))
        real = flat < total
        restore[flat[real]] = torch.nonzero(real).squeeze(1) + placed
        placed += flat.numel()
        buckets.append(Bucket(len(group), length, flat.to(device),
                              torch.from_numpy(mask)[:, None].to(device)))
    ordered = torch.tensor(order, dtype=torch.long)
    return PrefixTree(
        input_ids=torch.tensor(token, dtype=input_ids.dtype)[ordered].to(device),
        position_ids=torch.tensor(depth, dtype=torch.long)[ordered].to(device),
        unshared=torch.from_numpy(new_row[np.asarray(unshared, dtype=np.int64)]).to(device),
        attention=BucketPlan(tuple(buckets), restore.to(device)))


def why_not_shared(vision_language: bool, router_replay: bool, attn_implementation: str,
                   packed_sdpa: str, sequence_parallel: int = 1) -> str:
    """Why `actor.shared_prefix` cannot apply to this model ("" where it can). The engine
    then packs every micro-batch whole (the same numbers) and says so once."""
    return ("a vision-language model's image positions are not a prefix tree's depths"
            if vision_language else
            f"Ulysses (parallel.sequence_parallel_size={sequence_parallel}) splits the packed "
            f"tokens over ranks and exchanges heads, which a tree's masked buckets do not"
            if sequence_parallel > 1 else
            "router replay's routes are per packed token, not per tree row"
            if router_replay else
            f"the tree mask needs the packed SDPA attention, not {attn_implementation!r} "
            f"(flash-attn's varlen kernel takes no mask)"
            if attn_implementation != packed_sdpa else "")


def prefix_trees(wanted: bool, why_not: str) -> Optional[PrefixTreeUse]:
    """The engine's tree planner: with `actor.shared_prefix` where it applies, else None
    (a warning says why when it was asked for)."""
    if wanted and why_not:
        logger.warning("actor.shared_prefix=true: every micro-batch packed whole: %s", why_not)
    return PrefixTreeUse() if wanted and not why_not else None


class PrefixTreeUse:
    """The engine's side: a micro-batch's tree when it pays, the rows it forwarded, and one
    log line the first time micro-batches go each way (tree, or packed whole)."""

    def __init__(self, break_even: float = SHARED_FRACTION_BREAK_EVEN) -> None:
        self.break_even = break_even
        self.forwarded = 0  # model input rows since the engine's call began
        self._said: set[bool] = set()

    def plan(self, mb: TensorDictBase) -> Optional[PrefixTree]:
        ids = mb["input_ids"]
        tree = build_prefix_tree(ids, mb["cu_seqlens"], self.break_even)
        n_tokens = int(ids.shape[0])
        self.forwarded += n_tokens if tree is None else tree.n_rows
        if (tree is not None) not in self._said and n_tokens > 1:  # (not a dummy micro-batch)
            self._said.add(tree is not None)
            logger.info(
                "shared prefixes: %s", f"a micro-batch of {n_tokens} tokens forwarded as "
                f"{tree.n_rows} tree rows" if tree is not None else f"a micro-batch of "
                f"{n_tokens} tokens packed whole: its tree would keep more than "
                f"{self.break_even:.0%} of them (the masked attention would cost more)")
        return tree
