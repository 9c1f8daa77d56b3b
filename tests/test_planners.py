"""FastPersistSavePlanner / FastPersistLoadPlanner make exactly the plans and
Metadata DCP's default planners make (compared by ``repr``: every field,
index hints included), and checkpoints round-trip and reshard through them.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _validate_global_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType

from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner, _global, _items
from tests._dist import run_ranks
from tests._sd import DTYPES, assert_sd_equal, bits_equal, random_tensor

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(fn):
    """``("ok", repr of the result)`` or ``("error", type, message)``."""
    try:
        return ("ok", repr(fn()))
    except Exception as e:  # noqa: BLE001 - compared, not swallowed
        return ("error", type(e).__name__, str(e))


# ------------------------------------------------------------- state dicts

_names = st.text(alphabet="abcxyz._", min_size=1, max_size=4)


@st.composite
def _leaf(draw):
    kind = draw(st.sampled_from(["tensor", "tensor", "tensor", "param", "int", "float", "str", "bytes", "none"]))
    if kind in ("tensor", "param"):
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        t = random_tensor(tuple(shape), dtype, np.random.default_rng(draw(st.integers(0, 2**16))))
        if kind == "param" and dtype.is_floating_point:
            return torch.nn.Parameter(t, requires_grad=draw(st.booleans()))
        return t
    return {"int": 3, "float": 0.5, "str": "s", "bytes": b"\x00\x01", "none": None}[kind]


def _state_dicts(max_leaves: int = 12):
    tree = st.recursive(
        _leaf(),
        lambda inner: st.one_of(st.dictionaries(_names, inner, max_size=3), st.lists(inner, max_size=3)),
        max_leaves=max_leaves,
    )
    return st.dictionaries(_names, tree, min_size=1, max_size=6)


def _save_plans(cls, sds, **kw):
    """Local plans of one planner per simulated rank, then the global plan
    of rank 0's planner: (local plans, global plans, metadata) as reprs."""
    planners = [cls(**kw) for _ in sds]
    local = []
    for r, (p, sd) in enumerate(zip(planners, sds)):
        p.set_up_planner(sd, None, r == 0)
        local.append(p.create_local_plan())
    gp, md = planners[0].create_global_plan(local)
    return repr(local), repr(gp), repr(md), md


@_SETTINGS
@given(sd=_state_dicts(), world=st.integers(1, 4), keep=st.lists(st.integers(0, 15), min_size=4, max_size=4),
       lowest=st.booleans(), flat=st.booleans())
def test_save_plans_and_metadata_equal_dcps(sd, world, keep, lowest, flat):
    """Random nested state dicts, held whole or in part by 1-4 simulated
    ranks (replicated items deduplicated): every local plan, the global
    plans and the Metadata equal DCP's, index hints and all."""
    keys = sorted(sd)
    sds = [{k: sd[k] for i, k in enumerate(keys) if r == 0 or keep[r] >> (i % 4) & 1} for r in range(world)]
    kw = {"dedup_save_to_lowest_rank": lowest, "flatten_state_dict": flat}
    ours = _outcome(lambda: _save_plans(FastPersistSavePlanner, sds, **kw)[:3])
    assert ours == _outcome(lambda: _save_plans(DefaultSavePlanner, sds, **kw)[:3])


@_SETTINGS
@given(sd=_state_dicts(), drop=st.integers(0, 7), extra=st.booleans(), resize=st.booleans(), partial=st.booleans())
def test_load_plans_equal_dcps(sd, drop, extra, resize, partial):
    """Load plans for targets that match the checkpoint, miss keys, have
    keys it lacks or a tensor of another size: DCP's read items, or DCP's
    error with its message."""
    md = _save_plans(DefaultSavePlanner, [sd])[3]
    target = {k: v for i, (k, v) in enumerate(sd.items()) if not (drop >> i) & 1 or i > 2}
    if extra:
        target["zz_extra"] = torch.zeros(2)
    if resize:
        for k, v in target.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                target[k] = torch.zeros(v.shape[0] + 1, dtype=v.dtype)
                break

    def plan(cls):
        p = cls(allow_partial_load=partial)
        p.set_up_planner(target, md, True)
        return p.create_local_plan()

    assert _outcome(lambda: plan(FastPersistLoadPlanner)) == _outcome(lambda: plan(DefaultLoadPlanner))


# ---------------------------------------------- synthetic global plans

_PROPS = TensorProperties.create_from_tensor(torch.zeros(1))


def _shard(fqn, offsets, sizes, size, kind=WriteItemType.SHARD):
    off = torch.Size(offsets)
    return WriteItem(index=MetadataIndex(fqn, off), type=kind,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, torch.Size(sizes)),
                                                 properties=_PROPS, size=torch.Size(size)))


