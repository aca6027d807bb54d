"""Running a training job that must fail: the injected faults of `failing_trainer.py`, and a
watch that bounds the time from the error on screen to the launcher's exit (an event, not a
machine-speed guess). Shared by the local and Ray launchers' tests."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXIT_BOUND_S = 60.0  # from the exception on screen to the launcher's exit
START_BOUND_S = 600.0  # to the exception itself: start-up on a busy machine

FAULTS = [
    ("actor", [], "injected fault: actor"),
    ("batch", [], "injected fault: batch"),
    ("step", [], "injected fault: step"),
    ("evaluation", [], "injected fault: evaluation"),
    ("checkpoint", ["checkpoint.freq_steps=1"], "injected fault: checkpoint"),
]


def run_until_exit(cmd: list[str], env: dict[str, str], needle: str) -> tuple[int, list[str]]:
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
        deadline = time.monotonic() + START_BOUND_S
        while not seen.wait(1.0):  # the run may also end without it: say so at once
            if proc.poll() is not None:
                reader.join(timeout=10)
                if seen.is_set():
                    break
                pytest.fail(f"the run exited with code {proc.returncode} without {needle!r}:\n"
                            + "".join(lines[-60:]))
            assert time.monotonic() < deadline, \
                f"{needle!r} never printed:\n{''.join(lines[-60:])}"
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


def processes_naming(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if text in cmdline and entry.name != str(os.getpid()):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def failing_run_args(where: str, model_dir: Path, log_dir: Path, overrides: list[str]
                     ) -> list[str]:
    """`failing_trainer.py` as a short GRPO run failing at `where` (the launcher's arguments
    after its name; FAIL_AT reaches the trainer through the config, as on Ray it must)."""
    return ["tests/failing_trainer.py", "--config", "examples/user_script/config.yaml",
            f"launcher.trainer_env.FAIL_AT={where}",
            f"model.path={model_dir}", f"logging.log_dir={log_dir}", "total_train_steps=50",
            "gconfig.n_samples=2", "gconfig.max_new_tokens=4", "rollout.staleness.consumer_batch_size=2",
            "train_dataset.batch_size=1", "evaluation.n_prompts=2", "evaluation.freq_steps=100",
            "logging.tensorboard=false", "logging.plot=false", *overrides]
