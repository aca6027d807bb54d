"""An AReaL-lite experiment YAML read as ours: its section and key names mapped to our schema.

AReaL-lite keeps the PPO settings in `actor`, the model in `actor.path`, the run's name at the
top level, the file root in `cluster`, and has `saver` / `recover` / `evaluator` /
`stats_logger` / `sglang` sections and an `allocation_mode` string. `translate_arealite` turns
such a (composed, resolved) dict into one our dataclasses read: every AReaL-lite key is either
mapped to ours (kept too, for a ported script that reads it by its AReaL-lite name) or
refused with the replacement; a mapping whose meaning differs comes with a one-line notice.
docs/migrating_from_arealite.md has the whole table.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

from areal_like.api.algorithm_config import MOVED_KEYS
from areal_like.api.rollout_config import ROLLOUT_MOVED_KEYS

# top-level keys only AReaL-lite's experiment configs have: one of them marks a YAML as such
TOP_LEVEL = ("experiment_name", "trial_name", "allocation_mode", "cluster", "total_train_epochs",
             "tokenizer_path", "async_training", "server_only", "sglang", "saver", "recover",
             "evaluator", "stats_logger")
# PPO settings AReaL-lite reads from `actor`: ours live in `algorithm` (`MOVED_KEYS` says where)
ACTOR_ALGORITHM_KEYS = (
    "group_size", "ppo_n_minibatches", "eps_clip", "c_clip", "temperature", "reward_scaling",
    "reward_bias", "reward_clip", "overlong_reward_penalty", "overlong_tokens",
    "overlong_penalty_factor", "discount", "gae_lambda", "kl_ctl", "recompute_logprob",
    "use_decoupled_loss", "behav_imp_weight_cap", "dynamic_sampling")
# AReaL-lite's name -> ours, in `algorithm`
ACTOR_ALGORITHM_RENAMED = {"eps_clip_higher": "loss.eps_clip_high"}
# keys of AReaL-lite's actor that change nothing a run computes here (names, logging, how
# weights travel: our rollout.weights.transport decides that)
ACTOR_IGNORED = ("experiment_name", "trial_name", "log_agent_stats", "log_agent_stats_keys",
                 "max_new_tokens", "weight_update_mode", "pad_to_maximum", "bucket_size")
# keys of AReaL-lite's actor whose non-default value we cannot honour: (default, what instead)
ACTOR_REFUSED = {
    "init_from_scratch": (False, "a model is always loaded from {section}.path (build a fresh "
                                 "one with `python -m areal_like.models.tiny --out DIR`)"),
    "mask_no_eos_with_zero": (False, "truncated answers keep their reward here; penalise them "
                                     "with algorithm.shaping.overlong_penalty"),
    "reward_norm": (None, "rewards are shaped by algorithm.shaping.scaling / bias / clip; "
                          "normalise advantages with algorithm.norm.level"),
}
NORM_LEVELS = ("batch", "group")
SGLANG_TO_SERVER = {"context_length": "context_length", "dtype": "dtype",
                    "mem_fraction_static": "mem_fraction_static"}
DATASET_LOADER_KEYS = ("pin_memory", "num_workers", "drop_last")  # the script's data loader
RECOVER_MODES = {"disabled": "disabled", "auto": "auto", "resume": "auto", "fault": "auto"}
ALLOCATION = re.compile(r"^(?:sglang\.)?d(\d+)(?:p1)?(?:t(\d+))?\+d(\d+)(?:p1)?(?:t1)?$")


class ArealiteKeyError(ValueError):
    """An AReaL-lite key (or value) that has no counterpart: the message names the key and
    what to write instead."""


def looks_like_arealite(raw: dict[str, Any]) -> bool:
    """An AReaL-lite experiment config: one of its own top-level keys, or the model under
    `actor.path`."""
    actor = raw.get("actor")
    return any(k in raw for k in TOP_LEVEL) or (isinstance(actor, dict) and "path" in actor)


def translate_arealite(raw: dict[str, Any], has_field: Callable[[str], bool] = lambda key: False
                       ) -> tuple[dict[str, Any], list[str]]:
    """(the config in our key names, with the AReaL-lite keys kept beside them; notices where
    a meaning differs for a schema with `has_field(top-level key)`). Raises
    `ArealiteKeyError` for a key or value we cannot honour."""
    out = copy.deepcopy(raw)
    notices: list[str] = []
    _run_name(out, notices)
    _allocation(out, notices)
    for section in ("actor", "ref"):
        if isinstance(out.get(section), dict):
            _engine(out, section, notices)
    _datasets(out, notices)
    _utilities(out, notices)
    _sglang(out, notices)
    _top_level(out, notices)
    if out.get("total_train_epochs") and not has_field("total_train_epochs"):
        notices.append(f"total_train_epochs={out['total_train_epochs']}: our recipes stop at "
                       f"total_train_steps ({out.get('total_train_steps', 'its default')})")
    return out, notices


def _section(out: dict[str, Any], name: str) -> dict[str, Any]:
    node = out.get(name)
    if node is None:
        node = out[name] = {}
    return node


def _run_name(out: dict[str, Any], notices: list[str]) -> None:
    logging = _section(out, "logging")
    for key in ("experiment_name", "trial_name"):
        if out.get(key) is not None:
            logging.setdefault(key, out[key])
    fileroot = (out.get("cluster") or {}).get("fileroot")
    if fileroot:
        logging.setdefault("log_dir", fileroot)
        notices.append(f"cluster.fileroot={fileroot}: the run's files go to <fileroot>/"
                       f"<experiment_name>/<trial_name> (logging.log_dir), not AReaL-lite's "
                       f"<fileroot>/logs/<user>/...")


def _allocation(out: dict[str, Any], notices: list[str]) -> None:
    mode = out.get("allocation_mode")
    if not mode:
        return
    found = ALLOCATION.match(str(mode).replace(" ", ""))
    if not found:
        raise ArealiteKeyError(
            f"allocation_mode={mode!r}: only 'sglang.d<N>p1t<T>+d<M>p1t1' is understood (N "
            f"servers of T GPUs each, M FSDP trainer ranks); or set server.n_servers, "
            f"server.gpus_per_server and launcher.n_trainer_procs instead")
    servers, tensor_parallel, trainers = found.groups()
    server = _section(out, "server")
    server.setdefault("n_servers", int(servers))
    if tensor_parallel and int(tensor_parallel) > 1:
        server.setdefault("gpus_per_server", int(tensor_parallel))
    _section(out, "launcher").setdefault("n_trainer_procs", int(trainers))


def _lora(node: dict[str, Any], section: str) -> None:
    """AReaL-lite's `use_lora`, `lora_rank`, `lora_alpha`, `target_modules`, `peft_type` ->
    our `lora` section (rank 0: off)."""
    use = node.pop("use_lora", False)
    rank, alpha = node.pop("lora_rank", 32), node.pop("lora_alpha", 16)
    targets, peft_type = node.pop("target_modules", None), node.pop("peft_type", "lora")
    if not use:
        return
    if str(peft_type).lower() != "lora":
        raise ArealiteKeyError(f"{section}.peft_type={peft_type!r}: only LoRA is supported")
    if section != "actor":
        raise ArealiteKeyError(f"{section}.use_lora=true: only the actor trains adapters (the "
                               f"reference of a LoRA actor is its own frozen base)")
    lora = node.setdefault("lora", {})
    lora.setdefault("rank", rank)
    lora.setdefault("alpha", alpha)
    if targets and list(targets) != ["all-linear"]:  # all-linear: our default, the same
        lora.setdefault("target_modules", list(targets))


def _engine(out: dict[str, Any], section: str, notices: list[str]) -> None:
    """AReaL-lite's `actor` / `ref`: the model path, engine keys and (actor) PPO keys."""
    node = out[section]
    model = node.setdefault("model", {})
    if node.get("path"):
        model.setdefault("path", node["path"])
        if section == "actor":
            _section(out, "model").setdefault("path", node["path"])
    for key, (default, instead) in ACTOR_REFUSED.items():
        if node.get(key, default) not in (default, None, False):
            raise ArealiteKeyError(f"{section}.{key}={node[key]!r}: "
                                   f"{instead.format(section=section)}")
        node.pop(key, None)
    _lora(node, section)
    if node.pop("disable_dropout", False) and section == "actor":
        notices.append(f"{section}.disable_dropout=true: the model's own dropout settings "
                       f"apply (the shipped tiny models have none)")
    backend = node.get("backend")
    if backend is not None and backend not in ("fsdp", "auto", "gloo", "nccl"):
        raise ArealiteKeyError(f"{section}.backend={backend!r}: the train engine here is FSDP2 "
                               f"(backend: fsdp)")
    if backend == "fsdp":
        node["backend"] = "auto"  # ours names the process-group backend; auto picks it
    if node.get("dtype"):
        node.setdefault("param_dtype", node["dtype"])
        if node["dtype"] != "float32" and section == "actor":
            notices.append(f"actor.dtype={node['dtype']}: trained in mixed precision "
                           f"(actor.param_dtype) over float32 master weights")
    if node.get("optimizer") is None:
        node.pop("optimizer", None)  # a frozen reference: no optimizer
    elif node["optimizer"].get("type") == "adam":
        node["optimizer"]["type"] = "adamw"  # AReaL-lite's "adam" is torch's AdamW too
    for key in ACTOR_IGNORED:
        node.pop(key, None)
    if section != "actor":
        for key in (*ACTOR_ALGORITHM_KEYS, *ACTOR_ALGORITHM_RENAMED):
            node.pop(key, None)
        return
    algorithm = _section(out, "algorithm")
    level = _adv_norm_level(node.pop("group_adv_norm", False), node.pop("adv_norm", None))
    if level != "none":
        _set_default(algorithm, "norm.level", level)
    for key in ACTOR_ALGORITHM_KEYS:
        if key in node and node[key] is not None:
            _set_default(algorithm, MOVED_KEYS.get(key, key), node[key])
    for theirs, ours in ACTOR_ALGORITHM_RENAMED.items():
        if node.get(theirs) is not None:
            _set_default(algorithm, ours, node[theirs])
    if out.get("ref") is not None and float(node.get("kl_ctl") or 0.0) > 0:
        out.setdefault("use_ref_model", True)  # AReaL-lite builds the reference when kl_ctl > 0


