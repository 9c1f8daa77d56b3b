"""The recipes of docs/FRAMEWORKS.md, run exactly as written (each code block
saved as a file and run with the command on its first line), and each
framework's own checkpoint code on 2 gloo ranks on the CPU, with fp_dcp as the
storage, and every tensor loaded back bit-exact:

* Lightning Fabric, ``ModelParallelStrategy`` (FSDP2): ``fabric.save`` /
  ``fabric.load`` — the framework's own code path
  (``lightning/fabric/strategies/model_parallel.py`` ``_save_checkpoint`` ->
  ``lightning/fabric/strategies/fsdp.py`` ``_distributed_checkpoint_save``:
  ``save(converted_state, checkpoint_id=path)``), fp_dcp through the switch.
* torchtitan, ``CheckpointManager`` (``torchtitan/components/checkpointer/dcp.py``
  ``dcp_save`` / ``dcp_load``: ``dcp.save(sd, storage_writer=None,
  checkpoint_id=...)``, ``dcp.async_save(...)``, ``dcp.load(sd,
  checkpoint_id=...)``) — the framework's own code path, fp_dcp through the
  switch.
* Accelerate (FSDP2): ``save_fsdp_model`` / ``save_fsdp_optimizer``
  (``accelerate/utils/fsdp_utils.py``) hard-code
  ``storage_writer=dist_cp.FileSystemWriter(ckpt_dir)``, so no switch
  reaches them without patching Accelerate; and its FSDP mode needs GPUs.
  The test reproduces those exact DCP calls with the storage swapped for
  fp_dcp (the recipe: call DCP yourself with Accelerate's state dicts).

Each test skips, saying why, when its framework (extra ``frameworks``) is not
installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess

import pytest

from tests import _docblocks as docs
from tests._dist import run_ranks


def _need(module: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: {INSTALL} (docs/FRAMEWORKS.md)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Net:
    """A small model factory (module-level so the ranks can import it)."""

    @staticmethod
    def make(seed: int):
        import torch

        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.LayerNorm(48)
        )

    @staticmethod
    def fsdp2(seed: int, mesh):
        """``make(seed)`` with each Linear and the whole model ``fully_shard``-ed over ``mesh``."""
        import torch
        from torch.distributed.fsdp import fully_shard

        model = _Net.make(seed)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model


def _full_sd(sd):
    """Global values of a (possibly DTensor) state dict, flattened to
    key -> CPU tensor / value."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        elif isinstance(v, DTensor):
            out[prefix] = v.full_tensor().detach().cpu().clone()
        elif isinstance(v, torch.Tensor):
            out[prefix] = v.detach().cpu().clone()
        else:
            out[prefix] = v

    walk("", sd)
    return out


def _assert_same(a, b):
    import torch

    from tests._sd import bits_equal

    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:10]
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert bits_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _train(model, opt, steps, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _kinds(path):
    from fp_dcp._dcp_hooks import checkpoint_kind

    return checkpoint_kind(path)


# ------------------------------------------------------ Lightning Fabric


def _fabric(rank, world_size, root, port):
    import lightning as L
    import torch
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    import fp_dcp

    # torchrun's variables: Fabric joins the processes that run_ranks started
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")

    def parallelize(model, device_mesh):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=device_mesh["data_parallel"])
        fully_shard(model, mesh=device_mesh["data_parallel"])
        return model

    fp_dcp.use_as_default()  # the recipe's one line
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=world_size, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_Net.make(0))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, 3, seed=rank)
    path = os.path.join(root, "fabric-ckpt")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3})
    want = _full_sd({"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, opt)})

    model2 = fabric.setup_module(_Net.make(1))
    opt2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-2))
    _train(model2, opt2, 1, seed=100 + rank)
    before = _full_sd({"m": get_model_state_dict(model2)})
    assert any(not torch.equal(before[k], want[k]) for k in before)
    state = {"model": model2, "optimizer": opt2, "step": 0}
    fabric.load(path, state)
    got = _full_sd({"m": get_model_state_dict(model2), "o": get_optimizer_state_dict(model2, opt2)})
    _assert_same(want, got)
    assert state["step"] == 3
    fp_dcp.restore_default()
    return _kinds(path)


@pytest.mark.slow  # multi-process, ~5-10 s: the fast subset stays under 3 minutes
def test_lightning_fabric_model_parallel(tmp_path):
    _need("lightning")
    kinds = run_ranks(2, _fabric, str(tmp_path), _free_port(), timeout=300)
    assert kinds == ["fp_dcp", "fp_dcp"]


# --------------------------------------------------------------- torchtitan


