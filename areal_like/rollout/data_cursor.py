"""A resumable position in a dataloader that is cycled epoch after epoch.

The cursor records (epoch, batches drawn in that epoch, items drawn in that epoch). To resume
at a saved position it rebuilds the same iteration order and skips what was already drawn:

- if the loader (or its `sampler`, or its `batch_sampler.sampler`) has `set_epoch(epoch)`,
  the cursor calls it at every epoch start, and resuming skips only the batches already
  drawn in the saved epoch;
- otherwise it replays: it iterates every earlier epoch in full, then skips. That reproduces
  any loader whose order depends only on its own state, e.g. a `torch.utils.data.DataLoader`
  built with the same seeded `generator` (its sampler draws from it once per epoch), at the
  cost of reading those items again.

Each element the loader yields is either one data item (a dict) or a list/tuple of them (use
`collate_fn=lambda batch: batch` with a torch DataLoader).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional


def _set_epoch_fn(loader: Any) -> Optional[Any]:
    candidates = [loader, getattr(loader, "sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates.append(getattr(batch_sampler, "sampler", None))
    for obj in candidates:
        fn = getattr(obj, "set_epoch", None)
        if callable(fn):
            return fn
    return None


def as_items(element: Any, where: str) -> list[dict[str, Any]]:
    """The data items in one element yielded by a loader."""
    items = list(element) if isinstance(element, (list, tuple)) else [element]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TypeError(
                f"{where}: item {i} is a {type(item).__name__}; expected a dict data item (a "
                f"torch DataLoader needs collate_fn=lambda batch: batch)"
            )
    return items


class DataCursor:
    def __init__(self, loader: Iterable[Any], epoch: int = 0, batches_drawn: int = 0,
                 items_drawn: int = 0) -> None:
        if epoch < 0 or batches_drawn < 0 or items_drawn < 0:
            raise ValueError(
                f"DataCursor position must be >= 0, got epoch={epoch} batches_drawn="
                f"{batches_drawn} items_drawn={items_drawn}"
            )
        self.loader = loader
        self.epoch = epoch
        self.batches_drawn = batches_drawn
        self.items_drawn = items_drawn
        self._iterator: Optional[Iterator[Any]] = None
        self._set_epoch = _set_epoch_fn(loader)

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_drawn": self.batches_drawn,
                "items_drawn": self.items_drawn}

    def _open_epoch(self, epoch: int) -> Iterator[Any]:
        if self._set_epoch is not None:
            self._set_epoch(epoch)
        return iter(self.loader)

    def _resume(self) -> Iterator[Any]:
        """Open the current epoch, fast-forwarded to the saved position."""
        if self._set_epoch is None:
            for past in range(self.epoch):  # replay earlier epochs to advance loader state
                for _ in self._open_epoch(past):
                    pass
        iterator = self._open_epoch(self.epoch)
        for skipped in range(self.batches_drawn):
            try:
                next(iterator)
            except StopIteration:
                raise ValueError(
                    f"cannot resume the dataloader at epoch {self.epoch}, batch "
                    f"{self.batches_drawn}: its epoch has only {skipped} batches"
                ) from None
        return iterator

    def next_items(self) -> list[dict[str, Any]]:
        """The items of the next loader element, starting a new epoch when one runs out."""
        if self._iterator is None:
            self._iterator = self._resume()
        try:
            element = next(self._iterator)
        except StopIteration:
            if self.batches_drawn == 0:
                raise ValueError(f"the dataloader yielded nothing in epoch {self.epoch}") from None
            self.epoch += 1
            self.batches_drawn = 0
            self.items_drawn = 0
            self._iterator = self._open_epoch(self.epoch)
            try:
                element = next(self._iterator)
            except StopIteration:
                raise ValueError(
                    f"the dataloader yielded nothing in epoch {self.epoch}"
                ) from None
        where = f"dataloader epoch {self.epoch} batch {self.batches_drawn}"
        items = as_items(element, where)
        if not items:
            raise ValueError(f"{where} is an empty batch; every batch needs >= 1 data item")
        self.batches_drawn += 1
        self.items_drawn += len(items)
        return items
