"""The multi-rank scenarios of PyTorch's DCP tests that take a planner
(see ``tests/test_upstream_scenarios.py``), with fp_dcp's planners where
those tests use DCP's default ones and with both storages:

- ``test_file_system_checkpoint_cpu.py``: ShardedTensors on 2 gloo ranks
  saved under one sharding and loaded under another, bytes items, sharded
  and plain tensors swapped between save and load;
- ``test_dtensor_resharding.py``: a DTensor saved under one placement and
  mesh and loaded under another, on 4 gloo ranks; ``test_dtensor_checkpoint.py``:
  DTensors on a sub-mesh beside a module's extra state.

Values are compared bit for bit (upstream compares with ``allclose``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import fp_dcp
from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner
from tests._dist import run_ranks
from tests._sd import bits_equal
from tests.upstream.pairs import PLANNERS, STORAGES

pytestmark = pytest.mark.upstream



# ------------------------------------- test_file_system_checkpoint_cpu.py


def _specs(dim0: int):
    """The shardings PyTorch's test moves between: chunked over 2 and over
    4 (two per rank), and two uneven enumerations of ``dim0`` rows."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    def shards(rows, tail):
        return EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[off] + [0] * len(tail), shard_sizes=[n] + tail, placement=f"rank:{r}/cpu")
            for off, n, r in rows])

    return {
        "chunk2": ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]),
        "chunk4": ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu", "rank:0/cpu"]),
        "uneven5": shards([(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, dim0 - 9, 0)], []),
        "uneven2": shards([(0, 8, 1), (8, dim0 - 8, 0)], []),
    }


def _with_cols(spec, cols: int):
    """``spec`` for a 2-D tensor of ``cols`` columns (an enumeration's shards widened)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    if not isinstance(spec, EnumerableShardingSpec):
        return spec
    return EnumerableShardingSpec(shards=[
        ShardMetadata(shard_offsets=[s.shard_offsets[0], 0], shard_sizes=[s.shard_sizes[0], cols],
                      placement=s.placement) for s in spec.shards])


def _full(st) -> torch.Tensor | None:
    """The whole ShardedTensor on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    out = torch.zeros(st.shape, dtype=st.dtype) if dist.get_rank() == 0 else None
    st.gather(out=out)
    return out


def _io(storage: str, planners: str, path: str):
    """save(sd) / load(sd) as PyTorch's test calls them: the stock writer and
    reader with the planner passed, or no storage and no planner with
    fp_dcp's default-storage switch on (its storage and planners picked)."""
    if storage == "fp_dcp":
        assert planners == "fp_dcp"

        def save(sd):
            with fp_dcp.default_storage():
                dcp.save(sd, checkpoint_id=path)

        def load(sd):
            with fp_dcp.default_storage():
                dcp.load(sd, checkpoint_id=path)

        return save, load
    save_cls, load_cls = PLANNERS[planners]

    def save_stock(sd):
        dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=2), planner=save_cls())

    def load_stock(sd):
        dcp.load(sd, storage_reader=FileSystemReader(path), planner=load_cls())

    return save_stock, load_stock


# (saved, loaded) shardings of the short run: each sharding saved once, loaded once
_SHORT = (("chunk2", "uneven5"), ("uneven5", "chunk4"), ("chunk4", "uneven2"), ("uneven2", "chunk2"))


