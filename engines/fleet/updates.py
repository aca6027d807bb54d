"""One weight update on a fleet, server by server: pause -> load -> continue, the continue in
each server's own `finally`. Shared by the client's membership (readmission, in-process
updates) and trainer rank 0's `FleetUpdater`, so both load weights the same way and judge a
fleet-wide failure by the same rule."""

from __future__ import annotations

import logging
from typing import Optional

import aiohttp

from areal_like.api.io_struct import WeightUpdateMeta
from engines.server.api import ServerAPI
from engines.server.errors import InferenceServerError
from engines.server.fanout import on_each

logger = logging.getLogger("engines.fleet.client")

ANSWER_TIMEOUT_S = 5.0  # is a server that failed an update still there?


async def update_one(session: aiohttp.ClientSession, api: ServerAPI, addr: str,
                     meta: Optional[WeightUpdateMeta], timeout: float) -> None:
    """Pause `addr` (`api.update_pause_mode`: in-flight requests retracted, or aborted and
    continued by their client), load `meta` (None: keep the weights), continue. The continue
    always runs, even after a failed or cancelled load."""
    error: Optional[Exception] = None
    try:
        await api.pause(session, addr, api.update_pause_mode)
        if meta is not None:
            await api.load_weights(session, addr, meta, timeout)
    except Exception as e:  # noqa: BLE001 - raised below, after the continue
        error = e
    finally:  # a cancelled update still continues the server
        try:
            await api.resume(session, addr)
        except Exception as e:  # noqa: BLE001
            if error is None:
                error = e
            else:
                logger.error("inference server %s: could not continue after a failed "
                             "update: %s", addr, e)
    if error is not None:
        raise error


async def update_each(session: aiohttp.ClientSession, api: ServerAPI, targets: list[str],
                      meta: WeightUpdateMeta, timeout: float) -> dict[str, BaseException]:
    """`update_one` on every target at once; the servers that failed, with their errors."""
    return await on_each(targets, lambda a: update_one(session, api, a, meta, timeout))



async def refused_everywhere(session: aiohttp.ClientSession, api: ServerAPI,
                             targets: list[str], failed: dict[str, BaseException],
                             version: int) -> Optional[InferenceServerError]:
    """When every target failed and one of them still answers, the weights (not the servers)
    are at fault: the error to raise, and the version must not move. None otherwise (some
    server loaded them, or every failed one is gone and loads them when it comes back)."""
    if not targets or len(failed) < len(targets):
        return None
    alive = [a for a in failed if not await api.answers(session, a, ANSWER_TIMEOUT_S)]
    if not alive:
        return None
    errors = "; ".join(str(failed[a]) for a in alive)
    return InferenceServerError(f"weight update to version {version} failed on every "
                                f"server: {errors}")
