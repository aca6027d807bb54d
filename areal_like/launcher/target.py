"""What a launcher runs on the trainer ranks: a registered recipe or the user's own script.

    <launcher> grpo [--config FILE] [key=value ...]        a recipe (no --config: its own YAML)
    <launcher> path/to/train.py --config FILE [key=value]  a script, run as `python train.py ...`

Either way the config is composed and checked before any process starts; a script's YAML is
read for the sections a launcher needs (model, server, rollout, launcher, logging) — fully
validated when its defaults list names a registered schema.
"""

from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from areal_like.api.config import BaseExperimentConfig
from areal_like.api.config_loader import ConfigError, load_config, load_launch_config
from areal_like.runtime.preflight import check_recipe_config
from areal_like.runtime.recipe_args import split_args


class LaunchError(RuntimeError):
    """A part of the launch failed; the message says which and why."""


@dataclass
class TrainTarget:
    label: str  # "recipe grpo" / "script /abs/train.py"
    entry: list[str]  # what follows `python` (or torchrun's options): `-m recipes.grpo` / a path
    config_path: Path
    overrides: list[str]
    config: Any  # the recipe's config, or a BaseExperimentConfig for a schemaless script YAML
    needs_fleet: bool

    def args(self, extra: list[str]) -> list[str]:
        """The trainer's command-line arguments after `entry`."""
        return ["--config", str(self.config_path), *self.overrides, *extra]


def resolve_target(target: str, argv: list[str]) -> TrainTarget:
    """Parse `<recipe or script.py> [--config FILE] [key=value ...]` and load its config."""
    from recipes.configs import RECIPES  # registers the schemas a script's YAML may name

    if target.endswith(".py") or "/" in target:
        script = Path(target)
        if not script.is_file():
            raise LaunchError(f"training script {target!r} does not exist")
        if not any(a.split("=", 1)[0] in ("--config", "--config-name", "-cn") for a in argv):
            raise ConfigError(f"{target}: a training script needs --config FILE (the YAML it "
                              f"reads; the launcher reads model/server/launcher from it too)")
        config_path, overrides = split_args(argv, "")
        config = load_launch_config(BaseExperimentConfig, config_path, overrides)
        return TrainTarget(f"script {script.resolve()}", [str(script.resolve())],
                           config_path.resolve(), overrides, config, True)
    if target not in RECIPES:
        raise LaunchError(f"unknown recipe {target!r}; choose one of {sorted(RECIPES)}, or "
                          f"give the path of your own training script (a .py file)")
    config_cls, default_yaml, needs_fleet = RECIPES[target]
    config_path, overrides = split_args(argv, default_yaml)
    config = load_config(config_cls, config_path, overrides)  # fails fast on a typo
    check_recipe_config(config)  # what the trainer would refuse, before anything starts
    return TrainTarget(f"recipe {target}", ["-m", f"recipes.{target}"], config_path.resolve(),
                       overrides, config, needs_fleet)


def check_model_path(config: Any) -> None:
    if not (Path(config.model.path) / "config.json").is_file():
        raise LaunchError(f"model.path={config.model.path!r} is not an HF model folder (no "
                          f"config.json); set model.path=<folder>")


RANK_PREFIX = re.compile(r"^(\[(?:rank|default)\d+\]:)\s?")  # torchrun's tag on a rank's line
# the first line of a traceback's exception: `Name`, `Name: message`, `pkg.mod.Name: message`
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(?::(?:\s.*)?)?$")
TRACEBACK_HEAD = "Traceback (most recent call last):"
CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
IGNORED = "Exception ignored in"  # Python printed it and went on: not why the trainer ended
WRAPPER = "ChildFailedError"  # torchrun's own exception around a failed rank


def trainer_error(lines: list[str]) -> str:
    """The trainer's own exception line, if it printed one: the last traceback's exception
    line, whatever its name (`RewardBudgetExceeded: ...`, `KeyboardInterrupt`,
    `pkg.mod.Name: ...`), not torchrun's `ChildFailedError` wrapper nor one Python ignored.

    A rank's uncaught exception (torchrun tags its lines `[rankN]:`) wins over untagged output
    (e.g. the rollout controller, stopped by its rank's end); ranks are read apart, as their
    lines may interleave. A traceback introduced inside an exception's message or notes by a
    line ending in ':' (the rollout controller's "in the rollout controller process:") belongs
    to that exception. With no traceback head in `lines` (cut off): the last line whose name
    ends in Error/Exception."""
    found = {True: "", False: ""}  # by whether a rank tagged it
    state: dict[str, str] = {}  # per tag: "", "frames", "ignored" or "message"
    previous: dict[str, str] = {}
    for raw in lines:
        tag_match = RANK_PREFIX.match(raw)
        tag = tag_match.group(1) if tag_match else ""
        line = RANK_PREFIX.sub("", raw).rstrip("\r\n")
        now, before = state.get(tag, ""), previous.get(tag, "")
        previous[tag] = line
        if not line.strip():  # a rank's blank lines come untagged: they end every message
            state = {t: "" if s == "message" else s for t, s in state.items()}
        elif line.startswith(CHAINED):
            state[tag] = ""
        elif line.startswith(TRACEBACK_HEAD):
            if now == "message" and before.rstrip().endswith(":"):
                continue  # embedded in the message: part of that exception
            state[tag] = "ignored" if before.startswith(IGNORED) else "frames"
        elif now in ("frames", "ignored") and line[:1] not in (" ", "\t"):  # past the frames
            match = EXCEPTION_LINE.match(line)
            if now == "frames" and match is not None and WRAPPER not in match.group(1):
                found[bool(tag)] = line.strip()
            state[tag] = "message"
    return found[True] or found[False] or _named_error_line(lines)


def _named_error_line(lines: list[str]) -> str:
    for line in reversed(lines):
        line = RANK_PREFIX.sub("", line)
        head = line.split(":", 1)[0].strip().split(" ")[-1]
        if head.endswith(("Error", "Exception")) and WRAPPER not in head:
            return line.strip()
    return ""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C


def launcher_main(launch: Callable[[str, list[str]], int], doc: str,
                  argv: Optional[list[str]], stopped: str) -> int:
    """A launcher's command line: help, signals, and its errors as exit codes (config 2,
    launch 1, interrupted 130 after saying that `stopped` were stopped)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        return 0 if argv else 2
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C cleans up too, even when started from a script's background job (which would
    # inherit SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return launch(argv[0], argv[1:])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"launch failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"[launcher] interrupted: stopped {stopped}", file=sys.stderr)
        return 130
