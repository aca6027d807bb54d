"""An exception anywhere in a run ends the whole run within seconds, with that exception as the
last thing on screen and a non-zero exit code: the local launcher runs a user's script
(`failing_trainer.py`) on the session's SGLang fleet, failing at each place a trainer can
fail. The bound starts when the exception is printed (an event), so a slow machine cannot
fail the test, and a run that never ends can."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sglang_helpers import attach_args

REPO = Path(__file__).resolve().parents[1]
EXIT_BOUND_S = 60.0  # from the exception on screen to the launcher's exit
START_BOUND_S = 600.0  # to the exception itself: start-up on a busy machine

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

FAULTS = [
    ("actor", ["algorithm.policy_loss=foo"], "unknown policy loss 'foo'"),
    ("batch", [], "injected fault: batch"),
    ("step", [], "injected fault: step"),
    ("evaluation", [], "injected fault: evaluation"),
    ("checkpoint", ["checkpoint.freq_steps=1"], "injected fault: checkpoint"),
]


def _run_until_exit(cmd: list[str], env: dict[str, str], needle: str) -> tuple[int, list[str]]:
    """Run `cmd`; once a line with `needle` appears, it must exit within EXIT_BOUND_S."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if needle in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(START_BOUND_S), f"{needle!r} never printed:\n{''.join(lines[-60:])}"
        try:
            code = proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end within {EXIT_BOUND_S} s of {needle!r}:\n"
                        + "".join(lines[-40:]))
        reader.join(timeout=10)
        return code, lines
    finally:
        if proc.poll() is None:  # SIGTERM: the launcher stops the trainer it started
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def _processes_naming(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if text in cmdline and entry.name != str(os.getpid()):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


@pytest.mark.parametrize("where,overrides,needle", FAULTS, ids=[f[0] for f in FAULTS])
def test_an_exception_anywhere_ends_the_run_with_it_last_on_screen(
        fresh_fleet, tiny_model_dir, tmp_path, where, overrides, needle):
    log_dir = tmp_path / f"runs_{where}"
    cmd = [sys.executable, "-m", "areal_like.launcher.local", "tests/failing_trainer.py",
           "--config", "examples/user_script/config.yaml", f"model.path={tiny_model_dir}",
           *attach_args(fresh_fleet), f"logging.log_dir={log_dir}",
           "total_train_steps=50", "gconfig.n_samples=2", "gconfig.max_new_tokens=4",
           "rollout.consumer_batch_size=2", "train_dataset.batch_size=1",
           "evaluation.n_prompts=2", "evaluation.freq_steps=100", "logging.tensorboard=false",
           "logging.plot=false", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FAIL_AT=where)
    code, lines = _run_until_exit(cmd, env, needle)
    last = [line for line in lines if line.strip()][-1]
    assert code != 0 and "trainer exited with code" in last and needle in last, last
    assert not _processes_naming(str(log_dir)), _processes_naming(str(log_dir))
