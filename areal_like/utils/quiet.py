"""One progress bar per run: the libraries' own bars (transformers' "Loading weights" and
"Writing model shards" on every weight export, datasets' "Map", the hub's downloads) are
turned off in every process that trains or evaluates."""

from __future__ import annotations

import os


def silence_library_progress_bars() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # also for child processes
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
