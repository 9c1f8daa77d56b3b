"""What keeps fp_dcp working across the declared torch and Python range:
the private hooks checked by capability (not by the torch version), errors
that reach the user on every release, and the garbage-collector freeze on
every Python.  These run on whatever torch is installed."""

from __future__ import annotations

import gc
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter, _dcp_hooks
from fp_dcp import format as fmt
from fp_dcp import gc_freeze
from fp_dcp.gc_freeze import GcFreeze
from tests._sd import FAILED, assert_sd_equal, save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sd(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(257, 33, generator=g), "b": torch.randint(-9, 9, (40,), generator=g, dtype=torch.int16),
            "step": seed}


def _zeros(sd):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in sd.items()}


def _done(response):
    """Wait for what dcp.async_save returned (a future, or with lazy staging
    an AsyncSaveResponse)."""
    getattr(response, "upload_completion", response).result()


def _release(text):
    m = re.match(r"(\d+)\.(\d+)", text)
    assert m, text
    return int(m.group(1)), int(m.group(2))


# ------------------------------------------------------------- the torch range


def test_pyproject_declares_a_range_holding_the_installed_torch():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    m = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text)
    assert m, "pyproject.toml declares no torch range"
    lo, hi = _release(m.group(1)), _release(m.group(2))
    assert lo <= _release(torch.__version__) < hi
    # the oldest and the newest release of the range are the ones CI runs
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert f"OLDEST_TORCH={lo[0]}.{lo[1]}." in ci and f"NEWEST_TORCH={hi[0]}.{hi[1] - 1}." in ci
    # ... the oldest torch with the oldest Python the project declares
    floor = re.search(r'requires-python = ">=(\d+\.\d+)"', text)
    assert floor and f"OLDEST_PYTHON={floor.group(1)}\n" in ci
    # the build requirement is a setuptools that reads tool.setuptools.ext-modules
    assert '"setuptools>=74.1"' in text and "[[tool.setuptools.ext-modules]]" in text


def test_no_version_gate_is_left():
    src = open(os.path.join(ROOT, "fp_dcp", "_dcp_hooks.py")).read()
    assert "TESTED_TORCH" not in src and "FP_DCP_ALLOW_UNTESTED_TORCH" not in src
    for name in ("check_storage_hooks", "check_planner_hooks", "check_dtensor_hooks"):
        getattr(_dcp_hooks, name)()  # every hook fits the installed torch


@pytest.fixture
def fresh_checks(monkeypatch):
    monkeypatch.setattr(_dcp_hooks, "_checked", {})
    yield
    _dcp_hooks._checked.clear()


def _moved(what):
    def check():
        raise RuntimeError(what)
    return check


def test_a_missing_hook_is_named_only_where_a_feature_needs_it(tmp_path, monkeypatch, fresh_checks):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setattr(_dcp_hooks, "check_planner_hooks", _moved("DefaultSavePlanner._cached_plans_key is gone"))
    # a save through a planner that does not cache plans needs no hook
    sd = _sd(1)
    save(sd, tmp_path / "a", staging="eager")
    target = _zeros(sd)
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "a"))
    assert_sd_equal(sd, target)
    # one that caches plans needs the planner hook, and the refusal names it
    w = FastPersistWriter(tmp_path / "b")
    with pytest.raises(FAILED) as e:
        dcp.save(sd, storage_writer=w, planner=DefaultSavePlanner(enable_plan_caching=True))
    w.close()
    msg = str(e.value)
    assert "DefaultSavePlanner._cached_plans_key is gone" in msg and "plan caching" in msg and "2.99.0" in msg


def test_dtensor_staging_names_the_missing_hook(monkeypatch, fresh_checks):
    monkeypatch.setattr(_dcp_hooks, "check_dtensor_hooks", _moved("DTensor no longer keeps its spec in DTensor._spec"))
    with pytest.raises(RuntimeError, match=r"staging of DTensors needs .*DTensor\._spec"):
        _dcp_hooks.dtensor_spec(object())


@pytest.mark.parametrize("staging", ["eager", "lazy"])
def test_async_save_with_an_explicit_writer_on_any_release(tmp_path, monkeypatch, fresh_checks, staging):
    """``dcp.async_save(sd, storage_writer=FastPersistWriter(p))`` on a torch
    release number fp_dcp never saw, with every checked hook reported
    missing: it needs none of them."""
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setattr(_dcp_hooks, "_installed_tested", None, raising=False)
    for name in ("check_storage_hooks", "check_planner_hooks", "check_dtensor_hooks"):
        monkeypatch.setattr(_dcp_hooks, name, _moved(f"{name} failed"))
    sd = _sd(2)
    w = FastPersistWriter(tmp_path / "c", staging=staging)
    try:
        _done(dcp.async_save(sd, storage_writer=w))
    finally:
        w.close()
    target = _zeros(sd)
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert_sd_equal(sd, target)


