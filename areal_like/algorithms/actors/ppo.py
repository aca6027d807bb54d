"""PPOActor: every policy-gradient algorithm of the PPO family, chosen by configuration.

    actor = PPOActor(engine, algorithm_preset("grpo"), ref=None)
    stats = actor.update(batch)          # = compute_advantages + optimizer step(s)

An algorithm is `algorithm.adv.estimator` (by name) + `algorithm.loss.policy` (by name) +
`algorithm.loss.agg_mode` + options; see `areal_like.api.algorithm_presets` for GRPO, Dr.GRPO,
DAPO, RLOO, REINFORCE++, GSPO, ReMax, PPO (with `CriticActor`), CISPO and CPGD. The engine never
learns which one runs: it only receives `loss_fn` and `loss_weight_fn`.

Batch keys (token alignment, see `actors/base.py`): input_ids, attention_mask, loss_mask,
logprobs, rewards [B] or dense [B, L]; optional versions, group_id or uid [B] (else
consecutive groups of `group_size`), values [B, L] (critic, for gae), baseline_rewards [B]
(remax, raw: shaped here like the rewards), prox_logp / ref_logp / entropy [B, L] (computed
here when needed and missing).

The proximal log-probs (decoupled PPO's, or the ratio's anchor when recomputed) are the current
weights'. When the batch is trained in one optimizer step (one mini-batch, one epoch), the
update's own forward runs on exactly those weights: its detached log-probs serve, and no
separate forward is run (the loss takes them; the train/inference gap is recorded there).

With loss.top_entropy_ratio = rho < 1 the prepared batch carries `policy_mask`: the top ceil(rho*n)
of the n trained tokens of the whole batch (all ranks) by the entropy recorded when the batch
was prepared; the policy loss and its aggregation weights use exactly those tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.algorithms.actor_checks import check_actor_config
from areal_like.algorithms.actors.base import (
    TRAJECTORY_KEYS,
    compute_logprobs,
    compute_logprobs_entropy,
    default_tracker,
    require_keys,
    train_minibatches,
)
from areal_like.algorithms.actors.loss_fns import make_policy_loss_fn
from areal_like.algorithms.advantages import discounted_returns
from areal_like.algorithms.aggregation import loss_weight
from areal_like.algorithms.estimators import AdvantageInputs, AdvantageOutputs
from areal_like.algorithms.filters import (
    filter_zero_variance_groups,
    sequence_rewards,
    top_entropy_mask,
)
from areal_like.algorithms.functional import group_index_from_ids, shift_to_next_token
from areal_like.algorithms.kl import kl_estimate
from areal_like.algorithms.kl_controller import KLController
from areal_like.algorithms.mismatch import record_gap
from areal_like.algorithms.normalize import RunningMoments, clip_filter_weights, normalize
from areal_like.algorithms.registry import (
    estimator_traits,
    get_advantage_estimator,
)
from areal_like.algorithms.rewards import overlong_penalty, shape_rewards
from areal_like.api.config import AlgorithmConfig
from areal_like.api.engine_api import TrainEngine
from areal_like.api.trajectory import model_inputs
from areal_like.utils.distributed import data_parallel_group


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass
class _Aligned:
    """A batch's masks and log-probs, next-token aligned and zero off the trained tokens."""

    token_mask: torch.Tensor  # loss_mask as bool, not shifted (what the rewards are shaped on)
    mask: torch.Tensor  # the trained tokens, next-token aligned
    zero: torch.Tensor
    behav: Optional[torch.Tensor]  # the behaviour policy's (the server's)
    # the proximal policy's (recomputed by the trainer; None: the update's forward gives them)
    prox: Optional[torch.Tensor]
    old: Optional[torch.Tensor]  # the ratio's denominator: prox when recomputed, else behav
    ref: Optional[torch.Tensor]  # the reference model's
    values: Optional[torch.Tensor]  # the critic's


