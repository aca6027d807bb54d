"""A seeded, epoch-aware loader of data items (dicts) for rollout.

Each epoch is a permutation fixed by (seed, epoch), so an executor can resume exactly at a
saved (epoch, batch) position by calling `set_epoch` and skipping batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


class ItemLoader:
    """Yields lists of `batch_size` items from `dataset` (any indexable: dict items, pairs)."""

    def __init__(self, dataset: Sequence[Any], batch_size: int, seed: int = 1,
                 shuffle: bool = True, drop_last: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"ItemLoader.batch_size={batch_size}; expected >= 1")
        if len(dataset) < batch_size and drop_last:
            raise ValueError(
                f"ItemLoader: dataset has {len(dataset)} items, fewer than one batch of "
                f"{batch_size}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=gen).tolist()

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[Any]]:
        order = self.order(self.epoch)
        for b in range(len(self)):
            yield [self.dataset[i] for i in order[b * self.batch_size:(b + 1) * self.batch_size]]

    def forever(self, start_epoch: int = 0, skip: int = 0) -> Iterator[list[Any]]:
        """Batches epoch after epoch (for loops that count steps, not epochs), after skipping
        the first `skip` batches (resume: the batches already trained on)."""
        epoch, skip = start_epoch + skip // len(self), skip % len(self)
        while True:
            self.set_epoch(epoch)
            for batch in self:
                if skip:
                    skip -= 1
                    continue
                yield batch
            epoch += 1


def head_items(dataset: Sequence[dict[str, Any]], n: int, shuffle: bool,
               seed: int) -> list[dict[str, Any]]:
    """The first `n` items (e.g. held-out prompts): in file order, or of a permutation fixed
    by `seed` when `shuffle`."""
    order = (torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
             if shuffle else range(len(dataset)))
    return [dataset[i] for i in list(order)[:n]]
