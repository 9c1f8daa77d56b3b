"""DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``)
through ``FastPersistWriter``: a cached save (DCP sends the writer empty
plans) is complete and bit-exact, skips fp_dcp's own planning as well, and
never writes under an earlier save's file names.  1-4 gloo ranks on the CPU,
sync and async, the state dict unchanged, changed in value only, and changed
in structure on one rank only (DCP then sends a mix of fresh and empty plans).
"""

from __future__ import annotations

import os

import pytest

from tests._dist import run_ranks


def _planner():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return DefaultSavePlanner(enable_plan_caching=True)


# ----------------------------------- PyTorch's own test, storage swapped


def _torch_caching_test(rank, world_size, path):
    """``test_file_system_checkpoint.py::TestDistributedStateDictSaveLoadWithCaching
    ::test_read_write_shard_tensor`` (torch 2.13) with FileSystemWriter /
    FileSystemReader replaced by fp_dcp's: an FSDP2 model, two saves into one
    directory with plan caching on (through the deprecated
    ``save_state_dict``, as there), each loaded into a new model and compared.
    The weights change between the saves so that the second must write new
    bytes, and the bytes are compared bit for bit."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import load_state_dict, save_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from fp_dcp import FastPersistReader, FastPersistWriter
    from tests._sd import bits_equal

    class MyTestModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear_1 = torch.nn.Linear(5, 5)
            self.linear_2 = torch.nn.Linear(5, 1)
            self.emb = torch.nn.EmbeddingBag(5, 10)

    torch.manual_seed(0)
    model_to_save = MyTestModule()
    fully_shard(model_to_save)
    state_dict_to_save = {"model": get_model_state_dict(model_to_save)}
    cached = []
    for step in range(2):
        with torch.no_grad():
            for p in model_to_save.parameters():
                p.add_(step + 1.5)
        fs_writer = FastPersistWriter(path)
        save_state_dict(state_dict=state_dict_to_save, storage_writer=fs_writer, planner=_planner())
        cached.append(fs_writer.last_plan.get("dcp_cached"))
        fs_writer.close()
        dist.barrier()

        torch.manual_seed(100 + step)
        model_to_load = MyTestModule()
        fully_shard(model_to_load)
        state_dict_to_load_to = {"model": get_model_state_dict(model_to_load)}
        expected = get_model_state_dict(model_to_save)
        assert any(
            not torch.equal(v.to_local(), expected[k].to_local()) for k, v in state_dict_to_load_to["model"].items()
        )
        load_state_dict(state_dict=state_dict_to_load_to, storage_reader=FastPersistReader(path))
        set_model_state_dict(model_to_load, state_dict_to_load_to["model"])
        got = get_model_state_dict(model_to_load)
        assert set(got) == set(expected)
        for k, v in expected.items():
            assert bits_equal(got[k].full_tensor(), v.full_tensor()), k
        dist.barrier()
    return cached


def test_torch_plan_caching_test_with_fp_dcp(tmp_path):
    cached = run_ranks(2, _torch_caching_test, str(tmp_path / "ckpt"))
    # on the coordinator: the first save planned, the second was DCP-cached
    assert cached[0] == [False, True]


# ------------------------------------- many saves, changes, sync / async


def _sd(rank, world_size, step, extra):
    """Replicated tensors (their bytes split among all ranks), rank-local
    tensors, a bytes item; values depend on ``step``; ``extra`` adds a
    tensor on the last rank only (a structure change on one rank)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + 7)
    sd = {
        "embed": torch.randn(512, 300, generator=g),  # replicated, ~600 KiB
        "w": torch.randn(64, 33, generator=g, dtype=torch.float64),
        "b": torch.arange(11, dtype=torch.int16) + step,
        "meta": {"step": step, "name": "run"},
    }
    lg = torch.Generator().manual_seed(1000 * step + rank)
    sd[f"local.r{rank}"] = torch.randn(100 + rank, 7, generator=lg)
    if extra and rank == world_size - 1:
        sd[f"extra.r{rank}"] = torch.full((300, 17), float(step), dtype=torch.bfloat16)
    return sd


def _check_load(path, sd):
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader
    from tests._sd import bits_equal

    target = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1, "name": ""}) for k, v in sd.items()
    }
    dcp.load(target, storage_reader=FastPersistReader(path))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert bits_equal(target[k], v), k
        else:
            assert target[k] == v, k


