"""InferenceFleet start-up failures and lifetime, RemoteSGLangEngine failover: a server that dies at
start raises with its log tail; servers die with their parent; a server killed mid-batch loses
no request; an unreachable server fails within the timeout, naming the server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from config_helpers import rollout_config
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import make_engine, require_sglang_venv, revive_spare

from areal_like.api.config import ServerConfig
from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest
from areal_like.rollout import FleetUnavailableError
from areal_like.utils.network import HIGH_PORT, LOW_PORT
from engines.fleet.client import RemoteSGLangEngine
from engines.fleet.launch import InferenceFleet, find_free_port
from engines.server.errors import InferenceServerError, ServerStartError


def test_missing_venv_says_to_run_make_sglang(tiny_model_dir):
    fleet = InferenceFleet(tiny_model_dir, ServerConfig(venv="/nonexistent/sglang-venv"))
    with pytest.raises(ServerStartError, match="make sglang"):
        fleet.start()


async def test_unreachable_server_fails_with_a_clear_error():
    addr = f"127.0.0.1:{find_free_port()}"  # nothing listens there
    config = rollout_config(server_addrs=[addr], setup_timeout=1.0, request_timeout=5.0,
                           request_retries=2, retry_backoff=0.05, server_down_timeout=1.0,
                           health_check_interval=0.2)
    engine = RemoteSGLangEngine(config)
    try:
        with pytest.raises(InferenceServerError, match=rf"{addr} not healthy within 1 s"):
            engine.initialize()
    finally:
        engine.destroy()
    engine = RemoteSGLangEngine(config)
    engine.initialize(check_health=False)
    try:
        # its only server is down: the request waits server_down_timeout for it, then fails
        with pytest.raises(FleetUnavailableError) as info:
            await engine.agenerate(ModelRequest(input_ids=[1, 2, 3]))
        msg = str(info.value)
        assert "0 of 1 servers in service" in msg and f"{addr}: connection refused" in msg
        assert "Cannot connect to host" in msg and "server_down_timeout" in msg
    finally:
        engine.destroy()


@pytest.mark.sglang
@pytest.mark.e2e  # servers of its own
@pytest.mark.parametrize("forked", [False, True], ids=["exec", "forked-from-zygote"])
def test_server_dying_at_start_raises_with_its_log_tail(tiny_model_dir, tmp_path, forked):
    require_sglang_venv()
    broken = tmp_path / "broken_model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text('{"model_type": "qwen2", "architectures": [')
    fleet = InferenceFleet(broken, ServerConfig(startup_timeout=240, fork_children=forked),
                           log_dir=tmp_path / "logs")
    with pytest.raises(ServerStartError) as info:
        fleet.start()
    msg = str(info.value)
    assert "exited with code" in msg and "server_0.log" in msg
    assert "Traceback" in msg or "Error" in msg  # the log tail is in the message
    assert fleet.dead_servers() == [0]
    assert fleet.forks_servers == forked


@pytest.mark.sglang
@pytest.mark.e2e  # servers of its own
def test_server_whose_port_is_taken_fails_fast_with_its_log_tail(tiny_model_dir, tmp_path):
    """A port taken between our choice and the server's bind leaves SGLang's process alive
    but never healthy; the fleet sees the bind error in the log instead of waiting out
    `startup_timeout`."""
    require_sglang_venv()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        # a start-up timeout longer than the test's own: only the bind error can end it
        fleet = InferenceFleet(tiny_model_dir, ServerConfig(startup_timeout=3600,
                                                              fork_children=True),
                            base_port=port, log_dir=tmp_path / "logs")
        with pytest.raises(ServerStartError) as info:
            fleet.start()
    msg = str(info.value)
    assert "startup_timeout" not in msg, msg
    assert f"127.0.0.1:{port}" in msg and "server_0.log" in msg
    assert "address already in use" in msg.lower() or "exited with code" in msg


def test_free_ports_are_below_the_ephemeral_range_and_never_repeat():
    ports = [find_free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low > HIGH_PORT:  # otherwise find_free_port falls back to the OS's choice
        assert all(LOW_PORT <= p <= HIGH_PORT for p in ports)


@pytest.fixture(scope="module")
def _module_spare_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One extra server the failover test may kill (the session fleet stays intact). Its log
    dir is given relative to the working directory, as the default `logging.log_dir=runs`
    gives it: the servers' process-group store must still be found (it once waited forever).
    Its scheduler and detokenizer are forked (`fork_children`): niceness, CPUs and failover are
    checked on that start method too."""
    require_sglang_venv()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        config = ServerConfig(n_servers=1, context_length=1024, startup_timeout=300,
                              nice=3, cpus=[min(os.sched_getaffinity(0))],
                              fork_children=True)
        fleet = InferenceFleet(tiny_model_dir, config,
                               api_key=SGLANG_TEST_API_KEY, log_dir="runs/servers")
        fleet.start()
    try:
        assert fleet.log_dir.is_absolute() and (fleet.log_dir / "server_0.log").is_file()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def spare_server(_module_spare_server, tiny_model_dir: Path):
    """The module's extra server, alive and as new for each test (the failover test kills it,
    in whatever order the tests run)."""
    revive_spare(_module_spare_server, tiny_model_dir)
    return _module_spare_server


