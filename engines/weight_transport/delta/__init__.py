"""The delta transport's weight files (`areal_like_weight_delta.py`, both ends). This folder
goes on every inference server's PYTHONPATH: the module imports only torch and zstandard."""

from pathlib import Path

RECEIVER_DIR = Path(__file__).resolve().parent