def _series(rank, world_size, root, mode, same_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import SavePlanner

    from fp_dcp import FastPersistWriter
    from fp_dcp.format import DATA_SUFFIX

    if mode == "process":  # run_ranks' workers are daemonic; PROCESS mode starts a child
        import multiprocessing as mp

        mp.current_process()._config["daemon"] = False
    # (step, extra): first save, unchanged structure (cached) twice, a
    # change on the last rank only, unchanged again (cached), back
    steps = [(0, False), (1, False), (2, False), (3, True), (4, True), (5, False)]
    out = []
    writer = FastPersistWriter() if mode == "reuse" else None
    saved = []
    for step, extra in steps:
        path = os.path.join(root, "same" if same_dir else f"step{step}")
        sd = _sd(rank, world_size, step, extra)
        w = writer if writer is not None else FastPersistWriter(path)
        before = set(os.listdir(path)) if os.path.isdir(path) else set()
        if mode == "async":
            dcp.async_save(sd, checkpoint_id=path, storage_writer=w, planner=_planner()).result()
        elif mode == "process":  # the save, DCP's caches and ours live in the checkpoint process
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            dcp.async_save(sd, checkpoint_id=path, storage_writer=w, planner=_planner(),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        else:
            dcp.save(sd, checkpoint_id=path, storage_writer=w, planner=_planner())
        out.append({k: w.last_plan.get(k) for k in ("dcp_cached", "cached")} if rank == 0 else None)
        dist.barrier()
        now = {n for n in os.listdir(path) if n.endswith(DATA_SUFFIX)}
        # a save never reuses the file names of the checkpoint it replaces
        assert not (now & before), (step, sorted(now & before))
        _check_load(path, sd)
        saved.append((path, sd))
        if writer is None:
            w.close()
        dist.barrier()
    if not same_dir:  # every earlier checkpoint still loads, bit-exact
        for path, sd in saved:
            _check_load(path, sd)
    if writer is not None:
        writer.close()
    if mode != "process":
        assert SavePlanner._cached_save_plan  # DCP's cache was really used
    return out


@pytest.mark.parametrize(
    "world_size,mode,same_dir",
    [
        (1, "sync", True),
        (2, "sync", False),
        (2, "async", True),
        (2, "reuse", False),
        pytest.param(2, "process", True, marks=pytest.mark.slow),
        pytest.param(3, "sync", True, marks=pytest.mark.slow),
        (4, "sync", True),
        pytest.param(4, "async", False, marks=pytest.mark.slow),
    ],
)
def test_cached_saves_complete_and_bit_exact(tmp_path, world_size, mode, same_dir):
    res = run_ranks(world_size, _series, str(tmp_path), mode, same_dir, timeout=300)
    plans = res[0]
    if mode == "process":
        return  # the writer that planned is the checkpoint process's copy: every save checked bit-exact above
    dcp_cached = [p["dcp_cached"] for p in plans]
    # DCP cached the saves whose state-dict structure had not changed
    assert dcp_cached == [False, True, True, False, True, False]
    # fp_dcp's own placement came from its cache on every save DCP cached,
    # and on the return to the first structure
    assert [p["cached"] for p in plans] == [False, True, True, False, True, True]


def _stale_rank(rank, world_size, root):
    """Rank 1 drops a replicated tensor that DCP's dedup gave to rank 0:
    rank 1's global plan does not change, so DCP tells nobody, and the
    coordinator's record of rank 1 still lists the tensor.  The save must
    either be right or fail loudly on every rank, never commit a wrong
    checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter
    from fp_dcp.format import METADATA_NAME
    from tests._sd import FAILED, root_error

    g = torch.Generator().manual_seed(5)
    shared = torch.randn(4096, 64, generator=g)  # 1 MiB: split by bytes between the ranks
    sd = {"shared": shared, f"own.r{rank}": torch.full((10,), float(rank))}
    dcp.save(sd, checkpoint_id=os.path.join(root, "a"), storage_writer=FastPersistWriter(), planner=_planner())
    if rank == 1:
        del sd["shared"]
    path = os.path.join(root, "b")
    try:
        dcp.save(sd, checkpoint_id=path, storage_writer=FastPersistWriter(), planner=_planner())
    except FAILED as e:
        assert not os.path.exists(os.path.join(path, METADATA_NAME))
        return "failed: " + str(root_error(e))
    _check_load(path, sd) if rank == 0 else None
    return "ok"


def test_structure_change_dcp_does_not_report_is_right_or_loud(tmp_path):
    res = run_ranks(2, _stale_rank, str(tmp_path))
    assert len(set(r.split(":")[0] for r in res)) == 1, res
    if res[0] != "ok":  # ours, naming the tensor and the way out
        assert "plan caching" in res[0] and "shared" in res[0], res


def _interleaved(rank, world_size, root):
    """One process saving three things in turn: a model through a caching
    planner, a small state through a planner that does not cache (same
    class, so the same DCP cache key), and another structure through a
    caching planner of another class (its own DCP cache).  Each cached save
    must write its own structure, bit-exact."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from fp_dcp import FastPersistWriter

    class OtherPlanner(DefaultSavePlanner):
        pass

    flags = []
    for step in range(4):
        model = _sd(rank, world_size, step, extra=False)
        small = {"rng": torch.full((3,), float(step)), f"it{rank}": torch.tensor([step, rank])}
        other = {"o": torch.arange(50, dtype=torch.float64) * step, f"r{rank}": torch.ones(4 + rank) * step}
        jobs = [
            ("model", model, _planner()),
            ("small", small, DefaultSavePlanner()),
            ("other", other, OtherPlanner(enable_plan_caching=True)),
        ]
        for name, sd, planner in jobs:
            path = os.path.join(root, f"{name}{step}")
            w = FastPersistWriter(path)
            dcp.save(sd, storage_writer=w, planner=planner)
            flags.append((name, w.last_plan.get("dcp_cached")) if rank == 0 else None)
            w.close()
            _check_load(path, sd)
    return flags


def test_cached_saves_interleaved_with_other_planners(tmp_path):
    flags = run_ranks(2, _interleaved, str(tmp_path), timeout=300)[0]
    by_name = {}
    for name, cached in flags:
        by_name.setdefault(name, []).append(bool(cached))
    assert by_name == {"model": [False, True, True, True], "small": [False] * 4, "other": [False, True, True, True]}
