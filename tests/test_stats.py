"""Stats tracker: masked statistics, scopes, timings, distributed reduction, sinks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_like.api.config import LoggingConfig
from areal_like.utils.metrics_logger import MetricsLogger, read_jsonl, truncate_jsonl
from areal_like.utils.network import find_free_port
from areal_like.utils.stats_tracker import StatsTracker


def test_masked_stats_match_a_float64_reference():
    tracker = StatsTracker()
    gen = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(50, generator=gen), torch.rand(50, generator=gen) > 0.3)
              for _ in range(3)]
    with tracker.scope("actor"):
        for values, mask in chunks:
            tracker.denominator(n_tokens=mask)
            tracker.stat(denominator="n_tokens", x=values)
    out = tracker.export()
    selected = torch.cat([v[m] for v, m in chunks]).double()
    assert out["actor/n_tokens"] == sum(int(m.sum()) for _, m in chunks)
    assert out["actor/x/avg"] == pytest.approx(selected.mean().item(), abs=1e-6)
    assert out["actor/x/min"] == pytest.approx(selected.min().item(), abs=1e-6)
    assert out["actor/x/max"] == pytest.approx(selected.max().item(), abs=1e-6)
    assert tracker.export() == {}  # export resets


def test_scalars_counters_timings_and_nested_scopes():
    tracker = StatsTracker("root")
    with tracker.scope("a"), tracker.scope("b"):
        tracker.scalar(lr=1.0)
        tracker.scalar(lr=2.0)
        tracker.add(n=3)
        tracker.add(n=4)
        with tracker.record_timing("sleep"):
            time.sleep(0.02)
    out = tracker.export(reset=False)
    assert out["root/a/b/lr"] == 1.5
    assert out["root/a/b/n"] == 7
    assert out["timeperf/root/a/b/sleep"] >= 0.02
    assert tracker.export() == out


def test_errors_name_the_problem():
    tracker = StatsTracker()
    with pytest.raises(KeyError, match="denominator 'n'"):
        tracker.stat(denominator="n", x=torch.zeros(3))
    tracker.denominator(n=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="'x' has 4 elements"):
        tracker.stat(denominator="n", x=torch.zeros(4))
    with pytest.raises(TypeError, match="bool"):
        tracker.denominator(m=torch.ones(3))


@pytest.mark.torchrun
def test_reduction_across_two_torchrun_ranks(tmp_path):
    out_file = tmp_path / "stats.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
         str(Path(__file__).parent / "stats_worker.py"), str(out_file)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(out_file.read_text())
    kept = [1.0, 2.0, 3.0, 2.0, 6.0]  # rank 1's masked-out 4.0 must not count
    assert out["w/n"] == 5
    assert out["w/v/avg"] == pytest.approx(sum(kept) / 5)
    assert (out["w/v/min"], out["w/v/max"]) == (1.0, 6.0)
    assert out["w/s"] == 0.5 and out["w/c"] == 2.0
    assert out["w/only0"] == 5.0
    assert out["w/only1/avg"] == 8.0 and out["w/m"] == 2


def test_sinks_write_jsonl_tensorboard_and_console(tmp_path, capsys):
    config = LoggingConfig(log_dir=str(tmp_path), experiment_name="e", trial_name="t")
    logger = MetricsLogger(config, console_keys=["reward"])
    logger.log(1, {"reward": 0.25, "loss": 1.5})
    logger.log(2, {"reward": 0.5, "loss": float("nan")})
    logger.close()
    records = read_jsonl(tmp_path / "e" / "t" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward"] == 0.25 and records[0]["loss"] == 1.5
    console = capsys.readouterr().out
    assert "[step 2] reward=0.5" in console and "loss" not in console

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "e" / "t" / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward")] == [0.25, 0.5]
    assert [e.step for e in acc.Scalars("loss")] == [1]  # non-finite values are not plotted


def test_read_jsonl_names_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2"):
        read_jsonl(path)


def test_a_record_still_being_written_is_not_read_and_a_resume_drops_it(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "loss": 0.')  # a writer mid-record, or killed there
    assert read_jsonl(path) == [{"step": 1}]
    truncate_jsonl(path, keep_through=5)  # what a resumed run does before it appends
    assert path.read_text() == '{"step": 1}\n'


def test_fresh_run_starts_new_files_and_recovered_run_appends(tmp_path):
    config = LoggingConfig(log_dir=str(tmp_path), tensorboard=False, console=False)
    for fresh, expected_steps in ((True, [1]), (False, [1, 2]), (True, [3])):
        logger = MetricsLogger(config, fresh=fresh)
        logger.log(expected_steps[-1], {"x": 1.0})
        logger.close()
        assert [r["step"] for r in read_jsonl(logger.jsonl_path)] == expected_steps
