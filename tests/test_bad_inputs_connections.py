"""Bad addresses: every connection the run opens (teacher fleet, remote reward model, PRM
service) fails within its timeout with an error naming the address and the config key, and
the launcher's last line names the trainer's exception whatever its name.

A "silent" address is a real listening socket whose connections are accepted and never
answered (the hard case: no refusal to notice); a "refused" one is a port nothing listens on.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from config_helpers import rollout_config
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import reset_fleet

from areal_like.api.config import RolloutConfig
from areal_like.api.reward_config import RewardConfig
from areal_like.launcher.target import trainer_error
from areal_like.rewards.failures import RewardFailure
from areal_like.rewards.prm_client import PRMClient
from areal_like.rewards.remote_rm import RemoteRewardModel
from areal_like.rewards.reward_executor import RewardExecutor
from engines.fleet.client import RemoteInferenceEngine
from recipes.distill import connect_teacher
from workflows.distill import TeacherScorer, TeacherUnavailableError

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
BOUND_S = 120  # generous: each check below is bounded by a timeout of a few seconds


@contextmanager
def silent_server() -> Iterator[str]:
    """host:port of a server that accepts every connection and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was closed: the test is over
                return
            held.append(conn)  # kept open, never answered

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for conn in held:
            conn.close()
        thread.join(10)


