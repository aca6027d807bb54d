"""The `areal-like` command.

    areal-like run <recipe> [--config FILE] [key=value ...]   fleet + trainer (local launcher)
    areal-like run path/to/train.py --config FILE [...]        your own script, same launcher
    areal-like ray <recipe or script> [...]                    on a Ray cluster (Ray launcher)
    areal-like serve --model-path DIR [--n-servers N] ...      an inference fleet only
    areal-like tinker-serve --model-path DIR [--port P] ...    the Tinker API (docs/tinker.md)
    areal-like eval MODEL [--config FILE] [key=value ...]      held-out accuracy of a model
    areal-like tiny-model --out DIR [--size 1m]                build a tiny offline model
"""

from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from areal_like.launcher.local import main as run_main

        return run_main(rest)
    if command == "ray":
        from areal_like.launcher.ray import main as ray_main

        return ray_main(rest)
    if command == "serve":
        from engines.fleet.serve import main as serve_main

        return serve_main(rest)
    if command == "tinker-serve":
        from areal_like.tinker.serve import main as tinker_main

        return tinker_main(rest)
    if command == "eval":
        # registers the recipes' schemas (`grpo_schema`, ...) that a recipe YAML's defaults
        # list names; imported here because areal_like.runtime sits below recipes
        import recipes.configs  # noqa: F401
        from areal_like.runtime.evaluate_model import main as eval_main

        return eval_main(rest)
    if command == "tiny-model":
        from areal_like.models.tiny import main as tiny_main

        tiny_main(rest)
        return 0
    print(f"areal-like: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    return 2


def console() -> None:
    """The installed `areal-like` command: `main`, then the process ends without the
    interpreter's teardown of what the command imported (areal_like.utils.fast_exit)."""
    from areal_like.utils.fast_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    console()
