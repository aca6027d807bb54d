"""Shared fixtures: tiny offline models built once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Co-located processes on a small machine: one thread each (see DESIGN.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


# What a fixture costs marks every test that uses it (see docs/contributing.md): `sglang`
# needs the SGLang venv, `vllm` the vLLM one, `e2e` is left out of the quick tier (`pytest -m "not e2e"`).
FIXTURE_MARKERS = {
    "sglang_fleet": ("sglang",),
    "fresh_fleet": ("sglang", "e2e"),  # a run attached to the fleet
    "spare": ("sglang", "e2e"),  # a server of its own, killed by the test
    "spare_server": ("sglang", "e2e"),
    "vllm_fleet": ("vllm",),
    "any_spare": ("e2e",),  # and the backend's marker, from `any_fleet`'s parameter
    "ray_address": ("e2e",),  # a Ray cluster of its own
}
QUICK_TIER_LIMIT_S = 20.0  # a quick-tier test slower than this is named at the end
# Two lanes (`scripts/test.sh` runs pytest-xdist, `-n 2 --dist loadgroup`): a test with one of
# these markers starts or talks to servers, torchrun jobs or Ray, shares the session's fleets
# and module servers, and often both cores: all of them run in one worker, in collection order.
# The in-process tests run beside them in the other worker, a module at a time: alone they
# leave one core idle (docs/contributing.md, "Two lanes").
SERIAL_LANE_MARKERS = ("sglang", "vllm", "e2e", "torchrun")
SERIAL_LANE = "serial"
# ... except a module marked `beside_serial`: it starts every server it uses itself (no session
# fleet) and mostly waits on them, so it runs as a work unit of its own in the other worker,
# beside the serial lane, once that worker's in-process tests are done
BESIDE_LANE = "beside"


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the `xdist_group` marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            for marker in FIXTURE_MARKERS.get(fixture, ()):
                item.add_marker(marker)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "any_fleet" in params:  # sglang or vllm: the venv that test needs
            item.add_marker(params["any_fleet"])
        if item.get_closest_marker("beside_serial"):
            item.add_marker(pytest.mark.xdist_group(BESIDE_LANE))
        elif any(item.get_closest_marker(name) for name in SERIAL_LANE_MARKERS):
            item.add_marker(pytest.mark.xdist_group(SERIAL_LANE))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without the plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 (xdist's types)
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class LaneScheduling(LoadGroupScheduling):
        """The serial lane is one work unit; every other test goes with its module, so a
        module-scoped fixture is built once."""

        def _split_scope(self, nodeid: str) -> str:
            group = super()._split_scope(nodeid)  # xdist's: the `@group` name, else the test
            return group if group != nodeid else nodeid.split("::", 1)[0]

    return LaneScheduling(config, log)


_slow_in_quick_tier: list[tuple[str, float]] = []
_seconds_by_file: dict[str, float] = {}  # setup + call + teardown of its tests
# per xdist worker: its tests' seconds, and the first start and last end it reported (its
# wall time); the slower lane is the suite's critical path
_seconds_by_lane: dict[str, float] = {}
_span_by_lane: dict[str, tuple[float, float]] = {}
COST_TABLE_FILES = 25  # the files shown in the cost table, most seconds first
COST_TABLE_MIN_FILES = 4  # fewer files run: no table


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    slow = report.duration > QUICK_TIER_LIMIT_S
    if report.when == "call" and slow and "e2e" not in report.keywords:
        _slow_in_quick_tier.append((report.nodeid, report.duration))
    path = report.nodeid.split("::", 1)[0]
    _seconds_by_file[path] = _seconds_by_file.get(path, 0.0) + report.duration
    node = getattr(report, "node", None)  # xdist's controller sets the worker that ran it
    if node is not None:
        lane = node.gateway.id
        _seconds_by_lane[lane] = _seconds_by_lane.get(lane, 0.0) + report.duration
        began, ended = _span_by_lane.get(lane, (report.start, report.stop))
        _span_by_lane[lane] = (min(began, report.start), max(ended, report.stop))


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 (pytest's own type)
    if _slow_in_quick_tier:
        terminalreporter.section("quick-tier tests over the limit (mark them e2e?)")
        for nodeid, seconds in _slow_in_quick_tier:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
    _cost_table(terminalreporter)


def _cost_table(terminalreporter) -> None:  # noqa: ANN001 (pytest's own type)
    """Where the suite's time went: seconds per test file (its tests' setup, call and
    teardown: a session fixture counts in the first file that uses it), and per kind of start
    (servers, trainers, Ray nodes, Slurm, the install: `areal_like.utils.start_costs`, written
    by every process the tests start). Process-seconds: starts overlap in time, across the
    two lanes too. docs/contributing.md keeps the budget per area."""
    from areal_like.utils.start_costs import START_LOG_ENV, summarize

    if len(_seconds_by_file) < COST_TABLE_MIN_FILES:  # one file's run: its durations say it
        return
    terminalreporter.section("where the time went: test files (s), most first")
    ranked = sorted(_seconds_by_file.items(), key=lambda kv: -kv[1])
    for path, seconds in ranked[:COST_TABLE_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    rest = ranked[COST_TABLE_FILES:]
    if rest:
        terminalreporter.write_line(f"{sum(s for _, s in rest):8.1f}  ({len(rest)} other files)")
    terminalreporter.write_line(f"{sum(_seconds_by_file.values()):8.1f}  all "
                                f"{len(_seconds_by_file)} files (both lanes, summed)")
    for lane, seconds in sorted(_seconds_by_lane.items()):
        began, ended = _span_by_lane[lane]
        terminalreporter.write_line(f"{seconds:8.1f}  lane {lane}'s tests, over "
                                    f"{ended - began:.0f} s from its first to its last")
    log = os.environ.get(START_LOG_ENV)
    kinds = summarize(log) if log else []
    if kinds:
        terminalreporter.section("where the time went: starts by kind (process-seconds)")
        terminalreporter.write_line(f"{'kind':32} {'starts':>6} {'seconds':>9} {'mean':>7}")
        for kind in kinds:
            terminalreporter.write_line(f"{kind.kind:32} {kind.count:6d} {kind.seconds:9.1f} "
                                        f"{kind.seconds / kind.count:7.1f}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1M-parameter Qwen2 model + byte-level BPE tokenizer (seed 1)."""
    from areal_like.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_1m"), size="1m", seed=1)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1.5M-parameter Qwen3-MoE model (8 experts, top-2) on the same tokenizer (seed 1)."""
    from areal_like.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe_1m"), size="1m", seed=1,
                            arch="qwen3_moe")


