"""Reproducible sampling: the seed of every generation request, derived from the run's seed.

The rollout executor gives each episode a seed: a hash of the run seed, the data item (its
`id`, or its content) and how many times that item was rolled out before. Inside the episode,
request i gets `derive_seed(episode_seed, i)`, in the order the workflow calls `agenerate`
(for concurrent samples, the order the workflow starts them in). So a sample depends only on
the item, its repetition, its place in the episode and the weights — never on timing, on the
server that ran it, or on which other requests shared its batch — and an asynchronous run with
eta = 0 draws exactly the samples of a synchronous loop over the same data. Servers sample with
these seeds when they run deterministic inference (`ServerConfig.deterministic`).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from contextvars import ContextVar
from typing import Any, Optional

from areal_like.api.io_struct import ModelRequest

SEED_BITS = 63  # SGLang's sampling_seed is a signed 64-bit integer
DATA_ID_KEYS = ("id", "query_id", "qid", "uid")


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed that is a fixed function of `parts` (stable across processes)."""
    text = "\x1f".join(repr(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> (64 - SEED_BITS)


def random_seed() -> int:
    return secrets.randbits(SEED_BITS)


def data_key(data: dict[str, Any]) -> str:
    """What identifies a data item for seeding: its id field, else a hash of its content
    (JSON, with `repr` for other values: give items with tensors in them an `id`)."""
    for key in DATA_ID_KEYS:
        if key in data:
            return f"{key}={data[key]!r}"
    text = json.dumps(data, sort_keys=True, default=repr)
    return "content=" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class EpisodeSeeds:
    """The seeds of one episode's requests, in the order they are asked for."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.requests = 0

    def next_request_seed(self) -> int:
        seed = derive_seed(self.seed, self.requests)
        self.requests += 1
        return seed


_EPISODE: ContextVar[Optional[EpisodeSeeds]] = ContextVar("areal_like_episode", default=None)


def begin_episode(seed: int) -> EpisodeSeeds:
    """Seed the requests of the episode running in the current asyncio task (and the tasks it
    starts). Call it at the top of that task: each task has its own copy of the context."""
    episode = EpisodeSeeds(seed)
    _EPISODE.set(episode)
    return episode


def current_episode() -> Optional[EpisodeSeeds]:
    """The seeds of the episode running in this asyncio task (None outside one)."""
    return _EPISODE.get()


def request_seed(req: ModelRequest) -> int:
    """The sampling seed for `req`: its own `seed`, else the next seed of the running episode,
    else a random one (a request outside any seeded episode is not reproducible)."""
    if req.seed is not None:
        return req.seed
    episode = _EPISODE.get()
    return episode.next_request_seed() if episode is not None else random_seed()
