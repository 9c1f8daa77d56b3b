"""The scenarios of PyTorch's DCP tests that take a planner, written out here
so that they run everywhere (``tests/test_upstream_planners.py`` runs
PyTorch's files themselves where a checkout is given), with fp_dcp's
planners where those tests use DCP's default ones and with both storages
(the multi-rank ones are in ``tests/test_upstream_reshard.py``):

- ``test_planner.py``: plan caching (local, global, final plans) traced step
  by step with DCP's default planner and with ours, on the installed torch;
  the load planner's strict / partial loads, size mismatch and version;
- ``test_checkpoint.py``: a storage failing at each step, planners made by DCP;
- ``test_save_load_api.py``: storage detected from ``checkpoint_id``;
- ``e2e/test_e2e_save_and_load.py``: Stateful values loaded in place, plain
  ones replaced; model and optimizer state dicts loaded in place.

Values are compared bit for bit (upstream compares with ``allclose``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

import fp_dcp
from fp_dcp._dcp_hooks import checkpoint_kind
from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner
from tests._sd import bits_equal
from tests.upstream.pairs import PLANNERS, STORAGES

pytestmark = pytest.mark.upstream

_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
           "_cached_final_save_plan")


@pytest.fixture
def fresh_plan_caches():
    """DCP's class-level plan caches without our planners' and DCP's default
    planner's entries, before and after the test."""
    keys = (DefaultSavePlanner.__name__, FastPersistSavePlanner.__name__)

    def clear():
        for name in _CACHES:
            for key in keys:
                getattr(SavePlanner, name, {}).pop(key, None)

    clear()
    yield
    clear()


# ------------------------------------------------------- test_planner.py


def _sharded(rank: int, world: int, shard: int = 8):
    """A 1-D ShardedTensor of one ``shard``-element shard per rank, this
    rank's own filled with its global positions."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardProps

    mds = [ShardMetadata(shard_offsets=[i * shard], shard_sizes=[shard], placement=f"rank:{i}/cpu")
           for i in range(world)]
    local = [Shard.from_tensor_and_offsets(torch.arange(float(shard)) + rank * shard,
                                           shard_offsets=mds[rank].shard_offsets, rank=rank)]
    meta = ShardedTensorMetadata(shards_metadata=mds, size=torch.Size([shard * world]),
                                 tensor_properties=ShardProps.create_from_tensor(torch.zeros(1)))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards=local, sharded_tensor_metadata=meta)


def _rank_plan(cls, rank: int, world: int, size: int):
    """Rank ``rank``'s caching planner of ``cls`` set up on its state dict (a
    replicated tensor of ``size`` elements, a list, a ShardedTensor) and its
    local plan.  Each rank's planner is of its own subclass: DCP keys its
    class-level plan caches by class name, and these ranks share a process."""
    from torch.testing._internal.distributed.distributed_utils import with_dist

    with with_dist(rank=rank, world_size=world):
        sd = {"tensor": torch.arange(float(size)), "value": [1, 2, 3], "st": _sharded(rank, world)}
        planner = _per_rank(cls, rank)(enable_plan_caching=True)
        planner.set_up_planner(sd, is_coordinator=rank == 0)
        return planner, planner.create_local_plan()


_RANK_CLASSES: dict[tuple[type, int], type] = {}


def _per_rank(cls, rank: int) -> type:
    if (cls, rank) not in _RANK_CLASSES:
        _RANK_CLASSES[cls, rank] = type(f"{cls.__name__}Rank{rank}", (cls,), {})
    return _RANK_CLASSES[cls, rank]


def _cached(cls, world: int) -> list[str]:
    return [f"{name} {r}: {getattr(SavePlanner, name, {}).get(_per_rank(cls, r).__name__)!r}"
            for name in _CACHES for r in range(world)]


def _caching_trace(cls, world: int = 4) -> list[str]:
    """What three cached saves show, step by step: every plan each call
    returns and DCP's caches after it (PyTorch's local, global and final
    plan caching tests, as one sequence).  Rank 0's planner coordinates."""
    trace: list[str] = []
    for size in (10, 10, 20):  # a first save, the same again, the replicated tensor grown
        ranks = [_rank_plan(cls, r, world, size) for r in range(world)]
        trace += [f"local {r}: {plan!r}" for r, (_, plan) in enumerate(ranks)] + _cached(cls, world)
        global_plan, metadata = ranks[0][0].create_global_plan([plan for _, plan in ranks])
        trace += [f"global: {global_plan!r}", f"metadata: {metadata!r}"] + _cached(cls, world)
        for r, (planner, _) in enumerate(ranks):
            trace.append(f"final {r}: {planner.finish_plan(global_plan[r])!r}")
        trace += _cached(cls, world)
    return [line.replace(cls.__name__, "<planner>") for line in trace]


