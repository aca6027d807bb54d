"""Named algorithms as `algorithm` settings: an algorithm is configuration alone.

In a config file, `algorithm.preset: dapo` puts the preset's values under the file's own keys
(and the command line's): `algorithm.loss.eps_clip_high=0.3` overrides the preset key by key.
In Python:

    config = algorithm_preset("dapo", shaping={"max_response_tokens": 256,
                                               "overlong_tokens": 64})

    preset        estimator     policy loss  aggregation          notes
    grpo          grpo          ppo          seq-mean-token-mean
    dr_grpo       dr_grpo       ppo          constant             loss.agg_constant = the
                                                                  generation budget
    dapo          grpo          ppo          token-mean           clip-higher 0.2/0.28, overlong
                                                                  penalty, dynamic sampling
    rloo          rloo          ppo          token-mean
    reinforce_pp  reinforce_pp  ppo          token-mean           token KL in reward (needs ref)
    gspo          grpo          gspo         seq-mean-token-mean  eps 3e-4 / 4e-4
    remax         remax         reinforce    token-mean           A = shape(r) - shape(r_greedy)
    ppo           gae           ppo          token-mean           with CriticActor values
    cispo         grpo          cispo        token-mean           upper clip only (eps_h 0.28)
    cpgd          cpgd          cpgd         token-mean           policy-drift coef 0.1
    distill       grpo          ppo          seq-mean-token-mean  the teacher as KL reference:
                                                                  kl.coef 1.0, in_reward, k1,
                                                                  kl.discount 0 (per token)
    distill_full  grpo          ppo          seq-mean-token-mean  exact reverse KL to the
                                                                  teacher's top-k in the loss:
                                                                  kl.coef 1.0, estimator full

`reinforce_pp` sets kl.coef=0.01 with kl.in_reward: give PPOActor a reference engine, or
override kl.coef=0. `dr_grpo` needs loss.agg_constant and `dapo` shaping.max_response_tokens
(both the generation budget, gconfig.max_new_tokens; recipe configs fill them in when unset) and
shaping.overlong_tokens (the soft interval).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Optional, get_type_hints

from areal_like.api.algorithm_config import AlgorithmConfig, moved_key_message

# on-policy REINFORCE-style estimators do not need the decoupled correction
_ON_POLICY = {"off_policy": {"decoupled": False, "recompute_logprob": False}}

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"adv": {"estimator": "grpo"},
             "loss": {"policy": "ppo", "agg_mode": "seq-mean-token-mean"}},
    "dr_grpo": {"adv": {"estimator": "dr_grpo"}, "loss": {"policy": "ppo", "agg_mode": "constant"}},
    "dapo": {"adv": {"estimator": "grpo"},
             "loss": {"policy": "ppo", "agg_mode": "token-mean", "eps_clip": 0.2,
                      "eps_clip_high": 0.28},
             "shaping": {"overlong_penalty": True}, "filters": {"dynamic_sampling": True}},
    "rloo": {"adv": {"estimator": "rloo"}, "loss": {"policy": "ppo", "agg_mode": "token-mean"}},
    "reinforce_pp": {"adv": {"estimator": "reinforce_pp"},
                     "loss": {"policy": "ppo", "agg_mode": "token-mean"},
                     "kl": {"coef": 0.01, "in_reward": True, "estimator": "k1"}},
    "gspo": {"adv": {"estimator": "grpo"},
             "loss": {"policy": "gspo", "agg_mode": "seq-mean-token-mean", "eps_clip": 3e-4,
                      "eps_clip_high": 4e-4}},
    "remax": {"adv": {"estimator": "remax"},
              "loss": {"policy": "reinforce", "agg_mode": "token-mean"}, **_ON_POLICY},
    "ppo": {"adv": {"estimator": "gae"}, "loss": {"policy": "ppo", "agg_mode": "token-mean"},
            "norm": {"level": "batch"}},
    "cispo": {"adv": {"estimator": "grpo"},
              "loss": {"policy": "cispo", "agg_mode": "token-mean", "eps_clip": 10.0,
                       "eps_clip_high": 0.28}},
    "cpgd": {"adv": {"estimator": "cpgd"},
             "loss": {"policy": "cpgd", "agg_mode": "token-mean", "cpgd_drift_coef": 0.1}},
    "distill": {"adv": {"estimator": "grpo"},
                "loss": {"policy": "ppo", "agg_mode": "seq-mean-token-mean"},
                "kl": {"coef": 1.0, "in_reward": True, "estimator": "k1", "discount": 0.0}},
    "distill_full": {"adv": {"estimator": "grpo"},
                     "loss": {"policy": "ppo", "agg_mode": "seq-mean-token-mean"},
                     "kl": {"coef": 1.0, "in_reward": False, "estimator": "full"}},
}


class AlgorithmKeyError(KeyError):
    """An unknown preset or key in algorithm values; the message names it and its fix."""

    def __str__(self) -> str:
        return str(self.args[0])


def register_algorithm_preset(name: str, values: dict[str, Any], *,
                              override: bool = False) -> None:
    """Make `values` (nested like the `algorithm` section) selectable as `algorithm.preset`."""
    if name in PRESETS and not override:
        raise ValueError(f"algorithm preset {name!r} is already registered; pass override=True")
    check_algorithm_keys(values, "")
    PRESETS[name] = values


def preset_values(name: str) -> dict[str, Any]:
    """The nested values of preset `name` (a copy)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise AlgorithmKeyError(f"algorithm.preset={name!r} is not a registered preset; "
                                f"{hint}choose one of {sorted(PRESETS)}")
    return merge_values({}, PRESETS[name])


def merge_values(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, section by section (neither is changed)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = dict(value) if isinstance(value, dict) else value
    return out


def check_algorithm_keys(values: dict[str, Any], where: str) -> None:
    """AlgorithmKeyError for a key `AlgorithmConfig` does not have (an old flat key names its
    new place); `where` prefixes the message (a file, a call)."""
    hints = get_type_hints(AlgorithmConfig)
    for key, value in values.items():
        if key not in hints:
            moved = moved_key_message(key)
            close = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.6)
            fix = moved or (f"did you mean 'algorithm.{close[0]}'?" if close
                            else f"valid keys: {sorted(hints)}")
            raise AlgorithmKeyError(f"{where}unknown key 'algorithm.{key}': {fix}")
        section = hints[key]
        if dataclasses.is_dataclass(section) and isinstance(value, dict):
            names = [f.name for f in dataclasses.fields(section)]
            for leaf in value:
                if leaf not in names:
                    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.5)
                    fix = (f"did you mean 'algorithm.{key}.{close[0]}'?" if close
                           else f"valid keys: {names}")
                    raise AlgorithmKeyError(f"{where}unknown key 'algorithm.{key}.{leaf}': {fix}")


def algorithm_config(preset: Optional[str] = None, **values: Any) -> AlgorithmConfig:
    """An `AlgorithmConfig` from nested values (`loss={"eps_clip": 0.3}`, `group_size=4`) over
    preset `preset`'s values (none: the defaults)."""
    check_algorithm_keys(values, "algorithm_config(): ")
    merged = merge_values(preset_values(preset) if preset else {}, values)
    hints = get_type_hints(AlgorithmConfig)
    built = {key: hints[key](**value) if isinstance(value, dict) else value
             for key, value in merged.items()}
    return AlgorithmConfig(**{**built, "preset": preset})


def algorithm_preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """`AlgorithmConfig` of preset `name`, with nested `overrides` applied key by key."""
    return algorithm_config(name, **overrides)