@pytest.mark.parametrize("staging", ["eager", "lazy"])
def test_staging_works_without_async_saves_frame(tmp_path, monkeypatch, staging):
    """A torch whose ``async_save`` reaches ``stage`` another way (no frame
    found): the save still completes bit-exact, and a staging past its
    memory limit spills into the writer's own directory."""
    monkeypatch.setattr(_dcp_hooks, "async_save_caller", lambda: (False, None))
    sd = {"big": torch.arange(300_000, dtype=torch.float32), **_sd(3)}
    path = tmp_path / "c"
    w = FastPersistWriter(path, staging=staging, staging_memory_limit_bytes=1 << 20)
    try:
        _done(dcp.async_save(sd, storage_writer=w, checkpoint_id=path))
        _done(dcp.async_save(sd, storage_writer=w, checkpoint_id=path))  # the arena reused
    finally:
        w.close()
    target = _zeros(sd)
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert_sd_equal(sd, target)
    assert not any(n.startswith(".") and "spill" in n for n in os.listdir(path))


def test_async_save_caller_finds_the_frame_on_this_torch(tmp_path, monkeypatch):
    calls = []
    real = _dcp_hooks.async_save_caller
    monkeypatch.setattr(_dcp_hooks, "async_save_caller", lambda: calls.append(real()) or calls[-1])
    w = FastPersistWriter(tmp_path / "c")
    try:
        _done(dcp.async_save(_sd(4), storage_writer=w, checkpoint_id=tmp_path / "c"))
    finally:
        w.close()
    assert calls == [(True, os.fspath(tmp_path / "c"))], "async_save's frame was not found on this torch"


# -------------------------------------------- errors that reach the user


def _truncate(path):
    p = os.path.join(path, fmt.METADATA_NAME)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size // 2)


def _craft(path):
    p = os.path.join(path, fmt.METADATA_NAME)
    with open(p, "r+b") as f:
        head = f.read(64)
        f.seek(0)
        f.write(bytes(b ^ 0x5A for b in head))


@pytest.mark.parametrize("damage", ["missing", "truncated", "crafted"])
def test_a_refused_load_logs_its_reason_at_error(tmp_path, caplog, damage):
    """Some torch releases' dcp.load swallow read_metadata's exception (and
    raise ``AssertionError: metadata is None``): fp_dcp's reason is logged at
    ERROR by the ``fp_dcp`` logger, once, on every release."""
    path = tmp_path / "c"
    if damage != "missing":
        save(_sd(5), path)
        (_truncate if damage == "truncated" else _craft)(path)
    with caplog.at_level(logging.ERROR, logger="fp_dcp"):
        with pytest.raises(FAILED):
            dcp.load(_zeros(_sd(5)), storage_reader=FastPersistReader(path))
    records = [r for r in caplog.records if r.name == "fp_dcp" and r.levelno == logging.ERROR]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    text = records[0].getMessage()
    assert str(path) in text
    try:
        FastPersistReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - the reason itself
        assert str(e) in text
    else:
        raise AssertionError("read_metadata accepted a damaged checkpoint")


