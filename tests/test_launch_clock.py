"""The launch clock behind the start-up and shut-down lines: a process's start read from
/proc, the launcher's start handed down to the processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from areal_like.utils.launch_clock import LAUNCHED_AT_ENV, Phases, launched_at

CHILD = ("from areal_like.utils.launch_clock import launched_at, process_started_at; "
         "print(process_started_at(), launched_at())")


def test_a_childs_start_and_the_launch_it_was_handed(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != LAUNCHED_AT_ENV}
    before = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    started, launch = float(out[0]), float(out[1])
    # /proc counts in clock ticks (10 ms); the process began after `before`, before its import
    assert before - 0.05 <= started <= before + 5.0 and abs(launch - started) < 0.02
    out = subprocess.run([sys.executable, "-c", CHILD], env={**env, LAUNCHED_AT_ENV: "1234.5"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert float(out[1]) == 1234.5 and float(out[0]) > 1234.5


def test_phases_count_from_the_launch(monkeypatch):
    monkeypatch.setenv(LAUNCHED_AT_ENV, repr(time.time() - 10.0))
    phases = Phases("last step", from_process_start=False)
    phases.mark("closed")
    names = [part.rsplit(" ", 1) for part in phases.summary().split(", ")]
    assert [n for n, _ in names] == ["last step", "closed"]
    assert all(10.0 <= float(at) < 10.0 + 60 for _, at in names)
    assert abs(launched_at() - (time.time() - 10.0)) < 60