def test_plan_caching_steps_are_dcps():
    """Every step of plan caching through our planner is DCP's own on this
    torch: the same plans sent and returned, cached at the same step (the
    local plan as it is made on older releases, when the save finishes on
    newer ones), the same unusable plans once nothing changed."""
    try:
        ours, dcps = _caching_trace(FastPersistSavePlanner), _caching_trace(DefaultSavePlanner)
    finally:
        for name in _CACHES:
            for sub in _RANK_CLASSES.values():
                getattr(SavePlanner, name, {}).pop(sub.__name__, None)
    assert len(ours) == len(dcps)
    for mine, theirs in zip(ours, dcps):
        assert mine == theirs
    # what PyTorch's tests assert of it: in the second save nothing changed,
    # no rank sends its plan and the coordinator sends back none
    unusable = "SavePlan(items=[], storage_data=None, planner_data=None, usable=False)"
    second = ours[len(ours) // 3: 2 * len(ours) // 3]
    assert [line for line in second if line.startswith("local")] == [f"local {r}: {unusable}" for r in range(4)]
    assert [line for line in second if line.startswith("global")] == [f"global: [{', '.join([unusable] * 4)}]"]


@pytest.mark.parametrize("cls", [DefaultSavePlanner, FastPersistSavePlanner])
def test_finish_plan_returns_the_cached_final_plan_for_an_unusable_one(cls, fresh_plan_caches):
    planner = cls(enable_plan_caching=True)
    planner.set_up_planner({"tensor": torch.arange(10.0), "value": [1, 2, 3]}, is_coordinator=True)
    first = planner.finish_plan(planner.create_local_plan())
    assert SavePlanner._cached_final_save_plan[planner._cached_plans_key] == first
    assert planner.finish_plan(SavePlan([], usable=False)) == first
    # an unchanged local plan is not sent again
    again = cls(enable_plan_caching=True)
    again.set_up_planner({"tensor": torch.arange(10.0), "value": [1, 2, 3]}, is_coordinator=True)
    assert again.create_local_plan() == SavePlan([], usable=False)




def _save(sd, path, storage: str, planner=None) -> None:
    writer = STORAGES[storage][0](str(path))
    try:
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
    finally:
        getattr(writer, "close", lambda: None)()


def _load(sd, path, storage: str, planner) -> None:
    reader = STORAGES[storage][1](str(path))
    try:
        dcp.load(sd, storage_reader=reader, planner=planner, no_dist=True)
    finally:
        getattr(reader, "close", lambda: None)()


@pytest.mark.parametrize("planners", list(PLANNERS))
@pytest.mark.parametrize("storage", list(STORAGES))
def test_load_planner_partial_strict_size_and_version(tmp_path, storage, planners):
    """``TestLoadPlanner``: a model with a parameter the checkpoint lacks
    loads with ``allow_partial_load=True`` (the others bit for bit) and
    fails naming the missing key without it; a parameter of another size
    fails naming the mismatch; the planner keeps the checkpoint's version
    (DCP's writer's: fp_dcp's, see the next test)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    save_cls, load_cls = PLANNERS[planners]
    torch.manual_seed(1)
    original = torch.nn.Linear(2, 2)
    _save({"module": original}, tmp_path, storage, save_cls())

    new = torch.nn.Linear(2, 2)
    new.extra_param = torch.nn.Parameter(torch.randn(2, 2))
    extra = new.extra_param.detach().clone()
    _load({"module": new}, tmp_path, storage, load_cls(allow_partial_load=True))
    assert bits_equal(new.weight, original.weight) and bits_equal(new.bias, original.bias)
    assert bits_equal(new.extra_param, extra)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint"):
        _load({"module": new}, tmp_path, storage, load_cls(allow_partial_load=False))

    with pytest.raises(CheckpointException, match="Size mismatch"):
        _load({"module": torch.nn.Linear(3, 2)}, tmp_path, storage, load_cls())

    planner = load_cls()
    _load({"module": torch.nn.Linear(2, 2)}, tmp_path, storage, planner)
    if storage == "stock":
        assert planner.metadata.version == CURRENT_DCP_VERSION


@pytest.mark.parametrize("planners", list(PLANNERS))
def test_fp_dcp_checkpoint_records_dcps_version(tmp_path, planners):
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    save_cls, load_cls = PLANNERS[planners]
    _save({"module": torch.nn.Linear(2, 2)}, tmp_path, "fp_dcp", save_cls())
    planner = load_cls()
    _load({"module": torch.nn.Linear(2, 2)}, tmp_path, "fp_dcp", planner)
    assert planner.metadata.version == CURRENT_DCP_VERSION


# ------------------------------------------------------ test_checkpoint.py


class _Faulty:
    """A storage that holds nothing and raises ``ValueError`` at the step named."""

    def __init__(self, fail: str | None, metadata=None) -> None:
        self.fail, self.metadata = fail, metadata

    def _step(self, name: str, result=None):
        if self.fail == name:
            raise ValueError(f"failed in {name}")
        return result

    def _later(self, name: str, result=None):
        from torch.futures import Future

        fut: Future = Future()
        if self.fail == name + "_async":
            fut.set_exception(ValueError(f"failed in {name}_async"))
        else:
            fut.set_result(result)
        return fut

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def prepare_local_plan(self, plan):
        return self._step("prepare_local_plan", plan)

    def prepare_global_plan(self, plans):
        return self._step("prepare_global_plan", plans)


def _faulty_writer(fail):
    from torch.distributed.checkpoint import StorageWriter

    class Writer(_Faulty, StorageWriter):
        def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
            self._step("set_up_storage_writer")

        def write_data(self, plan, planner):
            self._step("write_data")
            return self._later("write_data", [])

        def finish(self, metadata, results):
            self._step("finish")

    return Writer(fail)


def _faulty_reader(fail, metadata):
    from torch.distributed.checkpoint import StorageReader

    class Reader(_Faulty, StorageReader):
        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
            self._step("set_up_storage_reader")

        def read_metadata(self):
            return self._step("read_metadata", self.metadata)

        def read_data(self, plan, planner):
            self._step("read_data")
            return self._later("read_data")

    return Reader(fail, metadata)


_SAVE_STEPS = ("set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data",
               "write_data_async", "finish")
_LOAD_STEPS = ("set_up_storage_reader", "read_metadata", "prepare_local_plan", "prepare_global_plan",
               "read_data", "read_data_async")


def test_storage_failures_surface_through_our_default_planners(monkeypatch):
    """``TestDistributedFailure``'s single-process cases: a storage failing
    at each step of a save or a load made with no planner given (ours, with
    the switch on) fails it with that step's error, and one that fails
    nowhere completes; our planners made every plan."""
    from torch.distributed.checkpoint.default_planner import _create_default_local_metadata

    made = []
    for cls in (FastPersistSavePlanner, FastPersistLoadPlanner):
        monkeypatch.setattr(cls, "create_local_plan",
                            lambda self, _f=cls.create_local_plan: made.append(type(self)) or _f(self))
    sd = {"replicated": torch.arange(100.0).view(10, 10), "bytes": [1, 2, 3, 4]}
    with fp_dcp.default_storage():
        for fail in (None,) + _SAVE_STEPS:
            if fail is None:
                dcp.save(sd, storage_writer=_faulty_writer(None), no_dist=True)
                continue
            with pytest.raises(CheckpointException) as info:
                dcp.save(sd, storage_writer=_faulty_writer(fail), no_dist=True)
            (error, _), = info.value.failures.values()
            assert isinstance(error, ValueError) and str(error) == f"failed in {fail}", error
        metadata = _create_default_local_metadata(sd)
        for fail in (None,) + _LOAD_STEPS:
            if fail is None:
                dcp.load(sd, storage_reader=_faulty_reader(None, metadata), no_dist=True)
                continue
            with pytest.raises(CheckpointException) as info:
                dcp.load(sd, storage_reader=_faulty_reader(fail, metadata), no_dist=True)
            (error, _), = info.value.failures.values()
            if fail != "read_metadata":  # torch 2.10-2.12 turn that one into "metadata is None"
                assert f"failed in {fail}" in str(error), error
    assert set(made) == {FastPersistSavePlanner, FastPersistLoadPlanner}
    # the save that succeeds and the five that fail after the storage's set-up
    assert made.count(FastPersistSavePlanner) == len(_SAVE_STEPS)


# ------------------------------------------------- test_save_load_api.py


def test_storage_detected_from_checkpoint_id_with_the_switch(tmp_path):
    """``test_auto_detect``: a path saves and loads with no storage and no
    planner given (fp_dcp's, with the switch on); an id no storage accepts
    fails with DCP's "Cannot detect"."""
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 3)
    target = torch.nn.Linear(4, 3)
    with fp_dcp.default_storage():
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "first"), no_dist=True)
        sd = target.state_dict()
        dcp.load(sd, checkpoint_id=str(tmp_path / "first"), no_dist=True)
        for k, v in model.state_dict().items():
            assert bits_equal(sd[k], v), k
        assert checkpoint_kind(tmp_path / "first") == "fp_dcp"
        with pytest.raises(RuntimeError, match="Cannot detect"):
            dcp.save(model.state_dict(), checkpoint_id="abc://abc.abc", no_dist=True)
        with pytest.raises(RuntimeError, match="Cannot detect"):
            dcp.load(model.state_dict(), checkpoint_id="abc://abc.abc", no_dist=True)