def refused_address() -> str:
    """host:port where nothing listens (a free port, bound once and closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def bad_address(kind: str) -> Iterator[str]:
    if kind == "silent":
        with silent_server() as addr:
            yield addr
    else:
        yield refused_address()


# ---- the teacher fleet --------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["silent", "refused"])
async def test_episodes_waiting_for_a_dead_teacher_share_one_attempt(kind):
    """Queued episodes wait on one connection attempt and fail together with its error
    (naming teacher.server_addrs and the address), not each after a set-up timeout of its
    own in turn; the attempt runs in a daemon thread, so a process can exit during it."""
    attempts: list[threading.Thread] = []

    def connect(config: RolloutConfig) -> RemoteInferenceEngine:  # the real one, counted
        attempts.append(threading.current_thread())
        return connect_teacher(config)

    with bad_address(kind) as addr:
        config = rollout_config(server_addrs=[addr], setup_timeout=2.0)
        scorer = TeacherScorer(functools.partial(connect, config), timeout=30,
                               addresses=[addr])
        start = time.monotonic()
        results = await asyncio.gather(*(scorer.score([[1, 2, 3]], [1]) for _ in range(8)),
                                       return_exceptions=True)
        elapsed = time.monotonic() - start
        assert len(attempts) == 1 and attempts[0].daemon
        for result in results:
            assert isinstance(result, TeacherUnavailableError), result
            assert f"teacher.server_addrs=['{addr}']" in str(result)
            assert f"server {addr} not healthy within 2 s" in str(result)
        assert elapsed < BOUND_S
        if kind == "refused":  # (quick to fail again) a later call makes a new attempt
            with pytest.raises(TeacherUnavailableError):
                await scorer.score([[1, 2, 3]], [1])
            assert len(attempts) == 2
    scorer.close()


def _recipe_args(model_dir: Path, log_dir: Path, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", f"logging.log_dir={log_dir}",
            f"rollout.client.api_key={SGLANG_TEST_API_KEY}", "total_train_steps=2",
            "evaluation.freq_steps=2", "evaluation.n_prompts=4", "valid_dataset.size=8",
            "train_dataset.size=200", "logging.tensorboard=false", "gconfig.max_new_tokens=4",
            "gconfig.n_samples=2", "rollout.staleness.consumer_batch_size=2",
            "train_dataset.batch_size=2", *extra]


@pytest.mark.sglang
@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["silent", "refused"])
def test_distill_with_a_teacher_that_never_answers_fails_at_start(kind, sglang_fleet,
                                                                   tiny_model_dir, tmp_path):
    """The recipe on the session's student fleet: the teacher is checked before the trainer
    starts anything (no step, no request to the student fleet), within
    rollout.client.setup_timeout, and the error names teacher.server_addrs and the address."""
    with bad_address(kind) as addr:
        args = _recipe_args(tiny_model_dir, tmp_path / "runs",
                            f"rollout.server_addrs=[{','.join(sglang_fleet.addresses)}]",
                            f"teacher.server_addrs=[{addr}]", "rollout.client.setup_timeout=3")
        start = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "recipes.distill", *args], cwd=REPO,
                                  env=ENV, capture_output=True, text=True, timeout=600)
        finally:  # were the check missing, the run would train on the session fleet
            reset_fleet(sglang_fleet, tiny_model_dir)
        elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert (f"TeacherUnavailableError: teacher.server_addrs=['{addr}']: the teacher fleet "
            f"does not answer") in out, out[-3000:]
    assert f"server {addr} not healthy within 3 s" in out
    assert "[step 0]" not in out  # nothing of the run started
    assert elapsed < BOUND_S


@pytest.mark.e2e
def test_launcher_stops_before_any_server_starts_when_the_teacher_is_silent(tiny_model_dir,
                                                                           tmp_path):
    with silent_server() as addr:
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "areal_like.launcher.local", "distill",
             f"model.path={tiny_model_dir}", f"teacher.server_addrs=[{addr}]",
             "rollout.client.setup_timeout=3", f"logging.log_dir={tmp_path / 'runs'}"],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
        elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"launch failed: teacher.server_addrs=['{addr}']: the teacher "
                           f"fleet does not answer"), last
    assert f"server {addr} not healthy within 3 s (rollout.client.setup_timeout)" in last
    assert "starting" not in proc.stdout and "[trainer]" not in proc.stdout
    assert elapsed < BOUND_S


@pytest.mark.sglang
@pytest.mark.e2e
def test_a_teacher_failing_mid_run_stops_the_run_with_its_cause_last(sglang_fleet,
                                                                   tiny_model_dir, tmp_path):
    """The teacher answers at start, then every scoring request outlives
    teacher.request_timeout: the reward budget stops the run; the trainer exits non-zero and
    the launcher (attached to the session fleet: it starts no server) says why last."""
    addrs = f"[{','.join(sglang_fleet.addresses)}]"
    args = _recipe_args(tiny_model_dir, tmp_path / "runs", f"rollout.server_addrs={addrs}",
                        f"teacher.server_addrs={addrs}", "teacher.request_timeout=0.0001")
    reset_fleet(sglang_fleet, tiny_model_dir)
    try:
        proc = subprocess.run([sys.executable, "-m", "areal_like.launcher.local", "distill",
                               *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                              timeout=600)
    finally:
        reset_fleet(sglang_fleet, tiny_model_dir)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[launcher] trainer exited with code 1: "), last
    assert "RewardBudgetExceeded: reward function teacher failed" in last, last
    assert (f"no log-probs from teacher.server_addrs={sglang_fleet.addresses} within "
            f"0.0001 s (teacher.request_timeout)") in last, last
    assert "[step 1]" not in proc.stdout  # no update on a batch the teacher did not score


# ---- the remote reward model and the PRM service ------------------------------------------
async def test_remote_rm_at_a_silent_address_times_out_naming_the_url():
    with silent_server() as addr:
        url = f"http://{addr}/get_reward"
        model = RemoteRewardModel(url, timeout=1.0, max_retries=0)
        try:
            with pytest.raises(RewardFailure) as info:
                await asyncio.wait_for(model.score("1+1=", "2", answer="2"), BOUND_S)
        finally:
            await model.aclose()
    assert info.value.kind == "timeout"
    assert f"remote_rm({url})" in str(info.value) and "reward.timeout=1.0 s" in str(info.value)


async def test_remote_rm_where_nothing_listens_fails_naming_the_url_and_key():
    url = f"http://{refused_address()}/get_reward"
    model = RemoteRewardModel(url, timeout=5.0, max_retries=1, retry_backoff=0.0)
    try:
        with pytest.raises(RewardFailure) as info:
            await asyncio.wait_for(model.score("1+1=", "2", answer="2"), BOUND_S)
    finally:
        await model.aclose()
    assert info.value.kind == "raised"
    assert f"cannot reach {url} (reward.remote_rm_url)" in str(info.value)
    assert "after 2 attempts" in str(info.value)


@pytest.mark.parametrize("kind", ["silent", "refused"])
async def test_prm_at_a_bad_address_fails_naming_it_and_is_counted(kind):
    executor = RewardExecutor(RewardConfig(use_processes=False))
    try:
        with bad_address(kind) as addr:
            client = PRMClient(f"http://{addr}", timeout=1.0, executor=executor)
            try:
                with pytest.raises(RewardFailure) as info:
                    await asyncio.wait_for(client.score("1+1=", ["2"]), BOUND_S)
            finally:
                await client.close()
    finally:
        executor.shutdown()
    message = str(info.value)
    assert info.value.fn_name == f"prm@{addr}"
    if kind == "silent":
        assert info.value.kind == "timeout"
        assert f"no answer from http://{addr}/score within prm.timeout=1.0 s" in message
    else:
        assert info.value.kind == "raised"
        assert f"request to http://{addr}/score failed (prm.url)" in message
    assert executor.failures[info.value.kind] == 1  # counted under the error budget


# ---- the launcher's last line ---------------------------------------------------------------
TORCHRUN_TAIL = """\
E1202 00:14:35.041000 8928 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 8931) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/main/areal_like/launcher/torchrun_loopback.py", line 24, in <module>
    sys.exit(main())
  File "/usr/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