def _set_default(section: dict[str, Any], dotted: str, value: Any) -> None:
    """`section[a][b] = value` for `dotted` "a.b", unless already set."""
    *parents, leaf = dotted.split(".")
    for parent in parents:
        section = section.setdefault(parent, {})
    section.setdefault(leaf, value)


def _adv_norm_level(group_adv_norm: bool, adv_norm: Any) -> str:
    """AReaL-lite's `group_adv_norm` / `adv_norm: {mean_level, std_level}` as our one
    `algorithm.norm.level`."""
    if not adv_norm:
        return "group" if group_adv_norm else "none"
    mean, std = adv_norm.get("mean_level", "batch"), adv_norm.get("std_level", "batch")
    if mean != std or mean not in NORM_LEVELS:
        raise ArealiteKeyError(
            f"actor.adv_norm={{mean_level: {mean}, std_level: {std}}}: advantages are "
            f"normalised at one level here, algorithm.norm.level in {NORM_LEVELS} (mean "
            f"and std; algorithm.norm.mean / norm.std switch either off)")
    return str(mean)


def _datasets(out: dict[str, Any], notices: list[str]) -> None:
    for name in ("train_dataset", "valid_dataset"):
        node = out.get(name)
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind in ("rl", "sft"):  # AReaL-lite's dataset kind; ours names the task
            del node["type"]
            if node.get("path"):
                node["type"] = "gsm8k"
                notices.append(f"{name}.type={kind} with path={node['path']}: read as our "
                               f"gsm8k task (a .jsonl/.parquet of question/answer); a script "
                               f"that builds its own dataset ignores both")