# -------------------------------------------- e2e/test_e2e_save_and_load.py


def _save_load_implicit(storage: str, path: str):
    """``dcp.save`` / ``dcp.load`` as the e2e tests call them, with no
    planner given: fp_dcp's storage and planners through the switch, or
    DCP's storage with our planners made by DCP (installed as its default)."""
    import contextlib

    from fp_dcp.planners import install_as_default

    @contextlib.contextmanager
    def ours():
        if storage == "fp_dcp":
            with fp_dcp.default_storage():
                yield
            return
        saved: dict = {}
        install_as_default(saved)
        try:
            yield
        finally:
            import importlib

            for (mod, name), value in saved.items():
                setattr(importlib.import_module(f"torch.distributed.checkpoint.{mod}"), name, value)

    def save(sd):
        with ours():
            dcp.save(sd, checkpoint_id=path, no_dist=True)

    def load(sd):
        with ours():
            dcp.load(sd, checkpoint_id=path, no_dist=True)

    return save, load


@pytest.mark.parametrize("storage", list(STORAGES))
def test_stateful_loaded_in_place_and_plain_dicts_replaced(tmp_path, storage):
    """``test_stateful_and_non_stateful_loads``: a Stateful value is loaded
    through its ``load_state_dict``, the state dict's entry left as it is;
    a plain dict value is replaced by the loaded one, bit for bit."""
    from torch.distributed.checkpoint.stateful import Stateful

    class Tracking(dict):
        set_item_called = False

        def __setitem__(self, key, value):
            self.set_item_called = True
            super().__setitem__(key, value)

    class Foo(Stateful):
        loaded = None

        def state_dict(self):
            return {"w": torch.arange(4.0) + 0.5}

        def load_state_dict(self, state_dict):
            self.loaded = state_dict

    save, load = _save_load_implicit(storage, str(tmp_path / "stateful"))
    foo = Foo()
    sd = Tracking(foo=foo)
    sd.set_item_called = False
    save(sd)
    load(sd)
    assert sd["foo"] is foo and not sd.set_item_called
    assert bits_equal(foo.loaded["w"], torch.arange(4.0) + 0.5)

    save, load = _save_load_implicit(storage, str(tmp_path / "plain"))
    values = torch.arange(100.0).view(10, 10) / 3
    sd = Tracking(foo={"replicated": values, "bytes": [1, 2, 3, 4]})
    save(sd)
    sd = Tracking(foo={"replicated": torch.zeros(10, 10), "bytes": []})
    sd.set_item_called = False
    load(sd)
    assert sd.set_item_called
    assert bits_equal(sd["foo"]["replicated"], values) and sd["foo"]["bytes"] == [1, 2, 3, 4]