class _OptState:
    """The optimizer's Stateful for torchtitan's CheckpointManager, as
    torchtitan's OptimizersContainer does it (torch's distributed state-dict
    API; the container itself needs torchtitan's full dependency set)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, optim_state_dict=sd)


class _Counter:
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _titan(rank, world_size, root, async_mode):
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    import fp_dcp

    fp_dcp.use_as_default()  # the recipe's one line (or FP_DCP_DEFAULT_STORAGE=1 / python -m fp_dcp.launch)
    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed):
        model = _Net.fsdp2(seed, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=2, keep_latest_k=0, async_mode=async_mode
        )
        train_state = _Counter()
        manager = CheckpointManager(
            config, dataloader=_Counter(7), model_parts=[model], optimizers=_OptState(model, opt),
            lr_schedulers=_Counter(3), states={"train_state": train_state}, sd_adapter=None, base_folder=root,
        )
        return model, opt, manager, train_state

    model, opt, manager, train_state = build(0)
    _train(model, opt, 2, seed=rank)
    train_state.n = 2
    assert manager.save(curr_step=2)
    manager.maybe_wait_for_saving()
    want = _full_sd({"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, opt)})
    manager.close()

    model2, opt2, manager2, state2 = build(1)
    _train(model2, opt2, 1, seed=100 + rank)
    assert manager2.load(step=2)  # torchtitan's auto-resume (step=-1) looks for .metadata: docs/FRAMEWORKS.md
    got = _full_sd({"m": get_model_state_dict(model2), "o": get_optimizer_state_dict(model2, opt2)})
    _assert_same(want, got)
    assert state2.n == 2
    found = manager2._find_load_step()
    manager2.close()
    fp_dcp.restore_default()
    return _kinds(os.path.join(root, "checkpoint", "step-2")), found


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_torchtitan_checkpoint_manager(tmp_path, async_mode):
    _need("torchtitan")
    res = run_ranks(2, _titan, str(tmp_path), async_mode, timeout=300)
    assert [r[0] for r in res] == ["fp_dcp", "fp_dcp"]
    # torchtitan 0.3.0 finds the latest step by a stock .metadata file, so
    # an fp_dcp checkpoint needs the hook of docs/FRAMEWORKS.md
    assert [r[1] for r in res] == [-1, -1]


# --------------------------------------------------------------- Accelerate


def _accelerate(rank, world_size, root):
    """Accelerate 1.15's FSDP2 SHARDED_STATE_DICT save / load
    (``accelerate/utils/fsdp_utils.py``: ``save_fsdp_model`` lines 172-184,
    ``save_fsdp_optimizer`` 340-352, ``load_fsdp_model`` 260-278,
    ``load_fsdp_optimizer`` 402-440), call for call, with
    ``dist_cp.FileSystemWriter(ckpt_dir)`` / ``FileSystemReader(ckpt_dir)``
    replaced by fp_dcp's; the state dicts come from Accelerate's own helpers."""
    import torch
    import torch.distributed.checkpoint as dist_cp
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
    from accelerate.utils.fsdp_utils import _get_model_state_dict, _set_model_state_dict
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from fp_dcp import FastPersistReader, FastPersistWriter

    mesh = init_device_mesh("cpu", (world_size,))
    # what _prepare_sd_options gives for FSDP2 with SHARDED_STATE_DICT and the default configs
    sd_options = StateDictOptions(full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False)

    def build(seed):
        model = _Net.fsdp2(seed, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build(0)
    _train(model, optimizer, 2, seed=rank)
    output_dir = os.path.join(root, "checkpoint_0")
    # save_fsdp_model
    state_dict = _get_model_state_dict(model, adapter_only=False, sd_options=sd_options)
    ckpt_dir = os.path.join(output_dir, f"{FSDP_MODEL_NAME}_0")
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_cp.save(state_dict={"model": state_dict}, storage_writer=FastPersistWriter(ckpt_dir),
                 planner=DefaultSavePlanner())
    # save_fsdp_optimizer
    optim_state = get_optimizer_state_dict(model, optimizer, options=sd_options)
    opt_dir = os.path.join(output_dir, f"{OPTIMIZER_NAME}_0")
    os.makedirs(opt_dir, exist_ok=True)
    dist_cp.save(state_dict={"optimizer": optim_state}, storage_writer=FastPersistWriter(opt_dir),
                 planner=DefaultSavePlanner())
    want = _full_sd({"m": _get_model_state_dict(model, sd_options=sd_options),
                     "o": get_optimizer_state_dict(model, optimizer, options=sd_options)})

    model2, optimizer2 = build(1)
    _train(model2, optimizer2, 1, seed=100 + rank)
    # load_fsdp_model
    state_dict = {"model": _get_model_state_dict(model2, adapter_only=False, sd_options=sd_options)}
    dist_cp.load(state_dict=state_dict, storage_reader=FastPersistReader(ckpt_dir), planner=DefaultLoadPlanner())
    _set_model_state_dict(model2, state_dict["model"], adapter_only=False, sd_options=sd_options)
    # load_fsdp_optimizer
    optim_state = {"optimizer": get_optimizer_state_dict(model2, optimizer2, options=sd_options)}
    dist_cp.load(state_dict=optim_state, storage_reader=FastPersistReader(opt_dir), planner=DefaultLoadPlanner())
    set_optimizer_state_dict(model2, optimizer2, optim_state["optimizer"], options=sd_options)
    got = _full_sd({"m": _get_model_state_dict(model2, sd_options=sd_options),
                    "o": get_optimizer_state_dict(model2, optimizer2, options=sd_options)})
    _assert_same(want, got)
    return _kinds(ckpt_dir), _kinds(opt_dir)


@pytest.mark.slow  # multi-process, ~5-10 s: the fast subset stays under 3 minutes
def test_accelerate_fsdp2_calls_reproduced(tmp_path):
    _need("accelerate")
    res = run_ranks(2, _accelerate, str(tmp_path), timeout=300)
    assert res == [("fp_dcp", "fp_dcp")] * 2


# ------------------------------------------------ docs/FRAMEWORKS.md, as written

PAGE = "docs/FRAMEWORKS.md"
BLOCKS = docs.blocks(PAGE)
INSTALL = 'pip install -e ".[frameworks]" && pip install --no-deps torchtitan==0.3.0'
RECIPES = {  # script -> (the framework it needs, the checkpoints it leaves)
    "lightning_trainer.py": ("lightning", ["ckpt/lightning"]),
    "lightning_fabric.py": ("lightning", ["ckpt/fabric"]),
    "titan_checkpoint.py": ("torchtitan", ["outputs/checkpoint/step-2", "outputs/checkpoint/step-4"]),
    "accelerate_dcp.py": ("accelerate", ["ckpt/accelerate"]),
}
GPU_MARK = re.compile(r"# needs GPUs; CPU twin: (\w+\.py)\n")


def test_every_block_of_the_page_is_run_or_has_a_cpu_twin():
    scripts = [docs.script(code)[0] for _, code in BLOCKS if docs.script(code)]
    assert sorted(scripts) == sorted(RECIPES)
    for lang, code in BLOCKS:
        if docs.script(code):
            assert lang == "python"
            continue
        if code.strip() == INSTALL:  # the install line: the same as CI's
            ci = open(os.path.join(docs.REPO, ".ci", "run")).read()
            assert 'pip install -q -e ".[test,bench,frameworks]"' in ci
            assert "pip install -q --no-deps torchtitan==0.3.0" in ci
            continue
        m = GPU_MARK.match(code)
        assert m and m.group(1) in RECIPES, f"{PAGE}: a block neither run by a test nor marked: {code[:200]}"


@pytest.mark.slow  # 2 processes each, 20-40 s on 2 busy cores
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_runs_as_written(tmp_path, name):
    module, checkpoints = RECIPES[name]
    _need(module)
    code = next(code for _, code in BLOCKS if docs.script(code) and docs.script(code)[0] == name)
    docs.run_script(code, str(tmp_path))  # the recipe asserts its own bit-exact round trip
    for ckpt in checkpoints:
        assert _kinds(str(tmp_path / ckpt)) == "fp_dcp", ckpt


def test_titan_command_line_hook_finds_the_newest_fp_dcp_step(tmp_path):
    """The shell line of the torchtitan section: -1 without checkpoints, then
    the newest committed fp_dcp step (an uncommitted one is not a checkpoint)."""
    code = next(code for _, code in BLOCKS if GPU_MARK.match(code))
    hook = next(ln for ln in code.splitlines() if ln.startswith("STEP="))

    def step():
        r = subprocess.run(["bash", "-c", hook + '\necho "${STEP:--1}"'], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, check=True)
        return int(r.stdout)

    assert step() == -1
    folder = tmp_path / "outputs" / "checkpoint"
    for n in (2, 10, 4):
        (folder / f"step-{n}").mkdir(parents=True)
        (folder / f"step-{n}" / ".fp_dcp.meta").write_bytes(b"x")
    (folder / "step-12").mkdir()  # interrupted before its commit
    assert step() == 10
