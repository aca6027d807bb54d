"""The launchers' console: a real process printing metric lines beside a tqdm bar (stdout and
stderr in one pipe, as a launcher reads a trainer) comes out as clean lines."""

from __future__ import annotations

import codecs
import io
import os
import subprocess
import sys

from areal_like.launcher.console import Console, TidyLog

TRAINER_LIKE = r"""
import sys
from tqdm import tqdm
from areal_like.utils.metrics_logger import MetricsLogger
from areal_like.api.config import LoggingConfig
import tempfile
logger = MetricsLogger(LoggingConfig(log_dir=tempfile.mkdtemp(), tensorboard=False, plot=False))
print("starting", flush=True)
for step in tqdm(range(20), desc="train steps", file=sys.stderr, mininterval=0):
    logger.log(step + 1, {"reward": step / 20})
print("", flush=True)
print("done", flush=True)
"""


def _run_through(console: Console | TidyLog, close: bool = True) -> None:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER_LIKE], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    decoder = codecs.getincrementaldecoder("utf-8")()
    while chunk := os.read(proc.stdout.fileno(), 97):  # odd chunks: lines split anywhere
        text = decoder.decode(chunk)
        console.feed("trainer", text) if isinstance(console, Console) else console.write(text)
    assert proc.wait(timeout=120) == 0
    if close:
        console.close()


def test_metric_lines_and_bars_are_apart_off_a_terminal():
    out = io.StringIO()
    _run_through(Console(out, tty=False))
    lines = out.getvalue().split("\n")
    assert lines[-1] == ""  # ends with a newline
    lines = lines[:-1]
    assert all(line.startswith("[trainer] ") and line.strip() != "[trainer]" for line in lines)
    metric = [line for line in lines if "[step " in line]
    assert [int(line.split("[step ")[1].split("]")[0]) for line in metric] == list(range(1, 21))
    assert all("%|" not in line for line in metric)  # no bar glued to a metric line
    bars = [line for line in lines if "train steps:" in line]
    percents = [int(b.split("train steps:")[1].split("%")[0]) for b in bars]
    assert percents == sorted(percents) and percents[0] == 0 and percents[-1] == 100
    assert len(bars) == len({p // 10 for p in percents}) <= 11  # one line per 10 %
    assert lines[0] == "[trainer] starting" and lines[-1] == "[trainer] done"
    assert len(lines) == 2 + len(metric) + len(bars)  # nothing else, no fragments


def test_a_launchers_log_file_has_whole_lines_whatever_its_console_is(tmp_path):
    """On a terminal the launcher has its trainer draw a live tqdm bar; the trainer's log file
    (local and Ray launchers both write it with TidyLog) still gets whole, unprefixed lines:
    the bar once per 10 %, metric lines apart, and what came without a final newline."""
    path = tmp_path / "trainer.log"
    path.write_text("$ earlier run\n")  # appended to, as a resumed run's log is
    log = TidyLog(path)
    _run_through(log, close=False)
    log.write("last words without a newline")
    log.close()
    text = path.read_text()
    assert "\r" not in text and "\x1b" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert lines[:2] == ["$ earlier run", "starting"]
    assert lines[-2:] == ["done", "last words without a newline"]
    metric = [line for line in lines if line.startswith("[step ")]
    assert len(metric) == 20 and all("%|" not in line for line in metric)
    bars = [line for line in lines if line.startswith("train steps:")]
    assert 2 <= len(bars) == len({int(b.split(":")[1].split("%")[0]) // 10 for b in bars}) <= 11
    assert len(lines) == 4 + len(metric) + len(bars)


def test_on_a_terminal_the_bar_is_one_live_line():
    out = io.StringIO()
    _run_through(Console(out, tty=True))
    screen = out.getvalue()
    # what a terminal shows: "\r\033[K" erases the line; keep what survives on each line
    shown = [seg.split("\r\x1b[K")[-1] for seg in screen.split("\n")]
    assert shown[-1] == ""
    shown = shown[:-1]
    metric = [s for s in shown if s.startswith("[trainer] [step ")]
    assert len(metric) == 20 and all("%|" not in s for s in metric)
    bars = [s for s in shown if "train steps:" in s]
    assert len(bars) == 1 and "100%" in bars[0]  # only the final bar is left on screen
    assert shown.index(bars[0]) == len(shown) - 1 or shown[-1] == "[trainer] done"
    assert "[trainer] " not in [s for s in shown]  # no empty prefixed lines
    assert len(shown) == 2 + len(metric) + len(bars)  # nothing else, no fragments


RUN_LIKE = r"""
import tempfile
from areal_like.api.config import LoggingConfig
from areal_like.utils.metrics_logger import MetricsLogger
from areal_like.utils.progress import progress
for every in (0, 25):
    print(f"== console_every={every}", flush=True)
    logger = MetricsLogger(LoggingConfig(log_dir=tempfile.mkdtemp(), tensorboard=False,
                                         plot=False, console_every=every), total_steps=200)
    logger.log(0, {"reward": 0.0})
    for step in progress(range(200), "train steps"):
        logger.log(step + 1, {"reward": step / 200} | ({"eval/accuracy": 0.5} if step == 76
                                                       else {}))
"""


def _metric_steps(out: str) -> list[int]:
    return [int(line.split("[step ")[1].split("]")[0]) for line in out.splitlines()
            if line.startswith("[step ")]


def test_a_run_written_to_a_file_shows_tenths_and_metric_lines_at_an_interval(tmp_path):
    """A run's output redirected to a file (no terminal, no launcher): progress is a plain
    line per tenth, metric lines come every `console_every` steps (0: about 50 per run) plus
    the first, the last and an evaluation; nothing is redrawn with a carriage return."""
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k != "AREAL_LIKE_LIVE_BAR"}
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", RUN_LIKE], stdout=f, stderr=subprocess.STDOUT,
                       check=True, timeout=120, env=env)
    text = log.read_text()
    assert "\r" not in text
    _, auto, every25 = text.split("== console_every=")
    for out in (auto, every25):
        tenths = [line for line in out.splitlines() if line.startswith("train steps: ")]
        assert [line.split()[2] for line in tenths] == [
            f"{n}/200" for n in (1, 20, 40, 60, 80, 100, 120, 140, 160, 180, 200)]
        assert tenths[-1].startswith("train steps: 200/200 (100%), ")
    assert _metric_steps(auto) == sorted({0, 77, *range(4, 201, 4)})  # 200 // 50 = 4
    assert _metric_steps(every25) == [0, *range(25, 76, 25), 77, *range(100, 201, 25)]