def _utilities(out: dict[str, Any], notices: list[str]) -> None:
    recover = out.get("recover") or {}
    checkpoint = _section(out, "checkpoint")
    if recover.get("mode") is not None:
        mode = str(recover["mode"])
        if mode not in RECOVER_MODES:
            raise ArealiteKeyError(f"recover.mode={mode!r}: one of {sorted(RECOVER_MODES)}")
        checkpoint.setdefault("recover", RECOVER_MODES[mode])
    if recover.get("freq_steps"):
        checkpoint.setdefault("freq_steps", recover["freq_steps"])
    evaluator = out.get("evaluator") or {}
    if evaluator.get("freq_steps"):
        _section(out, "evaluation").setdefault("freq_steps", evaluator["freq_steps"])
    used = (("recover", recover.get("mode", "disabled") != "disabled"), ("evaluator", True))
    for name, node in ((name, out.get(name) or {}) for name, on in used if on):
        if node.get("freq_epochs") or node.get("freq_secs"):
            ours = "checkpoint" if name == "recover" else "evaluation"
            also = "" if name == "recover" else "; a ported script's Evaluator honours all three"
            notices.append(f"{name}.freq_epochs / freq_secs: our recipes count steps only "
                           f"({ours}.freq_steps){also}")
    stats = out.get("stats_logger") or {}
    wandb = stats.get("wandb") or {}
    if wandb.get("mode", "disabled") != "disabled":
        wandb_section = _section(_section(out, "logging"), "wandb")
        wandb_section.setdefault("enabled", True)
        wandb_section.setdefault("mode", "online" if wandb["mode"] == "online" else "offline")


