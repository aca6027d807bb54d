"""SGLang's end of the delta transport: a weight file applied by our custom weight loader
(`areal_like_weight_delta.load_weight_file`, named by `--custom-weight-loader`) inside
SGLang's `/update_weights_from_tensor`, between `/begin_weight_update` and
`/end_weight_update`. The request's one "tensor" is a placeholder whose name says which file
to apply and where to write the receipt: SGLang discards a custom loader's result, and an
exception in it would end the scheduler, so the loader reports through a file beside the
weight file (the directory both ends share)."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from engines.server.errors import InferenceServerError
from engines.server.http import CONTROL_TIMEOUT_S, get_json, post_json

LOADER = "areal_like_weight_delta.load_weight_file"
RECEIPT_WAIT_S = 10.0  # written before SGLang answers; a shared file system may lag


def loader_args() -> list[str]:
    return ["--custom-weight-loader", LOADER]


async def apply_weight_file(session: aiohttp.ClientSession, addr: str, path: str,
                            version: int, timeout: float,
                            model_digest: bool) -> dict[str, Any]:
    """Apply `path` on `addr` (inside an open update) and, when applied, label the server
    with `version`; the receipt of its first rank."""
    import torch

    info = await get_json(session, addr, "/get_server_info")
    if LOADER not in (info.get("custom_weight_loader") or []):
        raise InferenceServerError(
            f"SGLang server {addr} was not started with --custom-weight-loader {LOADER} (and "
            f"engines/weight_transport/delta on its PYTHONPATH): it cannot apply weight files "
            f"(rollout.weights.transport=delta); start it with `areal-like serve` or add both")
    tp_size = int(info.get("tp_size", 1) or 1)
    receipts = Path(path).parent / "receipts"
    receipts.mkdir(exist_ok=True)
    receipt = receipts / f"{version}-{addr.replace(':', '_')}-{uuid.uuid4().hex[:8]}"
    request = json.dumps({"path": path, "receipt": str(receipt), "model_digest": model_digest})
    payload = base64.b64encode(pickle.dumps([(request, torch.zeros(1))])).decode("ascii")
    reply = await post_json(session, addr, "/update_weights_from_tensor",
                            {"serialized_named_tensors": [payload] * tp_size,
                             "load_format": LOADER, "flush_cache": True,
                             "selector": "target"}, timeout, retries=0)
    if not (isinstance(reply, dict) and reply.get("success")):
        raise InferenceServerError(f"SGLang server {addr} failed to apply weight file {path}: "
                                   f"{reply}")
    ranks = [await _read(Path(f"{receipt}.{rank}"), addr) for rank in range(tp_size)]
    for extra in ranks[1:]:
        if extra.get("applied") != ranks[0].get("applied"):
            raise InferenceServerError(f"SGLang server {addr}: its tensor-parallel ranks "
                                       f"disagree on weight file {path}: {ranks}")
    if ranks[0].get("applied"):  # only then: SGLang would label whatever it holds
        await post_json(session, addr, "/update_weight_version",
                        {"new_version": str(version), "abort_all_requests": False},
                        CONTROL_TIMEOUT_S)
    return ranks[0]


async def _read(path: Path, addr: str) -> dict[str, Any]:
    deadline = time.monotonic() + RECEIPT_WAIT_S
    while True:
        try:
            receipt = json.loads(path.read_text())
            path.unlink(missing_ok=True)
            return dict(receipt)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise InferenceServerError(
                    f"SGLang server {addr} answered but wrote no receipt {path}: is the "
                    f"directory shared with the server, and was it started with "
                    f"--custom-weight-loader {LOADER} (engines/weight_transport/delta on its "
                    f"PYTHONPATH)?") from None
            await asyncio.sleep(0.1)
