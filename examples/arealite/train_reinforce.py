"""The training loop of AReaL-lite's "Training Algorithm" document (Step 3), ported: the
document's `main` with its imports changed, the setup it leaves out (config, tokenizer,
data, FinetuneSpec) and the weight update it elides written as AReaL-lite's own GRPO example
writes them, each such line marked `# areal-like:`. Run it like any script of yours:

    python -m areal_like.launcher.local examples/arealite/train_reinforce.py \
        --config examples/arealite/reinforce.yaml model.path=<model folder>
"""

import itertools
import json
import os
import sys

import torch
import torch.distributed as dist
from reinforce_actor import FSDPReinforceActor
from remax_workflow import ReMaxRLVRWorkflow
from torch.utils.data import DataLoader

from areal_like.arealite import (
    FinetuneSpec,
    GRPOConfig,
    RemoteSGLangEngine,
    WeightUpdateMeta,
    gsm8k_reward_fn,
    load_expr_config,
    load_hf_tokenizer,
    stats_tracker,
)
from areal_like.data.tasks import build_task


def main(args):
    config, _ = load_expr_config(args, GRPOConfig)  # areal-like: the setup the document leaves out, from here ...
    tokenizer = load_hf_tokenizer(config.model.path)
    dataset = build_task(config.train_dataset).dataset
    dataloader = DataLoader(dataset, batch_size=config.train_dataset.batch_size, shuffle=True, collate_fn=lambda x: x)
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=len(dataset), train_batch_size=config.train_dataset.batch_size)
    max_steps = config.total_train_steps  # areal-like: ... to here
    # Initialize inference engine for rollouts
    rollout = RemoteSGLangEngine(config.rollout)
    rollout.initialize(None, ft_spec)
    # Initialize training engine
    actor = FSDPReinforceActor(config=config.actor)
    actor.initialize(None, ft_spec)
    # Create rollout workflow
    workflow = ReMaxRLVRWorkflow(
        reward_fn=gsm8k_reward_fn,
        gconfig=config.gconfig,
        tokenizer=tokenizer,
    )
    # Main training loop
    data_generator = itertools.cycle(dataloader)
    for global_step in range(max_steps):
        # Generate training data
        with stats_tracker.record_timing("rollout"):
            batch = rollout.rollout_batch(next(data_generator), workflow=workflow)
        batch = batch.to(actor.device)
        # Synchronize all processes
        dist.barrier()
        if torch.cuda.is_available(): torch.cuda.synchronize()  # areal-like: the document's unguarded call fails on a CPU-only machine  # noqa: E701
        # Training step
        with (
            stats_tracker.record_timing("train_step"),
            stats_tracker.scope("actor"),
        ):
            stats = actor.train_reinforce(batch)
            actor.step_lr_scheduler()
        # Update model weights
        with stats_tracker.record_timing("update_weights"):
            # Weight update logic here
            meta = WeightUpdateMeta.from_disk(f"{os.path.abspath(config.logging.log_dir)}/arealite_weights/v{global_step + 1}", global_step + 1)  # areal-like: the weight update the document elides, as AReaL-lite's GRPO example writes it, from here ...
            rollout.pause()
            if dist.get_rank() == 0:
                future = rollout.update_weights(meta)
            actor.upload_weights(meta)
            if dist.get_rank() == 0:
                future.result()
            dist.barrier()
            rollout.resume()
            actor.set_version(global_step + 1)
            rollout.set_version(global_step + 1)  # areal-like: ... to here
        print(json.dumps({"step": global_step, "loss": stats["loss"], "reward": batch["rewards"][:, 0].tolist(), "versions": sorted(set(batch["versions"][batch["loss_mask"].bool()].tolist()))}), flush=True)  # areal-like: what the test reads
    rollout.destroy()  # areal-like: the document's loop ends without cleanup
    actor.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
