"""The `algorithm` section of a recipe config (re-exported by `areal_like.api.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_like.api.config_checks import check as _check
from areal_like.api.config_checks import one_of as _one_of


@dataclass
class AlgorithmConfig:
    """An algorithm = advantage estimator + policy loss + aggregation, all chosen by name.

    Names are looked up in `areal_like.algorithms` registries when an actor is built, so users
    can register their own. Ready-made combinations (GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++,
    GSPO, ReMax, PPO, CISPO, CPGD) are in `areal_like.algorithms.presets`.
    """

    # gae | grpo (= group_norm) | dr_grpo | rloo | reinforce | reinforce_pp |
    # reinforce_baseline | remax | cpgd (or a registered name)
    adv_estimator: str = "grpo"
    # std of grpo's group normalisation: population (divide by n) | unbiased (n - 1, torch's
    # default std, as LightRFT / OpenRLHF)
    group_std: str = "population"
    policy_loss: str = "ppo"  # ppo | gspo | cispo | reinforce | cpgd
    loss_agg_mode: str = "token-mean"
    # normaliser for loss_agg_mode="constant" (Dr.GRPO); None: the generation budget
    # (gconfig.max_new_tokens), filled in by the recipe config
    loss_agg_constant: Optional[float] = None
    group_size: int = 1  # samples per prompt when the batch has no `group_id`/`uid` key
    ppo_n_minibatches: int = 1  # optimizer steps per batch and epoch
    ppo_epochs: int = 1  # passes over each batch (actor and critic), mini-batches in order
    temperature: float = 1.0  # sampling temperature: log-probs are taken of logits / temperature
    eps_clip: float = 0.2  # epsilon_low of the ratio clip
    eps_clip_high: Optional[float] = None  # clip-higher (DAPO); None: same as eps_clip
    c_clip: Optional[float] = None  # dual clip (> 1) for negative advantages; None: off
    use_decoupled_loss: bool = True  # ratio against the recomputed proximal policy
    recompute_logprob: bool = True  # recompute log-probs with the trainer before updating
    behav_imp_weight_cap: Optional[float] = None  # decoupled loss: mask tokens above this weight
    discount: float = 1.0
    gae_lambda: float = 1.0
    value_eps_clip: float = 0.2
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    overlong_reward_penalty: bool = False  # DAPO soft overlong punishment
    overlong_tokens: int = 0  # length of the soft-penalty interval before max_response_tokens
    overlong_penalty_factor: float = 1.0
    # for the overlong penalty; 0: the rollout's gconfig.max_new_tokens (filled in by recipes)
    max_response_tokens: int = 0
    # extra normalisation after the estimator: none | batch | group | running (cross-batch)
    adv_norm_level: str = "none"
    adv_norm_mean: bool = True
    adv_norm_std: bool = True
    adv_norm_leave_one_out: bool = False
    adv_norm_eps: float = 1e-5
    adv_norm_running_decay: float = 1.0  # running level: weight kept by old stats (1 = all)
    kl_ctl: float = 0.0  # KL-to-reference coefficient (needs a reference model when > 0)
    # adaptive KL controller (PPO paper / OpenRLHF): None keeps kl_ctl fixed; else kl_ctl is the
    # initial coefficient, multiplied after every step by 1 + clip(KL / kl_target - 1, +-0.2)
    # * n_samples / kl_horizon
    kl_target: Optional[float] = None
    kl_horizon: int = 10000
    kl_estimator: str = "k3"
    kl_in_reward: bool = False  # fold the token KL into the reward instead of the loss
    entropy_coef: float = 0.0
    top_entropy_ratio: float = 1.0  # train only on this top fraction of tokens by entropy
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal (DAPO)
    clip_filter_weight: bool = False  # up-weight samples of groups with reward variance (CPGD)
    clip_filter_max_weight: float = 3.0
    clip_filter_flat_weight: float = 1.0  # weight (lambda) of groups whose rewards are all equal
    cpgd_drift_coef: float = 0.0  # CPGD loss: policy-drift KL(pi_old || pi) coefficient

    def __post_init__(self) -> None:
        name = "AlgorithmConfig"
        _one_of(name, "loss_agg_mode", self.loss_agg_mode,
                ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant"))
        _one_of(name, "adv_norm_level", self.adv_norm_level,
                ("none", "batch", "group", "running"))
        _one_of(name, "kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        _check(name, "group_size", self.group_size >= 1, self.group_size, ">= 1")
        _check(name, "ppo_n_minibatches", self.ppo_n_minibatches >= 1, self.ppo_n_minibatches,
               ">= 1")
        _check(name, "ppo_epochs", self.ppo_epochs >= 1, self.ppo_epochs, ">= 1")
        _check(name, "temperature", self.temperature > 0, self.temperature, "> 0")
        _check(name, "eps_clip", self.eps_clip > 0, self.eps_clip, "> 0")
        if self.eps_clip_high is not None:
            _check(name, "eps_clip_high", self.eps_clip_high > 0, self.eps_clip_high, "> 0")
        if self.c_clip is not None:
            _check(name, "c_clip", self.c_clip > 1.0, self.c_clip, "> 1 (or None: off)")
        if self.behav_imp_weight_cap is not None:
            _check(name, "behav_imp_weight_cap", self.behav_imp_weight_cap > 1.0,
                   self.behav_imp_weight_cap, "> 1 (or None: off)")
        _check(name, "use_decoupled_loss", not (self.use_decoupled_loss
                                                and not self.recompute_logprob),
               self.use_decoupled_loss, "False when recompute_logprob=False (the decoupled "
               "loss needs the recomputed proximal log-probs)")
        _check(name, "discount", 0.0 <= self.discount <= 1.0, self.discount, "in [0, 1]")
        _check(name, "gae_lambda", 0.0 <= self.gae_lambda <= 1.0, self.gae_lambda, "in [0, 1]")
        if self.loss_agg_constant is not None:
            _check(name, "loss_agg_constant", self.loss_agg_constant > 0,
                   self.loss_agg_constant, "> 0 (or None: gconfig.max_new_tokens)")
        _check(name, "reward_clip", self.reward_clip > 0, self.reward_clip, "> 0")
        _check(name, "max_response_tokens", self.max_response_tokens >= 0,
               self.max_response_tokens, ">= 0 (0: gconfig.max_new_tokens)")
        if self.overlong_reward_penalty and self.max_response_tokens > 0:
            _check(name, "overlong_tokens",
                   0 < self.overlong_tokens <= self.max_response_tokens, self.overlong_tokens,
                   "in (0, max_response_tokens] when overlong_reward_penalty is on")
        _check(name, "adv_norm_eps", self.adv_norm_eps >= 0, self.adv_norm_eps, ">= 0")
        _check(name, "adv_norm_running_decay", 0.0 <= self.adv_norm_running_decay <= 1.0,
               self.adv_norm_running_decay, "in [0, 1]")
        _check(name, "kl_ctl", self.kl_ctl >= 0, self.kl_ctl, ">= 0")
        _one_of(name, "group_std", self.group_std, ("population", "unbiased"))
        if self.kl_target is not None:
            _check(name, "kl_target", self.kl_target > 0, self.kl_target, "> 0 (or None: fixed)")
            _check(name, "kl_ctl", self.kl_ctl > 0, self.kl_ctl,
                   "> 0 with kl_target set (the adaptive controller multiplies it)")
        _check(name, "kl_horizon", self.kl_horizon >= 1, self.kl_horizon, ">= 1")
        _check(name, "top_entropy_ratio", 0.0 < self.top_entropy_ratio <= 1.0,
               self.top_entropy_ratio, "in (0, 1]")
        _check(name, "clip_filter_max_weight", self.clip_filter_max_weight >= 1.0,
               self.clip_filter_max_weight, ">= 1")
        _check(name, "clip_filter_flat_weight", self.clip_filter_flat_weight >= 0.0,
               self.clip_filter_flat_weight, ">= 0")
        _check(name, "cpgd_drift_coef", self.cpgd_drift_coef >= 0, self.cpgd_drift_coef, ">= 0")
