"""`areal-like tinker-serve`: the Tinker API on this machine.

    areal-like tinker-serve --model-path DIR [--port 8000] [--trainer-ranks N] [--n-servers N]
                            [--fleet-addresses HOST:PORT,...] [--storage-dir DIR] ...

Starts an SGLang fleet serving DIR with LoRA adapters (or uses the one at --fleet-addresses,
which must serve LoRA up to --max-lora-rank), then the trainer ranks (`torchrun` for N > 1):
rank 0 serves the API on --host:--port (127.0.0.1 unless told otherwise). Point the SDK at it:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_loop.py
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Optional

from areal_like.api.config import ServerConfig
from areal_like.utils.network import bindable, find_free_port

logger = logging.getLogger("areal_like.tinker")
MIN_SESSION_TIMEOUT_S = 20.0  # the SDK heartbeats every 10 s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="areal-like tinker-serve",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="the base model (an HF folder)")
    p.add_argument("--model-name", default="",
                   help="what clients call it (base_model); default: the folder's name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="the one X-API-Key accepted (default: any tml-... key)")
    p.add_argument("--storage-dir", default="tinker_storage", help="checkpoints go here")
    p.add_argument("--trainer-ranks", type=int, default=1, help="FSDP2 ranks (torchrun)")
    p.add_argument("--n-servers", type=int, default=1, help="SGLang servers to start")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the servers run (the trainer ranks take CUDA when present)")
    p.add_argument("--fleet-addresses", default="",
                   help="use these running servers (comma-separated) instead")
    p.add_argument("--server-api-key", default=None, help="the fleet's API key")
    p.add_argument("--fork-children", action=argparse.BooleanOptionalAction,
                   default=ServerConfig.fork_children,
                   help="CPU: fork each server's scheduler instead of spawning it (faster "
                        "starts and restarts)")
    p.add_argument("--max-lora-rank", type=int, default=32)
    p.add_argument("--context-length", type=int, default=ServerConfig.context_length)
    p.add_argument("--max-models", type=int, default=4,
                   help="training models alive at once (each holds an engine)")
    p.add_argument("--session-timeout", type=float, default=120.0,
                   help="seconds without a heartbeat before a session is reaped")
    p.add_argument("--poll-wait", type=float, default=30.0,
                   help="how long retrieve_future holds a poll open")
    p.add_argument("--max-tokens-per-mb", type=int, default=4096)
    p.add_argument("--log-dir", default=None, help="the servers' logs")
    p.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[tinker-serve] %(message)s")
    if args.rank_process:
        from areal_like.tinker.rank_main import run_rank

        return run_rank(args)
    for flag, value in (("--trainer-ranks", args.trainer_ranks),
                        ("--max-lora-rank", args.max_lora_rank),
                        ("--max-models", args.max_models), ("--n-servers", args.n_servers),
                        ("--max-tokens-per-mb", args.max_tokens_per_mb),
                        ("--context-length", args.context_length)):
        if value < 1:
            print(f"error: {flag} {value}: must be >= 1", file=sys.stderr)
            return 2
    if not 0 < args.port < 65536:
        print(f"error: --port {args.port}: a TCP port is 1..65535", file=sys.stderr)
        return 2
    if not bindable(args.host, args.port, reuse_addr=True):  # before the servers start
        print(f"error: --port {args.port} on {args.host} is in use or cannot be bound",
              file=sys.stderr)
        return 2
    if args.session_timeout < MIN_SESSION_TIMEOUT_S:
        print(f"error: --session-timeout {args.session_timeout} is below "
              f"{MIN_SESSION_TIMEOUT_S} s: the SDK heartbeats every 10 s, so live sessions "
              f"would be reaped", file=sys.stderr)
        return 2
    if not os.path.isdir(args.model_path):
        print(f"error: --model-path {args.model_path!r} is not a folder", file=sys.stderr)
        return 2
    return _launch(args, argv or sys.argv[1:])


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    from areal_like.tinker.lora_shape import SERVED_MODULES
    from engines.fleet.launch import InferenceFleet
    from engines.fleet.supervisor import FleetDownError, FleetSupervisor
    from engines.server.errors import ServerStartError

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    fleet: Optional[InferenceFleet] = None
    ranks: Optional[subprocess.Popen[bytes]] = None
    try:
        addresses = [a for a in args.fleet_addresses.split(",") if a]
        server_key = args.server_api_key
        if not addresses:
            server_key = server_key or secrets.token_hex(16)
            config = ServerConfig(n_servers=args.n_servers, device=args.device,
                                  fork_children=args.fork_children,
                                  lora_rank=args.max_lora_rank,
                                  lora_target_modules=list(SERVED_MODULES),
                                  context_length=args.context_length,
                                  max_total_tokens=max(8192, args.context_length))
            fleet = InferenceFleet(args.model_path, config, api_key=server_key,
                                   log_dir=args.log_dir)
            fleet.start()
            addresses = list(fleet.addresses)
            logger.info("SGLang servers ready: %s (logs in %s)", addresses, fleet.log_dir)
        rank_args = [*argv, "--rank-process", "--fleet-addresses", ",".join(addresses)]
        env = {**os.environ, "AREAL_LIKE_TINKER_SERVER_KEY": server_key or ""}
        if args.trainer_ranks == 1:
            command = [sys.executable, "-m", "areal_like.tinker.serve", *rank_args]
        else:
            port = find_free_port()
            command = [sys.executable, "-m", "areal_like.launcher.torchrun_loopback",
                       f"--nproc-per-node={args.trainer_ranks}", "--master_addr=127.0.0.1",
                       f"--master_port={port}", "-m", "areal_like.tinker.serve", *rank_args]
        ranks = subprocess.Popen(command, env=env)
        supervisor = (FleetSupervisor(fleet, fleet.config.max_restarts, 1,
                                      prefix="[tinker-serve]") if fleet else None)
        while ranks.poll() is None:
            time.sleep(1.0)
            if supervisor is not None:
                supervisor.check()
        return ranks.returncode or 0
    except KeyboardInterrupt:
        return 0
    except (ServerStartError, FleetDownError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if ranks is not None and ranks.poll() is None:
            ranks.terminate()
            try:
                ranks.wait(timeout=60)
            except subprocess.TimeoutExpired:
                ranks.kill()
        if fleet is not None:
            fleet.stop()


if __name__ == "__main__":
    sys.exit(main())

