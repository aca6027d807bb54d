"""Launch a local fleet of real inference servers (one process each; SGLang, or vLLM with
`config.backend="vllm"`, see `engines/vllm/command.py`) and shut them down reliably.

From the command line: `python -m engines.fleet.serve` (`engines/fleet/serve.py`).

From Python (tests use it as a session fixture)::

    with InferenceFleet(model_path, ServerConfig(n_servers=2)) as fleet:
        fleet.addresses  # ["127.0.0.1:PORT", ...]

Servers run `<venv>/bin/python -m sglang.launch_server` from the dedicated SGLang venv made by
`make sglang`. Each one gets its own process group (so stopping it also stops SGLang's scheduler
and detokenizer children), `PR_SET_PDEATHSIG` so it dies with the process that started it, one
thread by default (OMP_NUM_THREADS) and a bounded KV cache. Logs go to `<log_dir>/server_<i>.log`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from types import TracebackType
from typing import Callable, Optional, Sequence, Union

from areal_like.api.config import ServerConfig
from areal_like.utils.cpus import check_cpus
from areal_like.utils.network import find_free_port, is_loopback
from areal_like.utils.start_costs import record_start
from engines.fleet.zygote import ForkedServer, ServerZygote
from engines.server.errors import ServerStartError
from engines.sglang.command import build_server_command
from engines.vllm import compile_cache
from engines.vllm.command import build_vllm_command, vllm_env
from engines.weight_transport.delta import RECEIVER_DIR as DELTA_RECEIVER_DIR

# what the fleet holds for each server: the process it started, or one the zygote forked
ServerProcess = Union[subprocess.Popen[bytes], ForkedServer]

REPO_ROOT = Path(__file__).resolve().parents[2]
_PR_SET_PDEATHSIG = 1


def resolve_server_python(venv: str | os.PathLike[str], backend: str = "sglang") -> Path:
    """`<venv>/bin/python` (empty `venv`: the backend's default); a relative venv is looked
    up in the CWD, then the repo root."""
    venv = venv or default_venv(backend)
    venv_path = Path(venv)
    candidates = [venv_path] if venv_path.is_absolute() else [Path.cwd() / venv_path,
                                                              REPO_ROOT / venv_path]
    candidates = list(dict.fromkeys(candidates))  # the CWD is usually the repo root
    for candidate in candidates:
        python = candidate / "bin" / "python"
        if python.exists():
            return python
    tried = ", ".join(str(c) for c in candidates)
    raise ServerStartError(f"{backend} venv {str(venv)!r} not found (looked in: {tried}). "
                           f"{install_hint(backend, venv)}")


_PROGRESS_BAR = re.compile(r"\d+%\s*(Completed\s*)?\||it/s\]")


def tail_file(path: Path, n_lines: int = 40) -> str:
    """The last `n_lines` lines of `path` that say something (no blanks, no progress bars)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log file at {path})"
    return "\n".join(meaningful_lines(lines, n_lines))


def meaningful_lines(lines: list[str], n_lines: int) -> list[str]:
    """The last `n_lines` of `lines` that say something (no blanks, no progress bars)."""
    return [line for line in lines if line.strip() and not _PROGRESS_BAR.search(line)][-n_lines:]


def server_gpus(config: ServerConfig, index: int) -> str:
    """The GPUs server `index` sees: its own slice of the GPUs visible to the launcher."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = config.gpus_per_server
    pool = (visible.split(",") if visible else
            [str(i) for i in range(config.n_servers * n)])
    mine = pool[index * n:(index + 1) * n]
    if len(mine) < n:
        raise ServerStartError(
            f"server {index} needs {n} GPU(s) (ServerConfig.gpus_per_server) but only "
            f"{len(pool)} are visible for {config.n_servers} server(s): {pool}")
    return ",".join(mine)


def server_env(config: ServerConfig, index: int = 0) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(config.threads_per_server)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1",
               SGLANG_HEALTH_CHECK_TIMEOUT=str(config.health_generate_timeout))
    # SGLang caches each image's vision-tower output by the image's content and keeps it across
    # weight updates: after an update, an image seen before was embedded by the old tower (0.07
    # off in log-probability on the tiny Qwen2-VL). RL shows the same images every epoch.
    env["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
    if config.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["AREAL_LIKE_SGLANG_FORK"] = "1" if config.fork_children else "0"  # see the shim
    else:
        env["CUDA_VISIBLE_DEVICES"] = server_gpus(config, index)
    # The main env's packages must never leak into the server's venv: only the receiving
    # end of the delta transport (torch and zstandard only) goes on its path.
    env["PYTHONPATH"] = str(DELTA_RECEIVER_DIR)
    return env


def die_with_parent(parent_pid: int, nice: int = 0,
                    cpus: Sequence[int] = ()) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGTERM when the thread that started it dies; `nice` and
    `cpus` (affinity) apply to it and to the processes it starts."""
    def preexec() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
        if nice:
            os.nice(nice)  # the scheduler and detokenizer it starts inherit it
        if cpus:
            os.sched_setaffinity(0, set(cpus))

    return preexec