@pytest.mark.sglang
@pytest.mark.e2e  # servers of its own
def test_server_processes_run_at_the_configured_niceness(spare_server):
    # nice=3: the server and the scheduler/detokenizer it started, relative to ours
    server_pid = spare_server.processes[0].pid
    pids = _live_pids_in_group(server_pid)
    assert server_pid in pids and len(pids) >= 3, pids
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {
        pid: min(19, ours + 3) for pid in pids}
    # forked from the zygote (`fork_children`), which imported SGLang at the same niceness
    zygote = spare_server.zygote_pid
    assert zygote and int(Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1]
                          .split()[1]) == zygote
    assert os.getpriority(os.PRIO_PROCESS, zygote) == min(19, ours + 3)
    autogroup = Path(f"/proc/{server_pid}/autogroup")
    if autogroup.exists():  # its own session's scheduling group is niced too
        assert autogroup.read_text().split()[-2:] == ["nice", "3"]


@pytest.mark.sglang
@pytest.mark.e2e  # servers of its own
def test_server_processes_run_on_the_configured_cpus(spare_server):
    # cpus=[first allowed core]: the server and the scheduler/detokenizer it started
    pids = _live_pids_in_group(spare_server.processes[0].pid)
    assert len(pids) >= 3, pids
    assert {pid: os.sched_getaffinity(pid) for pid in pids} == {
        pid: set(spare_server.config.cpus) for pid in pids}


@pytest.fixture
def victim_server(request: pytest.FixtureRequest, any_fleet, tiny_model_dir: Path):
    """A server of `any_fleet`'s backend that the test may kill, alive and as new."""
    if any_fleet.config.backend == "sglang":
        return request.getfixturevalue("spare_server")
    fleet = request.getfixturevalue(f"_session_{any_fleet.config.backend}_spare")
    revive_spare(fleet, tiny_model_dir)
    return fleet


@pytest.mark.e2e  # servers of its own
async def test_killing_a_server_mid_batch_loses_no_request(any_fleet, victim_server):
    spare_server = victim_server
    survivor, victim = any_fleet.addresses[0], spare_server.addresses[0]
    engine = make_engine([survivor, victim], SGLANG_TEST_API_KEY, request_retries=3,
                         retry_backoff=0.2, backend=any_fleet.config.backend)
    try:
        n_tokens = 300
        g = GenerationHyperparameters(max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                                      temperature=1.0)
        tasks = [asyncio.ensure_future(engine.agenerate(ModelRequest(input_ids=[5, i + 1],
                                                                     gconfig=g)))
                 for i in range(12)]
        while engine.inflight()[victim] == 0:
            await asyncio.sleep(0.01)
        # frozen, the victim finishes nothing more, however fast the machine: every request
        # it holds now must be retried
        spare_server.kill_server(0, signal.SIGSTOP)
        placed = engine.inflight()
        spare_server.kill_server(0)  # SIGKILL: the server and its scheduler vanish at once
        resps = await asyncio.gather(*tasks)
        assert spare_server.dead_servers() == [0]
        assert placed[victim] >= 1 and all(t.done() for t in tasks)
        for r in resps:  # every request finished in full
            assert r.stop_reason == "length" and len(r.output_tokens) == n_tokens
        # The victim's unfinished requests were retried on the survivor.
        assert sum(r.metadata["server"] == survivor for r in resps) > placed[survivor]
    finally:
        engine.destroy()


