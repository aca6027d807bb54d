"""The `reward` section: how reward functions run, and what happens when one fails."""

from __future__ import annotations

from dataclasses import dataclass

from areal_like.api.config_checks import (
    FINITE,
    FRACTION,
    IMPORT_PATH,
    above,
    at_least,
    bounded,
    check_bounds,
    choices,
)
from areal_like.api.config_checks import check as _check


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
    # queries per request (concurrent calls are batched)
    remote_rm_batch_size: int = bounded(8, bound=at_least(1))
    # extra attempts after a connection error or HTTP 5xx
    remote_rm_max_retries: int = bounded(2, bound=at_least(0))
    # seconds of execution per call (queueing time does not count)
    timeout: float = bounded(15.0, bound=above(0, " seconds"))
    # worker processes for sync reward functions
    max_workers: int = bounded(2, bound=at_least(1))
    use_processes: bool = True  # False: threads (for rewards that cannot be pickled)
    run_inline: bool = True  # @inline_reward functions (e.g. exact match) run in this thread
    # for starting workers and sending them the function
    startup_timeout: float = bounded(120.0, bound=above(0, " seconds"))
    # forkserver: workers fork from one process that imported the program once (a worker
    # replacing one stopped at its timeout starts in well under a second); spawn: each
    # worker imports the program again
    worker_start: str = bounded("forkserver", bound=choices("forkserver", "spawn"))
    on_failure: str = bounded("exclude", bound=choices("exclude", "constant"))
    # the reward of a failed sample when on_failure=constant
    failure_reward: float = bounded(0.0, bound=FINITE)
    max_failure_rate: float = bounded(0.05, bound=FRACTION)
    # calls per reward function the failure rate is measured over
    failure_window: int = bounded(200, bound=at_least(1))

    def __post_init__(self) -> None:
        name = "RewardConfig"
        _check(name, "fn", not self.fn or bool(IMPORT_PATH.match(self.fn)),
               self.fn, "empty or an import path like 'my_pkg.rewards:score'")
        _check(name, "remote_rm_url", not self.remote_rm_url or (
            self.remote_rm_url.startswith(("http://", "https://")) and not self.fn),
            self.remote_rm_url, "empty or an http(s):// URL, and not together with reward.fn")
        check_bounds(self, name)