@pytest.fixture
def executor_factory():
    """Makes RewardExecutors from RewardConfig keyword arguments; shuts them all down after."""
    from areal_like.api.config import RewardConfig
    from areal_like.rewards.reward_executor import RewardExecutor

    made: list = []

    def make(**config):
        made.append(RewardExecutor(RewardConfig(**config)))
        return made[-1]

    yield make
    for executor in made:
        executor.shutdown()


# ---- SGLang fleet (real servers; tests marked `sglang`) -------------------------------------
SGLANG_TEST_API_KEY = "areal-like-test-key"


@pytest.fixture(scope="session")
def sglang_fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two real SGLang servers on the tiny 1m model, shared by the whole session (each start-up
    costs ~30 s and ~2 GB). They require `SGLANG_TEST_API_KEY`. Tests that change weights
    restore `tiny_model_dir` before they end. Skips when the SGLang venv is missing, except in
    CI (CI=true), where a missing venv is an error."""
    from areal_like.api.config import ServerConfig
    from engines.fleet.launch import InferenceFleet, resolve_server_python
    from engines.server.errors import ServerStartError

    config = ServerConfig(n_servers=2, max_total_tokens=16384, context_length=1024)
    try:
        resolve_server_python(config.venv)
    except ServerStartError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the SGLang tests: {e}")
        pytest.skip(f"SGLang venv missing (run `make sglang`): {e}")
    fleet = InferenceFleet(tiny_model_dir, config, api_key=SGLANG_TEST_API_KEY,
                           log_dir=tmp_path_factory.mktemp("sglang_logs"))
    with fleet:
        yield fleet


def require_venv(backend: str) -> None:
    """Skip when `backend`'s venv is missing, except in CI (CI=true): there it is an error."""
    from engines.fleet.launch import resolve_server_python
    from engines.server.errors import ServerStartError

    try:
        resolve_server_python("", backend)
    except ServerStartError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the {backend} tests: {e}")
        pytest.skip(f"{backend} venv missing: {e}")