_ORPHAN_SCRIPT = """
import sys, threading, time
from areal_like.api.config import ServerConfig
from engines.fleet.launch import InferenceFleet

fleet = InferenceFleet(sys.argv[1], ServerConfig(startup_timeout=300,
                                                 fork_children=sys.argv[3] == "forked"),
                       log_dir=sys.argv[2])

def report():  # the server's pid (forked from the zygote: once the zygote has forked it)
    while not fleet.processes or fleet.processes[0].pid is None:
        time.sleep(0.05)
    zygote = fleet.zygote_pid or fleet.processes[0].pid
    print(fleet.processes[0].pid, zygote, flush=True)

threading.Thread(target=report, daemon=True).start()
fleet.start()
"""


def _live_pids_in_group(pgid: int) -> list[int]:
    """Processes (not zombies) whose process group is `pgid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.sglang
@pytest.mark.e2e  # servers of its own
@pytest.mark.parametrize("start", ["exec", "forked"])
def test_servers_die_with_the_process_that_started_them(tiny_model_dir, tmp_path, start):
    """Started by command, or forked from the SGLang zygote (which dies with the process that
    started it, and the servers with the zygote)."""
    require_sglang_venv()
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny_model_dir),
                               str(tmp_path), start], stdout=subprocess.PIPE, text=True)
    try:
        server_pid, zygote_pid = map(int, parent.stdout.readline().split())  # starting up
        assert _live_pids_in_group(server_pid)
        assert (zygote_pid != server_pid) == (start == "forked")
    finally:
        parent.kill()  # SIGKILL: no cleanup code of the parent runs
        parent.wait(timeout=30)
    deadline = time.monotonic() + 60
    while ((_live_pids_in_group(server_pid) or _live_pids_in_group(zygote_pid))
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert _live_pids_in_group(server_pid) == [], "server outlived its parent (PR_SET_PDEATHSIG)"
    assert _live_pids_in_group(zygote_pid) == [], "the zygote outlived its parent"


def test_the_zygote_imports_only_the_model_modules_of_the_served_architectures(tmp_path):
    """Which of SGLang's model modules the zygote skips (SGLANG_DISABLED_MODEL_ARCHS): those
    whose EntryClass names none of the served architectures; none when no module names one
    (the real fleets of the suite serve Qwen2, Qwen3-MoE and Qwen2-VL through it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines/sglang/shim"))
    try:
        from areal_like_sglang_zygote import unserved_model_modules
    finally:
        sys.path.pop(0)
    models = tmp_path / "models"
    models.mkdir()
    (models / "qwen2.py").write_text("class Qwen2ForCausalLM: ...\nEntryClass = Qwen2ForCausalLM\n")
    (models / "llava.py").write_text("EntryClass = [\n    LlavaLlamaForCausalLM,\n"
                                     "    LlavaQwenForCausalLM,\n]\n")
    (models / "qwen2_vl.py").write_text("EntryClass = [Qwen2VLForConditionalGeneration]\n")
    (models / "utils.py").write_text("def helper(): ...\n")  # no model class
    (models / "__init__.py").write_text("")
    assert unserved_model_modules(str(models), ["Qwen2ForCausalLM"]) == ["llava", "qwen2_vl"]
    assert unserved_model_modules(str(models), ["LlavaQwenForCausalLM"]) == ["qwen2", "qwen2_vl"]
    assert unserved_model_modules(str(models), ["Qwen2ForCausalLM", "Qwen2VLForConditional"
                                                "Generation"]) == ["llava"]
    assert unserved_model_modules(str(models), ["NoSuchArchitecture"]) == []