class PPOActor:
    """Backend-agnostic policy actor: computes advantages, hands a loss to the engine."""

    def __init__(self, engine: TrainEngine, config: AlgorithmConfig,
                 ref: Optional[TrainEngine] = None, tracker: Any = None,
                 scope: str = "actor", ref_in_batch: bool = False) -> None:
        """`ref_in_batch`: every batch brings its reference log-probs as `ref_logp` (e.g. a
        distillation teacher's, fetched during rollout) instead of a reference engine."""
        self.engine, self.config, self.ref = engine, config, ref
        self.tracker = default_tracker(tracker)
        self.scope = scope
        # a typo or a refused combination fails at construction, naming the choices
        check_actor_config(config, has_ref=ref is not None or ref_in_batch)
        self.estimator = get_advantage_estimator(config.adv.estimator)
        self.traits = estimator_traits(config.adv.estimator)
        self.running = (RunningMoments(config.norm.running_decay)
                        if config.norm.level == "running" else None)
        # the KL coefficient in use (fixed kl.coef, or adapted to kl.target after each step)
        self.kl_controller = KLController(config.kl.coef, config.kl.target, config.kl.horizon)
        self._observed_kl: Optional[torch.Tensor] = None  # [sum of per-seq mean KL, n seqs]

    # ---- state a checkpoint carries --------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The KL coefficient and the running advantage statistics (same on every rank)."""
        state: dict[str, Any] = {"kl_controller": self.kl_controller.state_dict()}
        if self.running is not None:
            state["running"] = vars(self.running).copy()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.running is not None and "running" in state:
            vars(self.running).update(state["running"])

    # ---- forwards ------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logp(self, batch: TensorDict) -> torch.Tensor:
        """[B, L] next-token log-probs under the current weights (the proximal policy)."""
        return compute_logprobs(self.engine, batch, self.config.temperature)

    @torch.no_grad()
    def compute_logp_entropy(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L] next-token log-probs and entropies under the current weights."""
        return compute_logprobs_entropy(self.engine, batch, self.config.temperature)

    @torch.no_grad()
    def compute_ref_logp(self, batch: TensorDict) -> torch.Tensor:
        """[B, L] next-token log-probs under the frozen reference model."""
        if self.ref is None:
            raise ValueError("compute_ref_logp: this PPOActor has no reference engine")
        return compute_logprobs(self.ref, batch, self.config.temperature)

    # ---- advantages ----------------------------------------------------------------------
    def compute_advantages(self, batch: TensorDict) -> TensorDict:
        """A new, next-token-aligned batch with `advantages` (and everything the loss needs).

        `batch` itself is not modified. Call once per batch: an already prepared batch (one
        with `advantages`) is rejected, because shifting twice would misalign it."""
        cfg = self.config
        if "advantages" in batch.keys():
            raise ValueError("compute_advantages: batch already has 'advantages' (already "
                             "prepared); pass the raw trajectory batch")
        require_keys(batch, TRAJECTORY_KEYS, "PPOActor.compute_advantages")
        b = batch.batch_size[0]
        ids = batch.get("group_id", None)
        ids = batch.get("uid", None) if ids is None else ids
        group_index = group_index_from_ids(ids, b, cfg.group_size).to(batch["input_ids"].device)
        tracker = self.tracker
        with tracker.scope(self.scope):
            if cfg.filters.dynamic_sampling:
                batch, group_index, counts = filter_zero_variance_groups(batch, group_index)
                tracker.scalar(**counts)
            needs_prox = cfg.off_policy.recompute_logprob or cfg.off_policy.decoupled
            extra: dict[str, torch.Tensor] = {}
            if cfg.loss.top_entropy_ratio < 1.0 and "entropy" not in batch.keys():
                # the filter uses the entropy of the policy that made the batch's step: one
                # forward gives it together with the proximal log-probs
                logp, extra["entropy"] = self.compute_logp_entropy(batch)
                if needs_prox and "prox_logp" not in batch.keys():
                    extra["prox_logp"] = logp
            elif "entropy" in batch.keys():
                extra["entropy"] = batch["entropy"]
            if needs_prox and "prox_logp" not in extra:
                if "prox_logp" in batch.keys():
                    extra["prox_logp"] = batch["prox_logp"]
                elif not self.proximal_from_update():
                    extra["prox_logp"] = self.compute_logp(batch)
            if cfg.kl.coef > 0:
                extra["ref_logp"] = (batch["ref_logp"] if "ref_logp" in batch.keys()
                                     else self.compute_ref_logp(batch))
            return self._prepare(batch, group_index, extra)

    def proximal_from_update(self) -> bool:
        """Whether the update's own forward gives the proximal log-probs (see the module doc):
        one optimizer step per batch, and nothing needs them before it (the reference KL
        observed for its controller, the entropy filter's forward gives them anyway)."""
        cfg = self.config
        return (cfg.update.n_minibatches == 1 and cfg.update.epochs == 1 and cfg.kl.coef <= 0
                and cfg.loss.top_entropy_ratio >= 1.0)

    def _prepare(self, batch: TensorDict, group_index: torch.Tensor,
                 extra: dict[str, torch.Tensor]) -> TensorDict:
        """The preparation, step by step (each step is one method below)."""
        aligned = self._align(batch, extra)
        token_r, seq_r = self._shape_rewards(batch, aligned)
        token_kl = self._reference_kl(aligned)
        token_r = self._kl_into_token_rewards(token_r, token_kl)
        out = self._estimate(batch, aligned, token_r, seq_r, group_index)
        adv = self._normalize(out.advantages, aligned.mask, group_index)
        adv = self._weight_groups(adv, seq_r, group_index)
        adv = self._kl_into_advantages(adv, token_kl, aligned.mask)
        prepared = self._assemble(batch, aligned, adv, out.returns, extra)
        self._record_batch_stats(batch, aligned, seq_r, prepared["advantages"], token_kl)
        return prepared

    def _align(self, batch: TensorDict, extra: dict[str, torch.Tensor]) -> _Aligned:
        """Next-token masks and the behaviour, proximal, old and reference log-probs."""
        cfg = self.config.off_policy
        token_mask = batch["loss_mask"].bool()
        mask = shift_to_next_token(token_mask)
        zero = torch.zeros((), dtype=torch.float32, device=mask.device)
        behav = None
        if "logprobs" in batch.keys():
            behav = torch.where(mask, shift_to_next_token(batch["logprobs"].float()), zero)
        elif cfg.decoupled or not cfg.recompute_logprob:
            raise ValueError(
                "the batch has no 'logprobs' (the behaviour policy's log-probs, from the "
                "inference server), which " + ("algorithm.off_policy.decoupled=true"
                                               if cfg.decoupled else
                                               "algorithm.off_policy.recompute_logprob=false") +
                " needs: return them from the workflow (ModelResponse.output_logprobs, 0 on "
                "prompt tokens) or set algorithm.off_policy.decoupled=false "
                "algorithm.off_policy.recompute_logprob=true")
        prox = extra.get("prox_logp")
        if prox is not None:
            prox = torch.where(mask, prox.float(), zero)
        ref = extra.get("ref_logp")
        if ref is not None:
            ref = torch.where(mask, ref.float(), zero)
        values = batch.get("values", None)
        if values is not None:
            values = torch.where(mask, values.float(), zero)
        return _Aligned(token_mask=token_mask, mask=mask, zero=zero, behav=behav, prox=prox,
                        old=prox if cfg.recompute_logprob else behav, ref=ref, values=values)

    def _shape_rewards(self, batch: TensorDict,
                       aligned: _Aligned) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-token-aligned token rewards, sequence rewards), shaped and overlong-penalised."""
        cfg = self.config.shaping
        overlong = None
        if cfg.overlong_penalty:
            overlong = overlong_penalty(aligned.token_mask.sum(-1), cfg.max_response_tokens,
                                        cfg.overlong_tokens, cfg.overlong_penalty_factor)
        token_r, seq_r = shape_rewards(batch["rewards"], aligned.token_mask, scale=cfg.scaling,
                                       bias=cfg.bias, clip=cfg.clip, overlong=overlong)
        return shift_to_next_token(token_r), seq_r

    def _reference_kl(self, aligned: _Aligned) -> Optional[torch.Tensor]:
        """Per-token KL(old || reference), observed for the KL controller; None without KL."""
        cfg = self.config.kl
        if cfg.coef <= 0:
            return None
        assert aligned.ref is not None and aligned.old is not None
        # `full` is taken in the loss; its sampled estimate (k1) is what is observed here
        estimator = "k1" if cfg.estimator == "full" else cfg.estimator
        token_kl = torch.where(aligned.mask, kl_estimate(aligned.old, aligned.ref, estimator),
                               aligned.zero)
        self._observe_kl(token_kl, aligned.mask)
        return token_kl

    def _kl_into_token_rewards(self, token_r: torch.Tensor,
                               token_kl: Optional[torch.Tensor]) -> torch.Tensor:
        """KL in the reward, for estimators that take it per token (before they run)."""
        if token_kl is None or not self.config.kl.in_reward \
                or self.traits.kl_placement != "token":
            return token_r
        return token_r - self.kl_controller.value * token_kl.double()

    def _estimate(self, batch: TensorDict, aligned: _Aligned, token_r: torch.Tensor,
                  seq_r: torch.Tensor, group_index: torch.Tensor) -> AdvantageOutputs:
        """The configured advantage estimator."""
        baseline = batch.get("baseline_rewards", None)
        if baseline is not None:  # shaped exactly like the rewards it is subtracted from
            if tuple(baseline.shape) != (batch.batch_size[0],):
                raise ValueError(f"'baseline_rewards' has shape {tuple(baseline.shape)}; "
                                 f"expected ({batch.batch_size[0]},)")
            shaping = self.config.shaping
            _, baseline = shape_rewards(baseline, aligned.token_mask, scale=shaping.scaling,
                                        bias=shaping.bias, clip=shaping.clip)
        inputs = AdvantageInputs(
            token_rewards=token_r, seq_rewards=seq_r, loss_mask=aligned.mask,
            group_index=group_index, values=aligned.values, baseline_rewards=baseline,
            all_reduce=_distributed(),
        )
        out = self.estimator(inputs, self.config)
        if tuple(out.advantages.shape) != tuple(aligned.mask.shape):
            raise ValueError(f"algorithm.adv.estimator={self.config.adv.estimator!r} returned "
                             f"advantages of shape {tuple(out.advantages.shape)}; expected "
                             f"{tuple(aligned.mask.shape)}")
        return out

    def _weight_groups(self, adv: torch.Tensor, seq_r: torch.Tensor,
                       group_index: torch.Tensor) -> torch.Tensor:
        """CPGD's clip-filter weights: up-weight groups whose rewards vary."""
        cfg = self.config.filters
        if not cfg.clip_filter_weight:
            return adv
        weights = clip_filter_weights(seq_r, group_index, cfg.clip_filter_max_weight,
                                      cfg.clip_filter_flat_weight, all_reduce=_distributed())
        return adv * weights[:, None]

    def _kl_into_advantages(self, adv: torch.Tensor, token_kl: Optional[torch.Tensor],
                            mask: torch.Tensor) -> torch.Tensor:
        """KL in the reward, for outcome estimators: the penalty's return-to-go, after
        normalisation (OpenRLHF / LightRFT order)."""
        if token_kl is None or not self.config.kl.in_reward \
                or self.traits.kl_placement != "outcome":
            return adv
        kl = self.config.kl
        discount = self.config.adv.discount if kl.discount is None else kl.discount
        return adv - self.kl_controller.value * discounted_returns(token_kl.double(), mask,
                                                                   discount)

    def _assemble(self, batch: TensorDict, aligned: _Aligned, adv: torch.Tensor,
                  returns: Optional[torch.Tensor],
                  extra: dict[str, torch.Tensor]) -> TensorDict:
        """The prepared batch: what the loss reads, masked to the trained tokens."""
        mask, zero = aligned.mask, aligned.zero
        prepared = {
            **model_inputs(batch),
            "loss_mask": mask,
            "advantages": torch.where(mask, adv.float(), zero),
        }
        optional = {"old_logp": aligned.old, "logprobs": aligned.behav, "prox_logp": aligned.prox,
                    "ref_logp": aligned.ref, "values": aligned.values,
                    "returns": None if returns is None else torch.where(mask, returns.float(),
                                                                        zero)}
        prepared.update({k: v for k, v in optional.items() if v is not None})
        deferred = aligned.prox is None and (self.config.off_policy.recompute_logprob
                                             or self.config.off_policy.decoupled)
        if deferred and "versions" in batch.keys():  # for the gap the loss records
            prepared["version_lag"] = self._version_lag(batch)
        for key in ("ref_top_ids", "ref_top_logp"):  # kl.estimator=full's reference
            if key in batch.keys():
                prepared[key] = batch[key]
        ratio = self.config.loss.top_entropy_ratio
        if ratio < 1.0:
            prepared["policy_mask"] = top_entropy_mask(extra["entropy"], mask, ratio,
                                                       all_ranks=_distributed())
        return TensorDict(prepared, batch_size=batch.batch_size, device=batch.device)

    def _normalize(self, adv: torch.Tensor, mask: torch.Tensor,
                   group_index: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        kw: dict[str, Any] = dict(mean=cfg.norm.mean, std=cfg.norm.std, eps=cfg.norm.eps)
        if cfg.norm.level == "batch":
            return normalize(adv, mask, None, leave_one_out=cfg.norm.leave_one_out,
                             all_reduce=_distributed(), **kw)
        if cfg.norm.level == "group":
            return normalize(adv, mask, group_index, leave_one_out=cfg.norm.leave_one_out,
                             **kw)
        if cfg.norm.level == "running":
            assert self.running is not None
            self.running.update(adv, mask, all_reduce=_distributed())
            return self.running.normalize(adv, mask, **kw)
        return adv

    def _record_batch_stats(self, batch: TensorDict, aligned: _Aligned, seq_r: torch.Tensor,
                            adv: torch.Tensor, token_kl: Optional[torch.Tensor]) -> None:
        t, mask = self.tracker, aligned.mask
        attn = batch["attention_mask"].bool()
        n_seqs = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
        response_len = batch["loss_mask"].bool().sum(-1).float()
        t.denominator(n_seqs=n_seqs, n_valid_tokens=mask)
        t.stat(denominator="n_seqs", task_reward=sequence_rewards(batch["rewards"]).float(),
               shaped_reward=seq_r.float(), response_length=response_len,
               prompt_length=attn.sum(-1).float() - response_len, seq_length=attn.sum(-1).float())
        token_stats = {"advantages": adv}
        if token_kl is not None:
            token_stats["kl_ref"] = token_kl
        lag = self._version_lag(batch) if "versions" in batch.keys() else None
        if lag is not None:
            token_stats["version_lag"] = torch.where(mask, lag, 0).float()
        t.stat(denominator="n_valid_tokens", **token_stats)
        if aligned.behav is not None and aligned.prox is not None:  # the train/inference gap
            record_gap(t, aligned.behav, aligned.prox, mask, lag, self.config.off_policy)

    def _version_lag(self, batch: TensorDict) -> torch.Tensor:
        """[B, L]: how many versions behind the trainer each next-token-aligned token is."""
        return self.engine.get_version() - shift_to_next_token(batch["versions"])

    def _observe_kl(self, token_kl: torch.Tensor, mask: torch.Tensor) -> None:
        # LightRFT's info["kl"]: each sequence's mean token KL; sequences without tokens skipped
        n_tok = mask.sum(-1)
        seq = token_kl.double().sum(-1) / n_tok.clamp(min=1)
        has = n_tok > 0
        self._observed_kl = torch.stack([seq[has].sum(), has.sum().double()]).cpu()

    def update_kl_controller(self) -> None:
        """Adapt the KL coefficient to the KL of the batch prepared last (pooled over ranks,
        so every rank holds the same coefficient). `update` calls it after training."""
        if self._observed_kl is None:
            return
        observed, self._observed_kl = self._observed_kl, None
        if _distributed():
            dist.all_reduce(observed, op=dist.ReduceOp.SUM, group=data_parallel_group())
        total, n = float(observed[0]), int(observed[1])
        if n == 0:
            return
        self.kl_controller.update(total / n, n)
        with self.tracker.scope(self.scope):
            self.tracker.scalar(kl_coef=self.kl_controller.value, kl_observed=total / n)

    # ---- training ------------------------------------------------------------------------
    def make_loss_fn(self):
        return make_policy_loss_fn(self.config, self.tracker, kl_coef=self.kl_controller.value,
                                   proximal_from_forward=self.proximal_from_update())

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One training step on `batch` (`algorithm.update.n_minibatches` optimizer steps per
        epoch, `update.epochs` epochs). Computes the advantages first unless `batch` is already
        prepared. Returns the engine's stats averaged over mini-batches; diagnostics go to the
        stats tracker under `scope`."""
        prepared = batch if "advantages" in batch.keys() else self.compute_advantages(batch)
        off_policy = self.config.off_policy
        if (off_policy.recompute_logprob or off_policy.decoupled) \
                and "prox_logp" not in prepared.keys() and not self.proximal_from_update():
            raise ValueError(
                f"PPOActor.update: the prepared batch has no 'prox_logp', and "
                f"algorithm.update.n_minibatches={self.config.update.n_minibatches} x "
                f"epochs={self.config.update.epochs} optimizer steps need them computed before "
                "the first (prepare the batch with this actor's compute_advantages)")
        loss_fn = self.make_loss_fn()
        mask_key = "policy_mask" if "policy_mask" in prepared.keys() else "loss_mask"
        weight_fn = functools.partial(loss_weight, mode=self.config.loss.agg_mode,
                                      mask_key=mask_key)
        stats = train_minibatches(self.engine, prepared, self.config.update.n_minibatches,
                                  loss_fn, weight_fn, self.tracker, self.scope,
                                  n_epochs=self.config.update.epochs)
        self.update_kl_controller()  # after the step, like PPO / OpenRLHF / LightRFT
        return stats
