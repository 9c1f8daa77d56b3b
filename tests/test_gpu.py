"""CUDA state through a real process group: an FSDP2 model and its AdamW
state sharded on a CUDA device mesh (NCCL, one rank per GPU), saved by
``dcp.save`` and by eager and lazy ``dcp.async_save``, loaded back into a
fresh FSDP2 model on the GPU and into plain CPU tensors, bit for bit.

The lazy and eager saves stage each ``DTensor``'s CUDA shard on the host and
rebuild the ``DTensor`` around the host copy (the private constructor in
``fp_dcp._dcp_hooks``); the synchronous save copies chunk by chunk on a side
stream.  Skipped without CUDA; ``_fsdp2_round_trips`` itself also runs on
the CPU (``device="cpu"``, gloo), which is how it is checked off the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from tests._dist import run_ranks
from tests._sd import assert_sd_equal

NCCL = "cpu:gloo,cuda:nccl"  # DCP's object collectives on gloo, the tensors' on NCCL


def _model(device: str) -> torch.nn.Module:
    g = torch.Generator().manual_seed(5)
    layers = [torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 96), torch.nn.LayerNorm(96)]
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model.to(device)


def _fsdp2(device: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    model = _model(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, device: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 96, generator=g).to(device)
    loss = (model(x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _host(v):
    """The state with every tensor (a DTensor's local shard) cloned to the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        v = v.to_local()
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    if isinstance(v, dict):
        return {k: _host(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_host(x) for x in v]
    return v


def _fsdp2_round_trips(rank, world_size, root, device):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from fp_dcp import FastPersistReader, FastPersistWriter

    model, opt = _fsdp2(device)
    _step(model, opt, device, 0)
    full0 = _host(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    msd, osd = get_state_dict(model, opt)
    assert all(isinstance(v, DTensor) and v.device.type == device for v in msd.values())
    for how in ("sync", "eager", "lazy"):
        path = os.path.join(root, how)
        state = {"model": msd, "optim": osd}
        want = _host(state)
        if how == "sync":
            with FastPersistWriter(path) as w:
                dcp.save(state, storage_writer=w)
        else:
            with FastPersistWriter(path, staging=how) as w:
                resp = dcp.async_save(state, storage_writer=w)
                if how == "lazy":
                    resp.staging_completion.result()
                    _step(model, opt, device, 1)  # training goes on once staged: the checkpoint keeps step 0's state
                    msd, osd = get_state_dict(model, opt)
                getattr(resp, "upload_completion", resp).result()
        fresh, fresh_opt = _fsdp2(device)
        _step(fresh, fresh_opt, device, 7)  # optimizer state to overwrite
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        target = {"model": fmsd, "optim": fosd}
        dcp.load(target, storage_reader=FastPersistReader(path))
        set_state_dict(fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        assert_sd_equal(want, _host({"model": get_model_state_dict(fresh), "optim": target["optim"]}), how)
        assert all(v.device.type == device for v in target["model"].values())
    # a plain CPU target of the full tensors (a restart without the GPU)
    cpu = {"model": {k: torch.zeros_like(v) for k, v in full0.items()}}
    dcp.load(cpu, storage_reader=FastPersistReader(os.path.join(root, "sync")))
    assert_sd_equal(full0, cpu["model"], "cpu")
    return sorted(cpu["model"])


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_fsdp2_save_async_and_load_bit_exact(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (keys,) = run_ranks(1, _fsdp2_round_trips, str(tmp_path), "cuda", timeout=300, backend=NCCL)
    assert keys == sorted(_model("cpu").state_dict())
