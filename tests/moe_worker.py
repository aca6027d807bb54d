"""Worker for tests/test_moe_engine.py, run as `torchrun --nproc_per_node=2 moe_worker.py`.

Every mixture-of-experts scenario of the FSDP2 engine in one launch; rank 0 writes the inputs
and what it observed to <out>/results.pt, and the test computes the references itself.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fsdp_worker import engine_config, full_params, make_batch, n_trained_tokens, nll_loss
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from areal_like.api import WeightUpdateMeta
from areal_like.api.moe_config import MoEConfig
from areal_like.api.trajectory import NO_EXPERT, ROUTED_EXPERTS
from engines.fsdp.engine import FSDPEngine
from engines.fsdp.packing import shard_batch

AUX_COEF = 0.5  # large, so that the balancing term visibly moves the routers


def forced_routing(batch: TensorDict, n_layers: int, top_k: int, n_experts: int,
                   seed: int) -> torch.Tensor:
    """Random distinct experts per token and layer [B, L, n_layers * top_k] (int16), with
    NO_EXPERT on every row's last real token (the server never forwards it)."""
    gen = torch.Generator().manual_seed(seed)
    b, seq_len = batch["input_ids"].shape
    scores = torch.rand(b, seq_len, n_layers, n_experts, generator=gen)
    routed = scores.topk(top_k, dim=-1).indices.to(torch.int16).reshape(b, seq_len, -1)
    lengths = batch["attention_mask"].sum(-1)
    for row, n in enumerate(lengths.tolist()):
        routed[row, n - 1] = NO_EXPERT
    return routed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dense-model", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    res: dict[str, Any] = {"world_size": world}

    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    n_layers, top_k, n_experts = (config.num_hidden_layers, config.num_experts_per_tok,
                                  config.num_experts)
    batch = make_batch(1, [23, 7, 15, 30, 4, 11], config.vocab_size)
    batch[ROUTED_EXPERTS] = forced_routing(batch, n_layers, top_k, n_experts, seed=3)
    res["batch"] = batch.to_dict()
    local = shard_batch(batch, rank, world)
    res["local_rows"] = [None] * world
    dist.all_gather_object(res["local_rows"], local["input_ids"].shape[0])

    # 1. Forward without replay (several micro-batches), and one train step with the
    #    load-balancing loss; the expert weights are sharded across the ranks.
    eng = FSDPEngine(engine_config(args.model, max_tokens=40,
                                   moe=MoEConfig(aux_loss_coef=AUX_COEF)))
    eng.initialize()
    experts = eng.model.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(experts, DTensor)
    res["expert_local_shape"] = tuple(experts.to_local().shape)
    res["expert_placements"] = str(experts.placements)
    res["forward_logprobs"] = eng.forward(batch)
    whole = FSDPEngine(engine_config(args.model, moe=MoEConfig(aux_loss_coef=AUX_COEF)))
    whole.initialize()  # one micro-batch per rank: the reference's aux loss per rank
    res["step"] = whole.train_batch(local, nll_loss, n_trained_tokens)
    res["params_step"] = full_params(whole)
    # the process-group transport's tensors, per expert as the HF folder names them
    specs = whole.weight_specs()
    buckets = [specs[i:i + 7] for i in range(0, len(specs), 7)]  # pieces span buckets
    sent = [t.clone() for ts in whole.iter_weight_buckets(buckets) if ts is not None
            for t in ts]  # rank 0's
    res["sent"] = dict(zip([s.name for s in specs], sent, strict=rank == 0))
    whole.update_weights(WeightUpdateMeta.from_disk(str(out / "export"), 1))
    whole.destroy()
    eng.destroy()

    # 2. Router replay: the forced experts route every token that has them.
    replay = FSDPEngine(engine_config(args.model, max_tokens=40,
                                      moe=MoEConfig(router_replay=True)))
    replay.initialize()
    res["replay_logprobs"] = replay.forward(batch)
    routers = replay._routers
    assert routers is not None
    one = batch[:1]  # the selected experts of one row's forward
    replay.forward(one)
    res["replay_selected_row0"] = routers.selected_experts().clone()
    errors: dict[str, str] = {}
    wrong = batch.clone()
    wrong[ROUTED_EXPERTS] = wrong[ROUTED_EXPERTS][:, :, :-top_k]  # a layer short
    try:
        replay.forward(wrong)
    except ValueError as e:
        errors["layer_count"] = str(e)
    unrouted = batch.clone()
    del unrouted[ROUTED_EXPERTS]
    try:
        replay.forward(unrouted)
    except ValueError as e:
        errors["missing"] = str(e)
    replay.destroy()
    try:
        FSDPEngine(engine_config(args.dense_model, moe=MoEConfig(router_replay=True))
                   ).initialize()
    except ValueError as e:
        errors["dense"] = str(e)
    res["errors"] = errors

    if rank == 0:
        torch.save(res, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
