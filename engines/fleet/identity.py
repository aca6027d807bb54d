"""Whether a server that joins a running fleet serves the same model: the backend's own
description of what it loaded (`ServerAPI.model_identity`) against a server in service; where
both model folders (`ServerAPI.model_folder`) can be read here, every dimension of their
config.json and the shape of every parameter a weight update would send (the safetensors
headers, read without loading a tensor); and its vocabulary against the trainer's
(`rollout.vocab_size`): a request naming the last token id is served, one naming the id past it
refused (`ServerAPI.vocabulary_probe`: a request each backend checks without harm)."""

from __future__ import annotations

import json
import logging
import re
import struct
import uuid
from pathlib import Path
from typing import Any, Optional

import aiohttp

from engines.server.api import ServerAPI
from engines.server.http import CONTROL_TIMEOUT_S

logger = logging.getLogger("engines.fleet.client")
# a config.json key that sizes a parameter or the computation: vocab_size, hidden_size,
# head_dim, num_hidden_layers, num_key_value_heads, num_experts, ... (not token ids)
DIMENSION = re.compile(r"(_size|_dim|^num_|_heads|_layers|experts)")


class NotReady(Exception):
    """The server could not be asked (starting, overloaded): ask again later."""


async def mismatch(session: aiohttp.ClientSession, api: ServerAPI, addr: str,
                   peer: Optional[str], vocab_size: int) -> str:
    """Why `addr` does not serve the fleet's model ('' when it does, as far as can be told)."""
    if peer is not None:
        mine, theirs = await api.model_identity(session, addr), \
            await api.model_identity(session, peer)
        differ = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
                  if mine.get(k) != theirs.get(k)}
        if differ:
            return "serves another model than " + peer + ": " + ", ".join(
                f"{k} {a!r} (fleet: {b!r})" for k, (a, b) in sorted(differ.items()))
        mine_dir, theirs_dir = (await api.model_folder(session, addr),
                                await api.model_folder(session, peer))
        why = folders_differ(mine_dir, theirs_dir)
        if why is None:
            logger.warning("inference server %s: its model folder (%s) or the fleet's (%s) "
                           "cannot be read here; its dimensions are not checked", addr,
                           mine_dir, theirs_dir)
        elif why:
            return f"serves another model than {peer}: {why}"
    if vocab_size > 0:
        if (why := await _refuses(session, api, addr, vocab_size - 1)):
            return (f"refused token id {vocab_size - 1} (rollout.vocab_size="
                    f"{vocab_size}): a smaller vocabulary ({why})")
        if not await _refuses(session, api, addr, vocab_size):
            return (f"accepted token id {vocab_size}, past the trainer's "
                    f"vocabulary (rollout.vocab_size={vocab_size}): a larger vocabulary")
    return ""


async def _refuses(session: aiohttp.ClientSession, api: ServerAPI, addr: str,
                   token_id: int) -> str:
    """'' when `addr` generates a token after the prompt [token_id]; its refusal of the id
    (HTTP 400 naming the token id or the vocabulary); raises `NotReady` for any other answer."""
    payload = api.vocabulary_probe(token_id, f"areal-like-vocabulary-{uuid.uuid4().hex[:12]}")
    async with session.post(f"http://{addr}{api.generate_path}", json=payload,
                            timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as resp:
        if resp.status == 200:
            return ""
        body = (await resp.text())[:300]
    if resp.status == 400 and any(w in body.lower() for w in ("token", "vocab")):
        return f"HTTP 400: {body}"
    raise NotReady(f"the vocabulary probe got HTTP {resp.status}: {body}")



def folders_differ(mine: Optional[str], theirs: Optional[str]) -> Optional[str]:
    """What differs between two model folders ('' nothing a weight update depends on; None:
    one cannot be read here): the dimensions in config.json, then the parameters' shapes."""
    if mine is None or theirs is None:
        return None
    mine_config, theirs_config = (_read_json(Path(folder) / "config.json")
                                  for folder in (mine, theirs))
    if mine_config is None or theirs_config is None:
        return None
    # only what both name: a folder the trainer wrote may add keys (a VLM's flattened
    # text_config) or name parameters by another convention
    dims = [_dimensions(mine_config), _dimensions(theirs_config)]
    differ = sorted(k for k in set(dims[0]) & set(dims[1]) if dims[0][k] != dims[1][k])
    if differ:
        return ", ".join(f"{k} {dims[0][k]!r} (fleet: {dims[1][k]!r})" for k in differ[:6])
    shapes = [_parameter_shapes(Path(folder)) for folder in (mine, theirs)]
    if shapes[0] is None or shapes[1] is None:
        return None
    names = sorted(n for n in set(shapes[0]) & set(shapes[1]) if shapes[0][n] != shapes[1][n])
    if names:
        return f"{len(names)} parameter(s) of another shape, e.g. " + ", ".join(
            f"{n} {shapes[0][n]} (fleet: {shapes[1][n]})" for n in names[:3])
    return ""


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _dimensions(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every dimension of a config.json, nested sections (text_config, vision_config) too."""
    found: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            found.update(_dimensions(value, f"{prefix}{key}."))
        elif (isinstance(value, int) and DIMENSION.search(key)
              and not key.endswith("_token_id")) or key == "tie_word_embeddings":
            found[prefix + key] = value
    return found


def _parameter_shapes(folder: Path) -> Optional[dict[str, list[int]]]:
    """{name: shape} from the headers of the folder's safetensors files (None: none here)."""
    shapes: dict[str, list[int]] = {}
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        try:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            return None
        shapes.update({name: list(entry["shape"]) for name, entry in header.items()
                       if name != "__metadata__" and isinstance(entry, dict)})
    return shapes if files else None
