"""One trainer rank of `tinker-serve`: every rank holds the training models' FSDP2 shards;
rank 0 also serves the HTTP API and drives the others (areal_like.tinker.ranks)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from aiohttp import web

from areal_like.tinker.app import build_app
from areal_like.tinker.ranks import TrainerRanks, control_group, follow
from areal_like.tinker.sampling import FleetSampler
from areal_like.tinker.service import ServiceConfig, TinkerService
from areal_like.tinker.trainer import TinkerTrainer
from areal_like.utils.distributed import ensure_process_group
from engines.fsdp.dist import resolve_device_and_backend

logger = logging.getLogger("areal_like.tinker")
HEARTBEAT_S = 20.0


def run_rank(args: argparse.Namespace) -> int:
    device, backend = resolve_device_and_backend("auto")
    ensure_process_group(backend, device)
    import torch.distributed as dist

    group = control_group(HEARTBEAT_S)
    trainer = TinkerTrainer(os.path.abspath(args.model_path), args.max_tokens_per_mb)
    if dist.get_rank() != 0:
        follow(trainer, group)
        return 0
    ranks = TrainerRanks(trainer, group, HEARTBEAT_S)
    ranks.start()
    try:
        asyncio.run(_serve(args, ranks))
    finally:
        ranks.stop()
    return 0


async def _serve(args: argparse.Namespace, ranks: TrainerRanks) -> None:
    from transformers import AutoConfig

    model_path = os.path.abspath(args.model_path)
    name = args.model_name or os.path.basename(model_path.rstrip("/"))
    vocab = int(AutoConfig.from_pretrained(model_path).vocab_size)
    config = ServiceConfig(model_name=name, model_path=model_path,
                           storage_dir=os.path.abspath(args.storage_dir),
                           max_lora_rank=args.max_lora_rank, max_models=args.max_models,
                           session_timeout_s=args.session_timeout, vocab_size=vocab,
                           max_tokens_per_datum=args.max_tokens_per_mb)
    addresses = [a for a in args.fleet_addresses.split(",") if a]
    sampler = FleetSampler(addresses, os.environ.get("AREAL_LIKE_TINKER_SERVER_KEY") or None,
                           args.context_length)
    sampler.start()
    service = TinkerService(config, ranks, sampler)
    app = build_app(service, api_key=args.api_key, poll_wait_s=args.poll_wait,
                    context_length=args.context_length)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("Tinker API on http://%s:%d (model %r, storage %s)", args.host, args.port,
                name, config.storage_dir)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        sampler.stop()