@st.composite
def _sharded_plans(draw):
    """Plans of 1-5 ranks holding boxes of 1-3 tensors: tilings, replicas
    (same box on several ranks), and now and then overlaps, gaps and boxes
    out of bounds."""
    world = draw(st.integers(1, 5))
    items = [[] for _ in range(world)]
    for t in range(draw(st.integers(1, 3))):
        nd = draw(st.integers(1, 3))
        size = [draw(st.integers(1, 6)) for _ in range(nd)]
        d = draw(st.integers(0, nd - 1))
        cuts = sorted(set(draw(st.lists(st.integers(1, size[d]), max_size=3))) | {size[d]})
        start = 0
        for c in cuts:
            off, ln = [0] * nd, list(size)
            off[d], ln[d] = start, c - start
            if draw(st.integers(0, 9)) == 0:  # a broken box
                off[draw(st.integers(0, nd - 1))] += draw(st.integers(-1, 2))
            holders = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
            for r in holders:
                items[r].append(_shard(f"t{t}", off, ln, size))
            start = c
    return [SavePlan(its) for its in items]


@_SETTINGS
@given(plans=_sharded_plans(), lowest=st.booleans())
def test_dedup_global_plan_and_validation_equal_dcps(plans, lowest):
    """Dedup (ties included), the global plan's index hints and Metadata,
    and validation's error list (overlaps, gaps, bounds): DCP's."""
    assert repr(_global.dedup(plans, lowest)) == repr(dedup_save_plans(plans, lowest))
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

    deduped = dedup_save_plans(plans, lowest)
    ours, theirs = _global.global_plan(deduped), create_default_global_save_plan(deduped)
    assert repr(ours) == repr(theirs)
    assert _global.validate(theirs[0], theirs[1]) == _global._errors(_validate_global_plan(theirs[0], theirs[1]))
    a = _outcome(lambda: FastPersistSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(plans))
    b = _outcome(lambda: DefaultSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(plans))
    assert a == b


def _gathered(plans):
    """The plans as the coordinator receives them from our local planners:
    items pickled as columns, unpickled as columns not yet made into items."""
    import pickle

    from fp_dcp.planners import _compact

    out = []
    for p in plans:
        items = _compact.WriteItems(p.items)
        items.lazy = True
        out.append(pickle.loads(pickle.dumps(dataclasses.replace(p, items=items))))
    return out


@_SETTINGS
@given(plans=_sharded_plans(), lowest=st.booleans())
def test_global_plan_from_columns_equals_dcps(plans, lowest):
    """Planned from the gathered columns (no items made): the same global
    plans (hints included), Metadata and validation errors as DCP's, and the
    global plans pickle as columns that come back as those plans."""
    import pickle

    from fp_dcp.planners import _columns, _compact

    gathered = _gathered(plans)
    assert all(type(p.items) is _compact.WriteItems and p.items._cols is not None for p in gathered)
    planned = _columns.plan(gathered, lowest)
    deduped = dedup_save_plans(plans, lowest)
    if planned is not None:
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        theirs = create_default_global_save_plan(deduped)
        assert repr(planned[:2]) == repr(theirs)
        for p in planned[0]:
            back = pickle.loads(pickle.dumps(p))
            assert repr(back) == repr(p) and type(back.items) is _compact.WriteItems
    gathered = _gathered(plans)
    a = _outcome(lambda: FastPersistSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(gathered))
    b = _outcome(lambda: DefaultSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(plans))
    assert a == b


def _scaled(plans, factor):
    """The plans with every chunk's offset and size, and the tensor's size,
    along dimension 0 multiplied by ``factor``."""
    def scale(size):
        return torch.Size([size[0] * factor, *size[1:]])

    return [SavePlan([_shard(it.index.fqn, scale(it.tensor_data.chunk.offsets), scale(it.tensor_data.chunk.sizes),
                             scale(it.tensor_data.size), it.type) for it in p.items]) for p in plans]


@_SETTINGS
@given(plans=_sharded_plans(), lowest=st.booleans())
def test_global_plan_from_columns_beyond_32_bits_equals_dcps(plans, lowest):
    """Offsets and sizes past 2**31 (kept in 64 bits, not 32): the same
    global plans, Metadata and validation errors as DCP's."""
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

    from fp_dcp.planners import _columns

    plans = _scaled(plans, 1 << 31)
    gathered = _gathered(plans)
    assert _columns._All([p.items.columns() for p in gathered]).toff.dtype == np.int64
    planned = _columns.plan(gathered, lowest)
    if planned is not None:
        assert repr(planned[:2]) == repr(create_default_global_save_plan(dedup_save_plans(plans, lowest)))
    a = _outcome(lambda: FastPersistSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(
        _gathered(plans)))
    assert a == _outcome(lambda: DefaultSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(plans))


@_SETTINGS
@given(plans=_sharded_plans(), lowest=st.booleans())
def test_dedup_without_its_table_equals_dcps(plans, lowest):
    """The dedup's way for many shared keys x ranks (one-rank items counted
    as the visit reaches them) keeps the items DCP's keeps."""
    from fp_dcp.planners import _columns

    was = _columns.TABLE_CELLS
    _columns.TABLE_CELLS = 0
    try:
        planned = _columns.plan(_gathered(plans), lowest)
    finally:
        _columns.TABLE_CELLS = was
    if planned is not None:
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        assert repr(planned[:2]) == repr(create_default_global_save_plan(dedup_save_plans(plans, lowest)))