def _nice_session(pid: int, nice: int) -> None:
    """Linux's autogroup scheduling shares the CPU between sessions first, whatever the
    niceness of their processes: the server's new session gets the same niceness as a group
    (the scheduler and detokenizer it starts are in it)."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():  # absent: no autogroups, the processes' niceness is what counts
        autogroup.write_text(str(nice))


def _bind_failed(log_path: Path) -> bool:
    try:
        with open(log_path, "rb") as f:
            return b"error while attempting to bind" in f.read()
    except OSError:
        return False


def model_architectures(model_path: str) -> list[str]:
    """`architectures` of the model folder's config.json ([] if it has none or cannot be read:
    the server then names the fault)."""
    try:
        found = json.loads((Path(model_path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return []
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def health_ok(address: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class InferenceFleet:
    """N local SGLang servers; a context manager. `.addresses` lists `host:port` of each.

    Servers die with the thread that started them (PR_SET_PDEATHSIG): start the fleet from a
    long-lived thread (normally the main one).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        config: Optional[ServerConfig] = None,
        *,
        host: str = "127.0.0.1",
        base_port: Optional[int] = None,
        api_key: Optional[str] = None,
        log_dir: Optional[str | os.PathLike[str]] = None,
        weight_version: int = 0,
    ) -> None:
        self.model_path = str(model_path)
        self.config = config or ServerConfig()
        self.kind = "vLLM" if self.config.backend == "vllm" else "SGLang"  # in messages
        self.host = host
        self.base_port = base_port
        self.api_key = api_key
        self.weight_version = weight_version
        # absolute: the servers' process-group store lives here and is named by a file:// URL
        self.log_dir = (Path(log_dir) if log_dir
                        else Path(tempfile.mkdtemp(prefix="sglang_logs_"))).resolve()
        self.addresses: list[str] = []
        self.log_paths: list[Path] = []
        self.processes: list[ServerProcess] = []
        self._zygote: Optional[ServerZygote] = None  # forks the servers (`forks_servers`)
        self._lock = threading.Lock()
        self._started_at = 0.0  # when `spawn` started the servers
        self._starting: set[int] = set()  # not yet healthy, by index (`check_started`)
        # when each server's latest start began, and which were restarts (start costs)
        self._spawned_at: dict[int, float] = {}
        self._restarted: set[int] = set()
        # vLLM: each compiling start's own cache, published once it is healthy (compile_cache)
        self._compile_caches: dict[int, tuple[Path, Path]] = {}  # (its own, the shared)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> InferenceFleet:
        """Start every server and wait until each answers `/health` (see `spawn`)."""
        self.spawn()
        try:
            self.wait_healthy(self.config.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self) -> InferenceFleet:
        """Start every server without waiting for it: `.addresses` are known at once, so a
        trainer can start beside them (`wait_healthy` or `check_started` after)."""
        if self.processes:
            raise ServerStartError("InferenceFleet started twice (start() or spawn())")
        if not (Path(self.model_path) / "config.json").exists():
            raise ServerStartError(
                f"model_path {self.model_path!r} is not an HF model folder (no config.json)"
            )
        self._python = resolve_server_python(self.config.venv, self.config.backend)
        try:
            check_cpus("server.cpus", self.config.cpus)
        except ValueError as e:
            raise ServerStartError(str(e)) from None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.config.n_servers):
                port = self.base_port + i if self.base_port else find_free_port(self.host)
                self.processes.append(self._spawn(i, port, "wb"))
                self.addresses.append(f"{self.host}:{port}")
                self.log_paths.append(self.log_dir / f"server_{i}.log")
        except BaseException:
            self.stop()
            raise
        self._started_at = time.monotonic()
        self._starting = set(range(len(self.processes)))
        return self

    @property
    def forks_servers(self) -> bool:
        """CPU SGLang with `fork_children`: every server (and restart) forked from one
        interpreter that imported SGLang once (`engines/fleet/zygote.py`)."""
        return (self.config.backend == "sglang" and self.config.device == "cpu"
                and self.config.fork_children)

    @property
    def zygote_pid(self) -> Optional[int]:
        """The pid of the interpreter the servers are forked from, if there is one running."""
        return self._zygote.process.pid if self._zygote and self._zygote.alive() else None

    def _spawn(self, index: int, port: int, mode: str) -> ServerProcess:
        self._spawned_at[index] = time.monotonic()
        self._restarted.discard(index)
        if self.config.backend == "vllm":
            cmd = build_vllm_command(self._python, self.model_path, port, self.config,
                                     self.host, self.api_key)
            env = vllm_env(server_env(self.config, index), self.config)
            if "--enforce-eager" not in cmd:  # it compiles: into a cache of its own
                if index in self._compile_caches:  # (its previous start's)
                    compile_cache.discard(self._compile_caches.pop(index)[0])
                shared = compile_cache.shared_cache(env)
                self._compile_caches[index] = (compile_cache.private_cache(shared), shared)
                env["VLLM_CACHE_ROOT"] = str(self._compile_caches[index][0])
        else:
            cmd = build_server_command(self._python, self.model_path, port, self.config,
                                       self.host, self.api_key, self.weight_version)
            env = server_env(self.config, index)
        if is_loopback(self.host):
            # gloo pair sockets on loopback; SGLang's scheduler group: a file store instead of
            # a TCP store that would listen on every interface (a new file each start: a
            # killed server leaves its file behind; vLLM uses a file store by itself). (A
            # relative path would read as file://<host>/... and the rendezvous would hang.)
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if self.config.backend == "sglang":
                store = self.log_dir / f".dist_store_{index}_{uuid.uuid4().hex}"
                env["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"] = f"file://{store}"
        if self.forks_servers:
            return self._fork(index, cmd, env, mode)
        with open(self.log_dir / f"server_{index}.log", mode) as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid(), self.config.nice, self.config.cpus),
            )
        if self.config.nice:
            _nice_session(process.pid, self.config.nice)
        return process

    def _fork(self, index: int, cmd: list[str], env: dict[str, str],
              mode: str) -> ForkedServer:
        if self._zygote is None or not self._zygote.alive():
            # the SGLang shim reads its switches at import: the zygote imports with the
            # servers' environment (on the CPU every server's is the same)
            zygote_env = dict(env, AREAL_LIKE_SGLANG_ARCHITECTURES=",".join(
                model_architectures(self.model_path)))  # it imports only their model modules
            self._zygote = ServerZygote(
                self._python, zygote_env, die_with_parent(os.getpid(), self.config.nice,
                                                          self.config.cpus))
            if self.config.nice:
                _nice_session(self._zygote.process.pid, self.config.nice)
        log_path = self.log_dir / f"server_{index}.log"
        with open(log_path, mode.replace("b", "")) as log:
            log.write(f"$ {' '.join(cmd)}  (forked from the SGLang zygote, pid "
                      f"{self._zygote.process.pid})\n")
        argv = cmd[cmd.index("sglang.launch_server") + 1:]
        return self._zygote.fork(argv, env, log_path, self.config.nice)

    def _remove_dist_stores(self) -> None:
        for store in self.log_dir.glob(".dist_store_*"):
            store.unlink(missing_ok=True)

    def restart_server(self, index: int) -> None:
        """Start server `index` again on its address (after it died); does not wait for it.
        Its log continues in the same file. Clients load their current weights on it before
        it takes traffic (`engines/fleet/membership.py`)."""
        with self._lock:
            if self.processes[index].poll() is None:
                raise ServerStartError(f"{self.kind} server {index} is still running")
            pid = self.processes[index].pid  # None: the zygote died before forking it
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):  # leftovers of its group
                    os.killpg(pid, signal.SIGKILL)
            port = int(self.addresses[index].rpartition(":")[2])
            self.processes[index] = self._spawn(index, port, "ab")
            self._restarted.add(index)

    def describe_death(self, index: int, n_lines: int = 15) -> str:
        """'SGLang server i (addr) died: killed by SIGKILL' plus the last lines of its log."""
        code = self.processes[index].returncode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        return (f"{self.kind} server {index} ({self.addresses[index]}) died: {how}. Last "
                f"lines of {self.log_paths[index]}:\n"
                f"{tail_file(self.log_paths[index], n_lines)}")

    def wait_healthy(self, timeout: float) -> None:
        """Until every server answers /health (after `start` or `restart_server`); raises
        naming the server and its log tail if one exits or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.processes)))
        while True:
            pending = self._still_starting(pending, deadline, timeout)
            if not pending:
                return
            time.sleep(0.5)

    def check_started(self) -> bool:
        """One look at servers started by `spawn`: True once every one answers /health;
        raises `ServerStartError` (naming the server, its log tail) if one exited or
        `config.startup_timeout` has passed since `spawn`."""
        timeout = self.config.startup_timeout
        self._starting = self._still_starting(
            self._starting, self._started_at + timeout, timeout)
        return not self._starting

    def _still_starting(self, pending: set[int], deadline: float, timeout: float) -> set[int]:
        """`pending` less the servers that answer /health now."""
        pending = set(pending)
        for i in sorted(pending):
            code = self.processes[i].poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.kind} server {i} ({self.addresses[i]}) exited with code "
                    f"{code} during start-up. Last lines of {self.log_paths[i]}:\n"
                    f"{tail_file(self.log_paths[i])}"
                )
            if health_ok(self.addresses[i]):
                pending.discard(i)
                if i in self._compile_caches:  # what it compiled, for every later start
                    compile_cache.publish(*self._compile_caches[i])
                if i in self._spawned_at:  # once per start (the test command's cost table)
                    record_start(f"{self.config.backend} server"
                                 + (" restart" if i in self._restarted else ""),
                                 time.monotonic() - self._spawned_at.pop(i), self.model_path)
            elif _bind_failed(self.log_paths[i]):  # the process may linger: fail now
                raise ServerStartError(
                    f"{self.kind} server {i} could not bind {self.addresses[i]} (address "
                    f"already in use: another process took the port). Last lines of "
                    f"{self.log_paths[i]}:\n{tail_file(self.log_paths[i])}"
                )
        if pending and time.monotonic() > deadline:
            i = min(pending)
            raise ServerStartError(
                f"{self.kind} server {i} ({self.addresses[i]}) not healthy after "
                f"{timeout:.0f} s (ServerConfig.startup_timeout). Last lines of "
                f"{self.log_paths[i]}:\n{tail_file(self.log_paths[i])}"
            )
        return pending

    def kill_server(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to server `index`'s process group (tests use it to simulate a crash)."""
        proc = self.processes[index]
        if proc.poll() is None and proc.pid is not None:  # None: queued in the zygote
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the group we created for this server only

    def stop(self, timeout: float = 20.0) -> None:
        """SIGKILL every server's process group and wait up to `timeout` for each. A server
        holds nothing to save (its weights come from the trainer); SGLang's SIGTERM path
        only adds its 5 s shutdown poll and leaves the same files behind. Safe to call twice."""
        with self._lock:
            for i in range(len(self.processes)):
                self.kill_server(i, signal.SIGKILL)
            if self._zygote is not None:  # and the servers it has not forked yet
                self._zygote.close(timeout)
            for proc in self.processes:
                proc.wait(timeout=timeout)
                # SGLang's children live in the same group: make sure none outlives the server.
                if proc.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            self._remove_dist_stores()
            for index in list(self._compile_caches):  # each server's own, now it stopped
                compile_cache.discard(self._compile_caches.pop(index)[0])

    def dead_servers(self) -> list[int]:
        return [i for i, p in enumerate(self.processes) if p.poll() is not None]

    def __enter__(self) -> InferenceFleet:
        return self.start()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()


def default_venv(backend: str) -> str:
    return ".venv-vllm" if backend == "vllm" else ".venv-sglang"


def install_hint(backend: str, venv: str | os.PathLike[str]) -> str:
    if backend == "vllm":
        return f"Run `bash scripts/install_vllm.sh {venv}` to install the vLLM server first."
    return (f"Run `make sglang` (or `bash scripts/install_sglang.sh {venv}`) to install the "
            f"SGLang server first.")
