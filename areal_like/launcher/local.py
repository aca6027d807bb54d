"""Local launcher: an SGLang fleet plus a `torchrun` trainer on this machine.

    python -m areal_like.launcher.local <recipe> [--config FILE] [key=value ...]
    python -m areal_like.launcher.local path/to/train.py --config FILE [key=value ...]
    areal-like run <recipe or script> [--config FILE] [key=value ...]

The config is composed and validated first, so a typo fails before any process starts. Unless
`rollout.server_addrs` names an existing fleet, `server.n_servers` SGLang servers are started
on `model.path` and the trainer at once beside them, with their addresses (its imports and
set-up overlap the servers' start-up; its first wait for healthy servers covers
`server.startup_timeout` too, and a server that fails to start stops the run). The trainer is
`torchrun --nproc_per_node=launcher.n_trainer_procs -m recipes.<recipe>` (or the user's script,
which receives `--config FILE key=value ...` with `rollout.server_addrs` added). Logs stream
with `[trainer]` / `[server i]` prefixes (the trainer's also go to `<run dir>/trainer.log`).
A server that dies is restarted up to `server.max_restarts` times (the trainer keeps going on
the others and loads its current weights on the restarted one); the run stops when fewer than
`rollout.health.min_servers` are left, with every dead server's exit code or signal and log
tail as the last thing on the screen. Ctrl-C stops everything. On CUDA machines servers take
the first GPUs and trainers the next ones; `launcher.cpu_allocation=split` splits the CPU cores
the same way (or `server.cpus`, `launcher.trainer_cpus`, `rollout.controller.cpus` name them).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from areal_like.launcher.console import Console, TidyLog
from areal_like.launcher.target import (
    LaunchError,
    check_model_path,
    launcher_main,
    resolve_target,
    trainer_error,
)
from areal_like.runtime.preflight import check_local_trainer_device
from areal_like.utils.cpus import check_cpus, split_cores
from areal_like.utils.fast_exit import exit_now
from areal_like.utils.launch_clock import mark_launch, stamp
from areal_like.utils.metrics_logger import run_dir
from areal_like.utils.network import bindable, find_free_port
from areal_like.utils.progress import LIVE_BAR_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
CONSOLE = Console()


def _stream(prefix: str, pipe, log_path: Path, mute: threading.Event,  # noqa: ANN001
            last_lines: list[str]) -> threading.Thread:
    """Echo `pipe` on the console with a prefix and copy it to `log_path`; after `mute` is
    set, only copy (the launcher's own error then stays the last thing on the screen)."""
    def pump() -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        partial = ""
        log = TidyLog(log_path)
        try:
            while chunk := os.read(pipe.fileno(), 65536):  # chunks: tqdm's bar has no newline
                text = decoder.decode(chunk)
                log.write(text)
                lines = (partial + text).split("\n")
                partial = lines.pop()
                last_lines.extend(line + "\n" for line in lines)
                del last_lines[:-200]
                if not mute.is_set():
                    CONSOLE.feed(prefix, text)
        finally:
            log.close()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def follow_log(prefix: str, path: Path, stop: threading.Event) -> threading.Thread:
    """Stream a growing log file (SGLang servers write their own logs)."""
    def pump() -> None:
        while not path.exists() and not stop.is_set():
            time.sleep(0.2)
        with open(path, "rb") as f:
            while not stop.is_set():
                chunk = f.read(65536)
                if chunk:
                    CONSOLE.feed(prefix, chunk.decode(errors="replace"))
                else:
                    time.sleep(0.2)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch CUDA runtime: a CPU machine
        return 0


def _master_port(config: Any) -> int:
    port = config.launcher.master_port
    if port == 0:
        return find_free_port()
    if not bindable("127.0.0.1", port):
        raise LaunchError(f"launcher.master_port={port} is in use on 127.0.0.1; choose another, "
                          f"or 0 for a free one")
    return port


def _allocate_cpus(config: Any, overrides: list[str]) -> tuple[Any, set[int]]:
    """Check the `*cpus` keys against this machine and resolve `launcher.cpu_allocation=split`
    (explicit ids win); returns the servers' config and the trainer's cores (empty: any)."""
    server, launcher, rollout = config.server, config.launcher, config.rollout
    trainer_cpus, server_cpus = list(launcher.trainer_cpus), list(server.cpus)
    if launcher.cpu_allocation == "split":
        n_trainer = launcher.n_trainer_procs * launcher.threads_per_trainer
        allowed = os.sched_getaffinity(0)
        split = split_cores(allowed, n_trainer)
        if split is None:
            CONSOLE.line(f"[launcher] launcher.cpu_allocation=split: {len(allowed)} core(s) "
                         f"leave none beside the trainer's {n_trainer}; all processes share them")
        else:
            trainer_cpus = trainer_cpus or split[1]
            server_cpus = server_cpus or split[0]
            if not rollout.controller.cpus:
                overrides.append(f"rollout.controller.cpus=[{','.join(map(str, split[0]))}]")
            CONSOLE.line(f"[launcher] cores: trainer {trainer_cpus}, servers {server_cpus}, "
                         f"rollout controller {rollout.controller.cpus or split[0]}")
    try:  # before anything starts
        for key, cpus in (("launcher.trainer_cpus", trainer_cpus), ("server.cpus", server_cpus),
                          ("rollout.controller.cpus", rollout.controller.cpus)):
            check_cpus(key, cpus)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return dataclasses.replace(server, cpus=server_cpus), set(trainer_cpus)


def _check_teacher(config: Any) -> None:
    """Before anything starts: a teacher fleet given by address answers (within
    rollout.client.setup_timeout); the teacher the launcher would serve exists, its cores too."""
    teacher = getattr(config, "teacher", None)
    if teacher is None:
        return
    if teacher.server_addrs:
        from recipes.distill import check_teacher
        from workflows.distill import TeacherUnavailableError

        CONSOLE.line(f"[launcher] checking that teacher.server_addrs={teacher.server_addrs} "
                     "answer (up to rollout.client.setup_timeout="
                     f"{config.rollout.client.setup_timeout} s)")
        try:
            check_teacher(config)
        except TeacherUnavailableError as e:
            raise LaunchError(str(e)) from None
        return
    try:  # (the folder itself: areal_like.runtime.preflight_models, with its tokenizer)
        check_cpus("teacher.cpus", teacher.cpus)
    except ValueError as e:
        raise LaunchError(str(e)) from None


def _start_teacher_fleet(config: Any, server_config: Any, log_dir: Path,
                         overrides: list[str]) -> Any:
    """Serve `teacher.model_path` on `teacher.n_servers` servers of the student's server
    settings, on `teacher.cpus` (empty: not pinned); the recipe gets their addresses as
    `teacher.server_addrs`."""
    from engines.fleet.launch import InferenceFleet
    from engines.server.errors import ServerStartError

    teacher = config.teacher
    CONSOLE.line(f"[launcher] starting {teacher.n_servers} teacher server(s) on "
                 f"{teacher.model_path}")
    fleet = InferenceFleet(teacher.model_path,
                           dataclasses.replace(server_config, n_servers=teacher.n_servers,
                                        cpus=list(teacher.cpus)),
                        api_key=config.rollout.client.api_key, log_dir=log_dir / "teacher_servers")
    try:
        fleet.start()
    except ServerStartError as e:
        raise LaunchError(f"teacher fleet: {e}") from e
    CONSOLE.line(f"[launcher] teacher servers ready: {fleet.addresses}")
    overrides.append(f"teacher.server_addrs=[{','.join(fleet.addresses)}]")
    return fleet


def _supervise_once_started(fleet: Any, config: Any, mute: threading.Event,
                            log_dir: Path) -> Any:
    """While the servers start beside the trainer: None until every one is healthy, then the
    supervisor that restarts dead ones. A server that fails to start stops the run, naming it
    (the trainer, waiting for it, is stopped quietly)."""
    from engines.fleet.supervisor import FleetSupervisor
    from engines.server.errors import ServerStartError

    try:
        if not fleet.check_started():
            return None
    except ServerStartError as e:
        mute.set()
        raise LaunchError(f"{e}\n(trainer stopped; its output is in "
                          f"{log_dir / 'trainer.log'})") from e
    CONSOLE.line(f"[launcher] servers ready: {fleet.addresses} ({stamp()} after launch)")
    return FleetSupervisor(fleet, config.server.max_restarts, config.rollout.health.min_servers)


def launch(target_name: str, argv: list[str], quiet_servers: bool = True) -> int:
    """Run a recipe or a training script with its fleet; returns the trainer's exit code."""
    mark_launch()  # the trainer's start-up phases count from this process's start
    target = resolve_target(target_name, argv)  # fails fast on a typo
    config, overrides, needs_fleet = target.config, target.overrides, target.needs_fleet
    check_model_path(config)
    check_local_trainer_device(config)
    _check_teacher(config)
    server_config, trainer_cpus = _allocate_cpus(config, overrides)
    master_port = _master_port(config)
    log_dir = run_dir(config.logging)
    n_gpus = _gpu_count() if config.server.device == "cuda" else 0

    fleet = teacher_fleet = None
    stop_follow, mute = threading.Event(), threading.Event()
    last_lines: list[str] = []
    trainer: Optional[subprocess.Popen[bytes]] = None
    try:
        if needs_fleet and not config.rollout.server_addrs:
            from engines.fleet.launch import InferenceFleet
            from engines.server.errors import ServerStartError

            CONSOLE.line(f"[launcher] starting {config.server.n_servers} "
                         f"{config.server.backend} server(s) on {config.model.path}; the "
                         f"trainer starts beside them ({stamp()} after launch)")
            fleet = InferenceFleet(config.model.path, server_config,
                                   api_key=config.rollout.client.api_key,
                                   log_dir=log_dir / "servers")
            try:
                fleet.spawn()
            except ServerStartError as e:  # spawn() already stopped every server
                raise LaunchError(str(e)) from e
            overrides.append(f"rollout.server_addrs=[{','.join(fleet.addresses)}]")
            # the trainer's first wait for healthy servers includes their start-up (the
            # launcher names a server that fails to start, within server.startup_timeout)
            setup_timeout = config.rollout.client.setup_timeout + server_config.startup_timeout
            overrides.append(f"rollout.client.setup_timeout={setup_timeout}")
            if not quiet_servers:
                for i, path in enumerate(fleet.log_paths):
                    follow_log(f"server {i}", path, stop_follow)

        teacher = getattr(config, "teacher", None)  # on-policy distillation's second fleet
        if needs_fleet and teacher is not None and not teacher.server_addrs:
            teacher_fleet = _start_teacher_fleet(config, server_config, log_dir, overrides)

        env = dict(os.environ, OMP_NUM_THREADS=str(config.launcher.threads_per_trainer),
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair sockets: loopback only
        # the user's modules (tasks, rewards named in config) import from where they launch
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(),
                                                          os.environ.get("PYTHONPATH")]))
        if CONSOLE.tty:  # the console redraws the trainer's bar as one live line
            env[LIVE_BAR_ENV] = "1"
        env.update(config.launcher.trainer_env)
        if n_gpus:
            first = config.server.n_servers * config.server.gpus_per_server if fleet else 0
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(first + i) for i in range(config.launcher.n_trainer_procs))
        # torchrun whose rendezvous store listens on 127.0.0.1 only
        cmd = [sys.executable, "-m", "areal_like.launcher.torchrun_loopback",
               f"--nproc_per_node={config.launcher.n_trainer_procs}",
               "--master_addr=127.0.0.1", f"--master_port={master_port}",
               *target.entry, *target.args([])]
        CONSOLE.line(f"[launcher] $ {' '.join(cmd)}")
        trainer = subprocess.Popen(
            cmd, cwd=os.getcwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, trainer_cpus)) if trainer_cpus else None)
        log_dir.mkdir(parents=True, exist_ok=True)
        pump = _stream("trainer", trainer.stdout, log_dir / "trainer.log", mute, last_lines)
        supervisor = None
        while trainer.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # returns when it exits
                trainer.wait(timeout=1.0)
            if fleet is not None and supervisor is None:
                supervisor = _supervise_once_started(fleet, config, mute, log_dir)
            if supervisor is not None:
                try:
                    supervisor.check()
                except RuntimeError as e:  # FleetDownError: stop the trainer quietly
                    mute.set()
                    raise LaunchError(f"{e}\n(trainer stopped; its output is in "
                                      f"{log_dir / 'trainer.log'})") from None
        pump.join(timeout=10)
        code = trainer.returncode
        if code != 0:
            cause = trainer_error(last_lines)
            CONSOLE.close()
            print(f"[launcher] trainer exited with code {code}"
                  + (f": {cause}" if cause else "") + f" (full output: {log_dir / 'trainer.log'})",
                  file=sys.stderr, flush=True)
        return code
    finally:
        mute.set()  # whatever a stopped trainer prints now stays in trainer.log
        CONSOLE.close()
        stop_follow.set()
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGTERM)
            try:
                trainer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(trainer.pid, signal.SIGKILL)
        for started in (fleet, teacher_fleet):
            if started is not None:
                started.stop()


def main(argv: Optional[list[str]] = None) -> int:
    return launcher_main(launch, __doc__ or "", argv, "trainer and servers")


if __name__ == "__main__":
    exit_now(main())  # servers stopped, trainer gone: skip the teardown of the imports
