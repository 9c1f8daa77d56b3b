"""Errors arrive whole, inputs cost what they honestly are, plain data loads.

Attacks and careless inputs on what surrounds the core load path, in the
style of ``tests/test_security.py``: every fp_dcp exception survives pickling
(DCP gathers a rank's error with pickle), the CLI answers every failure with
one line, every environment name the docs mention is accepted, metadata that
claims more than it holds is refused before it costs memory, options cannot
ask for more memory than a machine has, ``io.BytesIO`` train state (PyTorch's
own end-to-end DCP test) loads with no option, and the shared reads' error
exchange is plain data, not pickle.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pkgutil
import re
import subprocess
import sys

import pytest
import torch

import fp_dcp
from fp_dcp import format as fmt
from fp_dcp.checksums import BadBlock, ChecksumError
from tests._dist import run_ranks
from tests._sd import FAILED, flip_byte, root_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ------------------------------------------------------------ errors that arrive whole


def _fp_dcp_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in fp_dcp (all its modules imported)."""
    for info in pkgutil.walk_packages(fp_dcp.__path__, "fp_dcp."):
        if not info.name.endswith("__main__"):  # runs the CLI
            importlib.import_module(info.name)

    def walk(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)

    found = {c for c in walk(BaseException) if c.__module__.split(".")[0] == "fp_dcp"}
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _bad() -> list[BadBlock]:
    return [BadBlock("w", "/ckpt/a.r0.0.fpd", 4096, 0, 1 << 20, 0x1234, 0x5678),
            BadBlock("w", "/ckpt/a.r0.0.fpd", 4096 + (1 << 20), 1 << 20, 1 << 20, 1, 2)]


def _integrity_error():
    from fp_dcp.tiers.integrity import IntegrityError

    return IntegrityError("/tier/step_3/a.r0.0.fpd", "short: 10 of 4096 bytes")


# An fp_dcp exception whose constructor is its own (not a built-in one taking
# the message) needs a sample here, and a __reduce__ that rebuilds it.
_SAMPLES = {
    "fp_dcp.checksums.ChecksumError": lambda: ChecksumError(
        "checksum mismatch in w: bytes 0..1048576 at offset 4096 of /ckpt/a.r0.0.fpd", "/ckpt/a.r0.0.fpd", _bad()),
    "fp_dcp.tiers.integrity.IntegrityError": _integrity_error,
}