@pytest.mark.parametrize("storage", list(STORAGES))
def test_model_and_optimizer_state_loaded_in_place(tmp_path, storage):
    """``test_init_state_dict`` (and the e2e train state): a model's and an
    Adam optimizer's state dicts load into the very dicts passed, the
    optimizer's learning rate (not a tensor) comes back, and a BytesIO of
    the train state's losses round-trips."""
    import io

    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )

    def model_and_optim(lr):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        optim = torch.optim.Adam(model.parameters(), lr=lr)
        model(torch.rand(3, 8)).sum().backward()
        optim.step()
        return model, optim

    save, load = _save_load_implicit(storage, str(tmp_path / "ckpt"))
    model, optim = model_and_optim(0.1)
    losses = io.BytesIO()
    torch.save([0.5, 0.25], losses)
    save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim),
          "train_state": {"step": torch.tensor(2, dtype=torch.int32), "losses": losses}})

    model2, optim2 = model_and_optim(0.2)
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    msd, osd = get_model_state_dict(model2), get_optimizer_state_dict(model2, optim2)
    train_state = {"step": torch.tensor(0, dtype=torch.int32), "losses": io.BytesIO()}
    target = {"model": msd, "optimizer": osd, "train_state": train_state}
    load(target)
    assert target["model"] is msd and target["optimizer"] is osd
    set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd)
    assert optim2.param_groups[0]["lr"] == 0.1
    for (name, a), b in zip(get_model_state_dict(model).items(), get_model_state_dict(model2).values()):
        assert bits_equal(a, b), name
    want, got = get_optimizer_state_dict(model, optim)["state"], get_optimizer_state_dict(model2, optim2)["state"]
    for name in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert bits_equal(want[name][key], got[name][key]), (name, key)
    assert target["train_state"]["step"].item() == 2
    target["train_state"]["losses"].seek(0)
    assert torch.load(target["train_state"]["losses"]) == [0.5, 0.25]
