"""The Ray launcher on a real Ray cluster of two nodes on this machine (`ray start`, loopback
node addresses): a GRPO run with its trainer ranks on both nodes equals the local launcher's at
eta = 0; a user's script runs as the trainer; a killed
server actor, Ctrl-C and an exception in the trainer stop the job with nothing left behind;
bad addresses and ports fail clearly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
from bad_run_helpers import FAULTS, failing_run_args, run_until_exit
from sglang_helpers import assert_same_records

from areal_like.utils.metrics_logger import read_metrics
from areal_like.utils.network import find_free_port
from areal_like.utils.start_costs import record_start

pytest.importorskip("ray")
# a Ray cluster and servers of its own (no session fleet): beside the serial lane
pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.beside_serial]

REPO = Path(__file__).resolve().parents[1]
NODE_IP = "127.0.0.2"  # loopback; Ray turns 127.0.0.1 into the machine's public address
WORKER_IP = "127.0.0.3"  # the second node's
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
# the head declares a node dead after 3 failed health checks 1 s apart (Ray's default: 5, 3 s
# apart); a check still times out only after Ray's 10 s, so a slow node is not taken for dead
NODE_HEALTH = dict(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
# servers fork their schedulers (~13 s less per start; the launcher is under test)
FORK = "server.fork_children=true"
SCRIPT = ["examples/user_script/train.py", "--config", "examples/user_script/config.yaml"]


def _free_port() -> int:
    """Below the ephemeral range (a port the OS picks may be taken by another process's
    outgoing connection before Ray binds it: seen once, Ray's GCS failing to start)."""
    return find_free_port(NODE_IP)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session
                pids.append(int(entry.name))
    return pids


def _start_ray_node(args: list[str], log: Path) -> subprocess.Popen:
    """`ray start --block ...` in a session of its own; returns once the node is up."""
    with open(log, "wb") as out:
        # `ray start`, through this Python (its scripts folder need not be on PATH)
        node = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                                 "--disable-usage-stats",
                                 f"--dashboard-agent-listen-port={_free_port()}", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=ENV | NODE_HEALTH,
                                start_new_session=True)
    started = time.monotonic()
    deadline = started + 300
    while b"will now block" not in log.read_bytes():
        assert node.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the Ray node did not start within 300 s: {args}"
        time.sleep(0.2)
    record_start("ray node", time.monotonic() - started, "head" if "--head" in args else "worker")
    return node


