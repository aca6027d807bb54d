"""The main job in miniature, through the launcher: SFT warm start, then asynchronous GRPO on
two real SGLang servers, one of which is killed (SIGKILL) mid-run: the launcher restarts it,
the trainer takes it out of service and back with the current weights, no episode is lost, and
held-out greedy accuracy and training reward still rise. Every socket of the running job
listens on 127.0.0.1 only. 50 steps: from its 0.715-0.75 warm start GRPO reaches 0.84-0.94 in
30 steps and 0.90-0.98 in 50 (docs/benchmarks.md; 0.75 -> 0.84 once in CI at 30): the test
needs +0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sglang_helpers import listening_sockets, processes_running_module, server_pgid
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_like.utils.metrics_logger import read_metrics

# servers and torchrun jobs of its own only (no session fleet): beside the serial lane
pytestmark = [pytest.mark.beside_serial]

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _launch(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "areal_like.launcher.local", *args], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.sglang
@pytest.mark.e2e
def test_async_grpo_after_sft_raises_accuracy(tiny_model_dir, tmp_path):
    logs = tmp_path / "runs"
    _launch("sft", f"model.path={tiny_model_dir}", f"logging.log_dir={logs}",
            "logging.tensorboard=false", "evaluation.freq_steps=100")
    warm = logs / "sft_addition" / "trial0" / "final"
    run_dir = logs / "grpo_addition" / "trial0"
    out_path = tmp_path / "grpo.out"
    with open(out_path, "w") as out_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_like.launcher.local", "grpo", f"model.path={warm}",
             f"logging.log_dir={logs}", "server.n_servers=2", "total_train_steps=50",
             "evaluation.freq_steps=50", "evaluation.n_prompts=100", "checkpoint.freq_steps=0",
             "logging.tensorboard=false",
             "server.fork_children=true"],  # ~13 s less per server start, the restart too
            cwd=REPO, env=ENV, stdout=out_file, stderr=subprocess.STDOUT)
        try:
            # kill server 1 once step 10 is logged, however fast the machine is
            _wait_until(proc, out_path, lambda: _logged_step(run_dir / "metrics.jsonl", 10),
                        "step 10 logged")
            # every socket the job listens on (servers, their schedulers, the rendezvous,
            # gloo) is on loopback
            sockets = listening_sockets(proc.pid)
            assert sockets and {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
            ports = re.search(r"servers ready: \['[\d.]+:(\d+)', '[\d.]+:(\d+)'\]",
                              out_path.read_text()).groups()
            os.killpg(server_pgid(int(ports[1])), signal.SIGKILL)  # its own process group
            _wait_until(proc, out_path, _printed(out_path, f":{ports[1]} taken out of service"),
                        "server 1 taken out of service")
            # hold the trainer until the restarted server is back in service: the restart's
            # duration, not the machine's speed, decides
            trainer = processes_running_module(proc.pid, "recipes.grpo")
            assert len(trainer) == 1, trainer
            _stop_until_readmitted(proc, out_path, trainer[0], run_dir, ports[1])
            proc.wait(timeout=1200)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = out_path.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert "SGLang server 1" in out and "killed by SIGKILL" in out
    assert "restarting SGLang server 1 (restart 1 of 3)" in out
    # both servers, and the restart, forked from one interpreter that imported SGLang once
    zygotes = {m for i in (0, 1) for m in re.findall(
        r"forked from the SGLang zygote, pid (\d+)", (run_dir / f"servers/server_{i}.log")
        .read_text())}
    assert len(zygotes) == 1, zygotes
    assert "eval/accuracy:" in out and "curves:" in out
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(51))  # training went on, every step
    assert records[-1]["fleet/taken_out_total"] >= 1
    assert records[-1]["fleet/readmitted_total"] >= 1  # back with the current weights
    assert records[-1]["fleet/in_service"] == 2
    assert records[-1]["rollout/failed_total"] == 0  # no episode lost
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(accuracy) == 2
    assert accuracy[1] >= accuracy[0] + 0.1, accuracy
    rewards = [r["actor/task_reward/avg"] for r in records if "actor/task_reward/avg" in r]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5, rewards
    assert max(r.get("rollout/staleness_max", 0) for r in records) <= 2  # eta = 2
    # the trained model: an HF folder with the fleet's last weights, tokenizer, chat template
    final = run_dir / "final"
    assert f"final model: {final}" in out
    _assert_same_weights(final, run_dir / "weights" / "v50")
    assert AutoTokenizer.from_pretrained(final).chat_template
    assert AutoModelForCausalLM.from_pretrained(final).num_parameters() > 0
    # evaluated on its own (docs/quickstart.md's `areal-like eval`, the run folder's config,
    # one server of its own), it scores what the run's last evaluation logged (the same
    # weights, items and verifier; deterministic greedy decoding)
    out_json = tmp_path / "final.eval.json"
    proc = subprocess.run([sys.executable, "-m", "areal_like.cli", "eval", str(final),
                           "server.n_servers=1", "server.fork_children=true", "--out",
                           str(out_json)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evaluated = json.loads(out_json.read_text())
    assert evaluated["eval/n"] == 100 and evaluated["eval/accuracy"] == accuracy[-1], evaluated
    assert evaluated["config"] == str(run_dir / "config.yaml"), evaluated
    assert f"eval/accuracy: {accuracy[-1]:.4f}" in proc.stdout


def _stop_until_readmitted(proc: subprocess.Popen, out_path: Path, trainer: int,
                           run_dir: Path, port: str) -> None:
    """SIGSTOP the trainer until `port` is back in service. A stop that lands inside a weight
    update holds the fleet (no readmission until the update ends): the rollout process says
    so, and the trainer goes on to its next step and is stopped again."""
    back = _printed(out_path, f":{port} back in service")
    while True:
        since = out_path.stat().st_size
        os.kill(trainer, signal.SIGSTOP)
        try:
            held = _printed(out_path, "the fleet has been held", since)
            _wait_until(proc, out_path, lambda held=held: back() or held(),
                        "server 1 back in service (or the fleet held)")
        finally:
            os.kill(trainer, signal.SIGCONT)
        if back():
            return
        step = _last_step(run_dir / "metrics.jsonl")
        _wait_until(proc, out_path,
                    lambda step=step: back() or _last_step(run_dir / "metrics.jsonl") > step,
                    f"a step after {step} logged")
        if back():
            return


def _assert_same_weights(folder: Path, reference: Path) -> None:
    ours, theirs = load_file(folder / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def _last_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=-1)


def _logged_step(path: Path, step: int) -> bool:
    return _last_step(path) >= step


def _printed(out_path: Path, text: str, since: int = 0) -> Callable[[], bool]:
    return lambda: text.encode() in out_path.read_bytes()[since:]


def _wait_until(proc: subprocess.Popen, out_path: Path, done: Callable[[], bool],
                what: str) -> None:
    deadline = time.monotonic() + 1200
    while not done():
        assert proc.poll() is None, f"exited before {what}: " + out_path.read_text()[-4000:]
        assert time.monotonic() < deadline, f"not {what} within 1200 s"
        time.sleep(0.2)
