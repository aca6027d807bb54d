"""Reward execution in real worker processes: a failed call is a failure, never a reward; a
timeout measures execution and stops only the call that overran; too many failures stop the
run; a reward function that cannot work is reported before the first step."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import reward_fns

from areal_like.rewards.budget import FailureBudget
from areal_like.rewards.failures import RewardBudgetExceeded, RewardFailure, RewardFunctionError
from areal_like.rewards.reward_executor import RewardExecutor

REPO = Path(__file__).resolve().parents[1]


async def _gather(executor: RewardExecutor, calls: list[tuple]) -> list:
    return await asyncio.gather(*[executor(fn, "q", c, **kw) for fn, c, kw in calls],
                                return_exceptions=True)


async def test_sync_rewards_run_in_processes_and_async_rewards_directly(executor_factory):
    executor = executor_factory(max_workers=1, timeout=60)

    async def async_reward(prompt, completion, **_):
        await asyncio.sleep(0)
        return len(completion)

    values = await asyncio.gather(
        executor(reward_fns.right_if_42, "q", " 42 "),
        executor(reward_fns.right_if_42, "q", "41"),
        executor(reward_fns.right_if_42, "q", "7", answer="7", extra="ignored"),
        executor(async_reward, "q", "abc"),
    )
    assert values == [1.0, 0.0, 1.0, 3.0]
    assert (executor.n_calls, executor.n_failed) == (4, 0)


async def test_marked_rewards_run_inline_and_fail_like_the_others(executor_factory,
                                                                   busy_machine):
    """@inline_reward functions run in the caller's process (no worker is started); raising
    is a failure, and so is CPU time past the timeout -- CPU time, so a busy machine that
    slows the call down in wall time does not fail it."""
    executor = executor_factory(timeout=1.0, max_failure_rate=1.0)
    assert await executor(reward_fns.inline_pid, "q", "x") == float(os.getpid())
    assert await executor(reward_fns.inline_burns_cpu, "q", "x", seconds="0.3") == 1.0
    with pytest.raises(RewardFailure) as raised:
        await executor(reward_fns.inline_raises, "q", "boom")
    assert raised.value.kind == "raised" and "exploded on boom" in str(raised.value)
    with pytest.raises(RewardFailure) as slow:
        await executor(reward_fns.inline_burns_cpu, "q", "x", seconds="1.5")
    assert slow.value.kind == "timeout" and "of CPU inline" in str(slow.value)
    assert not executor.workers.started  # no worker process was needed
    assert (executor.n_calls, executor.failures) == (4, {"raised": 1, "timeout": 1})

    in_workers = executor_factory(timeout=60, run_inline=False)
    assert await in_workers(reward_fns.inline_pid, "q", "x") != float(os.getpid())


@pytest.mark.parametrize("use_processes", [True, False])
async def test_raising_reward_is_a_failure_with_its_traceback(executor_factory, use_processes,
                                                              caplog):
    executor = executor_factory(timeout=60, use_processes=use_processes)
    with pytest.raises(RewardFailure) as info:
        await executor(reward_fns.raises, "q", "boom")
    failure = info.value
    assert (failure.fn_name, failure.kind) == ("raises", "raised")
    assert "ValueError: verifier exploded on boom" in str(failure)
    assert 'raise ValueError("verifier exploded on " + completion)' in failure.traceback_text
    assert executor.failures == {"raised": 1}
    assert "verifier exploded on boom" in caplog.text


# values a reward function might return by mistake: none of them is a reward
INVALID = [True, False, np.bool_(True), "1.0", None, math.inf, -math.inf, math.nan, [1.0],
           {"reward": 1.0}]


@pytest.mark.parametrize("mode", ["process", "thread", "async"])
async def test_invalid_return_values_are_failures(executor_factory, mode):
    executor = executor_factory(timeout=60, use_processes=mode == "process",
                                max_failure_rate=1.0)

    async def async_returns(prompt, completion, value=None, **_):
        return value

    fn = async_returns if mode == "async" else reward_fns.returns
    results = await _gather(executor, [(fn, "x", {"value": v}) for v in INVALID]
                            + [(fn, "x", {"value": v}) for v in (1, 0.5, np.float32(0.25))])
    for value, result in zip(INVALID, results, strict=False):
        assert isinstance(result, RewardFailure) and result.kind == "invalid", (value, result)
        assert "finite" in str(result) or "not a real number" in str(result) \
            or "bool" in str(result)
    assert results[len(INVALID):] == [1.0, 0.5, 0.25]


async def test_timeout_counts_execution_not_queueing(executor_factory):
    """Eight 1-second calls on one worker take ~8 s in all, more than the 5 s timeout: none
    may time out, because each one's clock starts when the worker starts it."""
    executor = executor_factory(max_workers=1, timeout=5.0)
    executor.check(reward_fns.sleeps_briefly)  # worker up before the clock matters
    start = time.monotonic()
    values = await asyncio.gather(*[
        executor(reward_fns.sleeps_briefly, "q", "x", seconds="1.0") for _ in range(8)])
    assert values == [1.0] * 8
    assert time.monotonic() - start > 5.0  # the queue was longer than the timeout
    assert executor.n_failed == 0