def _reshard_sharded_tensors(rank: int, world: int, root: str, storage: str, planners: str, full: bool) -> int:
    """On each of 2 ranks: ShardedTensors saved under one sharding, loaded
    under another (every other with ``full``, else :data:`_SHORT`); bytes
    items; a ShardedTensor loaded into a plain tensor and a replicated
    tensor into a ShardedTensor. Returns the loads checked bit for bit on
    rank 0."""
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor

    checked = 0
    specs = _specs(10)
    for i, (name0, s0) in enumerate(specs.items()):
        for name1, s1 in specs.items():
            if name0 == name1 or not (full or (name0, name1) in _SHORT):
                continue
            save, load = _io(storage, planners, os.path.join(root, f"{name0}-{name1}"))
            torch.manual_seed(100 * i + rank)
            saved = sharded_tensor.rand(_with_cols(s0, 20), 10, 20, init_rrefs=False)
            save({"sharded_tensor": saved})
            target = {"sharded_tensor": sharded_tensor.zeros(_with_cols(s1, 20), 10, 20, init_rrefs=False)}
            load(target)
            a, b = _full(saved), _full(target["sharded_tensor"])
            if rank == 0:
                assert bits_equal(a, b), f"{name0} -> {name1}"
                checked += 1
    # columns: row-wise chunks loaded as column-wise ones
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    save, load = _io(storage, planners, os.path.join(root, "rows-cols"))
    saved = sharded_tensor.rand(specs["chunk2"], 10, 20, init_rrefs=False)
    save({"t": saved})
    cols = ChunkShardingSpec(dim=1, placements=["rank:0/cpu", "rank:1/cpu"])
    target = {"t": sharded_tensor.zeros(cols, 10, 20, init_rrefs=False)}
    load(target)
    a, b = _full(saved), _full(target["t"])
    if rank == 0:
        assert bits_equal(a, b)
        checked += 1
    # bytes items
    save, load = _io(storage, planners, os.path.join(root, "bytes"))
    save({"bytes0": [1], "bytes1": "string"})
    got = {"bytes0": [2], "bytes1": "other"}
    load(got)
    assert got == {"bytes0": [1], "bytes1": "string"}
    # a ShardedTensor loaded as a plain tensor, a replicated tensor as a ShardedTensor
    for j, (name0, s0) in enumerate(_specs(32).items()):
        for name1, s1 in _specs(32).items():
            if not (full or (name0, name1) in _SHORT):
                continue
            save, load = _io(storage, planners, os.path.join(root, f"swap-{name0}-{name1}"))
            torch.manual_seed(1000 + 10 * j + rank)
            sd = {"sharded": sharded_tensor.rand(s0, 32), "replicated": torch.arange(32.0) * 1.5}
            save(sd)
            target = {"sharded": torch.zeros(32), "replicated": sharded_tensor.zeros(s1, 32)}
            load(target)
            whole, replicated = _full(sd["sharded"]), _full(target["replicated"])
            if rank == 0:
                assert bits_equal(target["sharded"], whole), f"{name0} -> plain"
                assert bits_equal(replicated, sd["replicated"]), f"plain -> {name1}"
                checked += 1
    dist.barrier()
    return checked


def _run_sharded(tmp_path, storage, planners, full):
    checked = run_ranks(2, _reshard_sharded_tensors, str(tmp_path), storage, planners, full, timeout=300)
    assert checked == ([12 + 1 + 16, 0] if full else [2 * len(_SHORT) + 1, 0])


def test_sharded_tensors_reshard_through_fp_dcp_with_the_switch(tmp_path):
    _run_sharded(tmp_path, "fp_dcp", "fp_dcp", full=False)


@pytest.mark.slow
@pytest.mark.parametrize("storage,planners", [("fp_dcp", "fp_dcp"), ("stock", "fp_dcp"), ("stock", "dcp")])
def test_sharded_tensors_reshard_between_every_two_shardings(tmp_path, storage, planners):
    """Every pair of shardings, through fp_dcp's storage and planners, DCP's
    storage with our planners, and DCP's own (the reference: the scenario
    itself holds)."""
    _run_sharded(tmp_path, storage, planners, full=True)


# ------------------------------------------------ test_dtensor_resharding.py


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    one_d = [[Shard(0)], [Replicate()]]
    two_d = [[Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()], [Shard(0), Shard(0)]]
    return one_d, two_d


