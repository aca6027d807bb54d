"""The `algorithm` section of a recipe config (re-exported by `areal_like.api.config`).

An algorithm is an advantage estimator + a policy loss + an aggregation, chosen by name, with
its settings grouped by concern:

    algorithm:
      preset: dapo          # a registered preset's values (areal_like.api.algorithm_presets)
      group_size: 8         # everything below overrides the preset key by key
      adv:        {estimator, group_std, discount, gae_lambda}
      norm:       {level, mean, std, leave_one_out, eps, running_decay}   # after the estimator
      loss:       {policy, agg_mode, agg_constant, eps_clip, eps_clip_high, c_clip, ...}
      off_policy: {decoupled, recompute_logprob, behav_imp_weight_cap}
      kl:         {coef, target, horizon, estimator, in_reward, discount}
      shaping:    {scaling, bias, clip, overlong_penalty, overlong_tokens, ...}
      filters:    {dynamic_sampling, clip_filter_weight, ...}
      update:     {epochs, n_minibatches}

The 41 flat keys this section had before (`adv_estimator`, `kl_ctl`, ...) are refused with
their new place (`MOVED_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal_like.api.config_checks import (
    FRACTION,
    Bound,
    above,
    at_least,
    bounded,
    check_bounds,
    choices,
)
from areal_like.api.config_checks import check as _check
from areal_like.api.config_checks import moved_key_message as _moved_key_message
from areal_like.api.config_checks import one_of as _one_of


@dataclass
class AdvantageConfig:
    """`algorithm.adv`: the advantage estimator and its return settings."""

    # gae | grpo (= group_norm) | dr_grpo | rloo | reinforce | reinforce_pp |
    # reinforce_baseline | remax | cpgd (or a registered name)
    estimator: str = "grpo"
    # std of grpo's group normalisation: population (divide by n) | unbiased (n - 1, torch's
    # default std, as LightRFT / OpenRLHF)
    group_std: str = bounded("population", bound=choices("population", "unbiased"))
    discount: float = bounded(1.0, bound=FRACTION)
    gae_lambda: float = bounded(1.0, bound=FRACTION)

    def __post_init__(self) -> None:
        check_bounds(self, "algorithm.adv")


@dataclass
class AdvantageNormConfig:
    """`algorithm.norm`: extra normalisation of the advantages after the estimator."""

    # running: cross-batch
    level: str = bounded("none", bound=choices("none", "batch", "group", "running"))
    mean: bool = True
    std: bool = True
    leave_one_out: bool = False
    eps: float = bounded(1e-5, bound=at_least(0))
    # running level: weight kept by old stats (1 = all)
    running_decay: float = bounded(1.0, bound=FRACTION)

    def __post_init__(self) -> None:
        check_bounds(self, "algorithm.norm")


@dataclass
class PolicyLossConfig:
    """`algorithm.loss`: the policy loss, its clipping, and how token losses are aggregated."""

    policy: str = "ppo"  # ppo | gspo | cispo | reinforce | cpgd (or a registered name)
    agg_mode: str = bounded("token-mean", bound=choices(
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant"))
    # normaliser for agg_mode="constant" (Dr.GRPO); None: the generation budget
    # (gconfig.max_new_tokens), filled in by the recipe config
    agg_constant: Optional[float] = None
    eps_clip: float = bounded(0.2, bound=above(0))  # epsilon_low of the ratio clip
    eps_clip_high: Optional[float] = None  # clip-higher (DAPO); None: same as eps_clip
    c_clip: Optional[float] = None  # dual clip (> 1) for negative advantages; None: off
    value_eps_clip: float = 0.2  # the critic's value clip
    entropy_coef: float = 0.0
    # train only on this top fraction of tokens by entropy
    top_entropy_ratio: float = bounded(1.0, bound=Bound("in (0, 1]", lambda v: 0.0 < v <= 1.0))
    # CPGD loss: policy-drift KL(pi_old || pi) coefficient
    cpgd_drift_coef: float = bounded(0.0, bound=at_least(0))

    def __post_init__(self) -> None:
        name = "algorithm.loss"
        check_bounds(self, name)
        if self.agg_constant is not None:
            _check(name, "agg_constant", self.agg_constant > 0, self.agg_constant,
                   "> 0 (or None: gconfig.max_new_tokens)")
        if self.eps_clip_high is not None:
            _check(name, "eps_clip_high", self.eps_clip_high > 0, self.eps_clip_high, "> 0")
        if self.c_clip is not None:
            _check(name, "c_clip", self.c_clip > 1.0, self.c_clip, "> 1 (or None: off)")


# train/inference corrections of the decoupled weight (areal_like/algorithms/corrections.py):
# name -> default (low, high) bounds of the weight; None: that side is not bounded
CORRECTION_BOUNDS: dict[str, tuple[Optional[float], Optional[float]]] = {
    "none": (None, None),
    "tis": (None, 2.0),  # truncated IS: min(w, C)
    "mis_token": (0.5, 2.0),  # masked IS per token
    "mis_seq": (0.9, 1.1),  # masked IS per sequence, on the geometric mean weight
    "icepop": (0.5, 5.0),  # IcePop's published alpha, beta
}


@dataclass
class OffPolicyConfig:
    """`algorithm.off_policy`: how tokens sampled by an older policy, or by the inference
    server's numerics, are corrected."""

    decoupled: bool = True  # decoupled PPO: ratio against the recomputed proximal policy
    recompute_logprob: bool = True  # recompute log-probs with the trainer before updating
    behav_imp_weight_cap: Optional[float] = None  # decoupled loss: mask tokens above this weight
    # the decoupled weight w = pi_prox / pi_behav corrected: none | tis | mis_token | mis_seq |
    # icepop (docs/algorithms.md)
    correction: str = "none"
    correction_low: Optional[float] = None  # None: the correction's default (CORRECTION_BOUNDS)
    correction_high: Optional[float] = None

    def __post_init__(self) -> None:
        name = "algorithm.off_policy"
        if self.behav_imp_weight_cap is not None:
            _check(name, "behav_imp_weight_cap", self.behav_imp_weight_cap > 1.0,
                   self.behav_imp_weight_cap, "> 1 (or None: off)")
        _check(name, "decoupled", not (self.decoupled and not self.recompute_logprob),
               self.decoupled, "False when recompute_logprob=False (the decoupled loss needs "
               "the recomputed proximal log-probs)")
        _one_of(name, "correction", self.correction, tuple(CORRECTION_BOUNDS))
        if self.correction != "none":
            _check(name, "decoupled", self.decoupled, self.decoupled,
                   f"True with correction={self.correction!r} (it corrects the decoupled "
                   f"weight pi_prox / pi_behav)")
        for key in ("correction_low", "correction_high"):
            value = getattr(self, key)
            if value is not None:
                _check(name, key, value > 0, value, "> 0 (or None: the default)")
        if self.correction == "tis":
            _check(name, "correction_low", self.correction_low is None, self.correction_low,
                   "None with correction='tis' (it truncates from above only)")
        if self.correction == "none":  # a bound of no correction would be silently unused
            for key in ("correction_low", "correction_high"):
                _check(name, key, getattr(self, key) is None, getattr(self, key),
                       "None with correction='none' (no correction reads it): choose a "
                       f"correction, one of {tuple(c for c in CORRECTION_BOUNDS if c != 'none')}")
        if self.behav_imp_weight_cap is not None:
            _check(name, "behav_imp_weight_cap", self.decoupled, self.behav_imp_weight_cap,
                   "None with decoupled=false (only the decoupled loss weighs tokens by "
                   "pi_prox / pi_behav)")
        self._check_bounds_bracket_one()

    def _check_bounds_bracket_one(self) -> None:
        """The effective bounds (set or default) must keep a weight of 1, a token the server
        and the trainer agree on: otherwise every on-policy token is masked (or truncated)
        and a synchronous run trains on a zero gradient."""
        default_low, default_high = CORRECTION_BOUNDS[self.correction]
        low = default_low if self.correction_low is None else self.correction_low
        high = default_high if self.correction_high is None else self.correction_high
        name, which = "algorithm.off_policy", f"with correction={self.correction!r}"
        if low is not None and high is not None and high <= low:
            key = "correction_low" if self.correction_high is None else "correction_high"
            other = "set" if None not in (self.correction_low, self.correction_high) \
                else "the default"
            raise ValueError(f"{name}.{key}={getattr(self, key)!r} is invalid: {which} the "
                             f"bounds would be low={low} >= high={high} (the other is {other}), "
                             f"which masks every token; set them so that low < 1 < high")
        if low is not None:
            _check(name, "correction_low", low < 1.0, low, f"< 1 {which}: a weight of 1 (an "
                   f"on-policy token) would be masked, and so would every token of a "
                   f"synchronous run")
        if high is not None:
            tis = self.correction == "tis"
            _check(name, "correction_high", high >= 1.0 if tis else high > 1.0, high,
                   f"{'>=' if tis else '>'} 1 {which}: a weight of 1 (an on-policy token) "
                   f"would be {'truncated' if tis else 'masked'}")