class RayCluster:
    """A Ray cluster of our own with two nodes on this machine (loopback addresses 127.0.0.2
    and 127.0.0.3), as `ray start` makes one on two machines. Each node's processes share a
    session. The head has 4 CPUs (room for a whole job after the second node is lost), the
    second node 2."""

    def __init__(self) -> None:
        port = _free_port()
        self.address = f"{NODE_IP}:{port}"
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray_", dir="/tmp"))  # short socket paths
        self.head = _start_ray_node(
            ["--head", f"--node-ip-address={NODE_IP}", f"--port={port}", "--num-cpus=4",
             f"--ray-client-server-port={_free_port()}", f"--dashboard-port={_free_port()}",
             "--include-dashboard=false", f"--temp-dir={self.temp_dir}"],
            self.temp_dir / "head.log")
        self.worker: subprocess.Popen | None = None

    def start_worker(self) -> None:
        self.worker = _start_ray_node(
            [f"--address={self.address}", f"--node-ip-address={WORKER_IP}", "--num-cpus=2"],
            self.temp_dir / "worker.log")

    def kill_worker(self, sessions: list[int] = ()) -> None:
        """SIGKILL every process of the second node at once (its Ray processes and the
        `sessions` its actors started), as a node failure looks from Ray."""
        assert self.worker is not None
        pids = [p for sid in (self.worker.pid, *sessions) for p in _session_pids(sid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                os.kill(pid, signal.SIGKILL)
        self.worker.wait(timeout=60)
        self.worker = None

    def stop(self) -> None:
        for node in (self.head, self.worker):
            if node is not None:
                os.killpg(node.pid, signal.SIGKILL)
                for pid in _session_pids(node.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                node.wait(timeout=60)


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster()
    try:
        cluster.start_worker()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ray_address(ray_cluster):
    if ray_cluster.worker is None:  # a test lost it
        ray_cluster.start_worker()
    return ray_cluster.address


def _run(launcher: str, args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"areal_like.launcher.{launcher}", *args],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def _common(model_dir: Path, log_dir: Path, steps: int) -> list[str]:
    return [f"model.path={model_dir}", f"logging.log_dir={log_dir}", f"total_train_steps={steps}",
            "launcher.n_trainer_procs=2", "gconfig.n_samples=4", "gconfig.max_new_tokens=4",
            "rollout.staleness.consumer_batch_size=4", "train_dataset.batch_size=4",
            "train_dataset.size=400", "valid_dataset.size=16", "evaluation.n_prompts=16",
            "evaluation.freq_steps=100", "rollout.staleness.max_head_offpolicyness=0",
            "logging.tensorboard=false", "logging.plot=false"]


def _compared(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if k.startswith(("actor/", "eval/", "user/")) or k in ("step", "loss", "grad_norm")}


def test_a_missing_cluster_is_named_with_the_command_that_starts_one(tiny_model_dir, tmp_path):
    address = f"{NODE_IP}:{_free_port()}"  # nobody listens there
    proc = _run("ray", ["grpo", f"model.path={tiny_model_dir}", f"launcher.ray_address={address}",
                        f"logging.log_dir={tmp_path}"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-2000:]
    assert f"no Ray cluster reachable at launcher.ray_address='{address}'" in out
    assert "ray start --head" in out


def test_grpo_on_ray_equals_the_local_launcher(ray_address, tiny_model_dir, tmp_path):
    """1 server + 2 trainer ranks as Ray actors, the ranks on different nodes and the weights
    sent over process groups, vs the local launcher's torchrun with disk weights on a
    server it starts, eta = 0."""
    on_ray = [f"launcher.ray_address={ray_address}", "launcher.placement_strategy=STRICT_SPREAD",
              "rollout.weights.transport=distributed", "server.n_servers=1", FORK]
    runs = {}
    for launcher, extra in (("ray", on_ray), ("local", ["server.n_servers=1", FORK])):
        log_dir = tmp_path / launcher
        proc = _run(launcher, ["grpo", *_common(tiny_model_dir, log_dir, 3), *extra])
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
        runs[launcher] = read_metrics(log_dir / "grpo_addition" / "trial0" / "metrics.jsonl")
    ray_run, local = runs["ray"], runs["local"]
    assert [r["step"] for r in ray_run] == [0, 1, 2, 3]
    assert_same_records([_compared(r) for r in ray_run], [_compared(r) for r in local])
    logs = tmp_path / "ray" / "grpo_addition" / "trial0" / "logs"
    actors = json.loads((logs / "actors.json").read_text())
    assert [a["name"] for a in actors] == ["server_0", "trainer_0", "trainer_1"]
    trainer_nodes = {(a["ip"], a["node_id"]) for a in actors if a["role"] == "trainer"}
    assert {ip for ip, _ in trainer_nodes} == {NODE_IP, WORKER_IP}  # across the two nodes
    server = actors[0]
    assert f"--host {server['ip']}" in (logs / "server_0.log").read_text()  # its node's address
    assert not (tmp_path / "ray" / "grpo_addition" / "trial0" / "weights").exists()
    assert "sglang.launch_server" in (logs / "server_0.log").read_text()
    assert "[rank1]" not in (logs / "trainer_1.log").read_text()  # no errors, but its output
    assert (logs / "trainer_0.log").read_text().count("[step 3]") >= 1


def _wait_for_step(proc: subprocess.Popen, metrics: Path, step: int,
                   key: str = "user/world_size", also: Callable[[], bool] = lambda: True,
                   out_path: Path | None = None) -> list[dict]:
    """The metric records once a record of `step` or later has `key` (and `also()` holds).
    `out_path`: where the job's output goes when it is not `proc.stdout`."""
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            out = out_path.read_text() if out_path else proc.stdout.read()
            raise AssertionError(f"the job exited ({proc.returncode}): {out[-4000:]}")
        assert time.monotonic() < deadline, f"no step {step} within 600 s"
        records = read_metrics(metrics) if metrics.exists() else []
        if any(r["step"] >= step and key in r for r in records) and also():
            return read_metrics(metrics)  # read after also(): it holds every record also() saw
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_all_gone(actors: list[dict], timeout: float = 120) -> None:
    """Every actor process, trainer/server process and their sessions are gone."""
    pids = [p for a in actors for p in (a["actor_pid"], a["pid"])]
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) or any(_session_pids(a["pid"]) for a in actors):
        assert time.monotonic() < deadline, [
            (a["name"], _alive(a["actor_pid"]), _session_pids(a["pid"])) for a in actors]
        time.sleep(0.2)


def _interrupted_long_job(ray_address: str, model_dir: Path, tmp_path: Path,
                          interrupt: Callable[[subprocess.Popen, list[dict]], None],
                          *overrides: str, step: int = 1
                          ) -> tuple[int, str, list[dict], list[dict]]:
    """Start the user's script as a job far too long to finish, wait for `step`,
    `interrupt(proc, actors)`; (exit code, output, metric records, actors.json)."""
    run = tmp_path / "user_script" / "trial0"
    proc = _run("ray", [*SCRIPT, *_common(model_dir, tmp_path, 100_000),
                        f"launcher.ray_address={ray_address}",
                        "rollout.weights.transport=distributed",  # whichever node the server is on
                        FORK, *overrides],
                start_new_session=True)
    try:
        records = _wait_for_step(proc, run / "metrics.jsonl", step)
        actors = json.loads((run / "logs" / "actors.json").read_text())
        interrupt(proc, actors)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    return proc.returncode, out, records, actors


def test_vllm_servers_on_ray_then_ctrl_c_stops_every_actor_and_process(ray_address,
                                                                       tiny_model_dir,
                                                                       tmp_path):
    """`server.backend=vllm` under the Ray launcher: the server actor starts vLLM from its
    venv, the user's own script runs as the trainer (its `user/*` stats are logged, world
    size 2) and its ranks on the two nodes send the server weights over process groups; then
    Ctrl-C stops the job and leaves no process behind."""
    from conftest import require_venv

    require_venv("vllm")
    code, out, records, actors = _interrupted_long_job(
        ray_address, tiny_model_dir, tmp_path, lambda proc, _: proc.send_signal(signal.SIGINT),
        "server.backend=vllm", step=2)
    run = tmp_path / "user_script" / "trial0"
    assert "vllm.entrypoints.openai.api_server" in (run / "logs" / "server_0.log").read_text()
    assert "vllm server(s)" in out
    # two updates broadcast to the vLLM server, and rollouts generated with them
    assert max(r.get("rollout/version", 0) for r in records) >= 1, records
    assert next(r for r in records if "user/world_size" in r)["user/world_size"] == 2
    assert code == 130, out[-4000:]
    assert "interrupted: stopped every actor" in out
    _assert_all_gone(actors)
    # the trainers' last output (after the signal) was collected too
    assert (run / "logs" / "trainer_0.log").stat().st_size > 0


def test_a_rendezvous_port_in_use_is_named(ray_address, tiny_model_dir, tmp_path):
    with socket.socket() as taken, socket.socket() as taken_too:  # on both nodes' addresses
        taken.bind((NODE_IP, 0))
        port = taken.getsockname()[1]
        taken_too.bind((WORKER_IP, port))
        taken.listen(1)
        taken_too.listen(1)
        proc = _run("ray", ["grpo", f"model.path={tiny_model_dir}", f"logging.log_dir={tmp_path}",
                            f"launcher.ray_address={ray_address}", f"launcher.master_port={port}",
                            "rollout.weights.transport=distributed"])
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    assert re.search(rf"launcher.master_port={port} is in use on 127\.0\.0\.[23]", out), out
    assert "server(s) on" not in out and "servers ready" not in out  # before any starts


def test_more_than_the_cluster_has_is_refused(ray_address, tiny_model_dir, tmp_path):
    proc = _run("ray", ["grpo", f"model.path={tiny_model_dir}", f"logging.log_dir={tmp_path}",
                        f"launcher.ray_address={ray_address}", "server.n_servers=3",
                        "launcher.cpus_per_server=2"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    assert "the job needs 7 CPU (3 server(s) x 2 + 1 trainer rank(s) x 1" in out
    assert "the Ray cluster has 6 CPU in all" in out


RAY_FAULTS = [f for f in FAULTS if f[0] in ("actor", "step")]  # at start-up; in a step


@pytest.mark.parametrize("where,overrides,needle", RAY_FAULTS, ids=[f[0] for f in RAY_FAULTS])
def test_an_exception_in_the_trainer_ends_the_job_with_it_last_on_screen(
        ray_address, tiny_model_dir, tmp_path, where, overrides, needle):
    """As test_bad_runs.py for the local launcher: within a bound of the exception's line,
    the job exits 1 with it last on screen, and no actor or process is left (its server's
    included)."""
    cmd = [sys.executable, "-m", "areal_like.launcher.ray", *failing_run_args(
        where, tiny_model_dir, tmp_path, [f"launcher.ray_address={ray_address}",
                                          "server.n_servers=1", FORK, *overrides])]
    code, lines = run_until_exit(cmd, ENV, needle)
    last = [line for line in lines if line.strip()][-1]
    assert code == 1 and "trainer_0 exited with code 1" in last and needle in last, last
    _assert_all_gone(json.loads(
        (tmp_path / "user_script" / "trial0" / "logs" / "actors.json").read_text()))


# -- runs that heal themselves: each fault once, the run ends rc 0 with every step logged once

HEAL_STEPS = 8


# (step, trainer restarts, fault(actors)): the fault once the trainer gang, restarted that
# many times, has logged that step or a later one
Fault = tuple[int, int, Callable[[list[dict]], None]]


def _healing_run(ray_address: str, model_dir: Path, tmp_path: Path, faults: list[Fault],
                 *overrides: str, steps: int = HEAL_STEPS, trainer_restarts: int = 1
                 ) -> tuple[str, list[dict], list[dict], list[dict]]:
    """A GRPO run at eta = 0 with checkpoints every 2 steps and one restart allowed for each
    server (`trainer_restarts` for the trainer gang); each `Fault` in turn, a checkpoint
    existing. (Output, metric records, episodes, actors.json at the end.)"""
    run = tmp_path / "grpo_addition" / "trial0"
    proc = _run("ray", ["grpo", *_common(model_dir, tmp_path, steps),
                        f"launcher.ray_address={ray_address}",
                        "rollout.weights.transport=distributed", FORK, "checkpoint.freq_steps=2",
                        "server.max_restarts=1",
                        f"launcher.max_trainer_restarts={trainer_restarts}", *overrides],
                start_new_session=True)
    try:
        for after, restarts, fault in faults:
            _wait_for_step(proc, run / "metrics.jsonl", after, key="loss",
                           also=lambda a=after, n=restarts: (run / "checkpoints" / "latest")
                           .exists() and any(r["step"] >= a and "loss" in r
                                             and r.get("launcher/trainer_restarts", 0) == n
                                             for r in read_metrics(run / "metrics.jsonl")))
            fault(json.loads((run / "logs" / "actors.json").read_text()))
        faulted = time.monotonic()
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-5000:]
    print(f"last fault to the end of the run: {time.monotonic() - faulted:.1f} s")
    print("\n".join(line for line in out.splitlines() if line.startswith("[launcher]")))
    records = read_metrics(run / "metrics.jsonl")
    episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    actors = json.loads((run / "logs" / "actors.json").read_text())
    # every step logged once, none trained twice
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    trained = [i for e in episodes if "trained" in e for i in e["trained"]]
    assert len(trained) == len(set(trained)) and len(trained) == steps * 4
    # the fleet served the trainer's current weights at every step (eta = 0: recomputed
    # log-probabilities equal the servers' up to float noise), before and after the faults
    gaps = [r["actor/gap/abs_log_diff/max"] for r in records if "actor/gap/abs_log_diff/max" in r]
    assert len(gaps) == steps and max(gaps) < 1e-3, gaps
    return out, records, episodes, actors


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_a_killed_server_actor_rejoins_then_past_its_restarts_stops_the_job(ray_address,
                                                                            tiny_model_dir,
                                                                            tmp_path):
    """SIGKILL of one of two servers' actor and of its server's processes at step 2 (a
    crash; alone, the actor's death ends its server a little later through
    PR_SET_PDEATHSIG): Ray restarts the actor in its bundle, the launcher starts its server
    again on its address, the trainer's client sends it the current weights at the next
    broadcast and routes to it again; the run goes on on the other server meanwhile, and
    nothing is lost. Killed again once back in service, its one restart
    (`server.max_restarts=1`) used up, it stops the job within a bound, naming the actor, its
    node and its last lines, and leaves no process behind. Between the two, `server.n_servers`
    is raised to 3 on the running job (`areal_like.launcher.ray_scale`): the third server
    joins with the current weights. (One run for all: the run must not end before the server
    rejoins, however long its restart takes.)"""
    run = tmp_path / "grpo_addition" / "trial0"
    metrics, actors_file = run / "metrics.jsonl", run / "logs" / "actors.json"
    out_path = tmp_path / "launcher.out"
    with open(out_path, "w") as out_file:  # a file, not a pipe nobody reads while it runs
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_like.launcher.ray", "grpo",
             *_common(tiny_model_dir, tmp_path, 100_000), f"launcher.ray_address={ray_address}",
             "rollout.weights.transport=distributed", FORK, "server.max_restarts=1",
             "launcher.n_trainer_procs=1", "server.n_servers=2"],
            cwd=REPO, env=ENV, stdout=out_file, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
    try:
        _wait_for_step(proc, metrics, 2, key="loss", out_path=out_path)
        killed = next(a for a in _read(actors_file) if a["name"] == "server_0")
        os.kill(killed["actor_pid"], signal.SIGKILL)
        os.killpg(killed["pid"], signal.SIGKILL)

        def restarted() -> dict:
            return next(a for a in _read(actors_file) if a["name"] == "server_0")

        # back in service (the trainer's records) and its restart written down (actors.json,
        # rewritten once the restarted actor reported its server's pid)
        records = _wait_for_step(proc, metrics, 3, key="loss", also=lambda: any(
            r.get("fleet/readmitted_total", 0) >= 1 and r.get("fleet/in_service") == 2
            for r in read_metrics(metrics)) and restarted()["restarts"] == 1,
            out_path=out_path)
        server = restarted()
        # server.n_servers raised on the running job: a third server, placed by Ray, joins
        # the trainer's fleet through the addresses file with the current weights
        scale = subprocess.run(
            [sys.executable, "-m", "areal_like.launcher.ray_scale", "grpo_addition/trial0",
             "server.n_servers=3", f"launcher.ray_address={ray_address}"],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
        assert scale.returncode == 0, scale.stdout + scale.stderr
        grown = _wait_for_step(proc, metrics, 1, key="loss", also=lambda: any(
            r.get("fleet/in_service") == 3 and r.get("fleet/added_total", 0) == 1
            for r in read_metrics(metrics)), out_path=out_path)
        joined = next(r["step"] for r in grown if r.get("fleet/in_service") == 3)
        _wait_for_step(proc, metrics, joined + 1, key="loss", out_path=out_path)
        os.kill(server["actor_pid"], signal.SIGKILL)  # its restart is used up
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    out = out_path.read_text()
    # 1. restarted, back where the trainer's client looks, with the current weights
    assert server["restarts"] == 1 and server["actor_pid"] != killed["actor_pid"]
    assert server["address"] == killed["address"]
    assert "restarting it (restart 1 of 1, server.max_restarts)" in out
    last = next(r for r in reversed(records) if r.get("fleet/in_service") == 2
                and r.get("fleet/readmitted_total", 0) >= 1)
    assert (last["launcher/server_restarts"], last["launcher/trainer_restarts"]) == (1, 0)
    assert last["rollout/failed_total"] == 0
    assert "adding 1 server(s) (server.n_servers=3 asked)" in out
    third = next(a for a in _read(actors_file) if a["name"] == "server_2")
    assert f"3 servers: {third['address']} added" in out
    # every step logged once, none trained twice; at eta = 0 the fleet served the trainer's
    # current weights at every step (recomputed log-probabilities equal the servers'), the
    # added server's requests too
    records = read_metrics(metrics)
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))
    episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    ids = [i for e in episodes if "trained" in e for i in e["trained"]]
    assert len(ids) == len(set(ids))
    gaps = [r["actor/gap/abs_log_diff/max"] for r in records if "actor/gap/abs_log_diff/max" in r]
    assert gaps and max(gaps) < 1e-3, gaps
    # 2. killed past its restarts: the job stops naming it
    assert proc.returncode == 1, out[-4000:]
    tail = out[out.index("launch failed:"):]
    assert f"server_0 (node {server['ip']}, host {socket.gethostname()}" in tail
    assert "died" in tail and "last lines of" in tail and "are used up" in tail
    _assert_all_gone(_read(actors_file))


def test_a_killed_trainer_rank_then_a_lost_node_are_healed(ray_cluster, ray_address,
                                                          tiny_model_dir, tmp_path):
    """Two faults in one run (2 servers, 2 trainer ranks, placement SPREAD: one of each on
    each node), each after a checkpoint:

    1. SIGKILL of trainer rank 1's process: the launcher stops rank 0, starts both ranks
       again with `checkpoint.recover=auto`, the kept fleet gets the checkpoint's weights;
    2. then every process of the second node SIGKILLed at once: Ray declares the node dead
       and places its bundles on the head, the launcher restarts what ran there (the server
       on the head's address, the trainer gang from the checkpoint, given the server's new
       address) and the run ends with everything on the head.

    Every step is logged and trained once across both."""
    def kill_rank_1(actors: list[dict]) -> None:
        os.kill(next(a for a in actors if a["name"] == "trainer_1")["pid"], signal.SIGKILL)

    lost = []

    def lose_the_second_node(actors: list[dict]) -> None:
        lost.extend(a for a in actors if a["ip"] == WORKER_IP)
        # SPREAD: one of each there
        assert sorted(a["role"] for a in lost) == ["server", "trainer"], actors
        ray_cluster.kill_worker([a["pid"] for a in lost])

    out, records, episodes, actors = _healing_run(
        ray_address, tiny_model_dir, tmp_path,
        [(3, 0, kill_rank_1), (5, 1, lose_the_second_node)],
        "server.n_servers=2", "launcher.placement_strategy=SPREAD", steps=10,
        trainer_restarts=2)
    # 1. the killed rank
    assert ("trainer_1 (node " in out and "its trainer process exited with signal SIGKILL; "
            "restarting the 2 trainer rank(s) from the last checkpoint (restart 1 of 2" in out)
    assert "checkpoint.recover=auto" in out  # the second start's command line
    assert any("restored" in e for e in episodes)  # the recovered run's start
    between = [r for r in records if r.get("launcher/trainer_restarts") == 1]
    assert between and all(r["launcher/server_restarts"] == 0 for r in between)
    # 2. the lost node
    assert {a["ip"] for a in actors} == {NODE_IP}
    server = next(a for a in lost if a["role"] == "server")
    moved = next(a for a in actors if a["name"] == server["name"])
    assert moved["address"].startswith(f"{NODE_IP}:") and moved["restarts"] == 1
    assert sorted(a["restarts"] for a in actors if a["role"] == "server") == [0, 1]
    assert [a["restarts"] for a in actors if a["role"] == "trainer"] == [2, 2]
    last = [r for r in records if "loss" in r][-1]
    assert (last["launcher/server_restarts"], last["launcher/trainer_restarts"]) == (1, 2)
    assert "from the last checkpoint (restart 2 of 2" in out
    # the recovered trainer was given the moved server's new address, and it served
    second_start = out[out.index("(restart 2 of 2, launcher.max_trainer_restarts)"):]
    assert moved["address"] in second_start.split("rollout.server_addrs=[", 1)[1].split("]")[0]
    assert last["fleet/in_service"] == 2