def test_the_reason_reaches_stderr_with_no_logging_configured(tmp_path):
    """What a user running a script sees: the reason on stderr, whatever the
    torch release does with the exception."""
    path = tmp_path / "absent"
    script = textwrap.dedent(f"""
        import torch, torch.distributed.checkpoint as dcp
        from fp_dcp import FastPersistReader
        dcp.load({{"w": torch.zeros(3)}}, storage_reader=FastPersistReader({str(path)!r}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    try:
        FastPersistReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001
        reason = str(e)
    assert reason and str(path) in reason
    logged = [line for line in r.stderr.splitlines() if line.startswith("fp_dcp cannot load")]
    assert logged and reason in logged[0], r.stderr[-3000:]


# --------------------------------------------------------- the GC freeze


def test_no_freeze_where_the_interpreter_keeps_objects_in_the_permanent_generation(monkeypatch):
    """CPython 3.12 starts with objects of its own in the permanent
    generation (``gc.get_freeze_count() == 375`` on 3.12.1) and a save's
    freeze and thaw there crashed a later collection: the freeze does
    nothing on such an interpreter, even when the count reads 0 (after an
    application's ``gc.unfreeze()``); elsewhere it freezes and thaws."""
    if gc_freeze.interpreter_start_count() != 0:
        pytest.skip("freezing here is what must not happen (test_the_freeze_does_nothing_on_python_3_12)")
    gc.unfreeze()
    try:
        monkeypatch.setattr(gc_freeze, "_start_count", 375)
        f = GcFreeze()
        f.freeze()
        assert not f.frozen and gc.get_freeze_count() == 0
        f.thaw()
        monkeypatch.setattr(gc_freeze, "_start_count", 0)
        f.freeze()
        assert f.frozen and gc.get_freeze_count() > 0
        f.thaw()
        assert not f.frozen and gc.get_freeze_count() == 0
        monkeypatch.setattr(gc_freeze, "_start_count", -1)  # unknown: no freeze either
        f.freeze()
        assert not f.frozen
    finally:
        gc.unfreeze()


def test_the_interpreter_start_count_is_read_from_a_bare_interpreter(monkeypatch):
    monkeypatch.setattr(gc_freeze, "_start_count", None)
    bare = subprocess.run([sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
                          capture_output=True, text=True, check=True).stdout
    assert gc_freeze.interpreter_start_count() == int(bare)


def _python312():
    for p in ("/root/.pyenv/versions/3.12.1/bin/python", "python3.12"):
        try:
            r = subprocess.run([p, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True,
                               text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if r.stdout.strip() == "True":
            return p
    return None


def test_the_freeze_does_nothing_on_python_3_12():
    """The module on a real 3.12 interpreter (it needs no torch): no freeze,
    the interpreter's own objects left where they are."""
    py = _python312()
    if py is None:
        pytest.skip("no Python 3.12 on this machine")
    script = textwrap.dedent(f"""
        import gc, importlib.util
        spec = importlib.util.spec_from_file_location("g", {os.path.join(ROOT, "fp_dcp", "gc_freeze.py")!r})
        g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
        start = gc.get_freeze_count()
        f = g.GcFreeze(); f.freeze()
        during = gc.get_freeze_count()
        f.thaw()
        gc.collect()
        print(g.interpreter_start_count(), start, f.frozen, during, gc.get_freeze_count())
    """)
    out = subprocess.run([py, "-I", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    bare, start, frozen, during, after = out.stdout.split()
    assert bare == start != "0" and frozen == "False" and during == after == start, out.stdout


# a load step shaped as torch 2.11's (the reader's exception swallowed, the
# read retried with rank=) and as 2.13's (the exception kept and reported)
_STEP = '''
def local_step(reader):
    metadata = None
    first = None
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        {on_error}
    if not metadata:
        try:
            metadata = reader.read_metadata(rank=0)
        except Exception:
            pass
    if metadata is None:
        raise AssertionError({message})
    reader.set_up_storage_reader(metadata, True)
'''
_SWALLOWING_STEP = _STEP.format(on_error="pass", message='"metadata is None"')
_REPORTING_STEP = _STEP.format(on_error="first = e",
                               message='f"metadata is None; global metadata read failed: {first}"')


def _step(source):
    g = {"__name__": "torch.distributed.checkpoint.state_dict_loader"}
    exec(source, g)
    return g["local_step"]


@pytest.mark.parametrize("damage", ["missing", "truncated", "crafted"])
def test_a_load_step_that_swallows_the_error_still_raises_the_reason(tmp_path, damage):
    path = tmp_path / "c"
    if damage != "missing":
        save(_sd(6), path)
        (_truncate if damage == "truncated" else _craft)(path)
    with pytest.raises(Exception) as direct:
        FastPersistReader(path).read_metadata()
    with pytest.raises(type(direct.value)) as e:
        _step(_SWALLOWING_STEP)(FastPersistReader(path))
    assert str(e.value) == str(direct.value) and str(path) in str(e.value)
    # a step that reports the exception itself gets it as before
    with pytest.raises(AssertionError, match="global metadata read failed") as e:
        _step(_REPORTING_STEP)(FastPersistReader(path))
    assert str(direct.value) in str(e.value)
    # and a retry from anywhere else raises as usual
    r = FastPersistReader(path)
    for kwargs in ({}, {"rank": 0}):
        with pytest.raises(type(direct.value)):
            r.read_metadata(**kwargs)


def test_dcp_load_of_a_missing_checkpoint_names_it_on_this_torch(tmp_path):
    path = tmp_path / "absent"
    with pytest.raises(FAILED) as e:
        dcp.load({"w": torch.zeros(3)}, storage_reader=FastPersistReader(path))
    assert str(path) in str(e.value)