def test_replicated_and_sharded_items_plan_from_columns():
    """A key on every rank (dedup by planned bytes), shards of one tensor and
    a scalar: planned from the columns, equal to DCP's."""
    from fp_dcp.planners import _columns

    plans = []
    for r in range(3):
        items = [_shard("w", [r * 2, 0], [2, 3], [6, 3]), _shard("rep", [0], [5], [5], WriteItemType.TENSOR),
                 WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)]
        if r == 1:
            items.append(_shard("big", [0, 0], [7, 7], [7, 7], WriteItemType.TENSOR))
        plans.append(SavePlan(items))
    for lowest in (False, True):
        assert _columns.plan(_gathered(plans), lowest) is not None
        a = _outcome(lambda: FastPersistSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(
            _gathered(plans)))
        assert a == _outcome(lambda: DefaultSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(plans))


def test_validation_finds_an_overlap_only_a_sweep_sees():
    """A 2-D grid of chunks (no single dimension separates them) with one
    overlap: the column check hands the tensor to DCP's sweep, which names it."""
    size = (4, 4)
    boxes = [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((1, 1), (2, 2))]
    plans = [SavePlan([_shard("g", o, s, size)]) for o, s in boxes]
    gp, md = _global.global_plan(plans)
    errors = _global.validate(gp, md)
    assert errors == _global._errors(_validate_global_plan(gp, md))
    if errors != [None]:  # a torch whose check has no text: DCP's "Failed to validate global plan"
        assert any("overlapping" in e and "g" in e for e in errors)


def test_validation_of_a_grid_runs_no_sweep(monkeypatch):
    """A 2-D mesh's uneven grid of chunks (no single dimension separates
    them) is found disjoint without DCP's sweep, which compares each chunk
    with every other of its band (a whole row of the mesh), from the
    Metadata and from the gathered columns alike."""
    import torch.distributed.checkpoint.default_planner as dp

    size = (5, 7)
    cells = [((r, c), (nr, nc)) for r, nr in ((0, 3), (3, 2)) for c, nc in ((0, 4), (4, 3))]
    plans = [SavePlan([_shard("g", o, n, size)]) for o, n in cells]
    gp, md = _global.global_plan(plans)
    assert not _global._errors(_validate_global_plan(gp, md))
    assert _global._suspects(md, len(plans)) == (False, ["g"])  # the columns alone cannot tell

    def sweep(*args, **kwargs):
        raise AssertionError("DCP's sweep ran")

    monkeypatch.setattr(dp, "_validate_global_plan", sweep)
    assert _global.validate(gp, md) == []
    ours = FastPersistSavePlanner(flatten_state_dict=False)._create_global_plan(_gathered(plans))
    assert repr(ours) == repr((gp, md))


