"""``fp-dcp`` / ``python -m fp_dcp``: inspect, convert (torch.save,
safetensors, stock DCP both ways) bit for bit, and errors that name the file
and the fix."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp.tools.cli import main
from fp_dcp.tools.convert import SAFETENSORS_DTYPES
from tests._dist import run_ranks
from tests._sd import assert_sd_equal, bits_equal, mixed_state_dict, zeros_like_sd


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# children import this checkout, whatever else is installed
_ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _contiguous(x):
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    if isinstance(x, dict):
        return {k: _contiguous(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_contiguous(v) for v in x]
    return x


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "c")
    sd = mixed_state_dict(seed=3)
    dcp.save(sd, storage_writer=FastPersistWriter(path), no_dist=True)
    return sd, path


def _save_sharded(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(11)
    sd = {"w": distribute_tensor(torch.randn(64, 40, generator=g), mesh, [Shard(0)]),
          "v": distribute_tensor(torch.randn(30, 50, generator=g), mesh, [Shard(1)]),
          "step": 3}
    dcp.save(sd, storage_writer=FastPersistWriter(path))
    return True


# ------------------------------------------------------------------ inspect


def test_inspect_json_lists_format_tensors_chunks_and_files(ckpt, capsys):
    sd, path = ckpt
    assert main(["inspect", path, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "fp_dcp" and d["format_version"] >= 1 and d["world_size"] == 1
    flat, _ = flatten_state_dict(sd)
    tensors = {t["name"]: t for t in d["tensors"]}
    assert set(tensors) == {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
    for name, t in tensors.items():
        assert t["shape"] == list(flat[name].shape) and t["dtype"] == str(flat[name].dtype)[6:], name
        assert t["bytes"] == flat[name].numel() * flat[name].element_size()
        assert len(t["chunks"]) == 1
    assert {o["name"] for o in d["objects"]} == {k for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    assert d["files"] and all(f["size"] == f["size_on_disk"] == os.path.getsize(os.path.join(path, f["name"]))
                              for f in d["files"])


def test_inspect_table_and_chunks_of_a_sharded_checkpoint(tmp_path, capsys):
    path = str(tmp_path / "s")
    run_ranks(2, _save_sharded, path)
    assert main(["inspect", path, "--chunks"]) == 0
    out = capsys.readouterr().out
    assert "on 2 ranks" in out and "float32" in out and "64x40" in out
    assert "w chunk at [32, 0] size [32, 40]" in out and "v chunk at [0, 25] size [30, 25]" in out
    # and the sharded checkpoint consolidates into one torch.save file
    out_pt = str(tmp_path / "s.pt")
    assert main(["convert", path, out_pt, "-q"]) == 0
    got = torch.load(out_pt, weights_only=True)
    g = torch.Generator().manual_seed(11)
    assert torch.equal(got["w"], torch.randn(64, 40, generator=g))
    assert torch.equal(got["v"], torch.randn(30, 50, generator=g))
    assert got["step"] == 3


@pytest.mark.slow
def test_python_dash_m_and_the_console_script(ckpt):
    _, path = ckpt
    r = subprocess.run([sys.executable, "-m", "fp_dcp", "inspect", path], capture_output=True, text=True, env=_ENV)
    assert r.returncode == 0 and "format fp_dcp version" in r.stdout, r.stderr
    script = shutil.which("fp-dcp")
    if script is None:
        pytest.skip("the fp-dcp console script is not installed (pip install -e .)")
    r = subprocess.run([script, "--help"], capture_output=True, text=True, env=_ENV)
    assert r.returncode == 0 and "inspect" in r.stdout and "convert" in r.stdout


# ------------------------------------------------------------------ convert


def test_convert_to_torch_save_is_bit_exact_and_shows_progress(ckpt, tmp_path, capsys):
    sd, path = ckpt
    out = str(tmp_path / "model.pt")
    assert main(["convert", path, out]) == 0
    err = capsys.readouterr().err
    assert "reading" in err and "100.0%" in err and "wrote" in err
    assert_sd_equal(_contiguous(sd), _contiguous(torch.load(out, weights_only=True)))


def test_convert_to_torch_save_streams_tensors_through_the_file(tmp_path):
    """fp_dcp -> torch.save never holds the tensors' bytes in anonymous memory:
    the reader fills the output file's tensors in place (a MAP_SHARED mapping
    of the archive written with skip_data).  RssAnon sampled during the
    conversion of 192 MiB of tensors stays far below that."""
    import re
    import threading
    import time

    from fp_dcp.tools.convert import to_torch_save

    g = torch.Generator().manual_seed(4)
    sd = {"layers": [torch.randn(4 << 20, generator=g) for _ in range(12)], "note": {"step": 7},
          "odd": torch.randn(77, 13, generator=g).to(torch.float16)}
    dcp.save(sd, storage_writer=FastPersistWriter(str(tmp_path / "c")), no_dist=True)

    def anon_kib():
        return int(re.search(r"RssAnon:\s+(\d+)", open("/proc/self/status").read()).group(1))

    base, peak, stop = anon_kib(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anon_kib())
            time.sleep(0.001)

    th = threading.Thread(target=sample)
    th.start()
    try:
        to_torch_save(str(tmp_path / "c"), str(tmp_path / "m.pt"), progress=False)
    finally:
        stop.set()
        th.join()
    assert (peak[0] - base) * 1024 < 64 << 20  # 192 MiB of tensors converted
    assert_sd_equal(sd, torch.load(str(tmp_path / "m.pt"), weights_only=True))
    assert [n for n in os.listdir(tmp_path) if "tmp" in n] == []


def _read_safetensors(path):
    """A minimal reader of the format (independent of fp_dcp's writer)."""
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out, end = {}, 0
    for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = h["data_offsets"]
        assert a == end, f"{name}: a hole or an overlap in the data section"
        end = b
        raw = torch.frombuffer(bytearray(data[a:b]), dtype=torch.uint8) if b > a else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(names[h["dtype"]]).reshape(h["shape"])
    assert end == len(data)
    return out, meta


def test_convert_to_safetensors_is_bit_exact(ckpt, tmp_path, capsys):
    sd, path = ckpt
    out = str(tmp_path / "model.safetensors")
    # some dtypes have no safetensors name: an error naming the tensor, or left out on request
    assert main(["convert", path, out, "-q"]) == 1
    assert "d10_complex128: safetensors has no torch.complex128" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert main(["convert", path, out, "-q", "--skip-unsupported"]) == 0
    assert "skipped" in capsys.readouterr().err
    got, meta = _read_safetensors(out)
    flat, _ = flatten_state_dict(sd)
    want = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor) and v.dtype in SAFETENSORS_DTYPES}
    assert set(got) == set(want)
    for k in want:
        assert bits_equal(got[k], want[k].contiguous()), k
    assert meta["format"] == "pt"


