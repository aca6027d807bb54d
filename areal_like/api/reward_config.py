"""The `reward` section: how reward functions run, and what happens when one fails."""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_like.api.config_checks import IMPORT_PATH
from areal_like.api.config_checks import check as _check
from areal_like.api.config_checks import one_of as _one_of


@dataclass
class RewardConfig:
    """How reward functions run, and what happens when one fails.

    A call that raises, times out or returns something other than a finite real number is a
    *failed* sample: never a reward. By default its group is excluded from training (when the
    estimator uses group statistics; otherwise the sample alone), counted, and once more than
    `max_failure_rate` of the last `failure_window` calls of a reward function failed, the run
    stops naming the function and its first failure. `on_failure=constant` instead trains on
    `failure_reward` for failed samples (an explicit opt-in; still counted and budgeted).
    """

    # Import path of your own reward function, 'my_pkg.rewards:score' (called as
    # fn(prompt, completion, **item)); empty: the task's own verifier.
    fn: str = ""
    # URL of a remote reward model (POST {query, prompts, labels} -> {rewards}) that replaces
    # the task's verifier, like `fn` (see areal_like/rewards/remote_rm.py); empty: none
    remote_rm_url: str = ""
    remote_rm_batch_size: int = 8  # queries per request (concurrent calls are batched)
    remote_rm_max_retries: int = 2  # extra attempts after a connection error or HTTP 5xx
    timeout: float = 15.0  # seconds of execution per call (queueing time does not count)
    max_workers: int = 2  # worker processes for sync reward functions
    use_processes: bool = True  # False: threads (for rewards that cannot be pickled)
    run_inline: bool = True  # @inline_reward functions (e.g. exact match) run in this thread
    startup_timeout: float = 120.0  # for starting workers and sending them the function
    # forkserver: workers fork from one process that imported the program once (a worker
    # replacing one stopped at its timeout starts in well under a second); spawn: each
    # worker imports the program again
    worker_start: str = "forkserver"
    on_failure: str = "exclude"  # exclude | constant
    failure_reward: float = 0.0  # the reward of a failed sample when on_failure=constant
    max_failure_rate: float = 0.05
    failure_window: int = 200  # calls per reward function the failure rate is measured over

    def __post_init__(self) -> None:
        name = "RewardConfig"
        _check(name, "fn", not self.fn or bool(IMPORT_PATH.match(self.fn)),
               self.fn, "empty or an import path like 'my_pkg.rewards:score'")
        _check(name, "timeout", self.timeout > 0, self.timeout, "> 0 seconds")
        _check(name, "remote_rm_url", not self.remote_rm_url or (
            self.remote_rm_url.startswith(("http://", "https://")) and not self.fn),
            self.remote_rm_url, "empty or an http(s):// URL, and not together with reward.fn")
        _check(name, "remote_rm_batch_size", self.remote_rm_batch_size >= 1,
               self.remote_rm_batch_size, ">= 1")
        _check(name, "remote_rm_max_retries", self.remote_rm_max_retries >= 0,
               self.remote_rm_max_retries, ">= 0")
        _check(name, "max_workers", self.max_workers >= 1, self.max_workers, ">= 1")
        _check(name, "startup_timeout", self.startup_timeout > 0, self.startup_timeout,
               "> 0 seconds")
        _one_of(name, "worker_start", self.worker_start, ("forkserver", "spawn"))
        _one_of(name, "on_failure", self.on_failure, ("exclude", "constant"))
        _check(name, "failure_reward", math.isfinite(self.failure_reward),
               self.failure_reward, "a finite number")
        _check(name, "max_failure_rate", 0.0 <= self.max_failure_rate <= 1.0,
               self.max_failure_rate, "in [0, 1]")
        _check(name, "failure_window", self.failure_window >= 1, self.failure_window, ">= 1")