def test_a_state_dict_with_some_nested_values_is_flattened_key_by_key_as_dcp_does():
    """Plain values are kept as they are and only the nested ones are walked
    by DCP's flatten_state_dict, one key at a time: the same flat dict (same
    order, same objects) and mappings as DCP's whole walk; a collision, a
    DTensor-like value or a meta tensor being loaded falls back to DCP's walk."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

    from fp_dcp.planners import _flat

    sd = {"w": torch.ones(2), "cfg": {"lr": 0.1, "sched": [1, 2]}, "b.c": 3,
          "opt": {"state": {"0": {"exp": torch.zeros(3)}}, "groups": [{"lr": 0.5, "params": [0]}]},
          "p": torch.nn.Parameter(torch.ones(1)), "name": "run"}
    flat, mappings = _flat.flat_or_none(sd)
    want, want_mappings = flatten_state_dict(sd)
    want = _flatten_sharded_tensors(want)
    assert list(flat) == list(want) and all(flat[k] is want[k] for k in want)
    assert list(mappings.items()) == list(want_mappings.items())
    assert "opt.state.0.exp" in flat and mappings["cfg.lr"] == ("cfg", "lr")
    for loading in (False, True):  # a load walks in another order: the empty dict goes first, [3] stays one value
        nested = {"_": 0.5, "__": [3, {}]}
        want = (_flatten_sharded_tensors(nested) if loading else nested)
        want, want_mappings = flatten_state_dict(want)
        assert _flat.flat_or_none(nested, loading=loading) == (want, want_mappings)
        assert ("__" in want) is loading
    assert _flat.flat_or_none({"a.b": 1, "a": {"b": 2}}) is None  # DCP's walk reports the duplicate
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}})
    assert _flat.flat_or_none({"a": {"b": 2}, "a.b": 1}) is None
    assert _flat.flat_or_none({"w": 1, "x": {"a.b": 1, "a": {"b": 2}}}) is None  # a collision inside one value
    assert _flat.flat_or_none({"w": torch.ones(1), "opt": {"m": torch.empty(2, device="meta")}}, loading=True) is None
    assert _flat.flat_or_none({"w": torch.ones(1), "opt": {"m": torch.empty(2, device="meta")}}) is not None
    from torch.distributed.tensor import DTensor

    class Sub(torch.Tensor):  # a DTensor or ShardedTensor here: what DCP's walk acts on
        pass

    assert DTensor.__mro__[1] is torch.Tensor
    assert _flat.flat_or_none({"w": torch.ones(1), "x": {"y": torch.ones(1).as_subclass(Sub)}}) is None
    assert _flat.flat_or_none({"w": torch.ones(1), 3: 1}) is None  # DCP makes it "3"


def test_fast_builders_match_the_constructors_on_this_torch():
    assert _items.FAST, "DCP's plan classes changed shape: the planners fall back to the constructors"


# ------------------------------------------------------------ multi-rank


def _dt_state(ws, kinds):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    mesh2 = init_device_mesh("cpu", (2, ws // 2)) if ws % 2 == 0 else None
    pl = {"s0": [Shard(0)], "s1": [Shard(1)], "rep": [Replicate()]}
    sd = {}
    for i, (name, kind) in enumerate(kinds.items()):
        full = torch.randn(12 + i % 2, 10, generator=torch.Generator().manual_seed(i))  # shapes repeat
        if kind.startswith("2d") and mesh2 is not None:
            sd[name] = distribute_tensor(full, mesh2, [Shard(0), Shard(1)] if kind == "2d" else [Replicate(), Shard(0)])
        else:
            sd[name] = distribute_tensor(full, mesh, pl.get(kind, [Shard(0)]))
    sd["plain"] = torch.arange(7.0)
    sd["nested"] = {"step": 3, "t": torch.ones(3, dtype=torch.int8)}
    return sd


_SAVED = {"a": "s0", "b": "s1", "c": "rep", "d": "2d", "e": "2d_rep", "f": "s1", "g": "s0"}
_LOADED = {"a": "s1", "b": "s0", "c": "s0", "d": "s0", "e": "rep", "f": "s0", "g": "s1"}


def _plans_equal_and_round_trip(rank, ws, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.tensor import DTensor

    from fp_dcp import FastPersistReader, FastPersistWriter

    sd = _dt_state(ws, _SAVED)
    reprs = {}
    for cls in (FastPersistSavePlanner, DefaultSavePlanner):
        p = cls()
        p.set_up_planner(sd, None, rank == 0)
        local = p.create_local_plan()
        gathered = [None] * ws
        dist.all_gather_object(gathered, local)
        gp, md = p.create_global_plan(gathered)
        reprs[cls] = (repr(local), repr(gp), repr(md))
    assert reprs[FastPersistSavePlanner] == reprs[DefaultSavePlanner]

    dcp.save(sd, storage_writer=FastPersistWriter(os.path.join(root, "fp")), planner=FastPersistSavePlanner())
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, "stock")), planner=FastPersistSavePlanner())
    for path, reader in (("fp", FastPersistReader), ("stock", FileSystemReader)):
        target = _dt_state(ws, _LOADED)
        md = reader(os.path.join(root, path)).read_metadata()
        got = {}
        for cls in (FastPersistLoadPlanner, DefaultLoadPlanner):
            p = cls()
            p.set_up_planner(_dt_state(ws, _LOADED), md, rank == 0)
            got[cls] = repr(p.create_local_plan())
        assert got[FastPersistLoadPlanner] == got[DefaultLoadPlanner]
        for v in target.values():
            if isinstance(v, torch.Tensor):
                v.to_local().zero_() if isinstance(v, DTensor) else v.zero_()
        target["nested"]["step"] = 0
        dcp.load(target, storage_reader=reader(os.path.join(root, path)), planner=FastPersistLoadPlanner())
        want = _dt_state(ws, _LOADED)
        for k, v in want.items():
            if isinstance(v, DTensor):
                assert bits_equal(target[k].to_local(), v.to_local()), f"{path}: {k}"
        assert_sd_equal(target["nested"], want["nested"]) and bits_equal(target["plain"], want["plain"])

    # plan caching through the planner: the second and third saves reuse the plans
    for i in range(3):
        dcp.save(sd, storage_writer=FastPersistWriter(os.path.join(root, "cached")),
                 planner=FastPersistSavePlanner(enable_plan_caching=True))
    target = _dt_state(ws, _SAVED)
    dcp.load(target, storage_reader=FastPersistReader(os.path.join(root, "cached")), planner=FastPersistLoadPlanner())
    for k, v in sd.items():
        if isinstance(v, DTensor):
            assert bits_equal(target[k].to_local(), v.to_local()), f"cached: {k}"
    # a changed state dict on every rank: DCP merges the new plans into its cache
    changed = {**sd, "extra": torch.full((5,), float(ws))}
    dcp.save(changed, storage_writer=FastPersistWriter(os.path.join(root, "changed")),
             planner=FastPersistSavePlanner(enable_plan_caching=True))
    target = {**_dt_state(ws, _SAVED), "extra": torch.zeros(5)}
    dcp.load(target, storage_reader=FastPersistReader(os.path.join(root, "changed")), planner=FastPersistLoadPlanner())
    assert bits_equal(target["extra"], changed["extra"]) and bits_equal(target["a"].to_local(), sd["a"].to_local())


@pytest.mark.slow
def test_dtensor_plans_equal_dcps_and_round_trip_on_4_ranks(tmp_path):
    """Shard/Replicate on 1-D and 2-D meshes over 4 gloo ranks: local, global
    plans and Metadata equal DCP's; saves through fp_dcp's and DCP's own
    writer with our planner load back resharded (Shard(0) <-> Shard(1), 2-D
    -> 1-D) bit for bit with our load planner, whose read items equal DCP's;
    plan caching works through it."""
    run_ranks(4, _plans_equal_and_round_trip, str(tmp_path), timeout=300)


def test_dtensor_plans_equal_dcps_on_2_ranks(tmp_path):
    run_ranks(2, _plans_equal_and_round_trip, str(tmp_path), timeout=300)


def _fsdp_save(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fp_dcp import FastPersistWriter
    from tests.test_reshard import _STEPS_BEFORE, _fsdp, _full_state, _train

    model, opt = _fsdp(ws)
    _train(model, opt, _STEPS_BEFORE, 0, rank, ws)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FastPersistWriter(os.path.join(root, "fsdp")),
             planner=FastPersistSavePlanner())
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(root, "full.pt"))


def _fsdp_load(rank, ws, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fp_dcp import FastPersistReader
    from tests.test_reshard import _fsdp, _full_state

    model, opt = _fsdp(ws)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=FastPersistReader(os.path.join(root, "fsdp")), planner=FastPersistLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got, want = _full_state(model, opt), torch.load(os.path.join(root, "full.pt"))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert bits_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


@pytest.mark.slow
def test_fsdp2_4_ranks_reshards_to_2_and_3_through_our_planners(tmp_path):
    run_ranks(4, _fsdp_save, str(tmp_path), timeout=300)
    run_ranks(2, _fsdp_load, str(tmp_path), timeout=300)
    run_ranks(3, _fsdp_load, str(tmp_path), timeout=300)


# -------------------------------------------------------- one process


def test_round_trip_mixed_state_dict_through_both_storages(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from fp_dcp import FastPersistReader, FastPersistWriter
    from tests._sd import mixed_state_dict, zeros_like_sd

    sd = mixed_state_dict(3)
    for name, w, r in (("fp", FastPersistWriter, FastPersistReader), ("stock", FileSystemWriter, FileSystemReader)):
        path = str(tmp_path / name)
        writer = w(path)
        dcp.save(sd, storage_writer=writer, planner=FastPersistSavePlanner(), no_dist=True)
        target = zeros_like_sd(sd)
        dcp.load(target, storage_reader=r(path), planner=FastPersistLoadPlanner(), no_dist=True)
        assert_sd_equal(target, sd)
        if hasattr(writer, "close"):
            writer.close()


def test_dataclass_equality_ignores_hints_so_the_tests_compare_reprs():
    a, b = MetadataIndex("k", (0,), 1), MetadataIndex("k", (0,), 2)
    assert a == b and repr(a) != repr(b)
    assert dataclasses.replace(a, index=2) == b


# ------------------------------------------------- the default-storage switch


def test_the_switch_installs_our_planners_when_none_is_passed_and_leaves_a_passed_one(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict_loader as loader
    import torch.distributed.checkpoint.state_dict_saver as saver

    import fp_dcp
    from tests._sd import mixed_state_dict, zeros_like_sd

    calls = []
    for cls in (FastPersistSavePlanner, FastPersistLoadPlanner):
        original = cls.create_local_plan

        def counting(self, _original=original, _cls=cls):
            calls.append(_cls.__name__)
            return _original(self)

        monkeypatch.setattr(cls, "create_local_plan", counting)
    stock = (saver.DefaultSavePlanner, loader.DefaultLoadPlanner)
    sd = mixed_state_dict(5)
    with fp_dcp.default_storage():
        dcp.save(sd, checkpoint_id=str(tmp_path / "a"), no_dist=True)
        target = zeros_like_sd(sd)
        dcp.load(target, checkpoint_id=str(tmp_path / "a"), no_dist=True)
        assert_sd_equal(target, sd)
        assert calls == ["FastPersistSavePlanner", "FastPersistLoadPlanner"]
        dcp.save(sd, checkpoint_id=str(tmp_path / "b"), planner=DefaultSavePlanner(), no_dist=True)
        dcp.load(zeros_like_sd(sd), checkpoint_id=str(tmp_path / "b"), planner=DefaultLoadPlanner(), no_dist=True)
        assert len(calls) == 2, calls
    assert (saver.DefaultSavePlanner, loader.DefaultLoadPlanner) == stock
    dcp.save(sd, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert len(calls) == 2, "the switch is off: DCP's own default planner"


def test_the_environment_switch_installs_our_planners():
    import subprocess
    import sys

    code = ("import fp_dcp, torch.distributed.checkpoint.state_dict_saver as s, "
            "torch.distributed.checkpoint.state_dict_loader as l; "
            "print(s.DefaultSavePlanner.__name__, l.DefaultLoadPlanner.__name__)")
    env = dict(os.environ, FP_DCP_DEFAULT_STORAGE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["FastPersistSavePlanner", "FastPersistLoadPlanner"], out.stderr


# --------------- PyTorch's own planner scenarios (ShardedTensor), ours beside DCP's


def _sharded(rank: int, world: int, per_rank: int = 1, shard: int = 8):
    """A 1-D ShardedTensor of ``world * per_rank`` shards of ``shard``
    elements, this rank holding its own (as PyTorch's planner tests build it)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardProps

    mds, local = [], []
    for i in range(world * per_rank):
        md = ShardMetadata(shard_offsets=[i * shard], shard_sizes=[shard], placement=f"rank:{i // per_rank}/cpu")
        mds.append(md)
        if i // per_rank == rank:
            local.append(Shard.from_tensor_and_offsets(torch.arange(float(shard)) + i * shard,
                                                       shard_offsets=md.shard_offsets, rank=rank))
    meta = ShardedTensorMetadata(shards_metadata=mds, size=torch.Size([shard * len(mds)]),
                                 tensor_properties=ShardProps.create_from_tensor(torch.zeros(1)))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards=local, sharded_tensor_metadata=meta)


