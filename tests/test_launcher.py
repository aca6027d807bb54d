"""The local launcher: fail-fast config errors, a dying server, and a real run killed and
recovered (one SGLang server + a torchrun trainer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_like.utils.cpus import split_cores
from areal_like.utils.metrics_logger import read_metrics

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


# runs that start servers of their own fork their schedulers (~13 s less per start; what is
# under test is the launcher, not SGLang's start mode)
FORK = "server.fork_children=true"


def _launch(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "areal_like.launcher.local", *args],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)


def test_typo_fails_before_any_process_starts():
    proc = _launch(["grpo", "actor.optimizer.lrr=1e-4"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "did you mean 'actor.optimizer.lr'" in out
    assert "starting" not in out and "[trainer]" not in out


@pytest.mark.sglang
@pytest.mark.parametrize("key", ["launcher.trainer_cpus", "rollout.controller.cpus",
                                 "server.cpus"])
def test_cpus_the_machine_lacks_fail_before_any_process_starts(key, tiny_model_dir):
    proc = _launch(["grpo", f"model.path={tiny_model_dir}", f"{key}=[4096]"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert f"{key}=[4096]: CPU [4096] not available to this process" in out
    assert "servers ready" not in out and "[trainer]" not in out


def test_split_cores_trainer_last_rollout_side_the_rest():
    assert split_cores({0, 1}, 1) == ([0], [1])
    assert split_cores({5, 2, 3}, 2) == ([2], [3, 5])
    assert split_cores({4}, 1) is None  # nothing left for the servers


def test_split_on_one_core_says_it_shares_them(tiny_model_dir):
    one = min(os.sched_getaffinity(0))
    # an explicit id the machine lacks still stops the launch after the allocation line
    proc = _launch(["grpo", f"model.path={tiny_model_dir}", "launcher.cpu_allocation=split",
                    "rollout.controller.cpus=[4096]"],
                   preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    out, _ = proc.communicate(timeout=120)
    assert "launcher.cpu_allocation=split: 1 core(s) leave none beside the trainer's 1" in out
    assert proc.returncode == 1 and "rollout.controller.cpus=[4096]: CPU [4096]" in out
    assert "starting" not in out


def test_unknown_recipe_is_named():
    proc = _launch(["grpoo"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "unknown recipe 'grpoo'" in out


@pytest.mark.sglang
@pytest.mark.e2e
def test_server_dying_at_start_stops_launch_with_log_tail(tmp_path, tiny_model_dir):
    """The trainer starts beside the servers; one that dies during start-up stops the run,
    its exit code and log tail the last thing on screen (the trainer, waiting for it, is
    stopped quietly)."""
    # one server (the main job starts two, which both die: which is named first is a race)
    proc = _launch(["grpo", f"model.path={tiny_model_dir}", f"logging.log_dir={tmp_path / 'runs'}",
                    "server.extra_args=[--max-running-requests,many]", "server.n_servers=1",
                    FORK])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out[-2000:]
    failure = out.index("launch failed: SGLang server 0")
    assert "exited with code 2 during start-up" in out[failure:]
    assert "Last lines of" in out[failure:] and "invalid int value: 'many'" in out[failure:]
    assert "[trainer]" not in out[failure:]  # nothing of the stopped trainer after it


def _run_args(model_dir: Path, log_dir: Path, steps: int) -> list[str]:
    return ["grpo", f"model.path={model_dir}", f"logging.log_dir={log_dir}",
            f"total_train_steps={steps}", "gconfig.n_samples=4", "gconfig.max_new_tokens=4",
            "rollout.staleness.consumer_batch_size=4", "train_dataset.batch_size=4",
            "train_dataset.size=400", "valid_dataset.size=16", "evaluation.n_prompts=16",
            "evaluation.freq_steps=100", "checkpoint.freq_steps=2", "checkpoint.recover=auto",
            "logging.tensorboard=false", "logging.plot=false"]


@pytest.mark.sglang
@pytest.mark.e2e
def test_last_server_dying_stops_the_run_naming_it_last_on_screen(tmp_path, tiny_model_dir):
    """With no restarts left, the launcher stops the run; its error (server, signal, log) is
    the last thing printed, the trainer's output after the decision goes to trainer.log."""
    from sglang_helpers import server_pgid

    log_dir = tmp_path / "runs"
    run_dir = log_dir / "grpo_addition" / "trial0"
    proc = _launch([*_run_args(tiny_model_dir, log_dir, steps=100_000), "server.max_restarts=0",
                    "server.n_servers=1", FORK],  # the main job runs two
                   start_new_session=True)
    out_lines: list[str] = []
    try:
        while not (run_dir / "metrics.jsonl").exists() or not any(
                json.loads(line)["step"] >= 1 for line in (run_dir / "metrics.jsonl").open()):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        while not out_lines or "servers ready" not in "".join(out_lines):
            out_lines.append(proc.stdout.readline())
        addr = "".join(out_lines).split("servers ready: ['")[1].split("'")[0]
        os.killpg(server_pgid(int(addr.rpartition(":")[2])), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode == 1, out[-3000:]
    tail = out[out.index("launch failed:"):]
    assert "0 of 1 SGLang servers alive, fewer than the minimum 1" in tail
    assert f"SGLang server 0 ({addr}) died: killed by SIGKILL" in tail
    assert "server_0.log" in tail and "trainer.log" in tail
    assert "[trainer]" not in tail and "Traceback" not in tail  # nothing printed after it
    assert (run_dir / "trainer.log").stat().st_size > 0


SCRIPT = ["examples/user_script/train.py", "--config", "examples/user_script/config.yaml"]


@pytest.mark.sglang
@pytest.mark.e2e
def test_local_launcher_runs_a_users_script(tiny_model_dir, tmp_path, fresh_fleet):
    """On the session fleet (servers pinned to cores: test_sglang_fleet.py)."""
    from sglang_helpers import attach_args

    # pinned as on a 2-core machine: the trainer and controller on one core
    cpus = sorted(os.sched_getaffinity(0))
    proc = _launch([*SCRIPT, f"model.path={tiny_model_dir}", f"logging.log_dir={tmp_path}",
                    "total_train_steps=2", "evaluation.freq_steps=100",
                    "logging.tensorboard=false", "logging.plot=false", *attach_args(fresh_fleet),
                    f"launcher.trainer_cpus=[{cpus[-1]}]", f"rollout.controller.cpus=[{cpus[-1]}]"])
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    if (os.cpu_count() or 1) > 1:  # pinned to one of several: the trainer says where it runs
        assert f"trainer rank 0 runs on CPUs [{cpus[-1]}]" in out, out[-4000:]
    records = read_metrics(tmp_path / "user_script" / "trial0" / "metrics.jsonl")
    stats = [r for r in records if "user/solved_fraction" in r]
    assert [r["step"] for r in stats] == [1, 2] and stats[0]["user/world_size"] == 1
    assert all(0.0 <= r["user/solved_fraction"] <= 1.0 for r in stats)


def test_a_script_without_its_config_is_refused(tmp_path):
    proc = _launch(["examples/user_script/train.py", "total_train_steps=2"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "a training script needs --config FILE" in out
    proc = _launch(["no/such/train.py", "--config", "x.yaml"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "training script 'no/such/train.py' does not exist" in out


@pytest.mark.parametrize("transport,shared_dir,refused", [
    ("disk", "", True), ("disk", "/shared/runs", False), ("distributed", "", False)])
def test_ray_disk_weights_need_the_servers_beside_rank_0_or_a_shared_dir(transport, shared_dir,
                                                                         refused):
    """Placement check of the Ray launcher (nodes as Ray reports them; no cluster needed)."""
    from areal_like.launcher.ray_cluster import check_weight_path
    from areal_like.launcher.ray_member import Member
    from areal_like.launcher.target import LaunchError
    from recipes.configs import GRPOConfig

    config = GRPOConfig()
    config.rollout.weights.transport, config.launcher.shared_dir = transport, shared_dir
    members = []
    for name, ip in (("server_0", "10.0.0.2"), ("server_1", "10.0.0.1"), ("trainer_0", "10.0.0.1")):
        members.append(Member(name, name.split("_")[0], None, Path(f"{name}.log")))
        members[-1].node = {"ip": ip, "node_id": f"id-{ip}", "hostname": f"host-{ip}"}
    if refused:
        with pytest.raises(LaunchError, match=r"server_0 \(node 10.0.0.2, host host-10.0.0.2.*"
                                              r"rollout.weights.transport=distributed.*shared_dir"):
            check_weight_path(config, members[:2], members[2])
    else:
        check_weight_path(config, members[:2], members[2])


def test_a_missing_teacher_stops_the_launch_before_any_server_starts(tmp_path, tiny_model_dir):
    proc = _launch(["distill", f"model.path={tiny_model_dir}",
                    f"teacher.model_path={tmp_path / 'no_teacher'}",
                    f"logging.log_dir={tmp_path / 'runs'}"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-2000:]  # a config error, found with the config's
    assert f"teacher.model_path='{tmp_path / 'no_teacher'}' is not an HF model folder" in out
    assert "starting" not in out  # no server was started


@pytest.mark.parametrize("argv, named", [
    ([], "usage:"),
    (["grpo_addition", "server.n_servers=3"], "usage:"),  # no <experiment>/<trial>
    (["grpo_addition/trial0", "server.n_servers=3", "server.backend=vllm"], "usage:"),
    (["grpo_addition/trial0", "server.n_servers=three"], "'three': not a whole number"),
])
def test_raising_a_ray_jobs_servers_refuses_bad_arguments_before_connecting(argv, named, capsys):
    from areal_like.launcher.ray_scale import main

    assert main(argv) == 2
    assert named in capsys.readouterr().err