def test_safetensors_output_loads_with_the_safetensors_package(ckpt, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    sd, path = ckpt
    out = str(tmp_path / "m.safetensors")
    assert main(["convert", path, out, "-q", "--skip-unsupported"]) == 0
    got = st.load_file(out)
    flat, _ = flatten_state_dict(sd)
    for k, v in got.items():
        assert bits_equal(v, flat[k].contiguous()), k


def test_fp_dcp_to_stock_dcp_and_back_is_bit_exact(ckpt, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    sd, path = ckpt
    stock, back = str(tmp_path / "stock"), str(tmp_path / "back")
    assert main(["convert", "--to-dcp", path, stock, "-q"]) == 0
    assert os.path.exists(os.path.join(stock, ".metadata"))
    assert main(["convert", "--from-dcp", stock, back, "-q"]) == 0
    want = _contiguous(sd)
    a = zeros_like_sd(want)
    dcp.load(a, storage_reader=FileSystemReader(stock), no_dist=True)
    assert_sd_equal(want, a)
    b = zeros_like_sd(want)
    dcp.load(b, storage_reader=FastPersistReader(back), no_dist=True)
    assert_sd_equal(want, b)
    # the stock checkpoint also consolidates into torch.save
    assert main(["convert", stock, str(tmp_path / "s.pt"), "-q"]) == 0
    assert_sd_equal(want, _contiguous(torch.load(str(tmp_path / "s.pt"), weights_only=True)))


# ------------------------------------------------------------------ errors


def test_errors_name_the_file_and_the_fix(ckpt, tmp_path, capsys):
    _, path = ckpt
    stock = str(tmp_path / "stock")
    dcp.save({"x": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
    assert main(["inspect", stock]) == 1
    assert f"fp-dcp convert --from-dcp {stock}" in capsys.readouterr().err
    out = str(tmp_path / "exists.pt")
    open(out, "w").close()
    assert main(["convert", path, out, "-q"]) == 1
    err = capsys.readouterr().err
    assert out in err and "--force" in err
    assert main(["convert", path, out, "-q", "--force"]) == 0
    assert main(["convert", path, str(tmp_path / "model.xyz")]) == 1
    assert "--to" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "nothing" in capsys.readouterr().err
    assert main(["convert", "--from-dcp", path, str(tmp_path / "o")]) == 1
    assert "needs a stock DCP checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["convert"])
    assert e.value.code == 2


def test_torch_save_file_converts_to_fp_dcp(tmp_path):
    src = str(tmp_path / "m.pt")
    sd = {"a": torch.arange(12.0).reshape(3, 4), "b": {"c": torch.ones(2, dtype=torch.int8)}}
    torch.save(sd, src)
    out = str(tmp_path / "fp")
    assert main(["convert", src, out, "--to", "fp_dcp", "-q"]) == 0
    target = zeros_like_sd(sd)
    dcp.load(target, storage_reader=FastPersistReader(out), no_dist=True)
    assert_sd_equal(sd, target)
    assert np.array_equal(target["a"].numpy(), np.arange(12.0).reshape(3, 4))


# ------------------------------------------------------------------ start-up, help, one error path


def _run_cli(*args, cwd=None, importtime=False):
    cmd = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-m", "fp_dcp", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_ENV, cwd=cwd, timeout=120)


def _imported(importtime_stderr):
    """Module names from `python -X importtime` (one line per import)."""
    return {line.split("|")[-1].strip() for line in importtime_stderr.splitlines() if line.startswith("import time:")}


def test_help_and_usage_errors_import_no_torch(tmp_path):
    r = _run_cli("--help", importtime=True)
    assert r.returncode == 0, r.stderr
    mods = _imported(r.stderr)
    assert "fp_dcp.tools.cli" in mods and not {m for m in mods if m == "torch" or m.startswith("torch.")}
    assert not {m for m in mods if m in ("numpy", "fp_dcp._aio", "fp_dcp.format")}
    for word in ("inspect", "verify", "convert", "exit codes", "130", "-q"):
        assert word in r.stdout
    assert "``" not in r.stdout  # plain text, no markup
    for argv in (["inspect"], ["nosuchcommand"], ["verify", "--nosuchoption", "x"], []):
        r = _run_cli(*argv, importtime=True)
        assert r.returncode == 2, (argv, r.stderr)
        assert "usage: fp-dcp" in r.stderr and "torch" not in _imported(r.stderr)
    # a bad path is answered before torch is imported, too
    (tmp_path / "notes.txt").write_text("hello")
    r = _run_cli("verify", str(tmp_path / "notes.txt"), importtime=True)
    assert r.returncode == 1 and "a plain file, not a checkpoint directory" in r.stderr
    assert "torch" not in _imported(r.stderr)


def test_import_fp_dcp_cli_imports_no_torch_and_the_exports_still_work():
    code = ("import sys, fp_dcp.tools.cli, fp_dcp.options; assert 'torch' not in sys.modules, 'torch'; "
            "from fp_dcp import FastPersistWriter, FastPersistReader, FastPersistOptions; "
            "import fp_dcp; assert 'torch' in sys.modules; "
            "assert sorted(fp_dcp.__all__) == sorted(['FastPersistWriter', 'FastPersistReader', "
            "'FastPersistOptions', '__version__', 'use_as_default', 'restore_default', 'default_storage']); "
            "assert 'FastPersistWriter' in dir(fp_dcp) and 'use_as_default' in dir(fp_dcp); "
            "print(FastPersistWriter.__module__, FastPersistReader.__module__, fp_dcp.__file__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["fp_dcp.save.writer", "fp_dcp.load.reader", os.path.join(REPO, "fp_dcp", "__init__.py")]
    with pytest.raises(AttributeError):
        import fp_dcp

        fp_dcp.NoSuchThing  # noqa: B018


def test_cli_spells_the_format_names_like_the_format():
    from fp_dcp.tools import cli
    from fp_dcp import format as fmt

    assert (cli.META_NAME, cli.STOCK_META_NAME, cli.DATA_SUFFIX) == (
        fmt.METADATA_NAME, fmt.STOCK_METADATA_NAME, fmt.DATA_SUFFIX)


def test_an_unbuilt_extension_says_how_to_build_it(tmp_path):
    """A source tree whose extension was never built: one message naming the
    fix, not "cannot import name '_aio' from partially initialized module"."""
    shutil.copytree(os.path.join(REPO, "fp_dcp"), tmp_path / "clone" / "fp_dcp",
                    ignore=lambda _d, names: [n for n in names if n.endswith((".so", ".c")) or n == "__pycache__"])
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path / "clone")
    # the clone first on sys.path (the current directory), and no editable
    # install's finder (which would serve another checkout's fp_dcp._aio)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    no_editable = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
                   "if not getattr(f, '__module__', '').startswith('__editable__')]; ")
    for code in ("from fp_dcp import FastPersistWriter", "from fp_dcp import FastPersistReader",
                 "import fp_dcp.engine", "import fp_dcp.tools.verify"):
        r = subprocess.run([sys.executable, "-c", no_editable + code], capture_output=True, text=True, env=env,
                           cwd=tmp_path / "clone", timeout=60)
        assert r.returncode == 1, (code, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: fp_dcp's native extension (fp_dcp._aio) is not built"), (code, last)
        assert f"cd {tmp_path / 'clone'} && pip install -e ." in last
        assert "circular import" not in r.stderr and "partially initialized" not in r.stderr
    # the command line says the same in one line
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / ".fp_dcp.meta").write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", no_editable + "import sys; from fp_dcp.tools.cli import main; "
                        f"sys.exit(main(['verify', {str(ckpt)!r}]))"], capture_output=True, text=True, env=env,
                       cwd=tmp_path / "clone", timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("fp-dcp verify: fp_dcp's native extension (fp_dcp._aio) is not built"), r.stderr
    assert "Traceback" not in r.stderr


def test_a_clone_in_the_current_directory_says_so(tmp_path):
    """Run from the directory holding a clone named fp_dcp, Python imports the
    clone as a namespace package; the import says what happened and what to do
    instead of "cannot import name ... (unknown location)"."""
    os.symlink(REPO, tmp_path / "fp_dcp")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name in ("FastPersistWriter", "FastPersistReader", "FastPersistOptions"):
        r = subprocess.run([sys.executable, "-S", "-c", f"from fp_dcp import {name}"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=60)
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert "unknown location" not in r.stderr
        assert last.startswith("ImportError: 'fp_dcp' here is the repository"), last
        assert f"pip install -e {tmp_path / 'fp_dcp'}" in last and "another directory" in last


def test_every_command_has_quiet_progress_and_the_interrupt_message(ckpt, monkeypatch, capsys):
    from fp_dcp.tools import verify

    _, path = ckpt
    assert main(["verify", path]) == 0
    cap = capsys.readouterr()
    assert "verifying:" in cap.err and "100.0%" in cap.err and cap.out.rstrip().endswith("OK")
    assert main(["verify", "-q", path]) == 0
    assert capsys.readouterr().err == ""
    assert main(["inspect", "-q", path]) == 0
    assert capsys.readouterr().err == ""

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify, "verify_checkpoint", interrupted)
    assert main(["verify", "-q", path]) == 130
    assert "fp-dcp verify: interrupted" in capsys.readouterr().err
    monkeypatch.setattr("fp_dcp.tools.convert.describe", interrupted)
    assert main(["inspect", path]) == 130
    assert "fp-dcp inspect: interrupted" in capsys.readouterr().err


def test_inspect_keeps_other_items_out_of_the_tensor_table_and_counts_in_words(tmp_path, capsys):
    path = str(tmp_path / "c")
    dcp.save({"w": torch.ones(10, 4), "step": 7}, storage_writer=FastPersistWriter(path), no_dist=True)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "1 tensor (160 B), 1 other item, 1 data file (" in out and "on 1 rank " in out
    assert "object" not in out and "1 other items" not in out and "data files" not in out
    lines = out.splitlines()
    tensor_table = lines[lines.index(next(ln for ln in lines if ln.split()[:2] == ["tensor", "dtype"])):]
    tensor_table = tensor_table[:tensor_table.index("")]
    assert [ln.split()[0] for ln in tensor_table[2:]] == ["w"]
    other = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["other", "item"])
    assert lines[other + 2].split()[0] == "step"


# ------------------------------------------------------------------ bad paths: what was expected, what is there


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_bad_path_a_plain_file(tmp_path, capsys, command):
    f = tmp_path / "somefile.txt"
    f.write_text("x")
    assert main([command, str(f)]) == 1
    err = capsys.readouterr().err
    assert err == (f"fp-dcp {command}: {f}: a plain file, not a checkpoint directory; fp-dcp {command} expects "
                   f"the directory a save wrote into (it holds .fp_dcp.meta)\n")
    assert "Errno" not in err
    model = tmp_path / "model.pt"
    torch.save({"a": torch.ones(1)}, model)
    assert main([command, str(model)]) == 1
    assert f"fp-dcp convert {model} OUT --to fp_dcp" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_bad_path_a_directory_of_checkpoints_lists_them(tmp_path, capsys, command):
    for step in (9, 10):
        dcp.save({"w": torch.ones(3), "step": step},
                 storage_writer=FastPersistWriter(str(tmp_path / "run" / f"step{step}")), no_dist=True)
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(tmp_path / "run" / "stock"), no_dist=True)
    (tmp_path / "run" / "logs").mkdir()
    run = tmp_path / "run"
    assert main([command, str(run)]) == 1
    err = capsys.readouterr().err
    assert (f"{run}: not a checkpoint itself, but a directory holding 3 checkpoints one level down: "
            f"step9, step10, stock (stock DCP); give one of them, e.g. {run / 'step10'}") in err
    # a path that does not exist: the checkpoints beside it
    assert main([command, str(run / "step11")]) == 1
    err = capsys.readouterr().err
    assert f"{run / 'step11'}: no checkpoint directory here (nothing exists at this path)" in err
    assert f"checkpoints in {run}: step9, step10, stock (stock DCP)" in err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_bad_path_a_stock_checkpoint_points_to_convert(tmp_path, capsys, command):
    stock = tmp_path / "stock"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
    assert main([command, str(stock)]) == 1
    err = capsys.readouterr().err
    assert f"{stock}: a stock torch.distributed.checkpoint checkpoint (.metadata), not an fp_dcp one" in err
    assert f"fp-dcp convert --from-dcp {stock} OUT" in err


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_bad_path_an_empty_or_unrelated_directory(tmp_path, capsys, command):
    extra = [str(tmp_path / "out.pt")] if command == "convert" else []
    (tmp_path / "empty").mkdir()
    assert main([command, str(tmp_path / "empty"), *extra]) == 1
    err = capsys.readouterr().err
    assert (f"{tmp_path / 'empty'}: an empty directory, not a checkpoint: expected .fp_dcp.meta (fp_dcp) or "
            f".metadata (stock DCP) in it, or checkpoint directories one level down") in err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("x")
    assert main([command, str(tmp_path / "other"), *extra]) == 1
    assert f"{tmp_path / 'other'}: a directory of 1 entry, not a checkpoint" in capsys.readouterr().err


