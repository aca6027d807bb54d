"""Running a test's worker script under `torchrun --nproc_per_node=N` (2 by default) here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_like.utils.network import find_free_port

LAUNCH_TIMEOUT_S = 600


def run_worker(worker: str, model_dir: Path, out: Path, *extra: str,
               nproc: int = 2) -> dict[str, Any]:
    """Run tests/`worker` on `nproc` ranks (`--model model_dir --out out` + `extra` arguments,
    loopback rendezvous, one thread each); fail the test with its output if it fails; return
    `out`/results.pt."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()),
           str(Path(__file__).with_name(worker)), "--model", str(model_dir), "--out", str(out),
           *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker {worker} failed (rc={proc.returncode}):\n"
                    f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return torch.load(out / "results.pt", weights_only=False)