def _st_state(rank, world, shard=8):
    from torch.testing._internal.distributed.distributed_utils import with_dist

    with with_dist(rank=rank, world_size=world):
        return {"tensor": torch.arange(10.0), "value": [1, 2, 3], "st": _sharded(rank, world, shard=shard)}


@pytest.mark.parametrize("world", [1, 4])
def test_sharded_tensor_save_plans_equal_dcps(world):
    """PyTorch's local and global save plan scenarios (a tensor, a list and
    a ShardedTensor on 4 ranks): our plans, hints and Metadata are DCP's."""
    sds = [_st_state(r, world) for r in range(world)]
    assert _save_plans(FastPersistSavePlanner, sds)[:3] == _save_plans(DefaultSavePlanner, sds)[:3]


@pytest.mark.parametrize("saved,loading", [(8, 4), (4, 8), (4, 3)])
def test_sharded_tensor_reshard_load_plans_equal_dcps(saved, loading):
    """PyTorch's resharding scenarios (8 -> 4, 4 -> 8 and 4 -> 3 ranks of a
    120- or 128-element ShardedTensor): every rank's read items are DCP's."""
    from torch.testing._internal.distributed.distributed_utils import with_dist

    total = 120 if (saved, loading) == (4, 3) else 128
    md = _save_plans(DefaultSavePlanner, [_st_state(r, saved, total // saved) for r in range(saved)])[3]
    for rank in range(loading):
        with with_dist(rank=rank, world_size=loading):
            target = {"st": _sharded(rank, loading, shard=total // loading)}
            plans = []
            for cls in (FastPersistLoadPlanner, DefaultLoadPlanner):
                p = cls()
                p.set_up_planner(target, md, rank == 0)
                plans.append(repr(p.create_local_plan()))
        assert plans[0] == plans[1] and "ReadItem" in plans[0]


# ------------------------------------------------- plans that travel as columns


@_SETTINGS
@given(sd=_state_dicts(), world=st.integers(1, 3))
def test_plans_pickle_as_columns_and_come_back_equal(sd, world):
    """What DCP's gather and scatter do to our plans (pickle there and back)
    gives plans equal field for field (hints included) to the ones sent."""
    import pickle

    from fp_dcp.planners import _compact

    planners = [FastPersistSavePlanner() for _ in range(world)]
    local = []
    for r, p in enumerate(planners):
        p.set_up_planner(sd, None, r == 0)
        local.append(p.create_local_plan())
    gp, md = planners[0].create_global_plan(local)
    plans = [*local, *gp]
    lp = FastPersistLoadPlanner()
    lp.set_up_planner(sd, md, True)
    if not set(md.state_dict_metadata) - set(lp.state_dict):  # else DCP's own code plans it
        try:
            plans.append(lp.create_local_plan())
        except RuntimeError as e:  # a target DCP cannot load either (test_load_plans_equal_dcps)
            assert "Missing key" in str(e)
    for plan in plans:
        assert type(plan.items) in (_compact.WriteItems, _compact.ReadItems)
        back = pickle.loads(pickle.dumps(plan))
        assert repr(back) == repr(plan) and type(back.items) is type(plan.items)


def test_a_key_named_empty_comes_back():
    """A state dict whose only key is "" (joined: the empty string, as no
    keys at all) pickles and comes back with its item and mapping, after
    plans with no items and before."""
    import pickle

    for sd in ({"": torch.zeros(2)}, {"a": 1}, {"": torch.zeros(2)}):
        p = FastPersistSavePlanner()
        p.set_up_planner(sd, None, True)
        plan = p.create_local_plan()
        empty = dataclasses.replace(plan, items=type(plan.items)(), planner_data=type(plan.planner_data)())
        for sent in (empty, plan, empty, plan):
            back = pickle.loads(pickle.dumps(sent))
            assert repr(back) == repr(sent) and len(back.items) == len(sent.items)


def test_column_pickles_are_smaller_and_odd_items_pickle_as_lists():
    import pickle

    from fp_dcp.planners import _compact

    sd = {f"layer{i}.w": torch.zeros(4, 3) for i in range(200)}
    p = FastPersistSavePlanner()
    p.set_up_planner(sd, None, True)
    items = p.create_local_plan().items
    assert len(pickle.dumps(items)) < len(pickle.dumps(list(items))) / 2
    odd = _compact.WriteItems([*items[:2], dataclasses.replace(items[2], bytes_io_data=BytesIOWriteData(3))])
    back = pickle.loads(pickle.dumps(odd))
    assert type(back) is list and repr(back) == repr(odd)



def test_flat_mappings_pickle_as_their_keys_and_others_as_dicts():
    import pickle

    from fp_dcp.planners import _compact

    flat = {f"layer{i}.w": (f"layer{i}.w",) for i in range(300)}
    m = _compact.FlatMappings(flat)
    back = pickle.loads(pickle.dumps(m))
    assert type(back) is _compact.FlatMappings and back == flat and list(back) == list(flat)
    assert len(pickle.dumps(m)) < len(pickle.dumps(flat)) / 2
    again = pickle.dumps(back)  # scattered back from the coordinator: the keys it came as
    assert again == pickle.dumps(m) and pickle.loads(again) == flat
    assert pickle.loads(pickle.dumps(_compact.FlatMappings())) == {}
    for one in ({}, {"": ("",)}, {}, {"": ("",)}):  # one key named "": not the same as no key
        assert pickle.loads(pickle.dumps(_compact.FlatMappings(one))) == one
    for odd in ({"a": ("b",)}, {"a.b": ("a", "b")}, {"a\0": ("a\0",)}, {1: (1,)}):
        back = pickle.loads(pickle.dumps(_compact.FlatMappings(odd)))
        assert type(back) is dict and back == odd


def test_a_plans_keys_travel_once_with_its_items():
    """A save plan's items and its planner_data name the same keys (or the
    items a run of them): pickled together, the keys are carried once, and
    both come back equal to what was sent."""
    import pickle

    from fp_dcp.planners import _compact

    sd = {f"model.layers.{i}.weight": torch.zeros(2) for i in range(400)}
    sd["step"] = 7
    p = FastPersistSavePlanner()
    p.set_up_planner(sd, None, True)
    plan = p.create_local_plan()
    keys = len("\0".join(sd))
    apart = len(pickle.dumps(plan.items)) + len(pickle.dumps(plan.planner_data))
    assert len(pickle.dumps(plan)) < apart - keys * 0.9
    back = pickle.loads(pickle.dumps(plan))
    assert repr(back) == repr(plan) and type(back.planner_data) is _compact.FlatMappings
    for items in (list(plan.items)[:-1], list(plan.items)[:-100], list(plan.items)[1:]):
        fewer = dataclasses.replace(back, items=_compact.WriteItems(items))
        sent = pickle.dumps(fewer)
        assert repr(pickle.loads(sent)) == repr(fewer)
        if items[0] is plan.items[0]:  # the items name the first keys: only the rest is sent again
            assert len(sent) < len(pickle.dumps(fewer.items)) + len(pickle.dumps(fewer.planner_data)) - keys * 0.5


def test_changed_flat_mappings_pickle_and_merge_as_changed():
    """An unpickled key list changed by any dict method pickles and merges
    as what it now holds, not as the keys it came as."""
    import pickle
    from collections import ChainMap

    from fp_dcp.planners import _compact

    flat = {f"k{i}": (f"k{i}",) for i in range(5)}
    changes = [lambda d: d.__setitem__("k0", ("x", "y")), lambda d: d.__delitem__("k1"),
               lambda d: d.update(z=("z",)), lambda d: d.pop("k2"), lambda d: d.popitem(), lambda d: d.clear(),
               lambda d: d.setdefault("n", ("m",)), lambda d: d.__ior__({"k3": ("q",)})]
    for change in changes:
        d = pickle.loads(pickle.dumps(_compact.FlatMappings(flat)))
        change(d)
        want = dict(d)
        assert want != flat and pickle.loads(pickle.dumps(d)) == want
        others = [pickle.loads(pickle.dumps(_compact.FlatMappings(flat))) for _ in range(2)]
        for maps in ([d, *others], [*others, d]):
            got = _compact.merged(maps)
            assert got == dict(ChainMap(*maps)) and list(got) == list(dict(ChainMap(*maps)))


def test_merged_mappings_equal_dcps_merge():
    """The plans' planner_data merged as DCP merges them (ChainMap: the
    first map's value, the last map's key order first): at once for equal
    unpickled key lists, DCP's way for anything else."""
    import pickle
    from collections import ChainMap

    from fp_dcp.planners import _compact

    def sent(keys):
        return pickle.loads(pickle.dumps(_compact.FlatMappings({k: (k,) for k in keys})))

    cases = [[sent("abc") for _ in range(4)], [sent("abc"), sent("cba")], [sent("ab"), sent("abc")],
             [sent("abc"), {"a": ("a",), "b": ("x",)}], [{"a": ("a", "b")}, sent("a")], [sent("")], [],
             [_compact.FlatMappings({"a": ("a",)})] * 2]
    for maps in cases:
        want = dict(ChainMap(*maps))
        got = _compact.merged(maps)
        assert type(got) is dict and got == want and list(got) == list(want)
        assert got is not maps[0] if maps else True


def test_load_plans_pass_the_coordinator_as_columns_and_come_back_as_sent():
    """A gathered load plan is passed on as the columns it came as (no
    items made); one that comes back to the process that sent it is made of
    the items sent; any other is decoded, equal field for field."""
    import pickle

    from fp_dcp.planners import _compact

    sd = {f"layer{i}.w": torch.zeros(4, 3) for i in range(50)}
    sd["step"] = 3
    p = FastPersistSavePlanner()
    p.set_up_planner(sd, None, True)
    _, md = p.create_global_plan([p.create_local_plan()])
    lp = FastPersistLoadPlanner()
    lp.set_up_planner(dict(sd), md, True)
    plan = lp.create_local_plan()
    sent = pickle.dumps(plan)
    at_coordinator = pickle.loads(sent)
    assert at_coordinator.items._cols is not None
    scattered = [pickle.dumps(x) for x in DefaultLoadPlanner().create_global_plan([at_coordinator])]
    assert scattered == [sent] and at_coordinator.items._cols is not None
    back = pickle.loads(scattered[0])
    assert repr(back) == repr(plan) and all(a is b for a, b in zip(back.items, plan.items, strict=True))
    _compact._last_sent = None  # another process's plan: decoded
    other = pickle.loads(scattered[0])
    assert repr(other) == repr(plan) and not any(a is b for a, b in zip(other.items, plan.items))
    other.items.append(other.items[0])  # a plain list once read
    assert len(other.items) == len(plan.items) + 1 and type(other.items) is _compact.ReadItems


def test_tensor_reads_of_held_columns_are_those_of_the_items():
    """``ReadItems.tensor_reads``: the same items, whether the columns are
    still held (only those decoded), came back to their sender, or were
    made into items; index offsets and hints of every kind."""
    import pickle

    from torch.distributed.checkpoint.planner import ReadItem

    from fp_dcp.planners import _compact

    def item(kind, fqn, nd, off, hint):
        z, s = torch.Size([1] * nd), torch.Size(range(2, 2 + nd))
        return ReadItem(type=kind, dest_index=MetadataIndex(fqn, z if off else None, hint), dest_offsets=z,
                        storage_index=MetadataIndex(fqn, None if off else z, None), storage_offsets=z, lengths=s)

    from torch.distributed.checkpoint.planner import LoadItemType

    items = [item(LoadItemType.TENSOR if i % 5 else LoadItemType.BYTE_IO, f"k{i}", i % 4, i % 2, i % 3 or None)
             for i in range(40)]
    want = [r for r in items if r.type == LoadItemType.TENSOR and len(r.lengths) >= 2]
    sent = pickle.dumps(_compact.ReadItems(items))
    _compact._last_sent = None
    held = pickle.loads(sent)
    got = held.tensor_reads(2)
    assert held._cols is not None and repr(got) == repr(want) and not any(a is b for a, b in zip(got, want))
    assert repr(held.tensor_reads(0)) == repr([r for r in items if r.type == LoadItemType.TENSOR])
    assert repr(list(held)) == repr(items) and repr(held.tensor_reads(2)) == repr(want)
    pickle.dumps(_compact.ReadItems(items))  # sent by this process: its own items back
    back = pickle.loads(sent)
    assert all(a is b for a, b in zip(back.tensor_reads(2), want, strict=True))


def test_sharing_plan_from_interleavable_reads_equals_the_whole_plans():
    """The reader's coordinator plans shared reads from the reads of two or
    more dimensions only (decoded alone from held columns): the same
    sharing plan as from every read."""
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from fp_dcp.load.reader import _interleavable
    from fp_dcp.load.sharing.plan import MachineInfo, plan_sharing
    from fp_dcp.planners import _compact

    props = TensorProperties.create_from_tensor(torch.zeros(1))
    z2, z1 = torch.Size([0, 0]), torch.Size([0])
    md = {"m": TensorStorageMetadata(props, torch.Size([8, 40]), [Chunk(z2, torch.Size([8, 40]))]),
          "v": TensorStorageMetadata(props, torch.Size([40]), [Chunk(z1, torch.Size([40]))]),
          "step": BytesStorageMetadata()}

    def reads(r):
        cols = torch.Size([0, 20 * r])
        return [ReadItem(LoadItemType.TENSOR, MetadataIndex("m", cols, 0), z2, MetadataIndex("m", z2, 0), cols,
                         torch.Size([8, 20])),
                ReadItem(LoadItemType.TENSOR, MetadataIndex("v", z1, 0), z1, MetadataIndex("v", z1, 0), z1,
                         torch.Size([40])),
                ReadItem(LoadItemType.BYTE_IO, MetadataIndex("step"), z1, MetadataIndex("step"), z1, z1)]

    def sizes(fqn, chunk):
        return list(md[fqn].chunks[0].sizes), torch.float32

    plans = [LoadPlan(reads(r), storage_data=MachineInfo(7)) for r in range(2)]
    _compact._last_sent = None
    held = [pickle.loads(pickle.dumps(dataclasses.replace(p, items=_compact.ReadItems(p.items)))) for p in plans]
    _compact._last_sent = None
    kw = dict(budget=1 << 20, interleave=True, interleave_auto=True, replicate=False, transport="auto")
    whole = plan_sharing(plans, md, sizes, **kw)
    assert whole is not None and whole.units
    only = plan_sharing([dataclasses.replace(p, items=_interleavable(p.items)) for p in held], md, sizes, **kw)
    assert repr(only) == repr(whole) and all(p.items._cols is not None for p in held)