@dataclass
class KLConfig:
    """`algorithm.kl`: the KL-to-reference penalty (needs a reference model when coef > 0)."""

    coef: float = bounded(0.0, bound=at_least(0))
    # adaptive controller (PPO paper / OpenRLHF): None keeps coef fixed; else coef is the
    # initial value, multiplied after every step by 1 + clip(KL / target - 1, +-0.2)
    # * n_samples / horizon
    target: Optional[float] = None
    horizon: int = bounded(10000, bound=at_least(1))
    # k1 | k2 | k3: per sampled token; full: the exact KL over the vocabulary at each trained
    # position, from the reference's top-k next-token log-probs the batch brings (`ref_top_ids`,
    # `ref_top_logp`: a distillation teacher's, teacher.top_k); a loss term (in_reward false)
    estimator: str = bounded("k3", bound=choices("k1", "k2", "k3", "full"))
    in_reward: bool = False  # fold the token KL into the reward instead of the loss
    # discount of the in-reward penalty's return-to-go for outcome estimators; None: adv.discount.
    # 0 gives each token its own KL only (on-policy distillation's per-token reward, as the
    # Thinking Machines write-up uses): no summed future KL that a shorter answer would avoid
    discount: Optional[float] = None

    def __post_init__(self) -> None:
        name = "algorithm.kl"
        check_bounds(self, name)
        if self.estimator == "full":
            _check(name, "in_reward", not self.in_reward, self.in_reward,
                   "false with kl.estimator=full (the exact KL over the vocabulary is a loss "
                   "term; a reward needs a per-sampled-token estimator: k1, k2 or k3)")
        if self.target is not None:
            _check(name, "target", self.target > 0, self.target, "> 0 (or None: fixed)")
            _check(name, "coef", self.coef > 0, self.coef,
                   "> 0 with target set (the adaptive controller multiplies it)")
        if self.discount is not None:
            _check(name, "discount", 0.0 <= self.discount <= 1.0, self.discount, "in [0, 1]")
            _check(name, "discount", self.in_reward, self.discount,
                   "None unless kl.in_reward (it discounts the in-reward penalty)")


