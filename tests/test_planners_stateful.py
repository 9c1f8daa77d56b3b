"""The default-storage switch's copy of the state dict before planning
(DCP's ``_stateful_to_state_dict`` without its per-key debug records):
the same dict, the same ``state_dict()`` calls and errors, DCP's own
function whenever someone listens to DCP's logger, and DCP's back when the
switch goes off.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint.state_dict_saver as saver
from torch.distributed.checkpoint import logger as dcp_logger

import fp_dcp
from fp_dcp import _stateful
from torch.distributed.checkpoint.stateful import Stateful

STOCK = saver._stateful_to_state_dict


class _Box:
    """A Stateful that records the order of its calls."""

    def __init__(self, name, calls, fail=False):
        self.name, self.calls, self.fail = name, calls, fail

    def state_dict(self):
        self.calls.append(self.name)
        if self.fail:
            raise RuntimeError(f"state_dict of {self.name} failed")
        return {"name": self.name}

    def load_state_dict(self, sd):  # pragma: no cover - part of the protocol
        pass


def _state_dict(calls):
    odd = torch.zeros(2)
    odd.state_dict = lambda: {"odd": 1}  # an instance attribute makes it look Stateful
    odd.load_state_dict = lambda sd: None
    return {"w": torch.ones(3), "p": torch.nn.Parameter(torch.ones(2)), "i": 3, "f": 0.5, "s": "x", "b": b"y",
            "n": None, "t": True, "nested": {"a": torch.zeros(1)}, "list": [1, 2], "box1": _Box("box1", calls),
            "model": torch.nn.Linear(2, 2), "odd": odd, "box2": _Box("box2", calls)}



def test_this_torch_is_one_it_replaces():
    assert _stateful.installable(saver, STOCK)


def test_same_dict_same_calls_as_dcps():
    ours = _stateful.make(STOCK)
    calls_a, calls_b = [], []
    sd_a, sd_b = _state_dict(calls_a), _state_dict(calls_b)
    a, b = ours(sd_a), STOCK(sd_b)
    assert calls_a == calls_b == ["box1", "box2"]
    assert a["odd"] == b["odd"] == {"odd": 1}
    for k in ("w", "p", "i", "s", "nested", "list"):
        assert a[k] is sd_a[k] and b[k] is sd_b[k]
    assert list(a) == list(b) and type(a) is type(b) is dict
    assert list(a["model"]) == list(b["model"])


def test_same_error_as_dcps():
    ours = _stateful.make(STOCK)
    for fn in (ours, STOCK):
        calls = []
        with pytest.raises(RuntimeError, match="state_dict of bad failed"):
            fn({"a": _Box("a", calls), "bad": _Box("bad", calls, fail=True), "c": _Box("c", calls)})
        assert calls == ["a", "bad"]


def test_dcps_function_runs_when_someone_listens():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    ours = _stateful.make(STOCK)
    ours({"w": torch.ones(1)})
    assert records == []
    h = Keep()
    dcp_logger._dcp_logger.addHandler(h)
    try:
        ours({"w": torch.ones(1), "x": 1})
        seen = [r.msg["func_name"] for r in records]  # (the message dict is shared by start and end)
        records.clear()
        STOCK({"w": torch.ones(1), "x": 1})
    finally:
        dcp_logger._dcp_logger.removeHandler(h)
    assert seen.count("_stateful_to_state_dict.w") == 2
    assert seen == [r.msg["func_name"] for r in records]


def test_refuses_a_function_it_does_not_know():
    def _stateful_to_state_dict(state_dict):
        return dict(state_dict)

    assert not _stateful.installable(saver, _stateful_to_state_dict)


def test_the_switch_installs_it_and_puts_dcps_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    fp_dcp.use_as_default()
    try:
        assert saver._stateful_to_state_dict is not STOCK
        sd = {"w": torch.arange(6.0), "step": 4}
        dcp.save(sd, checkpoint_id=str(tmp_path / "c"))
        back = {"w": torch.zeros(6), "step": 0}
        dcp.load(back, checkpoint_id=str(tmp_path / "c"))
        assert torch.equal(back["w"], sd["w"]) and back["step"] == 4
    finally:
        fp_dcp.restore_default()
    assert saver._stateful_to_state_dict is STOCK


def _odd_values():
    """Values whose Stateful answer is easy to get wrong."""
    class Registered:  # a virtual subclass: Stateful without the methods
        pass

    Stateful.register(Registered)
    odd = torch.zeros(2)
    odd.state_dict = lambda: {}  # instance attributes make a plain tensor Stateful
    odd.load_state_dict = lambda sd: None
    half = torch.zeros(2)
    half.state_dict = lambda: {}  # one of the two methods: not Stateful
    blocked = torch.zeros(2)
    blocked.state_dict = None  # a method set to None blocks the protocol
    blocked.load_state_dict = lambda sd: None

    class Sub(torch.Tensor):
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    return [torch.ones(3), torch.nn.Parameter(torch.ones(2)), 3, 0.5, True, "s", b"b", None, odd, half, blocked,
            torch.zeros(1).as_subclass(Sub), Registered(), torch.nn.Linear(2, 2), {"a": 1}, [1], _Box("x", [])]


def test_quick_stateful_answers_as_the_protocol():
    quick = _stateful.quick_stateful(Stateful)
    for v in _odd_values():
        assert isinstance(v, quick) is isinstance(v, Stateful), v
        assert issubclass(type(v), quick) is issubclass(type(v), Stateful), type(v)
    # methods set on a plain type after the check was made
    for t, v in ((torch.nn.Parameter, torch.nn.Parameter(torch.ones(2))), (torch.Tensor, torch.ones(2))):
        t.state_dict = lambda self: {}
        t.load_state_dict = lambda self, sd: None
        try:
            assert isinstance(v, Stateful) and isinstance(v, quick), t
        finally:
            del t.state_dict, t.load_state_dict
        assert not isinstance(v, Stateful) and not isinstance(v, quick), t


def test_a_planner_installs_both_and_the_switch_puts_dcps_back(tmp_path):
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict_loader as loader

    from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner

    try:
        FastPersistSavePlanner()
        assert saver._stateful_to_state_dict is not STOCK and loader.Stateful is not Stateful
        assert loader.Stateful.__wrapped_stock__ is Stateful
        sd = {"w": torch.arange(6.0), "box": _Box("box", []), "step": 4}
        dcp.save(sd, checkpoint_id=str(tmp_path / "c"), planner=FastPersistSavePlanner(), no_dist=True)
        back = {"w": torch.zeros(6), "box": _Box("box", []), "step": 0}
        dcp.load(back, checkpoint_id=str(tmp_path / "c"), planner=FastPersistLoadPlanner(), no_dist=True)
        assert torch.equal(back["w"], sd["w"]) and back["step"] == 4
        fp_dcp.use_as_default()  # over the planners' installation: keeps DCP's own objects to restore
        fp_dcp.restore_default()
        assert saver._stateful_to_state_dict is STOCK and loader.Stateful is Stateful
    finally:
        saver._stateful_to_state_dict = STOCK
        loader.Stateful = Stateful


@pytest.mark.parametrize("make", ["writer", "reader"])
def test_a_writer_or_reader_installs_both(tmp_path, make):
    """``dcp.async_save(sd, storage_writer=FastPersistWriter(p))`` with no
    planner passed copies the state dict without DCP's per-key records too."""
    import torch.distributed.checkpoint.state_dict_loader as loader

    saver._stateful_to_state_dict = STOCK
    loader.Stateful = Stateful
    try:
        (fp_dcp.FastPersistWriter if make == "writer" else fp_dcp.FastPersistReader)(tmp_path / "c")
        assert saver._stateful_to_state_dict is not STOCK and loader.Stateful.__wrapped_stock__ is Stateful
    finally:
        saver._stateful_to_state_dict = STOCK
        loader.Stateful = Stateful