def test_bad_path_an_interrupted_save(tmp_path, capsys):
    d = tmp_path / "half"
    d.mkdir()
    (d / "x.r0.0.fpd").write_bytes(b"\0" * 4096)
    assert main(["verify", str(d)]) == 1
    assert "a save was interrupted before its commit" in capsys.readouterr().err


def test_verify_json_reports_a_bad_path_as_json(tmp_path, capsys):
    assert main(["verify", "--json", str(tmp_path / "nothing")]) == 1
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["ok"] is False and "no checkpoint directory here" in doc["errors"][0]
    assert "fp-dcp verify:" in cap.err


def test_ctrl_c_stops_verify_after_the_batches_in_flight(tmp_path, monkeypatch):
    """Ctrl-C during fp-dcp verify: the workers take no new batch, so the
    interrupt message comes at once, not after the whole checkpoint is read.
    The interrupt is raised where Ctrl-C lands, in the main thread waiting for
    a worker's result, while the worker is at its second batch of 16."""
    import concurrent.futures
    import threading

    from fp_dcp.tools import verify

    path = str(tmp_path / "c")
    dcp.save({f"t{i}": torch.ones(1 << 18) for i in range(16)}, storage_writer=FastPersistWriter(path), no_dist=True)
    monkeypatch.setattr(verify, "_BATCH_BYTES", 1 << 20)  # 16 batches of 1 MiB
    real_worker, taken = verify._worker, []
    interrupt, shutting_down = threading.Event(), threading.Event()

    def worker(directory, opts, verifier, paths, next_task, tick):
        def next_and_interrupt():
            task = next_task()
            if task is not None:
                taken.append(task)
                if len(taken) == 2:
                    interrupt.set()  # Ctrl-C now
                    assert shutting_down.wait(30)  # the main thread has taken it
            return task

        return real_worker(directory, opts, verifier, paths, next_and_interrupt, tick)

    real_result, real_shutdown = concurrent.futures.Future.result, concurrent.futures.ThreadPoolExecutor.shutdown

    def result(self, timeout=None):
        if interrupt.wait(30):
            raise KeyboardInterrupt
        return real_result(self, timeout)

    def shutdown(self, *a, **k):
        shutting_down.set()
        return real_shutdown(self, *a, **k)

    monkeypatch.setattr(concurrent.futures.Future, "result", result)
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "shutdown", shutdown)
    monkeypatch.setattr(verify, "_worker", worker)
    with pytest.raises(KeyboardInterrupt):
        verify.verify_checkpoint(path, workers=1)
    assert len(taken) == 2  # of 16
