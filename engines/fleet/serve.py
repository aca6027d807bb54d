"""Serve a local fleet of inference servers (SGLang or vLLM) from the command line,
restarting any that dies.

    python -m engines.fleet.serve --model-path DIR [--backend sglang|vllm] [--n-servers N]
                                   [--port P] [--api-key K] [--device cpu|cuda]
                                   [--venv DIR] [--log-dir DIR] [--join ADDRS_FILE]

(`areal-like serve` runs the same.) Extra arguments go to every server's command line.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from areal_like.api.config import BACKENDS, ServerConfig
from areal_like.utils.atomic_file import write_atomic
from engines.fleet.addrs_file import reading_clients
from engines.fleet.launch import InferenceFleet
from engines.fleet.supervisor import FleetDownError, FleetSupervisor
from engines.server.errors import ServerStartError

NO_JOB = ("no job reads it (no fleet client has marked it as read lately: its "
          "<file>.client.* heartbeats); is the job running, with rollout.server_addrs_file "
          "naming this file?")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--backend", choices=BACKENDS, default=ServerConfig.backend,
                        help="the inference server (clients attach with rollout.backend)")
    parser.add_argument("--n-servers", type=int, default=1)
    parser.add_argument("--port", type=int, default=None,
                        help="first port (server i uses port+i); default: free ports")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--venv", default=ServerConfig.venv,
                        help="the server's virtual environment (default: the backend's own)")
    parser.add_argument("--threads-per-server", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=ServerConfig.max_total_tokens)
    parser.add_argument("--startup-timeout", type=float, default=ServerConfig.startup_timeout)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--max-restarts", type=int, default=ServerConfig.max_restarts,
                        help="restarts of each server that dies (then it stays down)")
    parser.add_argument("--min-servers", type=int, default=1,
                        help="exit when fewer servers than this are alive")
    parser.add_argument("--addrs-file", default=None,
                        help="write the addresses here, one per line (a trainer's "
                             "rollout.server_addrs_file)")
    parser.add_argument("--join", default=None, metavar="ADDRS_FILE",
                        help="join a running job: add the addresses to its "
                             "rollout.server_addrs_file once the servers are up (they load the "
                             "job's current weights before they serve); on Ctrl-C / SIGTERM "
                             "take them out of it and stop once the job has drained them, or "
                             "at once when the job has ended")
    parser.add_argument("--drain-timeout", type=float, default=600.0,
                        help="--join: how long to wait for the job to drain the servers")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                        default=ServerConfig.deterministic,
                        help="seeded, batch-invariant sampling (default: on)")
    parser.add_argument("--fork-children", action=argparse.BooleanOptionalAction,
                        default=ServerConfig.fork_children,
                        help="CPU: fork the scheduler and detokenizer instead of spawning them "
                             "(~13 s less per start; default: off)")
    args, extra = parser.parse_known_args(argv)
    if args.join and not Path(args.join).resolve().parent.is_dir():  # before any server starts
        parser.error(f"--join {args.join}: no folder {Path(args.join).resolve().parent} (the "
                     f"job's rollout.server_addrs_file, on this machine: is the job running?)")
    if args.join and not reading_clients(args.join):
        parser.error(f"--join {args.join}: {NO_JOB}")
    config = ServerConfig(
        backend=args.backend, n_servers=args.n_servers, device=args.device, venv=args.venv,
        threads_per_server=args.threads_per_server, max_total_tokens=args.max_total_tokens,
        startup_timeout=args.startup_timeout, deterministic=args.deterministic,
        max_restarts=args.max_restarts, fork_children=args.fork_children,
        extra_args=extra,
    )
    fleet = InferenceFleet(args.model_path, config, host=args.host, base_port=args.port,
                           api_key=args.api_key, log_dir=args.log_dir)
    return run_fleet(fleet, args.min_servers, args.addrs_file, args.join, args.drain_timeout)


def run_fleet(fleet: InferenceFleet, min_servers: int, addrs_file: Optional[str] = None,
              join: Optional[str] = None, drain_timeout: float = 600.0) -> int:
    """Start `fleet`, write its addresses to `addrs_file` (and `join` a job's), then restart
    any server that dies until Ctrl-C / SIGTERM (0) or fewer than `min_servers` are left (1)."""
    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds start-up or the watch loop; `finally` stops the fleet

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    joined: list[str] = []
    try:
        fleet.start()
        print(f"{fleet.kind} servers ready (logs in {fleet.log_dir}):", flush=True)
        for addr in fleet.addresses:
            print(addr, flush=True)
        if addrs_file:
            write_atomic(addrs_file, "".join(f"{a}\n" for a in fleet.addresses))
        if join:
            if not reading_clients(join):  # it ended while the servers started
                print(f"error: --join {join}: {NO_JOB}", file=sys.stderr, flush=True)
                return 1
            joined = join_job(join, fleet.addresses)
        # a dead server is restarted; the others keep serving
        supervisor = FleetSupervisor(fleet, fleet.config.max_restarts, min_servers,
                                     prefix="[serve]")
        while True:
            time.sleep(1.0)
            supervisor.check()
    except KeyboardInterrupt:
        if joined and join:
            try:
                leave_job(join, joined, drain_timeout)
            except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM: the user will not wait
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a third: no traceback either)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                print("[serve] stopping without waiting for the drain (a second signal): the "
                      "job's requests still on these servers are retried on the others",
                      file=sys.stderr, flush=True)
        return 0
    except (ServerStartError, FleetDownError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # A second Ctrl-C / SIGTERM must not interrupt the shutdown itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop()


def _listed(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def join_job(addrs_file: str, addresses: list[str]) -> list[str]:
    """Add `addresses` to a running job's addresses file (its client re-reads it)."""
    path = Path(addrs_file)
    lines = _listed(path)
    present = {line.split("#", 1)[0].strip() for line in lines}
    added = [a for a in addresses if a not in present]
    drained = Path(f"{addrs_file}.drained")  # an earlier leave of these addresses
    if drained.exists():
        write_atomic(drained, "".join(f"{line}\n" for line in _listed(drained)
                                      if line.strip() not in addresses))
    write_atomic(path, "".join(f"{line}\n" for line in [*lines, *added]))
    print(f"[serve] joined the job of {path}: {', '.join(addresses)}", flush=True)
    return list(addresses)


def leave_job(addrs_file: str, addresses: list[str], timeout: float) -> None:
    """Take `addresses` out of the job's addresses file, then wait (at most `timeout` s) for
    its client to list them as drained in `<addrs_file>.drained`: no request of the job is
    left on them when they stop."""
    path, drained = Path(addrs_file), Path(f"{addrs_file}.drained")
    write_atomic(path, "".join(f"{line}\n" for line in _listed(path)
                               if line.split("#", 1)[0].strip() not in addresses))
    print(f"[serve] left the job of {path}; waiting for it to drain {', '.join(addresses)}",
          flush=True)
    deadline = time.monotonic() + timeout
    while not set(addresses) <= set(_listed(drained)):
        if not reading_clients(path):
            print(f"[serve] the job of {path} has ended (no client reads the file): nothing "
                  f"to drain", flush=True)
            return
        if time.monotonic() > deadline:
            print(f"[serve] the job did not drain {', '.join(addresses)} within {timeout:.0f} "
                  f"s (--drain-timeout); stopping anyway: its requests still on them are "
                  f"retried on the others", file=sys.stderr, flush=True)
            return
        time.sleep(0.2)
    print(f"[serve] drained: {', '.join(addresses)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
