"""The start-cost log behind the test command's closing table: starts appended by many
processes, summed by kind; nothing written where the variable is unset."""

from __future__ import annotations

import os
import subprocess
import sys

from areal_like.utils.start_costs import START_LOG_ENV, record_start, summarize

RECORD = ("from areal_like.utils.start_costs import record_start; "
          "[record_start(k, s) for k, s in [('sglang server', 12.5), ('trainer', 8.0)]]")


def test_starts_from_several_processes_are_summed_by_kind(tmp_path, monkeypatch):
    log = tmp_path / "starts.jsonl"
    env = dict(os.environ, **{START_LOG_ENV: str(log)})
    procs = [subprocess.Popen([sys.executable, "-c", RECORD], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    monkeypatch.setenv(START_LOG_ENV, str(log))
    record_start("ray node", 3.25, "head")
    with open(log, "a") as f:
        f.write('{"kind": "sglang server", "sec')  # a writer killed mid-line: skipped
    totals = {t.kind: (t.count, t.seconds) for t in summarize(log)}
    assert totals == {"sglang server": (3, 37.5), "trainer": (3, 24.0), "ray node": (1, 3.25)}
    assert [t.kind for t in summarize(log)] == ["sglang server", "trainer", "ray node"]


def test_nothing_is_written_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(START_LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_start("sglang server", 1.0)
    assert list(tmp_path.iterdir()) == [] and summarize(tmp_path / "none.jsonl") == []


def test_an_unwritable_log_is_said_once_and_the_start_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(START_LOG_ENV, str(tmp_path / "no" / "such" / "dir" / "log.jsonl"))
    monkeypatch.setattr("areal_like.utils.start_costs._warned", False)
    record_start("trainer", 1.0)
    record_start("trainer", 2.0)
    err = capsys.readouterr().err
    assert err.count("[start costs] cannot write") == 1 and START_LOG_ENV in err
