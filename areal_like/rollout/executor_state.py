"""The executor's shared state: queues, buffers and counters behind one condition variable.

The loop thread calls `admit` and `finish`; trainer threads call `enqueue`, `take_or_wait`,
`wait_ticket`, `checkpoint`... Every method takes the lock itself, so callers never do.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tensordict import TensorDict

from areal_like.api.config import RolloutConfig
from areal_like.api.errors import (
    ExecutorClosedError,
    FleetUnavailableError,
    RolloutError,
    RolloutQueueFullError,
    RolloutWorkflowError,
)
from areal_like.api.rollout_api import ShouldAccept
from areal_like.api.seeding import DATA_ID_KEYS, data_key, derive_seed, random_seed
from areal_like.api.workflow_api import RolloutWorkflow
from areal_like.rollout.filter_budget import FilterBudgetExceeded, FilterBudgets
from areal_like.rollout.outcome import Outcome
from areal_like.rollout.staleness import (
    RolloutCounters,
    admission_capacity,
    is_stale,
    staleness_bound,
)


def data_id_of(data: dict[str, Any], seq: int) -> str:
    return next((str(data[key]) for key in DATA_ID_KEYS if key in data), f"#{seq}")


class Ticket:
    """The outcomes of one `rollout_batch` call, by submission number."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.outcomes: dict[int, tuple[Outcome, Any]] = {}
        self.failure: Optional[RolloutWorkflowError] = None


@dataclass
class Submission:
    seq: int
    data: dict[str, Any]
    data_id: str
    workflow: RolloutWorkflow
    should_accept: Optional[ShouldAccept]
    bounded: bool  # counts against the staleness bound (False: rollout_batch items)
    episode_seed: int
    ticket: Optional[Ticket] = None
    start: float = 0.0  # monotonic time the episode was admitted
    admit_version: int = -1  # policy version when admitted (its tokens are no older)


@dataclass
class EpisodeResult:
    seq: int
    data_id: str
    trajectory: TensorDict
    bounded: bool
    latency: float  # seconds from admission to the validated trajectory
    min_version: Optional[int]
    episode_seed: int = -1  # with data_id, names the episode (the item's n-th rollout)

    @property
    def episode_id(self) -> str:
        return f"{self.data_id}@{self.episode_seed}"


def workflow_error(sub: Submission, exc: BaseException) -> RolloutWorkflowError:
    """Wrap `exc` so the caller sees which item failed; `exc` (and its traceback) is the cause."""
    err = RolloutWorkflowError(
        f"{type(sub.workflow).__name__}.arun_episode failed on data item id={sub.data_id} "
        f"(submission #{sub.seq}): {type(exc).__name__}: {exc}",
        data_id=sub.data_id, seq=sub.seq, data=sub.data,
    )
    err.__cause__ = exc
    err.__suppress_context__ = True
    return err