def _plain(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return value


def _own_init(cls) -> bool:
    return any("__init__" in vars(c) for c in cls.__mro__ if c.__module__.split(".")[0] == "fp_dcp")


@pytest.mark.parametrize("cls", _fp_dcp_exceptions(), ids=lambda c: c.__qualname__)
def test_every_fp_dcp_exception_round_trips_through_pickle(cls):
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _own_init(cls):
        assert name in _SAMPLES, (
            f"{name} has its own __init__: add a sample to _SAMPLES and a __reduce__ that rebuilds it "
            f"(DCP sends a rank's error to the others by pickle)"
        )
        err = _SAMPLES[name]()
    else:
        err = cls(f"{name}: what went wrong, in /ckpt/file, and the fix")
        err.tensor = "w"  # a field set by a raiser travels too
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(back) is cls and str(back) == str(err) and back.args == err.args
        assert {k: _plain(v) for k, v in vars(back).items()} == {k: _plain(v) for k, v in vars(err).items()}
        if isinstance(err, OSError):
            assert (back.errno, back.strerror, back.filename) == (err.errno, err.strerror, err.filename)


def test_a_checksum_error_keeps_its_fields_through_pickle():
    err = _SAMPLES["fp_dcp.checksums.ChecksumError"]()
    back = pickle.loads(pickle.dumps(err))
    assert (back.tensor, back.file_offset, back.length) == ("w", 4096, 1 << 20)
    assert [b.as_dict() for b in back.bad_blocks] == [b.as_dict() for b in _bad()]
    assert back.errno == 5 and back.filename == "/ckpt/a.r0.0.fpd" and "checksum mismatch in w" in str(back)


def _damaged_multirank_load(rank, ws, root):
    """Each rank loads its own shard; rank 0's shard has a damaged byte. DCP
    gathers rank 0's ChecksumError by pickle: every rank must name the file."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistReader, FastPersistWriter
    from fp_dcp.load.reader import read_checkpoint_metadata

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
    path = os.path.join(root, "bad")
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=FastPersistWriter(path))
    _, layout, _ = read_checkpoint_metadata(path)
    ext = next(exts[0] for index, exts in layout.extents.items() if index.fqn == "w" and not any(index.offset))
    data_file = os.path.join(path, layout.files[ext.file][0])
    dist.barrier()
    if rank == 0:
        flip_byte(data_file, ext.file_offset + 100)
    dist.barrier()
    target = {"w": distribute_tensor(torch.zeros(512, 1024), mesh, [Shard(0)])}
    try:
        dcp.load(target, storage_reader=FastPersistReader(path, share_replicated_reads=False,
                                                          share_interleaved_reads=False))
    except FAILED as e:
        text = str(e)
        assert "AttributeError" not in text and "object has no attribute" not in text, text
        first = root_error(e)
        assert isinstance(first, ChecksumError), text
        assert first.filename == data_file and first.tensor == "w" and data_file in str(first), text
        return True
    raise AssertionError("a damaged block did not fail the load")


@pytest.mark.slow  # multi-process
def test_a_damaged_file_is_named_on_every_rank_of_a_multirank_load(tmp_path):
    assert run_ranks(2, _damaged_multirank_load, str(tmp_path)) == [True, True]


# ------------------------------------------------------------ the CLI: one line, every failure


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "fp_dcp", *argv], capture_output=True, text=True, env=_ENV,
                          timeout=300)


def _one_line_failure(r, *names):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for name in names:
        assert name in lines[0], r.stderr
    return lines[0]


def _fp_dcp_ckpt(path):
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter
    from fp_dcp.load.reader import read_checkpoint_metadata

    dcp.save({"w": torch.arange(200_000, dtype=torch.float32), "step": 3},
             storage_writer=FastPersistWriter(str(path)), no_dist=True)
    _, layout, _ = read_checkpoint_metadata(str(path))
    return os.path.join(str(path), layout.files[0][0])


def test_cli_convert_of_a_damaged_checkpoint_is_one_line(tmp_path):
    """A checksum mismatch during convert's load reaches the CLI as DCP's
    CheckpointException (a BaseException): one line naming the file, exit 1."""
    data_file = _fp_dcp_ckpt(tmp_path / "c")
    flip_byte(data_file, 100)
    line = _one_line_failure(_cli("convert", "-q", str(tmp_path / "c"), str(tmp_path / "out.pt")),
                             data_file, "checksum mismatch")
    assert line.startswith("fp-dcp convert: ")
    assert not os.path.exists(tmp_path / "out.pt")


def test_cli_convert_of_a_truncated_checkpoint_is_one_line(tmp_path):
    data_file = _fp_dcp_ckpt(tmp_path / "c")
    os.truncate(data_file, 1000)
    _one_line_failure(_cli("convert", "-q", str(tmp_path / "c"), str(tmp_path / "out.pt")), data_file, "truncated")


def test_cli_convert_of_a_truncated_stock_checkpoint_names_the_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(1000.0), "step": 3}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")),
             no_dist=True)
    (data,) = [n for n in os.listdir(tmp_path / "s") if n.endswith(".distcp")]
    os.truncate(tmp_path / "s" / data, 100)
    _one_line_failure(_cli("convert", "-q", "--from-dcp", str(tmp_path / "s"), str(tmp_path / "o")),
                      str(tmp_path / "s" / data), "truncated")
    assert not os.path.exists(tmp_path / "o")


def test_cli_turns_a_checkpoint_exception_into_its_first_failure(monkeypatch, capsys):
    from torch.distributed.checkpoint.api import CheckpointException

    from fp_dcp.tools import cli

    err = ChecksumError("checksum mismatch in w at offset 4096 of /ckpt/a.r0.0.fpd", "/ckpt/a.r0.0.fpd", _bad())

    def fail(args):
        raise CheckpointException("load failed", {1: (ValueError("second"), None), 0: (err, None)})

    monkeypatch.setattr(cli, "_inspect", fail)
    assert cli.main(["inspect", "/nowhere"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["fp-dcp inspect: /ckpt/a.r0.0.fpd: checksum mismatch in w at offset 4096 of /ckpt/a.r0.0.fpd "
                     "(2 ranks failed)"], lines


# ------------------------------------------------------------ environment names


_NOT_OPTION_VALUES = {"FP_DCP_DEFAULT_STORAGE": "0", "FP_DCP_ALLOW_UNTESTED_TORCH": "0",
                      "FP_DCP_TUNING_FILE": "none", "FP_DCP_TEST_HOOKS": "0", "FP_DCP_RANKS_PER_NODE": "2"}


def _documented_env_names() -> set[str]:
    names: set[str] = set()
    for doc in [os.path.join(REPO, "README.md")] + [os.path.join(REPO, "docs", n)
                                                   for n in os.listdir(os.path.join(REPO, "docs"))]:
        if doc.endswith(".md"):
            names.update(re.findall(r"FP_DCP_[A-Z][A-Z_]*[A-Z]", open(doc, encoding="utf-8").read()))
    return names


def test_every_environment_name_the_docs_mention_is_accepted(monkeypatch):
    from fp_dcp.options import _NOT_OPTIONS, FastPersistOptions

    names = _documented_env_names()
    assert "FP_DCP_RANKS_PER_NODE" in names and "FP_DCP_ENGINE" in names
    fields = set(FastPersistOptions.field_names())
    for name in sorted(names):
        option = name[len("FP_DCP_"):].lower()
        assert option in fields or name in _NOT_OPTIONS, f"{name} is in the docs but names no option"
        if name in _NOT_OPTIONS:
            assert name in _NOT_OPTION_VALUES, f"{name}: add a harmless value to _NOT_OPTION_VALUES"
            monkeypatch.setenv(name, _NOT_OPTION_VALUES[name])
            FastPersistOptions.from_env()  # no error
            monkeypatch.delenv(name)


# ------------------------------------------------------------ bounded by the input's honest size


def _stock(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "s"
    dcp.save({"w": torch.arange(8.0), "step": 3}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def _append_to_metadata(path, junk: bytes) -> None:
    """Run ``junk`` (pickle opcodes that leave one object, popped) after the
    metadata object, before STOP: the file still unpickles to the metadata."""
    meta = path / ".metadata"
    data = meta.read_bytes()
    assert data.endswith(b".")
    meta.write_bytes(data[:-1] + junk + b"0.")  # 0: POP


def _memo_put(i):
    return b"r" + i.to_bytes(4, "little")  # LONG_BINPUT


def _memo_get(i):
    return b"j" + i.to_bytes(4, "little")  # LONG_BINGET


def test_a_small_stock_metadata_cannot_expand_through_path_objects(tmp_path):
    """PosixPath(p, p) of a memoized path doubles it at each level: 20 levels
    of a few bytes each are a million path parts on the old reader."""
    from fp_dcp.load.stock import SafeStockReader

    path = _stock(tmp_path)
    junk = b"cpathlib\nPosixPath\n" + _memo_put(900_000) + b"X\x03\x00\x00\x00abc\x85R" + _memo_put(900_001)
    for _ in range(20):
        junk += b"0" + _memo_get(900_000) + _memo_get(900_001) + _memo_get(900_001) + b"\x86R" + _memo_put(900_001)
    _append_to_metadata(path, junk)
    assert (path / ".metadata").stat().st_size < 4096
    with pytest.raises(fmt.CheckpointFormatError, match="refusing this stock DCP metadata.*path"):
        SafeStockReader(str(path), allow_pickle=False).read_metadata()


def test_a_small_stock_metadata_cannot_expand_through_shared_lists(tmp_path):
    """One memoized list of 20,000 ints handed to torch.Size 400 times: 8
    million elements from a 50 KB file (refused: an element budget per byte)."""
    from fp_dcp.load.stock import MetadataBudgetError, SafeStockReader

    path = _stock(tmp_path)
    junk = b"]" + b"(" + b"K\x07" * 20_000 + b"e" + _memo_put(900_000) + b"0" + b"]"
    junk += (b"ctorch\nSize\n" + _memo_get(900_000) + b"\x85R" + b"a") * 400
    _append_to_metadata(path, junk)
    with pytest.raises(MetadataBudgetError, match="expands to far more objects"):
        SafeStockReader(str(path), allow_pickle=False).read_metadata()


def test_a_stock_metadata_cannot_change_shared_objects(tmp_path):
    """BUILD on an object the unpickler hands out (the memory-format enum's
    member) would change it for the whole process."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from fp_dcp.load.stock import SafeStockReader

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    before = dict(vars(member))
    path = _stock(tmp_path)
    junk = (b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n" + b"K\x00\x85R"
            + b"}X\x06\x00\x00\x00_name_X\x05\x00\x00\x00PWNEDsb")
    _append_to_metadata(path, junk)
    with pytest.raises(fmt.CheckpointFormatError):
        SafeStockReader(str(path), allow_pickle=False).read_metadata()
    assert vars(member) == before and member.name == "TORCH_CONTIGUOUS_FORMAT"


def test_a_real_stock_checkpoint_still_loads_through_the_bounded_unpickler(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fp_dcp.load.stock import SafeStockReader

    sd = {f"layer{i}.w": torch.randn(3, 5) for i in range(300)}
    sd["step"] = 7
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")), no_dist=True)
    md = SafeStockReader(str(tmp_path / "s"), allow_pickle=False).read_metadata()
    assert len(md.state_dict_metadata) == 301
    target = {k: (torch.zeros(3, 5) if k != "step" else 0) for k in sd}
    dcp.load(target, storage_reader=SafeStockReader(str(tmp_path / "s"), allow_pickle=False), no_dist=True)
    assert target["step"] == 7 and all(torch.equal(target[k], sd[k]) for k in sd if k != "step")


def _meta_doc(path) -> dict:
    import json

    return json.loads((path / fmt.METADATA_NAME).read_bytes()[fmt.HEADER_SIZE:])


def _write_meta_doc(path, doc) -> None:
    import json
    import struct
    import zlib

    body = json.dumps(doc).encode()
    (path / fmt.METADATA_NAME).write_bytes(
        struct.pack("<8sIIQ", b"FPDCP\x00\r\n", fmt.FORMAT_VERSION, zlib.crc32(body), len(body)) + body)


def _without_chunks(tmp_path):
    """A checkpoint whose metadata claims a 1 GiB tensor 'ghost' with no chunks."""
    path = tmp_path / "c"
    _fp_dcp_ckpt(path)
    doc = _meta_doc(path)
    doc["state_dict_metadata"]["ghost"] = {"type": "tensor", "size": [1 << 28], "dtype": "float32", "chunks": []}
    _write_meta_doc(path, doc)
    return path


def test_a_tensor_claimed_with_no_chunks_is_refused_on_load(tmp_path):
    from tests._sd import failed_load

    path = _without_chunks(tmp_path)
    target = {"w": torch.zeros(200_000), "step": 0}
    err = failed_load(target, path)  # DCP's load re-raises the reader's metadata error in its own words
    assert "ghost: the metadata describes a tensor of shape [268435456] with no stored chunks" in str(err), err
    assert fmt.METADATA_NAME in str(err) and not target["w"].any()


def test_convert_refuses_a_tensor_claimed_with_no_chunks_instead_of_writing_zeros(tmp_path):
    path = _without_chunks(tmp_path)
    r = _cli("convert", "-q", str(path), str(tmp_path / "out.pt"))
    _one_line_failure(r, "ghost", "no stored chunks")
    assert not os.path.exists(tmp_path / "out.pt")


def test_chunks_that_overlap_or_fall_short_are_refused(tmp_path):
    path = tmp_path / "c"
    _fp_dcp_ckpt(path)
    good = _meta_doc(path)
    w = good["state_dict_metadata"]["w"]
    assert w["chunks"] == [[[0], [200_000]]]
    for chunks, words in (([[[0], [150_000]], [[50_000], [50_000]]], "overlap"),
                          ([[[0], [100_000]]], "100,000 of its 200,000 elements"),
                          ([[[0], [200_000]], [[0], [0]], [[10], [5]]], "of its 200,000")):
        doc = _meta_doc(path)
        doc["state_dict_metadata"]["w"]["chunks"] = chunks
        raw = doc["state_dict_metadata"]
        with pytest.raises(fmt.CheckpointFormatError, match=f"w: .*{words}"):
            fmt._from_doc(doc, fmt.FORMAT_VERSION)
        assert fmt._state_dict_md_columns(raw) is None  # the fast decoder defers to the reference
    fmt._from_doc(good, fmt.FORMAT_VERSION)  # exactly covered: accepted


def test_a_sharded_tensor_covered_exactly_is_accepted():
    chunks = [((r * 4, c * 5), (4, 5)) for r in range(3) for c in range(2)]
    fmt.check_chunks_cover("w", (12, 10), chunks)
    fmt.check_chunks_cover("empty", (0, 7), [((0, 0), (0, 7))])
    fmt.check_chunks_cover("scalar", (), [((), ())])
    with pytest.raises(fmt.CheckpointFormatError, match="w: .*overlap"):
        fmt.check_chunks_cover("w", (12, 10), chunks[:-1] + [((4, 5), (4, 5))])


def test_a_stock_checkpoint_claiming_a_tensor_without_chunks_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    from fp_dcp.load.stock import SafeStockReader

    path = _stock(tmp_path)
    md = pickle.loads((path / ".metadata").read_bytes())
    md.state_dict_metadata["ghost"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                            torch.Size([1 << 28]), [])
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(fmt.CheckpointFormatError, match="ghost: .*no stored chunks"):
        SafeStockReader(str(path), allow_pickle=False).read_metadata()
    r = _cli("convert", "-q", "--from-dcp", str(path), str(tmp_path / "o"))
    _one_line_failure(r, "ghost", "no stored chunks")
    assert not os.path.exists(tmp_path / "o")


def test_the_metadata_header_is_checked_against_the_file_size_before_the_body_is_read(tmp_path):
    path = tmp_path / "c"
    _fp_dcp_ckpt(path)
    data = (path / fmt.METADATA_NAME).read_bytes()
    head = data[:fmt.HEADER_SIZE]
    assert fmt.check_metadata_header(head, len(data), "m") == len(data) - fmt.HEADER_SIZE
    with pytest.raises(fmt.CheckpointFormatError, match="m: the metadata file is 2147483648 bytes but its header"):
        fmt.check_metadata_header(head, 1 << 31, "m")  # a sparse 2 GiB file behind a real header
    with pytest.raises(fmt.CheckpointFormatError, match="truncated"):
        fmt.check_metadata_header(head, len(data) - 1, "m")
    with pytest.raises(fmt.CheckpointFormatError, match="bad magic"):
        fmt.check_metadata_header(b"\0" * fmt.HEADER_SIZE, 1 << 31, "m")
    with pytest.raises(fmt.CheckpointFormatError, match="truncated"):
        fmt.check_metadata_header(head[:5], 1 << 31, "m")


# ------------------------------------------------------------ options a machine can meet


@pytest.mark.parametrize("env, value", [
    ("FP_DCP_QUEUE_DEPTH", "4096"),  # 16 GiB of bounce buffers at the default 4 MiB requests
    ("FP_DCP_QUEUE_DEPTH", "128"),  # 512 MiB
    ("FP_DCP_BLOCK_SIZE_BYTES", "1GiB"),
    ("FP_DCP_CUDA_CHUNK_BYTES", "64GiB"),
    ("FP_DCP_READ_THREADS", "4096"),
    ("FP_DCP_READ_BUFFER_BUDGET_BYTES", "1TiB"),
    ("FP_DCP_COALESCE_GAP_BYTES", "16GiB"),
    ("FP_DCP_PACK_THRESHOLD_BYTES", "16GiB"),
    ("FP_DCP_ALIGNMENT_BYTES", "1GiB"),
    ("FP_DCP_MAX_OVERREAD_PERCENT", "1000000"),
])
def test_an_option_past_its_upper_bound_is_a_named_error(monkeypatch, env, value):
    from fp_dcp.options import FastPersistOptions, OptionBoundError

    monkeypatch.setenv(env, value)
    with pytest.raises(OptionBoundError, match="past") as info:
        FastPersistOptions.from_env()
    name = env[len("FP_DCP_"):].lower()
    assert name in str(info.value) and isinstance(info.value, ValueError)


def test_options_within_their_bounds_are_accepted():
    from fp_dcp.options import MAX_IN_FLIGHT_BYTES, FastPersistOptions

    FastPersistOptions(queue_depth=64, block_size_bytes=4 << 20, read_threads=16, cuda_chunk_bytes=1 << 30,
                       read_buffer_budget_bytes=64 << 30, coalesce_gap_bytes=64 << 20)
    FastPersistOptions(queue_depth=1024, block_size_bytes=256 << 10)
    assert 64 * (4 << 20) == MAX_IN_FLIGHT_BYTES


def test_the_option_docs_state_each_upper_bound():
    from fp_dcp.options import _UPPER, FastPersistOptions

    entries = re.split(r"\n        (?=\w+: )", FastPersistOptions.__doc__)
    docs = {e.split(":", 1)[0]: " ".join(e.split()) for e in entries}
    for name in _UPPER:
        assert re.search(r"(?i)at most [\d,]+|from [\d,]+ (MiB )?to [\d,]+", docs[name]), \
            f"{name}'s line does not state its upper bound: {docs[name]}"


def test_a_tuning_record_past_the_bound_is_ignored(tmp_path, monkeypatch):
    """A record at the old documented maximum (512 MiB in flight) would take
    that much for the smallest save; it is ignored with a warning."""
    import warnings

    from fp_dcp import FastPersistOptions, tuning
    from fp_dcp.engine import IOSession
    from fp_dcp.options import MAX_IN_FLIGHT_BYTES

    monkeypatch.setenv("FP_DCP_TUNING_FILE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "_warned", set())
    d = tmp_path / "data"
    d.mkdir()
    big = tuning.Shape(8 << 20, 64)
    tuning.store(str(d), big, tuning.Shape(1 << 20, 4), {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = IOSession(FastPersistOptions(), str(d))
    try:
        assert s.tuned is None and s.engine.queue_depth * s.engine.block_size <= MAX_IN_FLIGHT_BYTES
        assert any(issubclass(w.category, tuning.TuningWarning) for w in caught)
    finally:
        s.close()


# ------------------------------------------------------------ plain data DCP passes through: io.BytesIO


class _TrainState:
    """PyTorch's end-to-end DCP test's train state (test_e2e_save_and_load.py,
    TestTrainState): a Stateful whose losses travel as an io.BytesIO."""

    def __init__(self, step=0, current_loss=-1.0, losses=None):
        self.step, self.current_loss, self.losses = step, current_loss, list(losses or [])

    def state_dict(self):
        loss_bytes = io.BytesIO()
        torch.save(self.losses, loss_bytes)
        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "current_loss": torch.tensor(self.current_loss, dtype=torch.float32),
                "losses": loss_bytes}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"].item()
        self.current_loss = state_dict["current_loss"].item()
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])

    def __eq__(self, other):
        return (self.step, self.current_loss, self.losses) == (other.step, other.current_loss, other.losses)


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    state = _TrainState()
    for _ in range(2):
        model(torch.rand(8, 8)).sum().backward()
        state.step += 1
        state.current_loss = float(torch.rand(1).item())
        state.losses.append(state.current_loss)
        optim.step()
        optim.zero_grad()
    return model, optim, state


def _e2e_train_state(tmp_path, writer, reader_of):
    """Save model, optimizer and train state; load them into fresh ones with
    no option; the train state (its losses an io.BytesIO) comes back equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim, state = _trained()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optimizer": osd, "train_state": state}, storage_writer=writer, no_dist=True)
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.2)
    model2(torch.rand(8, 8)).sum().backward()
    optim2.step()  # optimizer state to load into
    msd2, osd2 = get_state_dict(model2, optim2)
    loaded = _TrainState()
    dcp.load({"model": msd2, "optimizer": osd2, "train_state": loaded}, storage_reader=reader_of(), no_dist=True)
    set_state_dict(model2, optim2, model_state_dict=msd2, optim_state_dict=osd2)
    assert loaded == state and len(loaded.losses) == 2
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert optim2.param_groups[0]["lr"] == 0.1
    assert not any("BytesIO" in repr(g) for g in torch.serialization.get_safe_globals())  # nothing left behind


def test_pytorch_e2e_train_state_with_bytesio_loads_through_fp_dcp_with_no_option(tmp_path, monkeypatch):
    from fp_dcp import FastPersistReader, FastPersistWriter

    monkeypatch.delenv("FP_DCP_ALLOW_PICKLE", raising=False)
    path = str(tmp_path / "c")
    _e2e_train_state(tmp_path, FastPersistWriter(path), lambda: FastPersistReader(path))


def test_pytorch_e2e_train_state_with_bytesio_loads_from_a_stock_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from fp_dcp.load.stock import SafeStockReader

    monkeypatch.delenv("FP_DCP_ALLOW_PICKLE", raising=False)
    path = str(tmp_path / "s")
    _e2e_train_state(tmp_path, dcp.FileSystemWriter(path), lambda: SafeStockReader(path))


def _payload(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def test_a_bytesio_is_rebuilt_from_its_bytes_and_position_only(tmp_path):
    from fp_dcp.load.objects import UnsafeObjectError, load_object

    stream = io.BytesIO(b"opaque \x00 blob")
    stream.seek(4)
    got = load_object(_payload({"blob": stream, "more": [io.BytesIO(b"x")]}), "k", "ckpt", allow_pickle=False)
    assert type(got["blob"]) is io.BytesIO and got["blob"].getvalue() == b"opaque \x00 blob"
    assert got["blob"].tell() == 4 and type(got["more"][0]) is io.BytesIO
    marked = io.BytesIO(b"x")
    marked.hook = "anything"  # an attribute: not plain data
    with pytest.raises(UnsafeObjectError, match="'k': a stored io.BytesIO has a state other than"):
        load_object(_payload(marked), "k", "ckpt", allow_pickle=False)
    assert load_object(_payload(marked), "k", "ckpt", allow_pickle=True).hook == "anything"


def test_a_crafted_bytesio_cannot_run_code(tmp_path):
    """'_io.BytesIO' called on something that is not bytes (here an object
    whose rebuilding would run a command) is refused; nothing runs."""
    import zipfile

    from fp_dcp.load.objects import load_object

    marker = tmp_path / "PWNED"
    good = _payload(io.BytesIO(b"abc"))
    with zipfile.ZipFile(io.BytesIO(good)) as z:
        names = z.namelist()
        files = {n: z.read(n) for n in names}
    (pkl,) = [n for n in names if n.endswith("data.pkl")]
    files[pkl] = (b"\x80\x02c_io\nBytesIO\nq\x00cposix\nsystem\nq\x01X" + len(f"touch {marker}").to_bytes(4, "little")
                  + f"touch {marker}".encode() + b"\x85R\x85R.")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, files[n])
    with pytest.raises(fmt.CheckpointFormatError):
        load_object(out.getvalue(), "k", "ckpt", allow_pickle=False)
    assert not marker.exists()


# ------------------------------------------------------------ no pickle between the ranks of a shared read


def test_no_pickled_collective_in_the_load_path():
    """fp_dcp's own collectives of a load send plain data: no *_object
    collective (pickle) is called under fp_dcp/load/."""
    import ast

    pickled = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
               "send_object_list", "recv_object_list"}
    root = os.path.join(REPO, "fp_dcp", "load")
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                tree = ast.parse(open(path, encoding="utf-8").read())
                calls = [n.func.attr for n in ast.walk(tree)
                         if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in pickled]
                assert not calls, f"{os.path.relpath(path, REPO)} calls {calls}: send plain data instead"


def test_peer_messages_round_trip_and_malformed_ones_are_named():
    import struct

    from fp_dcp.load.sharing.messages import (MESSAGE_ROW_BYTES, MESSAGE_TEXT_BYTES, PeerMessageError,
                                              decode_text, encode_text)

    for text in (None, "", "ChecksumError: w: bytes 0..1048576 of /ckpt/a.r0.0.fpd", "ünïcødé ✓"):
        row = encode_text(text)
        assert len(row) == MESSAGE_ROW_BYTES and decode_text(row, 1) == text
    long = "é" * MESSAGE_TEXT_BYTES  # 2 bytes each: cut at a character boundary
    assert decode_text(encode_text(long), 1) == "é" * (MESSAGE_TEXT_BYTES // 2)
    bad = [
        (struct.pack("<BI", 1, 1 << 30) + bytes(MESSAGE_TEXT_BYTES), "malformed message"),
        (struct.pack("<BI", 7, 3) + b"abc" + bytes(MESSAGE_TEXT_BYTES - 3), "malformed message"),
        (struct.pack("<BI", 1, 2) + b"\xff\xfe" + bytes(MESSAGE_TEXT_BYTES - 2), "not UTF-8"),
        (pickle.dumps(ValueError("x")), "bytes, not"),
    ]
    for row, words in bad:
        with pytest.raises(PeerMessageError, match=f"rank 3 .*{words}"):
            decode_text(row, 3)


def _lying_peer(rank, ws, marker):
    """Rank 1 sends a pickle (that would create ``marker``) where a text row
    belongs; rank 0 gets a named error, and nothing runs."""
    import torch.distributed as dist

    from fp_dcp.load.sharing.messages import MESSAGE_ROW_BYTES, PeerMessageError, gather_texts

    if rank == 1:
        evil = b"cposix\nsystem\n(X" + len(f"touch {marker}").to_bytes(4, "little") + f"touch {marker}".encode()
        evil += b"tR."
        row = torch.zeros(MESSAGE_ROW_BYTES, dtype=torch.uint8)
        row[:len(evil)] = torch.frombuffer(bytearray(evil), dtype=torch.uint8)
        dist.all_gather([torch.empty_like(row) for _ in range(ws)], row)
        return True
    try:
        gather_texts("a real error", None, ws, "cpu")
    except PeerMessageError as e:
        assert "rank 1" in str(e), e
        return not os.path.exists(marker)
    raise AssertionError("a malformed message from a peer was accepted")


@pytest.mark.slow  # multi-process
def test_a_lying_peer_is_a_named_error_not_code(tmp_path):
    marker = str(tmp_path / "PWNED")
    assert run_ranks(2, _lying_peer, marker) == [True, True]
    assert not os.path.exists(marker)
