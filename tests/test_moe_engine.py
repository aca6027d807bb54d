"""A mixture of experts (tiny Qwen3-MoE) in the FSDP2 engine under a real `torchrun
--nproc_per_node=2` (gloo), against float64 references computed here with transformers in one
process: log-probs, one optimizer step with the load-balancing loss, router replay (R3), the
experts as the fleet receives them, and the errors of bad routing input.

One launch of tests/moe_worker.py runs every scenario; each test checks one of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import fsdp_worker as W
import moe_worker as MW
import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import run_worker
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from areal_like.api.trajectory import ROUTED_EXPERTS
from engines.fsdp.packing import shard_batch

pytestmark = [pytest.mark.torchrun, pytest.mark.e2e]

TOL = 1e-5  # float32 engine against a float64 reference


@pytest.fixture(scope="module")
def run(tiny_moe_dir: Path, tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("moe_worker")
    res = run_worker("moe_worker.py", tiny_moe_dir, out, "--dense-model", str(tiny_model_dir))
    res["out"], res["model_dir"] = out, tiny_moe_dir
    return res


def _reference(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager").double()


def _force_routing(model: Any, routed: Optional[torch.Tensor]) -> None:
    """Make every router of `model` select `routed` [T, layers * k] (own top-k where -1), gates
    from its own float64 softmax over the forced experts, renormalised."""
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate
        per_layer = None if routed is None else routed.reshape(routed.shape[0], -1, gate.top_k)

        def forward(h: torch.Tensor, gate: Any = gate, layer: int = layer,
                    per_layer: Optional[torch.Tensor] = per_layer) -> Any:
            logits = h.reshape(-1, h.shape[-1]) @ gate.weight.T
            probs = torch.softmax(logits.double(), -1)
            own = probs.topk(gate.top_k, -1).indices
            idx = own if per_layer is None else torch.where(
                per_layer[:, layer] >= 0, per_layer[:, layer].long(), own)
            weights = probs.gather(-1, idx)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), idx
        gate.forward = forward


def _per_sequence_logprobs(model: Any, batch: dict[str, torch.Tensor],
                           replay: bool) -> list[torch.Tensor]:
    rows = []
    with torch.no_grad():
        for b in range(batch["input_ids"].shape[0]):
            n = int(batch["attention_mask"][b].sum())
            seq = batch["input_ids"][b, :n]
            if replay:
                _force_routing(model, batch[ROUTED_EXPERTS][b, :n])
            logits = model(input_ids=seq[None]).logits[0]
            rows.append(torch.log_softmax(logits, -1)[:-1].gather(-1, seq[1:, None])[:, 0])
    return rows


def test_expert_weights_are_sharded_across_ranks(run: dict[str, Any]) -> None:
    n_experts, width2, hidden = 8, 2 * 96, 128
    assert run["world_size"] == 2
    assert run["expert_local_shape"] == (n_experts // 2, width2, hidden)
    assert "Shard(dim=0)" in run["expert_placements"]


def test_forward_logprobs_match_float64_reference(run: dict[str, Any]) -> None:
    ref = _per_sequence_logprobs(_reference(run["model_dir"]), run["batch"], replay=False)
    for b, want in enumerate(ref):
        got = run["forward_logprobs"][b, : want.shape[0]].double()
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_replayed_routing_matches_forced_reference(run: dict[str, Any]) -> None:
    batch = run["batch"]
    model = _reference(run["model_dir"])
    forced = _per_sequence_logprobs(model, batch, replay=True)
    _force_routing(model, None)
    own = _per_sequence_logprobs(model, batch, replay=False)
    for b, want in enumerate(forced):
        got = run["replay_logprobs"][b, : want.shape[0]].double()
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        # the check is meaningful: forced experts change the log-probs well beyond TOL
        assert float((want - own[b]).abs().max()) > 100 * TOL
    # every token the batch routes is routed there; the last (no record) by its own top-k
    n = int(batch["attention_mask"][0].sum())
    selected = run["replay_selected_row0"]
    routed = batch[ROUTED_EXPERTS][0, : n - 1].reshape(n - 1, -1, 2)
    assert torch.equal(selected[: n - 1].long(), routed.long())
    assert (selected[n - 1] >= 0).all()


def test_train_step_with_balancing_loss_matches_float64_reference(run: dict[str, Any]) -> None:
    """Loss = sum_r w_r (nll_r + c aux_r) / sum_r w_r over the ranks' shards (one micro-batch
    each), aux_r transformers' own load_balancing_loss_func over the shard's tokens."""
    model = _reference(run["model_dir"])
    from tensordict import TensorDict
    batch = TensorDict(run["batch"], batch_size=[run["batch"]["input_ids"].shape[0]])
    n_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    terms = []
    for rank in range(2):
        shard = shard_batch(batch, rank, 2)
        logp_sum, n_trained, layer_logits = 0.0, 0, []
        for b in range(shard.shape[0]):
            n = int(shard["attention_mask"][b].sum())
            seq, loss_mask = shard["input_ids"][b, :n], shard["loss_mask"][b, :n]
            out = model(input_ids=seq[None], output_router_logits=True)
            logp = torch.log_softmax(out.logits[0, :-1], -1).gather(-1, seq[1:, None])[:, 0]
            logp_sum = logp_sum + (logp * loss_mask[1:]).sum()
            n_trained += int(loss_mask[1:].sum())
            layer_logits.append(out.router_logits)
        per_layer = tuple(torch.cat([seq_logits[i] for seq_logits in layer_logits])
                          for i in range(len(layer_logits[0])))
        aux = load_balancing_loss_func(per_layer, n_experts, top_k)
        terms.append((n_trained, -logp_sum / n_trained, aux))
    total = sum(w for w, _, _ in terms)
    nll = sum(w * nll for w, nll, _ in terms) / total
    aux = sum(w * a for w, _, a in terms) / total
    params = [p for p in model.parameters()]
    router_grad_without_aux = torch.autograd.grad(nll, model.model.layers[0].mlp.gate.weight,
                                                  retain_graph=True)[0]
    (nll + MW.AUX_COEF * aux).backward()
    # the check is meaningful: the balancing term changes the routers' gradient
    router_grad = model.model.layers[0].mlp.gate.weight.grad
    assert float((router_grad - router_grad_without_aux).abs().max()) > 1e-3
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    opt = torch.optim.AdamW(params, lr=W.LR * 0.5, eps=W.ADAM_EPS, weight_decay=W.WEIGHT_DECAY)
    opt.step()

    got = run["step"]
    assert got["moe_route_agreement"] == pytest.approx(_agreement(run), abs=1e-12)
    assert got["loss"] == pytest.approx(float(nll.detach()), rel=TOL)
    assert got["moe_aux_loss"] == pytest.approx(float(aux.detach()), rel=TOL)
    assert got["grad_norm"] == pytest.approx(norm, rel=TOL)
    for name, want in model.state_dict().items():
        torch.testing.assert_close(run["params_step"][name].double(), want, atol=TOL, rtol=0)


def own_routing(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, top_k]: the experts `model`'s routers choose, in router order."""
    chosen: list[torch.Tensor] = []

    def record(module: Any, inputs: Any, out: Any) -> None:
        chosen.append(out[2])
    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


