"""Inputs cost what they honestly are, and plain data loads.

Attacks and careless inputs in the style of ``tests/test_security.py``: stock
metadata that would expand far past its size, metadata that claims tensors
it does not store, a metadata header that lies about the file's length,
options that would take more memory than a machine has, and ``io.BytesIO``
train state (PyTorch's own end-to-end DCP test) that must load with no
option, rebuilt without running anything the checkpoint chooses.
"""

from __future__ import annotations

import io
import os
import pickle
import pathlib
import re

import pytest
import torch

from fp_dcp import format as fmt
from tests.test_trust import _cli, _fp_dcp_ckpt, _one_line_failure

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


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_a_stock_checkpoint_id_path_of_any_python_is_read_as_text(tmp_path, module):
    """The stock writer pickles its checkpoint id as a path object, which
    Python 3.13 pickles as pathlib._local.PosixPath (3.12 and before:
    pathlib.PosixPath): a checkpoint saved on either loads on any Python."""
    from fp_dcp.load.stock import SafeStockReader

    path = _stock(tmp_path)
    for cls in ("PosixPath", "PurePosixPath"):
        _append_to_metadata(path, f"c{module}\n{cls}\n".encode() + b"X\x03\x00\x00\x00abc\x85R")
    md = SafeStockReader(str(path), allow_pickle=False).read_metadata()
    assert set(md.state_dict_metadata) == {"w", "step"}


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
    from tests._sd import metadata_doc_v2

    return metadata_doc_v2(path)  # the per-item sections these tests edit


def _write_meta_doc(path, doc) -> None:
    from tests._sd import write_metadata_doc

    write_metadata_doc(path, doc)


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
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

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
            fmt._from_doc(doc, 2)
        assert fmt._state_dict_md_columns(raw) is None  # the fast decoder defers to the reference
        # the same chunks in version 3's columns: the same error
        metadata, layout, extra = fmt._from_doc(good, 2)
        metadata.state_dict_metadata["w"].chunks = [
            ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks]
        with pytest.raises(fmt.CheckpointFormatError, match=f"w: .*{words}"):
            fmt.decode_metadata(fmt.encode_metadata(metadata, layout, extra, version=3), "m")
    fmt._from_doc(good, 2)  # exactly covered: accepted


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
    with pytest.raises(fmt.CheckpointFormatError, match=r"m: metadata is truncated or has trailing bytes \(file 2147483648 bytes"):
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
    from fp_dcp.options import _UPPER

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "OPTIONS.md").read_text()
    docs = dict(re.findall(r"^- \*\*`(\w+)`\*\*: (.*)$", text, re.M))
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


def test_a_stock_metadata_object_never_filled_in_is_a_named_error(tmp_path):
    """Metadata created (NEWOBJ) but never given its fields (no BUILD)."""
    from fp_dcp.load.stock import SafeStockReader

    path = _stock(tmp_path)
    (path / ".metadata").write_bytes(b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81.")
    with pytest.raises(fmt.CheckpointFormatError, match="not a stock DCP checkpoint's metadata"):
        SafeStockReader(str(path), allow_pickle=False).read_metadata()