@dataclass
class RewardShapingConfig:
    """`algorithm.shaping`: what is done to a reward before the estimator sees it."""

    scaling: float = bounded(1.0, bound=Bound(
        "!= 0 (0 would make every reward equal: no advantage, no gradient)", lambda v: v != 0))
    bias: float = 0.0
    clip: float = bounded(20.0, bound=above(0))
    overlong_penalty: bool = False  # DAPO soft overlong punishment
    # length of the soft-penalty interval before max_response_tokens; 0: a fifth of it (DAPO's
    # 4096 of 20480), at least 1 token
    overlong_tokens: int = bounded(0, bound=at_least(0, " (0: a fifth of max_response_tokens)"))
    overlong_penalty_factor: float = bounded(1.0, bound=above(0))
    # for the overlong penalty; 0: the rollout's gconfig.max_new_tokens (filled in by recipes)
    max_response_tokens: int = bounded(0, bound=at_least(0, " (0: gconfig.max_new_tokens)"))

    def __post_init__(self) -> None:
        name = "algorithm.shaping"
        check_bounds(self, name)
        if not self.overlong_penalty:  # read by the overlong penalty only
            for key, default in (("overlong_tokens", 0), ("overlong_penalty_factor", 1.0)):
                _check(name, key, getattr(self, key) == default, getattr(self, key),
                       f"{default} (unset) with overlong_penalty=false, which is the only "
                       f"reader of it: set algorithm.shaping.overlong_penalty=true")
        if self.overlong_penalty and self.max_response_tokens > 0 and self.overlong_tokens:
            _check(name, "overlong_tokens",
                   0 < self.overlong_tokens <= self.max_response_tokens, self.overlong_tokens,
                   "in (0, max_response_tokens] when overlong_penalty is on")


@dataclass
class GroupFilterConfig:
    """`algorithm.filters`: which groups train, and with what weight."""

    dynamic_sampling: bool = False  # drop groups whose rewards are all equal (DAPO)
    clip_filter_weight: bool = False  # up-weight samples of groups with reward variance (CPGD)
    clip_filter_max_weight: float = bounded(3.0, bound=at_least(1))
    # weight (lambda) of groups whose rewards are all equal
    clip_filter_flat_weight: float = bounded(1.0, bound=at_least(0))
    # dynamic sampling: stop the run when this many consumer batches' worth of groups in a row
    # are rejected (no group accepted in between): the task is too hard or too easy for the model
    max_rejected_batches: int = bounded(10, bound=at_least(1))

    def __post_init__(self) -> None:
        name = "algorithm.filters"
        check_bounds(self, name)
        unread = {"clip_filter_weight": ("clip_filter_max_weight", "clip_filter_flat_weight"),
                  "dynamic_sampling": ("max_rejected_batches",)}
        for switch, keys in unread.items():  # a setting of a filter that is off is unread
            for key in keys if not getattr(self, switch) else ():
                default = GroupFilterConfig.__dataclass_fields__[key].default
                _check(name, key, getattr(self, key) == default, getattr(self, key),
                       f"{default} (unset) with {switch}=false, which is the only reader of "
                       f"it: set algorithm.filters.{switch}=true")