recipes.distill FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 8931)
============================================================
"""

BUDGET = ("reward function teacher failed 11 of its last 11 calls, more than the 10 that "
          "reward.max_failure_rate=0.05 over reward.failure_window=200 allows")

ONE_RANK = f"""\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/recipes/distill.py", line 69, in main
[rank0]:     rl.train(workflow, train_step)
[rank0]:   File "/work/main/areal_like/rollout/process.py", line 185, in _receive
[rank0]:     raise value
[rank0]: areal_like.rewards.failures.RewardBudgetExceeded: {BUDGET} (failures so far: raised 11). First failure: reward function teacher raised: ZeroDivisionError: boom
[rank0]: its traceback:
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/tests/reward_fns.py", line 3, in boom
[rank0]: ZeroDivisionError: boom
[rank0]: in the rollout controller process:
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/areal_like/rewards/budget.py", line 54, in record
[rank0]:     raise error
[rank0]: areal_like.rewards.failures.RewardBudgetExceeded: {BUDGET} (in the controller)
2026-12-02 00:14:31,118 areal_like.rollout.process: rollout controller (pid 9049) did not exit within 10 s; killing it
""" + TORCHRUN_TAIL

TWO_RANKS = f"""\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/work/main/areal_like/runtime/main_rank.py", line 79, in _follow
[rank1]:     raise MainRankError(status["message"])
2026-12-02 00:19:37,090 areal_like: rank 0 failed while waiting for a rollout batch: RewardBudgetExceeded: {BUDGET}
[rank1]: areal_like.runtime.main_rank.MainRankError: rank 0 failed while waiting for a rollout batch: RewardBudgetExceeded: {BUDGET} (rank 1)
Traceback (most recent call last):
  File "/work/main/areal_like/runtime/main_rank.py", line 57, in _lead
    result = future.result(timeout=interval)
areal_like.rewards.failures.RewardBudgetExceeded: {BUDGET} (logged)
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/areal_like/rollout/process.py", line 185, in _receive
[rank0]:     raise value
[rank0]: areal_like.rewards.failures.RewardBudgetExceeded: {BUDGET}
[rank0]: The above exception was the direct cause of the following exception:
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/areal_like/runtime/main_rank.py", line 66, in _lead
[rank0]:     raise MainRankError(message) from e
[rank0]: areal_like.runtime.main_rank.MainRankError: rank 0 failed while waiting for a rollout batch: RewardBudgetExceeded: {BUDGET} (rank 0)
W1202 00:19:38.832000 14956 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 15002 closing signal SIGTERM
rollout controller: signal 15 (the trainer exited)
Exception ignored in: <module 'threading' from '/usr/lib/python3.11/threading.py'>
Traceback (most recent call last):
  File "/usr/lib/python3.11/threading.py", line 1560, in _shutdown
    atexit_call()
  File "/work/main/areal_like/rollout/service.py", line 171, in on_term
    raise SystemExit(f"rollout controller: signal {{signum}} (the trainer exited)")
SystemExit: rollout controller: signal 15 (the trainer exited)
""" + TORCHRUN_TAIL


def _lines(text: str) -> list[str]:
    return [line + "\n" for line in text.split("\n")]


def test_trainer_error_names_an_exception_whatever_its_name():
    # one rank: the rank's own exception, not its embedded tracebacks nor torchrun's wrapper
    assert trainer_error(_lines(ONE_RANK)) == \
        f"areal_like.rewards.failures.RewardBudgetExceeded: {BUDGET} (failures so far: " \
        f"raised 11). First failure: reward function teacher raised: ZeroDivisionError: boom"
    # two ranks: rank 0's chained exception; not the controller's SystemExit Python ignored
    assert trainer_error(_lines(TWO_RANKS)) == \
        "areal_like.runtime.main_rank.MainRankError: rank 0 failed while waiting for a " \
        f"rollout batch: RewardBudgetExceeded: {BUDGET} (rank 0)"
    # a name without Error/Exception, with and without a message, untagged (one process)
    for last in ("KeyboardInterrupt", "pkg.mod.SomeName: the message",
                 "RewardBudgetExceeded: reward function f failed 3 of its last 3 calls"):
        text = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                f"    main()\n{last}\n")
        assert trainer_error(_lines(text + TORCHRUN_TAIL)) == last


def test_trainer_error_reads_interleaved_ranks_apart_and_falls_back():
    interleaved = """\
[rank0]: Traceback (most recent call last):
[rank1]: Traceback (most recent call last):
[rank0]:   File "/work/main/recipes/grpo.py", line 40, in main
[rank1]:   File "/work/main/areal_like/runtime/main_rank.py", line 79, in _follow
[rank0]: recipes.grpo.StepFailed: step 3
[rank1]:     raise MainRankError(status["message"])
[rank1]: areal_like.runtime.main_rank.MainRankError: rank 0 failed: StepFailed: step 3
"""
    assert trainer_error(_lines(interleaved + TORCHRUN_TAIL)) == \
        "areal_like.runtime.main_rank.MainRankError: rank 0 failed: StepFailed: step 3"
    # only torchrun's own wrapper: no cause of the trainer's
    assert trainer_error(_lines(TORCHRUN_TAIL)) == ""
    # the traceback's head cut off (only the last lines are kept): a name ending in Error
    assert trainer_error(["    raise ValueError('x')\n", "ValueError: x\n",
                          *_lines(TORCHRUN_TAIL)]) == "ValueError: x"