# The shared vLLM servers skip torch.compile: ~7 s less per start (18.5 s against 25-26.5 s,
# tiny 1m model, idle) for 7-18 % fewer tokens/s (docs/benchmarks.md). Launcher and Ray runs of
# the tests start vLLM as users do, compiled, so that path stays under test.
VLLM_TEST_ARGS = ("--enforce-eager",)


@pytest.fixture(scope="session")
def vllm_fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two real vLLM servers on the tiny 1m model, shared like `sglang_fleet` (same API key,
    same rule: tests that change weights restore them)."""
    from areal_like.api.config import ServerConfig
    from engines.fleet.launch import InferenceFleet

    require_venv("vllm")
    config = ServerConfig(backend="vllm", n_servers=2, context_length=1024,
                          extra_args=list(VLLM_TEST_ARGS))
    with InferenceFleet(tiny_model_dir, config, api_key=SGLANG_TEST_API_KEY,
                        log_dir=tmp_path_factory.mktemp("vllm_logs")) as fleet:
        yield fleet


@pytest.fixture(scope="session", params=["sglang", "vllm"])
def any_fleet(request: pytest.FixtureRequest):
    """The session's SGLang fleet, then its vLLM fleet: a test that takes it runs on both
    backends (ids `[sglang]` / `[vllm]`)."""
    return request.getfixturevalue(f"{request.param}_fleet")


@pytest.fixture(scope="session")
def _session_vllm_spare(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`_module_spare`'s one killable server, on vLLM: one per session (a vLLM start costs
    30-60 s here; `any_spare` revives it for each test)."""
    from areal_like.api.config import ServerConfig
    from engines.fleet.launch import InferenceFleet

    require_venv("vllm")
    config = ServerConfig(backend="vllm", n_servers=1, context_length=1024,
                          extra_args=list(VLLM_TEST_ARGS))
    with InferenceFleet(tiny_model_dir, config, api_key=SGLANG_TEST_API_KEY,
                        log_dir=tmp_path_factory.mktemp("vllm_spare")) as fleet:
        yield fleet


@pytest.fixture
def any_spare(request: pytest.FixtureRequest, any_fleet, tiny_model_dir: Path):
    """`spare`, of `any_fleet`'s backend."""
    from sglang_helpers import revive_spare

    backend = any_fleet.config.backend
    fleet = request.getfixturevalue("_module_spare" if backend == "sglang"
                                    else f"_session_{backend}_spare")
    revive_spare(fleet, tiny_model_dir)
    yield fleet


@pytest.fixture(scope="module")
def _module_spare(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from areal_like.api.config import ServerConfig
    from engines.fleet.launch import InferenceFleet

    # forked children (`server.fork_children`, opt-in): a spare is restarted after nearly
    # every test that uses it, ~15 s less each; the session fleet keeps SGLang's spawn. Its
    # /health_generate gives up after 5 s, not 20: the hung-scheduler test waits for it twice
    config = ServerConfig(n_servers=1, context_length=1024, fork_children=True,
                          health_generate_timeout=5)
    fleet = InferenceFleet(tiny_model_dir, config, api_key=SGLANG_TEST_API_KEY,
                           log_dir=tmp_path_factory.mktemp("spare"))
    with fleet:
        yield fleet


@pytest.fixture
def spare(_module_spare, tiny_model_dir: Path):
    """One real server beside the session fleet that a test may kill, hang or restart (the
    session fleet stays intact). Started once per test module: each test gets it serving the
    session weights under version 0, as new (`sglang_helpers.revive_spare`)."""
    from sglang_helpers import revive_spare

    revive_spare(_module_spare, tiny_model_dir)
    yield _module_spare


@pytest.fixture
def fresh_fleet(sglang_fleet, tiny_model_dir: Path):
    """The session fleet as a just-started one: the session weights under version 0, not
    paused (`sglang_helpers.reset_fleet`), before the test and again after it, whatever the
    test's runs left behind. For runs that attach to it (`sglang_helpers.attach_args`) where
    nothing about the servers' own start-up or death is under test: they then cost no server
    start-up (~20-40 s each)."""
    from sglang_helpers import reset_fleet

    reset_fleet(sglang_fleet, tiny_model_dir)
    yield sglang_fleet
    reset_fleet(sglang_fleet, tiny_model_dir)


@pytest.fixture
def busy_machine():
    """Two CPU-bound processes beside the test (the machine has two cores)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait(timeout=30)