@dataclass
class ExecutorState:
    config: RolloutConfig
    # reentrant: describe()/capacity() are also called from inside locked methods
    cond: threading.Condition = field(
        default_factory=lambda: threading.Condition(threading.RLock()))
    queued: deque = field(default_factory=deque)  # bounded submissions, FIFO
    queued_sync: deque = field(default_factory=deque)  # rollout_batch submissions, first served
    running: dict = field(default_factory=dict)  # seq -> Submission
    running_bounded: int = 0
    ready: deque = field(default_factory=deque)  # EpisodeResult, accepted and not consumed
    oldest_ready: float = math.inf  # min of min_version over `ready`: O(1) staleness check
    ready_waits: list = field(default_factory=list)  # counts blocked waiters need
    errors: deque = field(default_factory=deque)  # RolloutWorkflowError, oldest first
    counters: RolloutCounters = field(default_factory=RolloutCounters)
    restored_pending: list = field(default_factory=list)  # (data item, episode seed) to rerun
    seed: int = field(default_factory=random_seed)
    rollouts_of: dict = field(default_factory=dict)  # data_key -> times rolled out so far
    last_batch: dict = field(default_factory=dict)
    paused: bool = False
    closed: bool = False
    fatal: Optional[BaseException] = None
    next_seq: int = 0
    # the version at which the first bounded rollout was admitted: the bound counts versions
    # from there (a run may start at any version, e.g. a fleet already at v = 5)
    start_version: Optional[int] = None
    filters: FilterBudgets = field(init=False)  # rejections in a row by budgeted filters

    def __post_init__(self) -> None:
        if self.config.seed is not None:
            self.seed = self.config.seed
        self.filters = FilterBudgets(self.config.staleness.consumer_batch_size)

    # ---- errors and lifecycle -----------------------------------------------------------
    def set_fatal(self, exc: BaseException) -> None:
        with self.cond:
            if self.fatal is None:
                self.fatal = exc
            self.cond.notify_all()

    def raise_if_fatal(self) -> None:
        with self.cond:
            if isinstance(self.fatal, (FleetUnavailableError, FilterBudgetExceeded)):
                raise self.fatal  # says everything itself
            if self.fatal is not None:
                raise RolloutError(
                    f"the rollout event-loop thread failed: {type(self.fatal).__name__}: "
                    f"{self.fatal}"
                ) from self.fatal

    def _raise_if_unusable(self) -> None:
        """For waiters: closed, fatal, or the oldest workflow error (each raised once)."""
        if self.closed:
            raise ExecutorClosedError("WorkflowExecutor was destroyed while waiting")
        self.raise_if_fatal()
        if self.errors:
            raise self.errors.popleft()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.counters.cancelled += len(self.queued) + len(self.queued_sync)
            self.queued.clear()
            self.queued_sync.clear()
            self.cond.notify_all()

    def set_paused(self, paused: bool) -> None:
        with self.cond:
            self.paused = paused
            self.cond.notify_all()

    # ---- submission and admission -------------------------------------------------------
    def episode_seed(self, data: dict[str, Any]) -> int:
        """The seed of the next rollout of `data`: (run seed, item, how many times before)."""
        key = data_key(data)
        with self.cond:
            repeat = self.rollouts_of.get(key, 0)
            self.rollouts_of[key] = repeat + 1
        return derive_seed(self.seed, key, repeat)

    def enqueue(
        self, data: dict[str, Any], workflow: RolloutWorkflow,
        should_accept: Optional[ShouldAccept], bounded: bool,
        respect_limit: bool = False, ticket: Optional[Ticket] = None,
        episode_seed: Optional[int] = None,
    ) -> Submission:
        if not isinstance(data, dict):
            raise TypeError(f"a data item must be a dict, got {type(data).__name__}")
        if not isinstance(workflow, RolloutWorkflow):
            raise TypeError(f"workflow must be a RolloutWorkflow, got {type(workflow).__name__}")
        with self.cond:
            if self.closed:
                raise ExecutorClosedError("WorkflowExecutor was destroyed")
            limit = self.config.staleness.queue_size
            if respect_limit and limit > 0 and len(self.queued) >= limit:
                raise RolloutQueueFullError(
                    f"rollout input queue is full ({len(self.queued)} items, "
                    f"rollout.staleness.queue_size={limit}); wait() for results first"
                )
            seq = self.next_seq
            self.next_seq += 1
            if episode_seed is None:
                episode_seed = self.episode_seed(data)
            sub = Submission(seq, data, data_id_of(data, seq), workflow, should_accept,
                             bounded, episode_seed, ticket)
            self.counters.submitted += 1
            if ticket is not None:
                ticket.seqs.append(seq)
                self.queued_sync.append(sub)
            else:
                self.queued.append(sub)
            return sub

    def resubmit_restored(self, workflow: RolloutWorkflow,
                          should_accept: Optional[ShouldAccept]) -> int:
        with self.cond:
            pending, self.restored_pending = self.restored_pending, []
        for data, seed in pending:  # the seeds they had: they draw the same samples again
            self.enqueue(data, workflow, should_accept, bounded=True, episode_seed=seed)
        return len(pending)

    def versions_since_start(self, version: int) -> int:
        """The `v` of the staleness bound: versions since the first bounded admission."""
        with self.cond:
            return 0 if self.start_version is None else max(0, version - self.start_version)

    def capacity(self, version: int) -> int:
        with self.cond:
            cfg = self.config.staleness
            return admission_capacity(cfg.max_head_offpolicyness,
                                      self.versions_since_start(version),
                                      cfg.consumer_batch_size,
                                      self.counters.staleness_accepted, self.running_bounded)

    def admit(self, version: int) -> list[Submission]:
        """Move queued submissions to running as far as pause, concurrency and staleness allow."""
        started: list[Submission] = []
        with self.cond:
            if self.paused or self.closed:
                return started
            free = self.config.staleness.max_concurrent_rollouts - len(self.running)
            while free > 0 and self.queued_sync:
                started.append(self.queued_sync.popleft())
                free -= 1
            capacity = self.capacity(version)
            while free > 0 and capacity > 0 and self.queued:
                if self.start_version is None:  # the first bounded admission, not the first try
                    self.start_version = version
                started.append(self.queued.popleft())
                self.running_bounded += 1
                free -= 1
                capacity -= 1
            for sub in started:
                sub.admit_version = version
                self.running[sub.seq] = sub
        return started

    def finish(self, sub: Submission, kind: Outcome, payload: Any) -> None:
        """Record an episode's outcome (payload: its EpisodeResult when accepted, the
        exception to raise when failed or fatal, else None)."""
        with self.cond:
            self.running.pop(sub.seq, None)
            if sub.bounded:
                self.running_bounded -= 1
            c = self.counters
            if kind is Outcome.CANCELLED:
                c.cancelled += 1
            else:
                c.completed += 1
                if kind is Outcome.PARTIAL_ACCEPTED:
                    c.partial_groups += 1
                    kind = Outcome.ACCEPTED
                counter = (Outcome.FAILED if kind is Outcome.FATAL else kind).value
                setattr(c, counter, getattr(c, counter) + 1)
                exceeded = self.filters.record(sub.should_accept, kind, payload if kind is
                                               Outcome.REJECTED_BY_FILTER else None)
                if exceeded is not None:  # every wait raises it from now on
                    self.set_fatal(exceeded)
            raises = kind in (Outcome.FAILED, Outcome.FATAL)
            # wake waiters only when it can matter: one wake per episode costs a thread switch
            if sub.ticket is not None:
                ticket = sub.ticket
                ticket.outcomes[sub.seq] = (kind, payload)
                if raises and ticket.failure is None:
                    ticket.failure = payload
                wake = raises or len(ticket.outcomes) >= len(ticket.seqs)
            elif kind is Outcome.ACCEPTED:
                self.ready.append(payload)
                if payload.min_version is not None:
                    self.oldest_ready = min(self.oldest_ready, payload.min_version)
                if sub.bounded:
                    c.staleness_accepted += 1
                wake = any(len(self.ready) >= n for n in self.ready_waits)
            else:  # an error to raise, or a rejection that changes how much to prefetch
                if raises:
                    self.errors.append(payload)
                wake = True
            if wake:
                self.cond.notify_all()

    # ---- consumption --------------------------------------------------------------------
    def _recompute_oldest_locked(self) -> None:
        versions = [r.min_version for r in self.ready if r.min_version is not None]
        self.oldest_ready = min(versions, default=math.inf)

    def _drop_stale_locked(self, version: int) -> int:
        eta = self.config.staleness.max_head_offpolicyness
        if self.oldest_ready >= version - eta:
            return 0
        keep = [r for r in self.ready if not is_stale(r.min_version, version, eta)]
        dropped = len(self.ready) - len(keep)
        if dropped:
            stale_bounded = sum(r.bounded for r in self.ready) - sum(r.bounded for r in keep)
            self.ready = deque(keep)
            self._recompute_oldest_locked()
            self.counters.dropped_stale += dropped
            self.counters.staleness_accepted -= stale_bounded  # frees admission budget
        return dropped

    def _due_running_locked(self, count: int, version: int) -> bool:
        """True if a batch at `version` must wait for a running group: one admitted at
        v - η or earlier is stale at the next version, so it goes into this batch (the long
        answers of a heavy-tailed workload would otherwise be overtaken and dropped). The
        admission bound keeps such groups at most one batch's worth."""
        eta = self.config.staleness.max_head_offpolicyness
        due_ready = sum(1 for r in self.ready
                        if r.min_version is not None and r.min_version <= version - eta)
        if due_ready >= count:
            return False
        return any(sub.bounded and sub.admit_version <= version - eta
                   for sub in self.running.values())

    def _take_oldest_locked(self, count: int) -> list[EpisodeResult]:
        """The `count` ready groups from the oldest policy (then the earliest admitted):
        the ones closest to going stale are trained first."""
        order = sorted(self.ready, key=lambda r: (
            math.inf if r.min_version is None else r.min_version, r.seq))
        taken = order[:count]
        chosen = {id(r) for r in taken}
        self.ready = deque(r for r in self.ready if id(r) not in chosen)
        return taken

    def refill_need(self, version: int) -> int:
        """How many more items prepare_batch should draw: enough that everything the bound
        admits at `version` is queued, plus one consumer batch of slack so rejected groups
        are replaced while the trainer is busy."""
        with self.cond:
            cfg = self.config.staleness
            bound = staleness_bound(cfg.max_head_offpolicyness,
                                    self.versions_since_start(version), cfg.consumer_batch_size)
            in_pipeline = (self.counters.staleness_accepted + self.running_bounded
                           + len(self.queued))
            need = bound + cfg.consumer_batch_size - in_pipeline
            if cfg.queue_size > 0:
                need = min(need, cfg.queue_size - len(self.queued))
            return need

    def take_or_wait(
        self, count: int, version: int, deadline: float, want_refill: bool,
        make_timeout: Callable[[], Exception], on_drop: Callable[[], None],
    ) -> tuple[Optional[list[EpisodeResult]], int]:
        """Take `count` fresh groups, or report how many items to draw (want_refill), or
        wait once for a change; raise the oldest workflow error or a timeout."""
        with self.cond:
            self._raise_if_unusable()
            if want_refill:  # top up first, so prefetch does not depend on timing
                need = self.refill_need(version)
                if need > 0:
                    return None, need
            if self._drop_stale_locked(version):
                on_drop()
            if len(self.ready) >= count and not self._due_running_locked(count, version):
                taken = self._take_oldest_locked(count)
                self._recompute_oldest_locked()
                self.counters.consumed += count
                return taken, 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise make_timeout()
            self.ready_waits.append(count)
            try:  # the 1 s cap re-reads the version, which another thread may advance
                self.cond.wait(min(remaining, 1.0))
            finally:
                self.ready_waits.remove(count)
            return None, 0

    def wait_ticket(self, ticket: Ticket, count: int, deadline: float,
                    make_timeout: Callable[[], Exception]) -> list[tuple[Outcome, Any]]:
        """Wait until all of a rollout_batch's items finished; raise its first failure."""
        with self.cond:
            while True:
                self._raise_if_unusable()
                if ticket.failure is not None:
                    raise ticket.failure
                if len(ticket.outcomes) >= count:
                    return [ticket.outcomes[seq] for seq in ticket.seqs]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise make_timeout()
                self.cond.wait(min(remaining, 1.0))

    def drop_stale_results(self, outcomes: list[tuple[Outcome, Any]],
                           version: int) -> list[EpisodeResult]:
        eta = self.config.staleness.max_head_offpolicyness
        results = [payload for kind, payload in outcomes if kind is Outcome.ACCEPTED]
        fresh = [r for r in results if not is_stale(r.min_version, version, eta)]
        with self.cond:
            self.counters.dropped_stale += len(results) - len(fresh)
            self.counters.consumed += len(fresh)
        return fresh

    # ---- reporting ----------------------------------------------------------------------
    def snapshot(self, version: int) -> dict[str, Any]:
        with self.cond:
            c = self.counters
            return {
                **c.to_dict(), "rejected": c.rejected, "version": version,
                "running": len(self.running), "queued": len(self.queued) + len(self.queued_sync),
                "buffered": len(self.ready), "pending_errors": len(self.errors),
                "capacity": self.capacity(version), "paused": self.paused,
                "last_batch": dict(self.last_batch),
            }

    def describe(self, version: int) -> str:
        """A one-paragraph account of where every submitted item went, with hints."""
        with self.cond:
            c, cfg = self.counters, self.config.staleness
            eta, b = cfg.max_head_offpolicyness, cfg.consumer_batch_size
            queued = len(self.queued) + len(self.queued_sync)
            capacity = self.capacity(version)
            text = (
                f"produced {c.completed} episodes (accepted {c.accepted}, rejected {c.rejected}: "
                f"{c.rejected_by_workflow} by the workflow returning None, "
                f"{c.rejected_by_filter} by should_accept; failed {c.failed}; excluded for a "
                f"failed reward {c.failed_reward}); dropped as "
                f"stale {c.dropped_stale}; consumed {c.consumed}; still running "
                f"{len(self.running)}, queued {queued}; version {version}, eta {eta}."
            ) + self.filters.describe()
            hints = []
            if self.paused:
                hints.append("the executor is paused: call resume()")
            if self.queued and capacity <= 0:
                hints.append(
                    f"admission is blocked by the staleness bound (accepted "
                    f"{c.staleness_accepted} + running {self.running_bounded} >= (eta {eta} + "
                    f"{self.versions_since_start(version)} versions since the first admission + "
                    f"1) x consumer_batch_size {b}); advance the version after each consumed "
                    f"batch or raise max_head_offpolicyness"
                )
            due = sorted(s.seq for s in self.running.values()
                         if s.bounded and s.admit_version <= version - eta)
            if due:
                hints.append(
                    f"the batch waits for submission(s) #{due[:5]} admitted at version <= "
                    f"{version - eta}: they would be stale at the next version")
            if queued == 0 and not self.running:
                hints.append("nothing is running or queued: submit more data")
            return text + ("".join(f" Hint: {h}." for h in hints))

    # ---- checkpointing ------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        with self.cond:
            if self.errors:
                raise self.errors.popleft()
            unfinished = sorted(
                [s for s in self.running.values() if s.ticket is None] + list(self.queued),
                key=lambda s: s.seq,
            )
            counters = self.counters.to_dict()
            # restored items not yet re-queued were taken off `submitted` by restore
            counters["submitted"] += len(self.restored_pending)
            return {
                "counters": counters,
                "ready": list(self.ready),
                # restored items come first: they were drawn earliest
                "pending": list(self.restored_pending)
                + [(s.data, s.episode_seed) for s in unfinished],
                "paused": self.paused,
                "next_seq": self.next_seq,
                "seed": self.seed,
                "rollouts_of": dict(self.rollouts_of),
                "start_version": self.start_version,
            }

    def restore(self, counters: dict[str, int], ready: list[EpisodeResult],
                pending: list[tuple[dict[str, Any], int]], paused: bool, next_seq: int,
                seed: int, rollouts_of: dict[str, int],
                start_version: Optional[int]) -> None:
        with self.cond:
            busy = len(self.running) + len(self.queued) + len(self.queued_sync) + len(self.ready)
            if busy or self.counters.submitted:
                raise RolloutError(
                    "load_state_dict() needs a fresh executor: this one already has "
                    f"{self.counters.submitted} submissions ({busy} not yet consumed)"
                )
            restored = RolloutCounters.from_dict(counters)
            # unfinished items will be submitted again: they are not counted twice
            restored.submitted -= len(pending)
            self.counters = restored
            self.ready = deque(ready)
            self._recompute_oldest_locked()
            self.restored_pending = list(pending)
            self.paused = paused
            self.next_seq = next_seq
            self.seed = seed
            self.rollouts_of = dict(rollouts_of)
            self.start_version = None if start_version is None else int(start_version)
