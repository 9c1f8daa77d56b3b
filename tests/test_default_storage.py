"""The switch that makes fp_dcp the storage DCP picks for ``checkpoint_id=``
(``fp_dcp.use_as_default`` / ``restore_default`` / ``default_storage`` /
``FP_DCP_DEFAULT_STORAGE=1`` / ``python -m fp_dcp.launch``), the private
torch hooks it rests on (checked against the installed torch, whatever its
version)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fp_dcp
from fp_dcp import _dcp_hooks
from fp_dcp.format import METADATA_NAME, STOCK_METADATA_NAME
from tests._dist import run_ranks
from tests._sd import FAILED, bits_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _switch_off():
    fp_dcp.restore_default()
    yield
    fp_dcp.restore_default()


def _sd(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 70, generator=g),
        "b": torch.randint(-100, 100, (33,), generator=g, dtype=torch.int32),
        "h": torch.randn(1000, generator=g).to(torch.bfloat16),
        "extra": {"step": seed, "tag": "x"},
    }


def _zeros(sd):
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1, "tag": ""}) for k, v in sd.items()}


def _same(a, b):
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert bits_equal(v, b[k]), k
        else:
            assert v == b[k], k


def _kind(path):
    return _dcp_hooks.checkpoint_kind(path)


# ----------------------------------------------------------------- the hooks


def test_hooks_fit_the_installed_torch():
    # the day torch moves storage selection, this fails (and use_as_default refuses)
    _dcp_hooks.check_storage_hooks()
    _dcp_hooks.check_planner_hooks()
    _dcp_hooks.check_dtensor_hooks()
    from torch.distributed.checkpoint import _storage_utils, format_utils
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    fp_dcp.use_as_default()
    assert _storage_utils.FileSystemWriter is not FileSystemWriter
    assert format_utils.FileSystemReader is not FileSystemReader
    _dcp_hooks.check_storage_hooks()  # still fine while on
    fp_dcp.restore_default()
    assert _storage_utils.FileSystemWriter is FileSystemWriter and _storage_utils.FileSystemReader is FileSystemReader
    assert format_utils.FileSystemWriter is FileSystemWriter and format_utils.FileSystemReader is FileSystemReader
    # and the public names were never touched
    assert dcp.FileSystemWriter is FileSystemWriter and dcp.FileSystemReader is FileSystemReader


def test_hook_check_fails_loudly_when_torch_moves_storage_selection(monkeypatch):
    import torch.distributed.checkpoint.state_dict_loader as loader
    from torch.distributed.checkpoint import _storage_utils, format_utils

    def moved(storage, checkpoint_id, reader=False):  # looks up neither name
        return storage

    monkeypatch.setattr(_storage_utils, "_storage_setup", moved)
    with pytest.raises(RuntimeError, match="no longer looks up FileSystemWriter"):
        _dcp_hooks.check_storage_hooks()
    with pytest.raises(RuntimeError, match="does not fit torch"):
        fp_dcp.use_as_default()
    assert not _dcp_hooks.is_default()
    monkeypatch.undo()
    monkeypatch.setattr(loader, "_storage_setup", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="state_dict_loader no longer calls"):
        _dcp_hooks.check_storage_hooks()
    monkeypatch.undo()
    monkeypatch.delattr(format_utils, "dcp_to_torch_save")
    with pytest.raises(RuntimeError, match="format_utils.dcp_to_torch_save"):
        _dcp_hooks.check_storage_hooks()
    monkeypatch.undo()
    import torch.distributed.checkpoint.state_dict_saver as saver

    monkeypatch.setattr(saver, "_ProcessBasedAsyncCheckpointExecutor", object)
    with pytest.raises(RuntimeError, match="_ProcessBasedAsyncCheckpointExecutor is not the stock class"):
        _dcp_hooks.check_storage_hooks()


def test_the_switch_checks_hooks_not_the_version(monkeypatch):
    # a release number fp_dcp never saw does not refuse the switch: only a missing hook does
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    fp_dcp.use_as_default()
    assert _dcp_hooks.is_default()
    fp_dcp.restore_default()


# -------------------------------------------------------- one process


def test_switch_makes_checkpoint_id_saves_and_loads_fp_dcp(tmp_path):
    sd = _sd(1)
    off, on = str(tmp_path / "off"), str(tmp_path / "on")
    dcp.save(sd, checkpoint_id=off)  # switch off: stock
    assert _kind(off) == "stock" and not os.path.exists(os.path.join(off, METADATA_NAME))
    fp_dcp.use_as_default()
    dcp.save(sd, checkpoint_id=on)
    assert _kind(on) == "fp_dcp" and not os.path.exists(os.path.join(on, STOCK_METADATA_NAME))
    # mixed directories: each loads with its own reader, bit-exact
    for path in (on, off):
        got = _zeros(sd)
        dcp.load(got, checkpoint_id=path)
        _same(sd, got)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    part = _load_state_dict_from_keys({"w", "extra"}, checkpoint_id=on)
    assert set(part) == {"w", "extra"} and bits_equal(part["w"], sd["w"]) and part["extra"] == sd["extra"]
    fp_dcp.restore_default()
    dcp.save(sd, checkpoint_id=str(tmp_path / "off2"))
    assert _kind(str(tmp_path / "off2")) == "stock"


def test_async_save_with_checkpoint_id(tmp_path):
    sd = _sd(2)
    path = str(tmp_path / "a")
    with fp_dcp.default_storage():
        fut = dcp.async_save(sd, checkpoint_id=path)
        fut.result()
        assert _kind(path) == "fp_dcp"
        got = _zeros(sd)
        dcp.load(got, checkpoint_id=path)
    _same(sd, got)
    assert not _dcp_hooks.is_default()


def test_async_save_keeps_the_writer_chosen_at_the_call(tmp_path, monkeypatch):
    # the background save may start after the switch went off again: it
    # gets its writer when async_save is called, not when it starts
    from torch.distributed.checkpoint._async_thread_executor import _ThreadBasedAsyncCheckpointExecutor

    seen = []
    original = _ThreadBasedAsyncCheckpointExecutor.execute_save

    def spy(self, staged, *, checkpoint_id=None, storage_writer=None, **kwargs):
        seen.append(storage_writer)
        return original(self, staged, checkpoint_id=checkpoint_id, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(_ThreadBasedAsyncCheckpointExecutor, "execute_save", spy)
    sd = _sd(6)
    path = str(tmp_path / "a")
    with fp_dcp.default_storage():
        fut = dcp.async_save(sd, checkpoint_id=path)
    fut.result()
    assert isinstance(seen[0], fp_dcp.FastPersistWriter)
    assert _kind(path) == "fp_dcp"
    fut = dcp.async_save(sd, checkpoint_id=str(tmp_path / "b"))  # switch off: stock, untouched
    fut.result()
    assert seen[1] is None and _kind(str(tmp_path / "b")) == "stock"


def test_format_utils_convert_both_ways(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    sd = _sd(3)
    src = str(tmp_path / "model.pt")
    torch.save(sd, src)
    with fp_dcp.default_storage():
        torch_save_to_dcp(src, str(tmp_path / "ck"))
        assert _kind(str(tmp_path / "ck")) == "fp_dcp"
        dcp_to_torch_save(str(tmp_path / "ck"), str(tmp_path / "back.pt"))
    back = torch.load(str(tmp_path / "back.pt"), weights_only=True)
    _same(sd, back)


def test_context_manager_nests_and_keeps_options(tmp_path):
    sd = _sd(4)
    fp_dcp.use_as_default(engine="threads")
    with fp_dcp.default_storage(write_checksums=False):
        w = _dcp_hooks._DefaultWriter(str(tmp_path / "x"))
        assert w.options.write_checksums is False
    assert _dcp_hooks.is_default()
    w = _dcp_hooks._DefaultWriter(str(tmp_path / "x"))
    assert w.options.engine == "threads" and w.options.write_checksums is True
    with pytest.raises(Exception, match="no_such_option"):
        fp_dcp.use_as_default(no_such_option=1)
    fp_dcp.restore_default()
    with fp_dcp.default_storage():
        with pytest.raises(ZeroDivisionError):
            with fp_dcp.default_storage():
                1 / 0
        assert _dcp_hooks.is_default()
    assert not _dcp_hooks.is_default()
    dcp.save(sd, checkpoint_id=str(tmp_path / "s"))
    assert _kind(str(tmp_path / "s")) == "stock"


def test_stock_reader_on_an_fp_dcp_checkpoint_names_the_missing_metadata(tmp_path):
    # switch off: DCP's stock reader opens <dir>/.metadata and fails; no
    # hook of DCP lets fp_dcp say more without writing a pickle for the
    # stock reader to run (README: "Use from a framework")
    sd = _sd(5)
    path = str(tmp_path / "fp")
    dcp.save(sd, storage_writer=fp_dcp.FastPersistWriter(path))
    with pytest.raises(FAILED) as e:
        dcp.load(_zeros(sd), checkpoint_id=path)
    # torch's own reader: where the load step swallows its error (torch 2.11)
    # torch says only "metadata is None", and fp_dcp is not involved
    msg = str(e.value)
    assert STOCK_METADATA_NAME in msg or msg.rstrip().endswith("AssertionError: metadata is None"), msg
    with fp_dcp.default_storage():
        got = _zeros(sd)
        dcp.load(got, checkpoint_id=path)
    _same(sd, got)


_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed.checkpoint as dcp
    path = sys.argv[1]
    sd = {"w": torch.arange(1000, dtype=torch.float32), "n": torch.tensor([7])}
    dcp.save(sd, checkpoint_id=path)
    got = {"w": torch.zeros(1000), "n": torch.zeros(1, dtype=torch.int64)}
    dcp.load(got, checkpoint_id=path)
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["n"], sd["n"])
    print("fp_dcp imported:", "fp_dcp" in sys.modules)
    """
)


