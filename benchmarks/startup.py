"""Where start-up time goes: an SGLang server (spawned vs forked children) and a torchrun job.

    python benchmarks/startup.py [--rounds 3] [--fleet 2] [--skip-torchrun]

SGLang server, started as the tests and the launcher start it (`InferenceFleet`, tiny 1m model,
one thread), with its log at info level read as it grows; each phase ends when its line first
appears (median over rounds):
- `imports`: until the server process prints its arguments (Python start + `import sglang`);
- `children`: until the scheduler begins to initialise (its process started and, when
  spawned, imported SGLang again; the detokenizer starts beside it);
- `model load`: until the weights are loaded and the KV cache allocated;
- `warm-up`: from the HTTP server listening until `/health` answers 200 (SGLang's warm-up
  generation runs in between; the launcher polls every 0.5 s).
Rows: `spawn` (SGLang's default start method, the baseline), `fork` (the server started by
command, its children forked) and `zygote` (`server.fork_children=true` as it is now: the
server itself forked from an interpreter that imported SGLang first, `engines/fleet/zygote.py`;
`imports` then is the zygote's); the ratio is against `spawn` of the same run.

A fleet of `--fleet` servers (default 2) started by command (`fork`, the baseline) and forked
from one zygote (`zygote`): seconds until every server answers `/health`, then until a
SIGKILLed server restarted by the fleet answers again, alternating the two, median of rounds.

torchrun: `torchrun --nproc_per_node=2` of a script that imports torch, joins a gloo group and
exits; and the same script importing the trainer's modules (`recipes.grpo`) first.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from areal_like.api.config import ServerConfig  # noqa: E402
from areal_like.models.tiny import build_tiny_model  # noqa: E402
from areal_like.utils.network import find_free_port  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402

PHASES = [("imports", "server_args="), ("children", "Init parallel begin"),
          ("model load", "Memory pool end"), ("HTTP up", "Uvicorn running")]

RANK_SCRIPT = """
import sys
if sys.argv[1] == "trainer":
    import recipes.grpo  # noqa: F401  (the trainer's imports)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


class StartedByCommand(InferenceFleet):
    """The fleet as it was before the zygote: each server its own interpreter."""

    @property
    def forks_servers(self) -> bool:
        return False


def _fleet(model: Path, mode: str, log_dir: Path, **config: object) -> InferenceFleet:
    server = ServerConfig(context_length=1024, max_total_tokens=16384,
                          fork_children=mode != "spawn", **config)  # type: ignore[arg-type]
    fleet = (StartedByCommand if mode != "zygote" else InferenceFleet)(model, server,
                                                                     log_dir=log_dir)
    assert fleet.forks_servers == (mode == "zygote")
    return fleet


def server_phases(model: Path, mode: str, log_dir: Path) -> dict[str, float]:
    fleet = _fleet(model, mode, log_dir, extra_args=["--log-level", "info"])
    marks: dict[str, float] = {}
    t0 = time.monotonic()
    done = threading.Event()

    def watch() -> None:  # the phases, as their lines reach the log
        while not done.is_set():
            text = fleet.log_paths[0].read_text() if fleet.log_paths else ""
            for name, line in PHASES:
                if name not in marks and line in text:
                    marks[name] = time.monotonic() - t0
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        fleet.start()
        marks["total"] = time.monotonic() - t0
    finally:
        done.set()
        watcher.join()
        fleet.stop()
    missing = [name for name, _ in PHASES if name not in marks]
    assert not missing, f"log lines not seen: {missing} (SGLang changed its messages?)"
    return marks


def fleet_seconds(model: Path, mode: str, n_servers: int, log_dir: Path) -> tuple[float, float]:
    """(start: until all `n_servers` answer /health, restart: of the last one, SIGKILLed)."""
    fleet = _fleet(model, mode, log_dir, n_servers=n_servers)
    t0 = time.monotonic()
    try:
        fleet.start()
        start = time.monotonic() - t0
        victim = fleet.processes[-1]
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
        t0 = time.monotonic()
        fleet.restart_server(n_servers - 1)
        fleet.wait_healthy(300)
        return start, time.monotonic() - t0
    finally:
        fleet.stop()


def torchrun_seconds(mode: str, script: Path) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--master_addr=127.0.0.1", f"--master_port={find_free_port()}", str(script),
                    mode],
                   cwd=REPO, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fleet", type=int, default=2, help="servers in the fleet rows")
    parser.add_argument("--skip-torchrun", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup_bench_"))
    model = build_tiny_model(work / "tiny_1m", size="1m", seed=1)

    rows: dict[str, dict[str, float]] = {}
    for mode in ("spawn", "fork", "zygote"):
        runs = [server_phases(model, mode, work / f"{mode}{r}") for r in range(args.rounds)]
        rows[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\nSGLang server start-up, seconds (median of {args.rounds}), tiny 1m model")
    names = ["imports", "children", "model load", "warm-up", "total"]
    print(f"{'mode':8}" + "".join(f"{n:>12}" for n in names) + f"{'vs spawn':>10}")
    for mode, m in rows.items():
        parts = [m["imports"], m["children"] - m["imports"], m["model load"] - m["children"],
                 m["total"] - m["HTTP up"], m["total"]]
        ratio = m["total"] / rows["spawn"]["total"]
        print(f"{mode:8}" + "".join(f"{p:12.1f}" for p in parts) + f"{ratio:10.2f}x",
              flush=True)

    fleets: dict[str, list[tuple[float, float]]] = {"fork": [], "zygote": []}
    for r in range(args.rounds):  # alternating, so that both see the same machine
        for mode in fleets:
            fleets[mode].append(fleet_seconds(model, mode, args.fleet, work / f"fleet{mode}{r}"))
    print(f"\nA fleet of {args.fleet} SGLang servers, seconds (median of {args.rounds})")
    print(f"{'mode':8}{'start':>10}{'vs fork':>10}{'restart':>10}{'vs fork':>10}")
    base = [statistics.median(x[i] for x in fleets["fork"]) for i in (0, 1)]
    for mode, timed in fleets.items():
        start, restart = (statistics.median(x[i] for x in timed) for i in (0, 1))
        print(f"{mode:8}{start:10.1f}{start / base[0]:9.2f}x{restart:10.1f}"
              f"{restart / base[1]:9.2f}x", flush=True)

    if not args.skip_torchrun:
        script = work / "rank.py"
        script.write_text(RANK_SCRIPT)
        bare = statistics.median(torchrun_seconds("bare", script) for _ in range(args.rounds))
        trainer = statistics.median(torchrun_seconds("trainer", script)
                                    for _ in range(args.rounds))
        print(f"\ntorchrun --nproc_per_node=2, seconds (median of {args.rounds})")
        print(f"{'torch + gloo group':28}{bare:8.1f}{1.0:8.2f}x")
        print(f"{'+ trainer imports':28}{trainer:8.1f}{trainer / bare:8.2f}x")


if __name__ == "__main__":
    main()
