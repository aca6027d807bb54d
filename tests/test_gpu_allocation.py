"""How servers and trainers split the GPUs (pure functions; no GPU needed)."""

from __future__ import annotations

import pytest

from areal_like.api.config import ServerConfig
from engines.fleet.launch import server_gpus
from engines.server.errors import ServerStartError
from engines.sglang.command import build_server_command


def test_each_server_gets_its_own_slice(monkeypatch):
    config = ServerConfig(device="cuda", n_servers=2, gpus_per_server=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [server_gpus(config, i) for i in range(2)] == ["4,5", "6,7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [server_gpus(config, i) for i in range(2)] == ["0,1", "2,3"]
    cmd = build_server_command("python", "/m", 30000, config)  # type: ignore[arg-type]
    assert cmd[cmd.index("--tp-size") + 1] == "2" and "--device" not in cmd


def test_too_few_gpus_is_named(monkeypatch):
    config = ServerConfig(device="cuda", n_servers=3, gpus_per_server=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ServerStartError, match="gpus_per_server.*only 2 are visible"):
        server_gpus(config, 2)
