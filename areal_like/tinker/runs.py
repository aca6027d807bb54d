"""The Tinker API's REST views of training runs and their checkpoints, read from the storage
folder (`<storage>/<model id>/<weights|sampler_weights>/<name>/tinker_checkpoint.json`), so
runs of earlier server processes are listed too."""

from __future__ import annotations

import datetime
import json
import os
import shutil
from typing import Any, Optional

from areal_like.tinker.errors import NotFound, UserError

CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}
META_FILE = "tinker_checkpoint.json"


def _folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def checkpoints(storage_dir: str, model_dir: str) -> list[dict[str, Any]]:
    """Every checkpoint of one model folder, oldest first, as the SDK's Checkpoint."""
    found = []
    for kind, checkpoint_type in CHECKPOINT_TYPES.items():
        kind_dir = os.path.join(storage_dir, model_dir, kind)
        for name in sorted(os.listdir(kind_dir)) if os.path.isdir(kind_dir) else []:
            meta_path = os.path.join(kind_dir, name, META_FILE)
            if not os.path.isfile(meta_path):
                continue  # being written
            with open(meta_path) as f:
                meta = json.load(f)
            found.append({
                "checkpoint_id": f"{kind}/{name}", "checkpoint_type": checkpoint_type,
                "time": meta["time"], "size_bytes": _folder_size(os.path.join(kind_dir, name)),
                "tinker_path": f"tinker://{meta['model_id']}/{kind}/{name}", "public": False,
                "user_metadata": _strings(meta.get("user_metadata"))})
    return sorted(found, key=lambda c: c["time"])


def training_run(storage_dir: str, run_id: str, alive: Optional[dict[str, Any]],
                 base_model: str) -> dict[str, Any]:
    """The SDK's TrainingRun for model `run_id` (alive: what the service holds of it)."""
    model_dir = run_id.replace(":", "_")
    saved = checkpoints(storage_dir, model_dir)
    if alive is None and not saved:
        raise NotFound(f"no training run {run_id!r} (no live model, no checkpoints)")
    training = [c for c in saved if c["checkpoint_type"] == "training"]
    sampler = [c for c in saved if c["checkpoint_type"] == "sampler"]
    meta = alive or _meta(storage_dir, model_dir, saved[-1]["checkpoint_id"])
    last = alive["last_request_time"] if alive else saved[-1]["time"]
    return {"training_run_id": run_id, "base_model": base_model, "model_owner": "local",
            "is_lora": True, "corrupted": False, "lora_rank": meta["lora_rank"],
            "last_request_time": last,
            "last_checkpoint": training[-1] if training else None,
            "last_sampler_checkpoint": sampler[-1] if sampler else None,
            "user_metadata": _strings(meta.get("user_metadata"))}


def run_ids(storage_dir: str, alive: list[str]) -> list[str]:
    """Live models and every model with a checkpoint on disk."""
    ids = set(alive)
    for model_dir in os.listdir(storage_dir) if os.path.isdir(storage_dir) else []:
        saved = checkpoints(storage_dir, model_dir)
        if saved:
            ids.add(saved[0]["tinker_path"].removeprefix("tinker://").split("/")[0])
    return sorted(ids)


def checkpoint_owner(folder: str) -> Optional[str]:
    """The key fingerprint a checkpoint records (None: none recorded, or being written)."""
    meta_path = os.path.join(folder, META_FILE)
    if not os.path.isfile(meta_path):
        return None
    with open(meta_path) as f:
        owner = json.load(f).get("owner")
    return str(owner) if owner is not None else None


def run_owner(storage_dir: str, run_id: str) -> Optional[str]:
    """The key fingerprint that made run `run_id`, as its newest checkpoint records it."""
    model_dir = run_id.replace(":", "_")
    saved = checkpoints(storage_dir, model_dir)
    return checkpoint_owner(os.path.join(storage_dir, model_dir, saved[-1]["checkpoint_id"])) \
        if saved else None


def delete_checkpoint(storage_dir: str, run_id: str, checkpoint_id: str) -> None:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in CHECKPOINT_TYPES or not name or "/" in name or name in (".", ".."):
        raise UserError(f"checkpoint id {checkpoint_id!r}: expected weights/<name> or "
                        f"sampler_weights/<name>")
    folder = os.path.join(storage_dir, run_id.replace(":", "_"), kind, name)
    if not os.path.isdir(folder):
        raise NotFound(f"no checkpoint {checkpoint_id!r} of {run_id!r}")
    shutil.rmtree(folder)


def _meta(storage_dir: str, model_dir: str, checkpoint_id: str) -> dict[str, Any]:
    with open(os.path.join(storage_dir, model_dir, checkpoint_id, META_FILE)) as f:
        meta: dict[str, Any] = json.load(f)
    return meta


def _strings(metadata: Any) -> Optional[dict[str, str]]:
    return {str(k): str(v) for k, v in metadata.items()} if metadata else None


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()
