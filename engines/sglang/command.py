"""The `sglang.launch_server` command line of one server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from areal_like.api.config import ServerConfig
from engines.server.errors import ServerStartError
from engines.sglang.weight_files import loader_args


def build_server_command(
    python: Path,
    model_path: str,
    port: int,
    config: ServerConfig,
    host: str = "127.0.0.1",
    api_key: Optional[str] = None,
    weight_version: int = 0,
) -> list[str]:
    """The `sglang.launch_server` command line for one server.

    The tokenizer stays loaded (--skip-tokenizer-init would disable `min_new_tokens`), but
    requests talk in token ids, so SGLang's handling of a custom tokenizer never matters.
    """
    cmd = [
        str(python), "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--dtype", config.dtype,
        "--context-length", str(config.context_length),
        "--max-total-tokens", str(config.max_total_tokens),
        "--mem-fraction-static", str(config.mem_fraction_static),
        "--weight-version", str(weight_version),
        "--log-level", "warning",
        *loader_args(),  # the delta transport's weight files (rollout.weights.transport)
    ]
    if config.device == "cpu":
        # torch_native: the CPU engine's dense path that needs no sgl_kernel (see the shim).
        # --sleep-on-idle: an idle scheduler otherwise busy-polls a whole core.
        # --skip-server-warmup: its warm-up generation only delays /health (~1.3 s of a
        # server's start on this CPU, the first requests as fast; docs/benchmarks.md)
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle",
                "--skip-server-warmup"]
    elif config.gpus_per_server > 1:
        cmd += ["--tp-size", str(config.gpus_per_server)]
    if config.deterministic:
        # per-request sampling_seed + batch-invariant kernels (on CPU: engines/sglang/shim)
        cmd += ["--enable-deterministic-inference"]
    if config.lora_rank > 0:
        cmd += lora_server_args(config)
    cmd += vision_server_args(model_path)
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += [str(a) for a in config.extra_args]
    return cmd


def vision_server_args(model_path: str) -> list[str]:
    """For a vision-language folder: resize images as the folder's image processor does.

    SGLang replaces a Qwen2-VL processor's `size` (its pixel budget) with the released
    checkpoints' (up to 1003520 pixels) whatever the folder says, so a large image would get
    more tokens on the server than in the trainer's processor (areal_like.models.vision); its
    per-request image options put the folder's own budget back."""
    folder = Path(model_path)
    try:
        config = json.loads((folder / "config.json").read_text())
        processor = json.loads((folder / "preprocessor_config.json").read_text())
    except (OSError, ValueError):  # no such files, or broken ones: the server names them
        return []
    if not isinstance(config, dict) or not isinstance(processor, dict) \
            or "vision_config" not in config or "size" not in processor:
        return []
    return ["--mm-process-config", json.dumps({"image": {"size": processor["size"]}})]


def lora_server_args(config: ServerConfig) -> list[str]:
    """Serve base + run-time-loaded LoRA adapters (SGLang's own LoRA support). Two adapter
    slots per batch: the policy's adapter and base-model requests."""
    if not config.lora_target_modules:
        raise ServerStartError("server.lora_rank > 0 but server.lora_target_modules is empty")
    args = ["--enable-lora", "--max-lora-rank", str(config.lora_rank),
            "--lora-target-modules", *config.lora_target_modules, "--max-loras-per-batch", "2"]
    if config.device == "cpu":
        args += ["--lora-backend", "torch_native"]  # the others are GPU kernels
    return args
