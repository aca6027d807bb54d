"""The rollout API is declared once (`RolloutAPI`): the in-process controller implements every
call, and the rollout process's proxy and its dispatch are derived from the declaration.
Unit tests of the derivation (a recording pipe stands in for the controller process); the
calls crossing a real process to a real fleet are in test_rollout_process.py."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from config_helpers import rollout_config

from areal_like.api.config import RewardConfig
from areal_like.api.io_struct import UpdateReport, WeightUpdateMeta
from areal_like.api.rollout_api import LOCAL_METHODS, RolloutAPI, remote_calls
from areal_like.rollout import process as rollout_process
from areal_like.rollout.controller import RolloutController
from areal_like.rollout.process import (
    CALL_MARGIN_S,
    CALL_TIMEOUTS,
    DEFAULT_CALL_TIMEOUT_S,
    RolloutProcess,
)
from areal_like.rollout.service import RolloutService, RolloutSetup, _Ref

# a weight update trainer rank 0 drives: the rollout process is told only these two
TRANSPORT = {"begin_weight_update", "end_weight_update"}


def _parameters(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_public_method_of_the_declaration_is_a_remote_call_but_lifecycle():
    declared = {name for name, value in inspect.getmembers(RolloutAPI, inspect.isfunction)
                if not name.startswith("_")}
    calls = remote_calls()
    assert set(calls) == declared - LOCAL_METHODS
    assert set(calls) >= TRANSPORT and {"prepare_batch", "export_stats",
                                        "finished_evaluations"} <= set(calls)
    assert "last_episode_ids" not in calls  # a property: state, not a call
    assert set(CALL_TIMEOUTS) <= set(calls)  # the table names no call that does not exist


@pytest.mark.parametrize("name", sorted(remote_calls()))
def test_both_sides_offer_each_call_with_the_declared_signature(name):
    declared = remote_calls()[name]
    implemented = getattr(RolloutController, name)
    assert not getattr(implemented, "__isabstractmethod__", False), name
    assert _parameters(implemented) == _parameters(declared), name
    proxy = getattr(RolloutProcess, name)
    assert proxy.__qualname__ == name and proxy.__doc__ == declared.__doc__
    assert inspect.signature(proxy) == inspect.signature(declared)
    assert not RolloutProcess.__abstractmethods__ and not RolloutController.__abstractmethods__


class _Process:
    pid = 4242

    def is_alive(self) -> bool:
        return True


class _RecordingPipe:
    """Records what the proxy sends; answers like the controller process does."""

    def __init__(self, reply: Any = None, episode_ids: Any = ()) -> None:
        self.sent: list[Any] = []
        self.reply = ("ok", (reply, list(episode_ids)))

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def poll(self, timeout: float) -> bool:
        return True

    def recv(self) -> Any:
        return self.reply


def _proxy(pipe: _RecordingPipe, timeouts: list[float], monkeypatch) -> RolloutProcess:
    setup = RolloutSetup(rollout=rollout_config(weight_update_timeout=7.0),
                         reward=RewardConfig(), eval_timeout=11.0, wait_timeout=13.0)
    process = RolloutProcess(setup)
    process._process, process._conn = _Process(), pipe
    receive = process._receive

    def timed_receive(name: str, timeout: float) -> Any:
        timeouts.append(timeout - CALL_MARGIN_S)
        return receive(name, timeout)

    monkeypatch.setattr(process, "_receive", timed_receive)
    return process


def test_a_call_sends_its_arguments_objects_once_and_is_bounded_by_the_table(monkeypatch):
    pipe, timeouts = _RecordingPipe(reply="batch", episode_ids=["q0@1"]), []
    process = _proxy(pipe, timeouts, monkeypatch)
    workflow, loader = object(), [1, 2]

    assert process.prepare_batch(loader, workflow) == "batch"
    name, args, kwargs, one_way = pipe.sent[-1]
    assert name == "prepare_batch" and kwargs == {} and not one_way
    assert [type(a) for a in args] == [_Ref, _Ref, type(None), type(None)]
    assert args[0].obj is loader and args[1].obj is workflow  # the objects, the first time
    assert process.last_episode_ids == ["q0@1"]

    process.prepare_batch(loader, workflow, timeout=5.0)
    _, again, _, _ = pipe.sent[-1]
    assert (again[0].token, again[1].token) == (args[0].token, args[1].token)
    assert again[0].obj is None and again[1].obj is None  # by reference afterwards
    assert again[3] == 5.0
    assert timeouts == [13.0, 5.0]  # setup.wait_timeout, then the call's own timeout

    process.begin_weight_update(3, "retract")
    process.finished_evaluations(wait=True)
    process.finished_evaluations()
    process.stats()
    assert timeouts[2:] == [14.0, 11.0, DEFAULT_CALL_TIMEOUT_S, DEFAULT_CALL_TIMEOUT_S]
    assert pipe.sent[-3][1:] == ((True,), {}, False)
    with pytest.raises(TypeError):
        process.wait()  # `count` missing: refused before anything is sent
    assert len(pipe.sent) == 6

    # the end of an update is one-way: nothing is received for it, and the next call's
    # bound covers it too (the controller answers it first)
    report = UpdateReport(WeightUpdateMeta.from_disk("/w", 3))
    assert process.end_weight_update(report) is None
    assert pipe.sent[-1] == ("end_weight_update", (report,), {}, True) and len(timeouts) == 6
    process.stats()
    assert timeouts[6:] == [7.0 + DEFAULT_CALL_TIMEOUT_S]
    process.stats()
    assert timeouts[7:] == [DEFAULT_CALL_TIMEOUT_S]


def test_the_dispatch_answers_declared_calls_only_and_resolves_references():
    calls = []

    class _Controller:
        last_episode_ids = ["q1@2"]

        def prepare_batch(self, dataloader, workflow, should_accept=None, timeout=None):
            calls.append((dataloader, workflow, should_accept, timeout))
            return "batch"

    service = RolloutService.__new__(RolloutService)
    service.controller, service._objects = _Controller(), {}
    loader, workflow = ["items"], object()
    assert service.call("prepare_batch", (_Ref(0, loader), _Ref(1, workflow), None, 3.0),
                        {}) == "batch"
    assert service.call("prepare_batch", (_Ref(0), _Ref(1), None, None), {}) == "batch"
    assert calls == [(loader, workflow, None, 3.0), (loader, workflow, None, None)]
    assert service.last_episode_ids() == ["q1@2"]
    for undeclared in ("executor", "_call", "destroy", "episode_seed"):
        with pytest.raises(AttributeError, match=repr(undeclared)):
            service.call(undeclared, (), {})
    assert {"workflow", "dataloader", "should_accept"} == rollout_process.BY_REFERENCE