async def test_threads_held_by_timed_out_calls_fail_later_calls_instead_of_hanging(
        executor_factory):
    """use_processes=false: a thread cannot be stopped, so once every thread still runs a call
    that timed out, a queued call fails (counted) instead of waiting forever for a thread; once
    a thread is free again calls run; a call still queued at shutdown fails too."""
    executor = executor_factory(max_workers=1, timeout=0.5, use_processes=False)
    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    def blocks(prompt, completion, **_):
        entered.set()
        try:
            release.wait(60)
        finally:
            left.set()
        return 1.0

    try:
        results = await _gather(executor, [(blocks, "x", {}), (reward_fns.right_if_42, "42", {})])
        assert isinstance(results[0], RewardFailure) and results[0].kind == "timeout"
        assert isinstance(results[1], RewardFailure) and results[1].kind == "timeout"
        assert "all 1 reward threads still run calls that timed out" in str(results[1])
        assert executor.failures == {"timeout": 2}
    finally:
        release.set()
    assert await asyncio.to_thread(left.wait, 30)
    assert await executor(reward_fns.right_if_42, "q", "42") == 1.0  # the thread is back

    patient = executor_factory(max_workers=1, timeout=60, use_processes=False)
    entered.clear()
    release.clear()
    first = asyncio.ensure_future(patient(blocks, "q", "x"))
    queued = asyncio.ensure_future(patient(reward_fns.right_if_42, "q", "42"))
    assert await asyncio.to_thread(entered.wait, 30)  # `first` holds the only thread
    patient.shutdown()
    release.set()
    assert await asyncio.gather(first, queued, return_exceptions=True) == [1.0, queued.exception()]
    assert isinstance(queued.exception(), RewardFailure)
    assert "shut down before the call started" in str(queued.exception())


async def test_a_crashed_worker_fails_only_its_own_call(executor_factory):
    executor = executor_factory(max_workers=2, timeout=60)
    results = await _gather(executor, [(reward_fns.exits, "x", {})]
                            + [(reward_fns.right_if_42, "42", {})] * 6)
    assert isinstance(results[0], RewardFailure) and results[0].kind == "crashed"
    assert results[1:] == [1.0] * 6


async def test_a_worker_killed_while_idle_does_not_break_later_calls(executor_factory):
    """pebble gives up its whole pool when a worker dies while no call runs (the OOM killer
    taking an idle worker): the next calls get a new pool and real rewards."""
    executor = executor_factory(max_workers=1, timeout=60)
    idle_worker = int(await executor(reward_fns.worker_pid, "q", "x"))
    os.kill(idle_worker, signal.SIGKILL)
    values = await asyncio.wait_for(_gather(executor, [(reward_fns.worker_pid, "x", {})] * 3
                                            + [(reward_fns.right_if_42, "42", {})]), 120)
    assert values[3] == 1.0 and all(isinstance(pid, float) for pid in values[:3])
    assert idle_worker not in values and executor.failures == {}
    assert executor.workers.replaced == 1