def _agreement(run: dict[str, Any]) -> float:
    """The share of recorded (token, layer) routes where the reference's own top-k picks the
    batch's (forced) experts."""
    model, batch = _reference(run["model_dir"]).eval(), run["batch"]
    agreed = recorded = 0
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        own = own_routing(model, batch["input_ids"][b, :n].tolist())[: n - 1]  # (no record)
        forced = batch[ROUTED_EXPERTS][b, : n - 1].reshape(n - 1, -1, 2).long()
        same = (own.sort(-1).values == forced.sort(-1).values).all(-1)
        agreed, recorded = agreed + int(same.sum()), recorded + same.numel()
    assert 0 < agreed < recorded
    return agreed / recorded


def test_experts_reach_the_fleet_per_expert_as_the_folder_names_them(
        run: dict[str, Any]) -> None:
    folder = load_file(run["out"] / "export" / "model.safetensors")
    sent = run["sent"]
    assert set(sent) == set(folder)
    for name, tensor in folder.items():
        assert torch.equal(sent[name], tensor), name
    fused = run["params_step"]["model.layers.2.mlp.experts.gate_up_proj"]
    width = fused.shape[1] // 2
    assert torch.equal(sent["model.layers.2.mlp.experts.5.gate_proj.weight"], fused[5, :width])
    assert torch.equal(sent["model.layers.2.mlp.experts.5.up_proj.weight"], fused[5, width:])


def test_bad_routing_input_is_refused_with_the_reason(run: dict[str, Any]) -> None:
    errors = run["errors"]
    assert "routed_experts" in errors["layer_count"] and "4 MoE layers" in errors["layer_count"]
    assert "6 expert ids per token" in errors["layer_count"]
    assert "rollout.return_routed_experts" in errors["missing"]
    assert "actor.moe" in errors["dense"] and "dense" in errors["dense"]
