"""The fleet's end of the delta transport: each server applies trainer rank 0's weight file
through its backend's end (`ServerAPI.apply_weight_file`: SGLang's custom weight loader, our
vLLM worker method; both run `engines/weight_transport/delta/`), and reports a receipt.

Per server: pause (requests retracted) -> open the update -> apply the delta when the server
held its base at the last receipt, else the full file -> on a refusal of the delta (a base it
does not hold: restarted at the same address; a corrupted file) the full file, counted ->
close -> continue. A server that refuses the full file too, or fails on the way, is reported
failed and left paused (it may hold part of the weights): out of service until a later
update includes it.

Runs on trainer rank 0, on the loop of its `FleetUpdater` (engines/fleet/updater.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable

import aiohttp

from areal_like.api.config import RolloutConfig
from areal_like.api.io_struct import WeightUpdateMeta
from engines.server.api import ServerAPI
from engines.server.errors import InferenceServerError
from engines.server.fanout import on_each

logger = logging.getLogger("engines.fleet.client")


class FleetDeltaLoader:
    def __init__(self, config: RolloutConfig, session: Callable[[], aiohttp.ClientSession],
                 api: ServerAPI) -> None:
        self.config = config
        self.api = api
        self.model_digest = config.weights.delta_model_digest
        self._session = session
        self.held: dict[str, str] = {}  # server -> digest of the state it last applied
        self.receipts: dict[str, dict[str, Any]] = {}  # server -> its last receipt
        # delta / full files applied; fallbacks_<why>: deltas refused, then full loads
        self.counts: collections.Counter[str] = collections.Counter(delta=0, full=0)

    async def update(self, targets: list[str], meta: WeightUpdateMeta,
                     full_file: Callable[[], str]) -> dict[str, BaseException]:
        """Apply `meta` on every target at once; the servers that failed, with their errors."""
        lock = asyncio.Lock()  # one thread writes the full file; the others wait for it
        full: dict[str, str] = {}

        async def full_path() -> str:
            async with lock:
                if "path" not in full:
                    full["path"] = await asyncio.to_thread(full_file)
                return full["path"]

        return await on_each(targets, lambda a: self._one(a, meta, full_path))

    async def _one(self, addr: str, meta: WeightUpdateMeta,
                   full_path: Callable[[], Any]) -> None:
        """Pause -> open -> apply -> close -> continue. A server that fails is left paused
        (it may hold part of the weights): out of service until a later update includes it."""
        session = self._session()
        timeout = self.config.weights.update_timeout
        try:
            await self.api.pause(session, addr, self.api.update_pause_mode)
            await self.api.begin_update(session, addr)
            try:
                receipt = await self._apply(session, addr, meta, full_path, timeout)
            except BaseException:
                try:  # SGLang refuses the next update's session while this one is open
                    await self.api.end_update(session, addr)
                except Exception as e:  # noqa: BLE001 - the apply's error is the one raised
                    logger.info("inference server %s: closing a failed update: %s", addr, e)
                raise
            await self.api.end_update(session, addr)
        except Exception:
            self.held.pop(addr, None)
            raise
        await self.api.resume(session, addr)
        self.held[addr] = str(receipt["state_digest"])
        self.receipts[addr] = receipt

    async def _apply(self, session: aiohttp.ClientSession, addr: str, meta: WeightUpdateMeta,
                     full_path: Callable[[], Any], timeout: float) -> dict[str, Any]:
        assert meta.path is not None
        is_delta = meta.base_version is not None
        if is_delta and self.held.get(addr) == meta.base_state_digest:
            receipt = await self.api.apply_weight_file(session, addr, meta.path, meta.version,
                                                       timeout, self.model_digest)
            if receipt.get("applied"):
                self.counts["delta"] += 1
                return receipt
            why = str(receipt.get("refused", "refused"))
            self.counts[f"fallbacks_{why}"] += 1
            logger.warning("inference server %s refused the delta of weights version %d (%s: "
                           "%s); loading the full version instead", addr, meta.version, why,
                           receipt.get("error", ""))
            if receipt.get("partial"):
                raise InferenceServerError(f"inference server {addr} failed while loading "
                                           f"weights version {meta.version}: "
                                           f"{receipt.get('error')}")
        elif is_delta:
            self.counts["fallbacks_unknown_base"] += 1  # new, restarted, or failed before
        path = await full_path() if is_delta else meta.path
        receipt = await self.api.apply_weight_file(session, addr, path, meta.version, timeout,
                                                   self.model_digest)
        if not receipt.get("applied"):
            raise InferenceServerError(f"inference server {addr} refused the full weights "
                                       f"version {meta.version} ({path}): "
                                       f"{receipt.get('error', receipt)}")
        self.counts["full"] += 1
        return receipt

    def stats(self) -> dict[str, float]:
        return {f"weight_sync/{k}_total": float(v) for k, v in sorted(self.counts.items())}