def test_workers_that_die_while_starting_fail_the_call_instead_of_hanging(tmp_path):
    """Every worker exits while it starts (the program exits when a worker imports it), so
    each pool breaks before it takes the call: the call is sent to RESENDS new pools, then
    fails as `crashed`, counted, without waiting for any timeout."""
    (tmp_path / "program.py").write_text(textwrap.dedent("""
        import asyncio
        import json
        import sys

        if __name__ == "__mp_main__":  # a worker importing the program
            sys.exit(3)

        import reward_fns

        from areal_like.api.config import RewardConfig
        from areal_like.rewards.failures import RewardFailure
        from areal_like.rewards.reward_executor import RESENDS, RewardExecutor

        async def call(executor):
            try:
                return await asyncio.wait_for(executor(reward_fns.right_if_42, "q", "42"), 240)
            except RewardFailure as failure:
                return [failure.kind, str(failure)]

        if __name__ == "__main__":
            executor = RewardExecutor(RewardConfig(max_workers=1, timeout=3600))
            outcome = asyncio.run(call(executor))
            print(json.dumps([outcome, dict(executor.failures), executor.workers.replaced,
                              RESENDS]))
            executor.shutdown()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    proc = subprocess.run([sys.executable, str(tmp_path / "program.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (kind, message), failures, replaced, resends = json.loads(proc.stdout.splitlines()[-1])
    assert kind == "crashed" and f"broke {resends + 1} times before the call started" in message
    assert failures == {"crashed": 1} and replaced == resends


async def test_200_calls_under_load_with_one_hanging(executor_factory, busy_machine):
    """200 reward calls while two CPU-bound processes load the machine, one of them hanging:
    exactly one failure (its timeout), 199 right answers; the hang stops only itself."""
    executor = executor_factory(max_workers=2, timeout=10.0)
    items = [{"answer": str(i), "hang": i == 57} for i in range(200)]
    completions = [str(i) if i % 4 else f"{i}0" for i in range(200)]  # every 4th is wrong
    results = await _gather(executor, [(reward_fns.hangs_on, c, kw)
                                       for c, kw in zip(completions, items, strict=True)])
    failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert [(i, r.kind) for i, r in failures] == [(57, "timeout")]
    expected = [1.0 if i % 4 else 0.0 for i in range(200)]
    assert [r for i, r in enumerate(results) if i != 57] == expected[:57] + expected[58:]
    assert executor.failures == {"timeout": 1} and executor.n_calls == 200


def test_budget_trips_past_the_allowed_rate_and_stays_tripped():
    budget = FailureBudget(max_rate=0.1, window=20)  # 2 failures allowed in any 20 calls
    boom = RewardFailure("f", "raised", "ValueError: boom", "Traceback ...\nValueError: boom")
    for _ in range(30):
        budget.record("f", None)
    budget.record("f", boom)
    budget.record("f", boom)
    for _ in range(18):  # the window slides: the two failures leave it
        budget.record("f", None)
    budget.record("f", boom)
    budget.record("f", boom)
    budget.record("g", boom)  # another function has its own budget
    with pytest.raises(RewardBudgetExceeded) as info:
        budget.record("f", boom)
    message = str(info.value)
    assert "reward function f failed 3 of its last 20 calls" in message
    assert "reward.max_failure_rate=0.1" in message and "raised 5" in message
    assert "First failure: reward function f raised: ValueError: boom" in message
    assert "Traceback ...\nValueError: boom" in message
    with pytest.raises(RewardBudgetExceeded):
        budget.record("f", None)
    # the allowance is floor(rate x window) of the decimal numbers, not of their binary roundings
    assert [FailureBudget(r, w).allowed for r, w in [(0.29, 100), (0.07, 100), (0.1, 20)]] == \
        [29, 7, 2]


async def test_budget_stops_a_reward_that_always_fails(executor_factory):
    executor = executor_factory(timeout=60, max_failure_rate=0.05, failure_window=100)
    calls = [executor(reward_fns.raises, "q", f"c{i}") for i in range(5)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, RewardFailure) for r in results)  # 5 allowed in 100
    with pytest.raises(RewardBudgetExceeded, match="reward function raises failed 6 of its "
                                                   "last 6 calls"):
        await executor(reward_fns.raises, "q", "one more")


async def test_constant_on_failure_is_an_explicit_opt_in(executor_factory):
    executor = executor_factory(timeout=60, on_failure="constant", failure_reward=-1.0,
                                max_failure_rate=1.0)
    assert await executor(reward_fns.raises, "q", "x") == -1.0
    assert await executor(reward_fns.returns, "q", "x", value=math.inf) == -1.0
    assert executor.failures == {"raised": 1, "invalid": 1}


def _closure_reward():
    offset = 1.0

    def reward(prompt, completion, **_):
        return offset

    return reward


def _needs_answer(prompt, completion, answer):
    return 1.0


def _one_argument(completion):
    return 1.0


def _arealite_without_ids(prompt, completions):
    return 1.0


@pytest.mark.parametrize("fn, data, expected", [
    (lambda p, c, **_: 1.0, None, ["<lambda>", "cannot be sent to reward worker processes",
                                   "reward.use_processes=false"]),
    (_closure_reward(), None, ["_closure_reward.reward", "cannot be pickled"]),
    (_one_argument, None, ["_one_argument(completion)", "takes either (prompt, completion, "
                                                        "**kwargs) or, as in AReaL-lite"]),
    (_arealite_without_ids, None, ["reward_fn(prompt, completions, prompt_ids, completion_ids,"
                                   " **data)", "unexpected keyword argument 'prompt_ids'"]),
    (_needs_answer, {"answer": "1", "id": "a"}, ["_needs_answer(prompt, completion, answer)",
                                                "['answer', 'id']", "unexpected keyword",
                                                "**kwargs"]),
    (_needs_answer, {"id": "a"}, ["missing a required argument: 'answer'"]),
    ("not a function", None, ["is not callable"]),
])
def test_check_reports_unusable_reward_functions(executor_factory, fn, data, expected):
    executor = executor_factory()
    with pytest.raises(RewardFunctionError) as info:
        executor.check(fn, data)
    for text in expected:
        assert text in str(info.value)
    assert not executor.workers.started  # failed before any worker was started


@pytest.mark.parametrize("use_processes", [True, False])
async def test_arealite_convention_is_detected_and_gets_the_token_ids(executor_factory,
                                                                      use_processes):
    """AReaL-lite's reward_fn(prompt, completions, prompt_ids, completion_ids, **data) runs
    unchanged, in workers and in threads; ours, beside it, gets no ids."""
    executor = executor_factory(max_workers=1, timeout=60, use_processes=use_processes)
    executor.check(reward_fns.arealite_style, {"answer": "42", "id": 1})
    right, wrong, ours = await asyncio.gather(
        executor(reward_fns.arealite_style, "q", " 42", token_ids=([1, 2, 3], [4, 5]),
                 answer="42", id=1),
        executor(reward_fns.arealite_style, "q", "41", token_ids=([1], [2]), answer="42"),
        executor(reward_fns.right_if_42, "q", "42", token_ids=([1], [2]), answer="42"))
    assert (right, wrong, ours) == (302.0, 0.0, 1.0)


def test_check_accepts_good_functions_and_loads_them_in_a_worker(executor_factory):
    executor = executor_factory()
    executor.check(reward_fns.right_if_42, {"answer": "42", "id": 3, "messages": []})
    executor.check(_needs_answer, {"answer": "1"})
    assert executor.workers.started


def test_a_script_without_main_guard_is_named_at_start(tmp_path):
    """Worker processes import the running script again; without a `__main__` guard that
    re-runs its training code. The check names the script and the fix instead of hanging."""
    script = tmp_path / "train_without_guard.py"
    script.write_text(textwrap.dedent("""
        from areal_like.rewards.reward_executor import RewardExecutor

        def my_reward(prompt, completion, **data):
            return 1.0

        executor = RewardExecutor()
        executor.check(my_reward, {"answer": "1"})
        print("CHECK PASSED")
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "CHECK PASSED" not in proc.stdout
    assert "RewardFunctionError" in proc.stderr
    assert "could not load reward function my_reward" in proc.stderr
    assert f"importing the running script ({script})" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr


_PROGRAM = textwrap.dedent("""
    import asyncio
    import json
    import sys

    import program_dependency  # noqa: F401  (records every process that executes it)
    import reward_fns

    from areal_like.api.config import RewardConfig
    from areal_like.rewards.reward_executor import RewardExecutor


    async def calls(executor):
        first = await executor(reward_fns.worker_pid, "q", "a")
        try:
            await executor(reward_fns.worker_pid, "q", "a", hang=True)
        except Exception as e:
            timeout = e.kind
        return first, timeout, await executor(reward_fns.worker_pid, "q", "a")


    if __name__ == "__main__":
        executor = RewardExecutor(RewardConfig(max_workers=1, timeout=2.0))
        executor.check(reward_fns.worker_pid, {})
        print(json.dumps(asyncio.run(calls(executor))))
        executor.shutdown()
""")


def _run_program(tmp_path: Path, dependency: str) -> subprocess.CompletedProcess:
    (tmp_path / "program.py").write_text(_PROGRAM)
    (tmp_path / "program_dependency.py").write_text(dependency)
    env = {**os.environ, "IMPORT_LOG": str(tmp_path / "imports.log"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "tests"), str(REPO)])}
    return subprocess.run([sys.executable, str(tmp_path / "program.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_replacement_worker_does_not_import_the_program_again(tmp_path):
    """A worker stopped at its timeout is replaced by one forked from the worker server, which
    imported the program's modules once: neither worker executes them again."""
    proc = _run_program(tmp_path, textwrap.dedent("""
        import os
        with open(os.environ["IMPORT_LOG"], "a") as log:
            log.write(f"{os.getpid()}\\n")
    """))
    assert proc.returncode == 0, proc.stderr
    first, timeout, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert timeout == "timeout" and first != second  # the hung worker was replaced
    importers = (tmp_path / "imports.log").read_text().split()
    assert len(importers) == 2  # the program and the worker server, not each worker
    assert str(int(first)) not in importers and str(int(second)) not in importers


def test_a_worker_server_that_cannot_start_is_named_at_start(tmp_path):
    """A module that imports in the program but fails in the worker server (a check of
    its own on how it was started): the start check names the setting that avoids it."""
    proc = _run_program(tmp_path, textwrap.dedent("""
        import sys
        if sys.argv[0] == "-c":  # the worker server runs as `python -c ...`
            raise RuntimeError("program_dependency refuses to load in a worker server")
    """))
    assert proc.returncode != 0
    assert "RuntimeError: program_dependency refuses to load in a worker server" in proc.stderr
    assert "RewardFunctionError: reward worker processes could not start" in proc.stderr
    assert "reward.worker_start=spawn" in proc.stderr