def _sglang(out: dict[str, Any], notices: list[str]) -> None:
    sglang = out.get("sglang") or {}
    server = _section(out, "server")
    for theirs, ours in SGLANG_TO_SERVER.items():
        if sglang.get(theirs) is not None:
            server.setdefault(ours, sglang[theirs])
    if sglang.get("random_seed") is not None:
        notices.append("sglang.random_seed: sampling is seeded per data item from "
                       "rollout.seed (default: seed), the same on every server")


def _top_level(out: dict[str, Any], notices: list[str]) -> None:
    if out.get("tokenizer_path"):
        _section(out, "model").setdefault("tokenizer_path", out["tokenizer_path"])
    if out.get("server_only"):
        raise ArealiteKeyError("server_only=true: serve a fleet without a trainer with "
                               "`areal-like serve --model-path DIR --n-servers N`")
    if out.get("async_training") is False:
        _section(_section(out, "rollout"), "staleness")["max_head_offpolicyness"] = 0
        notices.append("async_training=false: rollout.staleness.max_head_offpolicyness=0 (our "
                       "recipes are synchronous at eta = 0)")
    rollout = out.get("rollout") or {}
    if "queue_size" in rollout and rollout["queue_size"] is None:
        rollout["queue_size"] = 0  # unbounded, AReaL-lite's null
    for key in [k for k in rollout if k in ROLLOUT_MOVED_KEYS]:  # flat there, by concern here
        section, _, leaf = ROLLOUT_MOVED_KEYS[key].partition(".")
        _section(rollout, section).setdefault(leaf, rollout.pop(key))
    for key in ("experiment_name", "trial_name", "enable_rollout_tracing"):
        rollout.pop(key, None)


def arealite_only(parent: str, key: str) -> bool:
    """Whether `<parent>.<key>` is an AReaL-lite key that `translate_arealite` mapped to ours
    (or a script's data-loader setting): a schema without such a field may drop it."""
    if not parent:
        return key in (*TOP_LEVEL, "use_ref_model")
    if parent in ("actor", "ref"):
        return key in ("path", "dtype", *ACTOR_ALGORITHM_KEYS, *ACTOR_ALGORITHM_RENAMED)
    if parent in ("train_dataset", "valid_dataset"):
        return key in DATASET_LOADER_KEYS
    return False