def _reshard_dtensors(rank: int, world: int, root: str, storage: str) -> int:
    """On 4 ranks: a 4x4 DTensor saved under each 1-D and 2-D placement and
    loaded under every other placement of either mesh, through our planners
    (passed as PyTorch's test passes DCP's). Returns the loads checked."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor, zeros

    writer_cls, reader_cls = STORAGES[storage]
    one_d, two_d = _placements()
    meshes = {1: init_device_mesh("cpu", (world,)), 2: init_device_mesh("cpu", (2, world // 2))}
    layouts = [(1, p) for p in one_d] + [(2, p) for p in two_d]
    whole = torch.arange(16, dtype=torch.float).view(4, 4) * 0.7
    checked = 0
    for i, (dims0, p0) in enumerate(layouts):
        path = os.path.join(root, str(i))
        writer = writer_cls(path)
        dcp.save({"dtensor": distribute_tensor(whole, meshes[dims0], p0)}, storage_writer=writer,
                 planner=FastPersistSavePlanner())
        getattr(writer, "close", lambda: None)()
        for dims1, p1 in layouts:
            if (dims1, p1) == (dims0, p0):
                continue
            target = {"dtensor": zeros([4, 4], device_mesh=meshes[dims1], placements=p1)}
            reader = reader_cls(path)
            dcp.load(target, storage_reader=reader, planner=FastPersistLoadPlanner())
            getattr(reader, "close", lambda: None)()
            got = target["dtensor"].redistribute(meshes[dims1], [Replicate()] * dims1).to_local()
            assert bits_equal(got, whole), f"{p0} -> {p1}"
            checked += 1
    return checked + _submesh_and_extra_state(rank, world, os.path.join(root, "submesh"), storage)


def _submesh_and_extra_state(rank: int, world: int, path: str, storage: str) -> int:
    """``test_dtensor_checkpoint``'s model: DTensors on a mesh of the even
    ranks only (the odd ones hold nothing of them) beside a module's extra
    state (an int and a tensor in a dict), through our planners."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    writer_cls, reader_cls = STORAGES[storage]
    sub = DeviceMesh("cpu", [r for r in range(world) if r % 2 == 0])
    values = torch.arange(6.0) + 0.25
    sd = {"sdt": distribute_tensor(values, sub, [Shard(0)]),
          "rdt": distribute_tensor(values * 2, sub, [Replicate()]),
          "_extra_state": {"extra_state": 1, "extra_state_tensor": torch.tensor([0.5])}}
    writer = writer_cls(path)
    dcp.save(sd, storage_writer=writer, planner=FastPersistSavePlanner())
    getattr(writer, "close", lambda: None)()
    target = {"sdt": zeros([6], device_mesh=sub, placements=[Shard(0)]),
              "rdt": zeros([6], device_mesh=sub, placements=[Replicate()]),
              "_extra_state": {"extra_state": 10, "extra_state_tensor": torch.tensor([10.0])}}
    reader = reader_cls(path)
    dcp.load(target, storage_reader=reader, planner=FastPersistLoadPlanner())
    getattr(reader, "close", lambda: None)()
    if rank % 2 == 0:
        assert bits_equal(target["sdt"].to_local(), sd["sdt"].to_local())
        assert bits_equal(target["rdt"].to_local(), values * 2)
    else:
        assert target["sdt"].to_local().numel() == 0 and target["rdt"].to_local().numel() == 0
    assert target["_extra_state"]["extra_state"] == 1
    assert bits_equal(target["_extra_state"]["extra_state_tensor"], torch.tensor([0.5]))
    return 1


@pytest.mark.slow
@pytest.mark.parametrize("storage", list(STORAGES))
def test_dtensors_reshard_between_placements_and_meshes(tmp_path, storage):
    checked = run_ranks(4, _reshard_dtensors, str(tmp_path), storage, timeout=400)
    assert checked == [30 + 1] * 4