@pytest.mark.parametrize("how", ["env", pytest.param("launch", marks=pytest.mark.slow),
                                 pytest.param("launch -m", marks=pytest.mark.slow),
                                 pytest.param("off", marks=pytest.mark.slow)])
def test_unmodified_script(tmp_path, how):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    path = str(tmp_path / "ck")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(_dcp_hooks.DEFAULT_STORAGE_ENV, None)
    if how == "env":  # the launch script sets it; something imports fp_dcp
        env[_dcp_hooks.DEFAULT_STORAGE_ENV] = "1"
        cmd = [sys.executable, "-c", "import fp_dcp, runpy, sys; sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')", str(script), path]
    elif how == "launch":
        cmd = [sys.executable, "-m", "fp_dcp.launch", str(script), path]
    elif how == "launch -m":
        env["PYTHONPATH"] += os.pathsep + str(tmp_path)
        cmd = [sys.executable, "-m", "fp_dcp.launch", "-m", "train", path]
    else:
        cmd = [sys.executable, str(script), path]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _kind(path) == ("stock" if how == "off" else "fp_dcp")


def test_env_variable_rejects_nonsense(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, **{_dcp_hooks.DEFAULT_STORAGE_ENV: "maybe"})
    out = subprocess.run([sys.executable, "-c", "import fp_dcp"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "FP_DCP_DEFAULT_STORAGE='maybe'" in out.stderr


# -------------------------------------------------------------- ranks


def _ranks_script(rank, world_size, root, on):
    """An unmodified training step: dcp.save / dcp.load with checkpoint_id
    only, a replicated tensor and a rank-local one."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fp_dcp
    from tests._sd import bits_equal

    if on:
        fp_dcp.use_as_default()
    g = torch.Generator().manual_seed(9)
    sd = {"shared": torch.randn(1024, 257, generator=g), f"own{rank}": torch.full((5,), float(rank))}
    path = os.path.join(root, "on" if on else "off")
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(got, checkpoint_id=path)
    for k in sd:
        assert bits_equal(got[k], sd[k]), k
    return _dcp_hooks.checkpoint_kind(path)


@pytest.mark.parametrize("on", [True, False])
def test_two_ranks_unmodified_script(tmp_path, on):
    kinds = run_ranks(2, _ranks_script, str(tmp_path), on)
    assert kinds == (["fp_dcp"] * 2 if on else ["stock"] * 2)


def _ranks_process_mode(rank, world_size, root):
    """async_save(checkpoint_id=...) with AsyncCheckpointerType.PROCESS: the
    save runs in a spawned checkpoint process, where the switch is off; the
    writer must travel there with the request.  Switch off again: stock."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import multiprocessing as mp

    import fp_dcp
    from tests._sd import bits_equal

    # run_ranks' workers are daemonic; DCP's PROCESS mode starts a child.
    mp.current_process()._config["daemon"] = False
    sd = {"shared": torch.randn(300, 41, generator=torch.Generator().manual_seed(3)), f"own{rank}": torch.ones(3) * rank}
    kinds = []
    for on in (True, False):
        path = os.path.join(root, "on" if on else "off")
        if on:
            fp_dcp.use_as_default()
        dcp.async_save(sd, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        fp_dcp.restore_default()
        dist.barrier()
        kinds.append(_dcp_hooks.checkpoint_kind(path))
        with fp_dcp.default_storage():  # loads either kind
            got = {k: torch.zeros_like(v) for k, v in sd.items()}
            dcp.load(got, checkpoint_id=path)
        assert all(bits_equal(got[k], sd[k]) for k in sd)
    return kinds


@pytest.mark.slow
def test_async_save_process_mode_gets_the_writer(tmp_path):
    kinds = run_ranks(2, _ranks_process_mode, str(tmp_path), timeout=300)
    assert kinds == [["fp_dcp", "stock"]] * 2
