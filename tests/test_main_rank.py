"""Rank 0's long phases under a real 2-rank torchrun job against a real SGLang server: they may
outlast the other ranks' collective timeout, and a failure there ends every rank alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import require_sglang_venv

from areal_like.api.config import ServerConfig
from areal_like.runtime.main_rank import heartbeat_interval
from areal_like.utils.network import find_free_port
from engines.fleet.launch import InferenceFleet

pytestmark = [pytest.mark.torchrun, pytest.mark.e2e]
COLLECTIVE_TIMEOUT_S = 4.0  # heartbeats every 0.8 s: 3.2 s of slack on a busy machine
LAUNCH_TIMEOUT_S = 600  # a hang is what this catches; the work itself takes seconds


def _launch(mode: str, out: Path, **args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()),
           str(Path(__file__).with_name("main_rank_worker.py")), "--mode", mode,
           "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--out", str(out)]
    for key, value in args.items():
        cmd += [f"--{key.replace('_', '-')}", value]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _reports(out: Path, log: str) -> list[dict]:
    paths = [out / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in paths), f"a rank wrote no report:\n{log[-6000:]}"
    return [json.loads(p.read_text()) for p in paths]


def test_without_heartbeats_a_long_rank0_phase_kills_the_waiting_rank(tmp_path):
    """The control: the collective timeout is real, so the heartbeats below are needed."""
    proc = _launch("unguarded", tmp_path)
    log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    waiting = _reports(tmp_path, log)[1]
    assert "error" in waiting, log[-3000:]
    assert "timed out" in waiting["error"].lower() or "timeout" in waiting["error"].lower()


def test_rank0_may_wait_for_rollouts_longer_than_the_collective_timeout(sglang_fleet,
                                                                       tiny_model_dir,
                                                                       tmp_path):
    assert heartbeat_interval(COLLECTIVE_TIMEOUT_S) < COLLECTIVE_TIMEOUT_S
    proc = _launch("slow", tmp_path, addr=sglang_fleet.addresses[0],
                   api_key=SGLANG_TEST_API_KEY, model=str(tiny_model_dir))
    log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, log[-6000:]
    main, waiting = _reports(tmp_path, log)
    # four rewards of one timeout each, one at a time: the wait outlasted the timeout 4x
    assert main["phase_s"] >= 4 * COLLECTIVE_TIMEOUT_S
    assert waiting["phase_s"] >= 4 * COLLECTIVE_TIMEOUT_S
    assert main["rows"] == waiting["rows"] == 4


def test_server_death_on_rank0_ends_every_rank_with_the_same_error(tiny_model_dir,
                                                                   tmp_path_factory):
    require_sglang_venv()
    out = tmp_path_factory.mktemp("server_dies")
    fleet = InferenceFleet(tiny_model_dir, ServerConfig(n_servers=1, context_length=1024,
                                                          fork_children=True),
                        api_key=SGLANG_TEST_API_KEY, log_dir=tmp_path_factory.mktemp("logs"))
    with fleet:
        proc = _launch("server_dies", out, addr=fleet.addresses[0],
                       api_key=SGLANG_TEST_API_KEY, model=str(tiny_model_dir))
        try:
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            while not (out / "first_batch_done").exists():  # rollouts are flowing
                assert proc.poll() is None, proc.communicate()[0][-6000:]
                assert time.monotonic() < deadline, "no first batch"
                time.sleep(0.05)
            fleet.kill_server(0)
            killed_at = time.time()
            log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 0
    main, waiting = _reports(out, log)
    assert main.get("error") and main["error"] == waiting.get("error"), log[-6000:]
    assert main["error"].startswith("MainRankError: rank 0 failed while waiting for rollouts")
    assert fleet.addresses[0] in main["error"]  # names the server that went away
    # rank 1 learned of it from rank 0 (a collective timeout would read differently)
    assert main["error_at"] > killed_at
