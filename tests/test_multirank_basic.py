"""fp_dcp with several gloo processes: sharded and replicated state dicts
round trip, and a sharded checkpoint loads into another world size."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks


def _save_dtensor(rank, world_size, path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistWriter

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = torch.randn(64, 48)
    sd = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "v": distribute_tensor(full.t().contiguous(), mesh, [Shard(1)]),
        "replicated": torch.arange(1000, dtype=torch.int64),  # every rank holds it (DDP style)
        "step": 7,
    }
    writer = FastPersistWriter(path)
    dcp.save(sd, storage_writer=writer)
    return writer.last_stats["bytes"]


def _load_dtensor(rank, world_size, path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistReader

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = torch.randn(64, 48)
    # the other placement: rows become columns
    sd = {
        "w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)]),
        "v": distribute_tensor(torch.zeros(48, 64), mesh, [Shard(0)]),
        "replicated": torch.zeros(1000, dtype=torch.int64),
        "step": 0,
    }
    dcp.load(sd, storage_reader=FastPersistReader(path))
    assert torch.equal(sd["w"].full_tensor(), full)
    assert torch.equal(sd["v"].full_tensor(), full.t())
    assert torch.equal(sd["replicated"], torch.arange(1000))
    assert sd["step"] == 7
    return True


@pytest.mark.parametrize("save_ws, load_ws", [(2, 3), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_dtensor_checkpoint_loads_resharded_on_another_world_size(tmp_path, save_ws, load_ws):
    path = str(tmp_path / "c")
    written = run_ranks(save_ws, _save_dtensor, path)
    # the replicated tensor is written once in all, the shards by their owners
    assert sum(written) >= 2 * 64 * 48 * 4 + 8000
    assert all(run_ranks(load_ws, _load_dtensor, path))


def test_sharded_checkpoint_loads_into_one_process_without_a_process_group(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    path = str(tmp_path / "c")
    run_ranks(2, _save_dtensor, path)
    torch.manual_seed(0)
    full = torch.randn(64, 48)
    sd = {"w": torch.zeros(64, 48), "v": torch.zeros(48, 64), "replicated": torch.zeros(1000, dtype=torch.int64)}
    dcp.load(sd, storage_reader=FastPersistReader(path))
    assert torch.equal(sd["w"], full) and torch.equal(sd["v"], full.t())


def _fail_on_rank_1(rank, world_size, path):
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    sd = {f"t{rank}": torch.ones(10)}
    target = path if rank == 0 else "/proc/fp_dcp_cannot_write_here"
    try:
        dcp.save(sd, storage_writer=FastPersistWriter(target), checkpoint_id=target)
    except BaseException as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_failure_on_one_rank_fails_every_rank_and_commits_nothing(tmp_path):
    import os

    path = str(tmp_path / "c")
    outcomes = run_ranks(2, _fail_on_rank_1, path)
    assert all("fp_dcp_cannot_write_here" in o for o in outcomes), outcomes
    assert not os.path.exists(os.path.join(path, ".fp_dcp.meta"))