@dataclass
class UpdateConfig:
    """`algorithm.update`: optimizer steps per batch."""

    # passes over each batch (actor and critic), mini-batches in order
    epochs: int = bounded(1, bound=at_least(1))
    n_minibatches: int = bounded(1, bound=at_least(1))  # optimizer steps per batch and epoch

    def __post_init__(self) -> None:
        check_bounds(self, "algorithm.update")


# every key of the old flat section -> its place now (under `algorithm.`)
MOVED_KEYS: dict[str, str] = {
    "adv_estimator": "adv.estimator", "group_std": "adv.group_std",
    "discount": "adv.discount", "gae_lambda": "adv.gae_lambda",
    "adv_norm_level": "norm.level", "adv_norm_mean": "norm.mean", "adv_norm_std": "norm.std",
    "adv_norm_leave_one_out": "norm.leave_one_out", "adv_norm_eps": "norm.eps",
    "adv_norm_running_decay": "norm.running_decay",
    "policy_loss": "loss.policy", "loss_agg_mode": "loss.agg_mode",
    "loss_agg_constant": "loss.agg_constant", "eps_clip": "loss.eps_clip",
    "eps_clip_high": "loss.eps_clip_high", "c_clip": "loss.c_clip",
    "value_eps_clip": "loss.value_eps_clip", "entropy_coef": "loss.entropy_coef",
    "top_entropy_ratio": "loss.top_entropy_ratio", "cpgd_drift_coef": "loss.cpgd_drift_coef",
    "use_decoupled_loss": "off_policy.decoupled",
    "recompute_logprob": "off_policy.recompute_logprob",
    "behav_imp_weight_cap": "off_policy.behav_imp_weight_cap",
    "kl_ctl": "kl.coef", "kl_target": "kl.target", "kl_horizon": "kl.horizon",
    "kl_estimator": "kl.estimator", "kl_in_reward": "kl.in_reward",
    "reward_scaling": "shaping.scaling", "reward_bias": "shaping.bias",
    "reward_clip": "shaping.clip", "overlong_reward_penalty": "shaping.overlong_penalty",
    "overlong_tokens": "shaping.overlong_tokens",
    "overlong_penalty_factor": "shaping.overlong_penalty_factor",
    "max_response_tokens": "shaping.max_response_tokens",
    "dynamic_sampling": "filters.dynamic_sampling",
    "clip_filter_weight": "filters.clip_filter_weight",
    "clip_filter_max_weight": "filters.clip_filter_max_weight",
    "clip_filter_flat_weight": "filters.clip_filter_flat_weight",
    "ppo_epochs": "update.epochs", "ppo_n_minibatches": "update.n_minibatches",
}


@dataclass
class AlgorithmConfig:
    """An algorithm = advantage estimator + policy loss + aggregation, all chosen by name.

    Names are looked up in `areal_like.algorithms` registries when an actor is built, so users
    can register their own. `preset` names the ready-made combination (GRPO, Dr.GRPO, DAPO,
    RLOO, REINFORCE++, GSPO, ReMax, PPO, CISPO, CPGD) the values came from: a config file
    applies it under its own keys, in Python `algorithm_preset(name, **overrides)` does.
    """

    # a registered preset (grpo, dapo, ...): its values under the section's own keys
    preset: Optional[str] = None
    # samples per prompt when the batch has no `group_id`/`uid` key
    group_size: int = bounded(1, bound=at_least(1))
    # sampling temperature: log-probs are taken of logits / temperature
    temperature: float = bounded(1.0, bound=above(0))
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)
    norm: AdvantageNormConfig = field(default_factory=AdvantageNormConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    filters: GroupFilterConfig = field(default_factory=GroupFilterConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)

    moved_keys = MOVED_KEYS  # an old flat key is refused naming its place

    def __post_init__(self) -> None:
        check_bounds(self, "algorithm")


def moved_key_message(key: str) -> Optional[str]:
    """'algorithm.<key> is now algorithm.<new place>' for an old flat key, else None."""
    return _moved_key_message(AlgorithmConfig, "algorithm", key)
