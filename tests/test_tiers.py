"""Multi-tier checkpointing (fp_dcp.tiers): node-local saves replicated to
another node and drained to a persistent root; restores from the fastest
complete tier on 4, 2 and 3 ranks after a node is lost; corrupt replicas
skipped by checksum; drains killed at each point of their protocol;
retention per tier.  4 gloo ranks on this machine act as 2 nodes
(``ranks_per_node=2``, ``local_root=".../node{node}"``)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np

import pytest

from tests._dist import run_ranks
from tests._sd import flip_byte

# ------------------------------------------------------------ pure parts


def test_topology_places_replicas_on_other_nodes():
    from fp_dcp.tiers.topology import Topology

    t = Topology.by_ranks_per_node(4, 2)
    assert t.nodes == ((0, 1), (2, 3))
    assert t.replication_pairs(1) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    t3 = Topology.by_ranks_per_node(3, 2)  # a restart on 3 ranks: nodes of unequal size
    assert t3.nodes == ((0, 1), (2,)) and t3.replication_pairs(1) == [(0, 2), (1, 2), (2, 0)]
    t6 = Topology.by_ranks_per_node(6, 2)
    for node in range(3):
        assert node not in t6.holders(node, 2) and len(set(t6.holders(node, 2))) == 2
    for src, dst in t6.replication_pairs(2):
        assert t6.node_of(src) != t6.node_of(dst)
    assert Topology.by_host(["a", "b", "a", "b"]).nodes == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match="at least 2 nodes"):
        Topology.by_ranks_per_node(2, 2).holders(0, 1)
    with pytest.raises(ValueError):
        Topology(((0,), (0, 1)))


def _one_rank_checkpoint(path, seed=0):
    """A 1-rank fp_dcp checkpoint in ``path`` (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    g = torch.Generator().manual_seed(seed)
    sd = {"a": torch.randn(300_000, generator=g), "b": torch.randn(7, 5, generator=g), "n": 3}
    dcp.save(sd, storage_writer=FastPersistWriter(path), no_dist=True)
    return sd


def _read_ranges(path, ranges):
    """The bytes of ``ranges`` of ``path``, concatenated, as a restore's
    holder reads them (``FileIO.read_ranges``), copied out of its buffer."""
    from fp_dcp import FastPersistOptions
    from fp_dcp.tiers.replicate import FileIO

    io = FileIO(FastPersistOptions(), os.path.dirname(path))
    try:
        return io.read_ranges(path, ranges).copy()
    finally:
        io.close()


def test_checked_copy_refuses_corruption(tmp_path):
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import integrity

    src = str(tmp_path / "src")
    _one_rank_checkpoint(src)
    _, layout, _ = read_checkpoint_metadata(src)
    name = layout.files[0][0]
    dst = str(tmp_path / "dst")
    os.makedirs(dst)
    integrity.copy_checked(os.path.join(src, name), os.path.join(dst, name), layout, 0)
    with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "rb") as g:
        assert f.read() == g.read()
    integrity.check_buffer(_read_ranges(os.path.join(dst, name), [(0, layout.files[0][1])]), layout, 0, "x")
    flip_byte(os.path.join(src, name), 123_457)  # one flipped byte inside tensor "a"
    os.unlink(os.path.join(dst, name))
    with pytest.raises(integrity.IntegrityError, match="checksum mismatch in a"):
        integrity.copy_checked(os.path.join(src, name), os.path.join(dst, name), layout, 0)
    assert os.listdir(dst) == []  # nothing half-copied left behind
    with pytest.raises(integrity.IntegrityError, match="checksum mismatch"):
        integrity.check_buffer(_read_ranges(os.path.join(src, name), [(0, layout.files[0][1])]), layout, 0, "x")
    with pytest.raises(integrity.IntegrityError, match="short"):
        integrity.check_buffer(np.zeros(10, np.uint8), layout, 0, "x")


def test_ranges_of_a_file_are_checked_copied_and_sent_alone(tmp_path):
    """A restore moves only the extents a node reads: ranges of a file are
    read concatenated, checked alone, written at their offsets (holes
    elsewhere), and a range that cuts an extent (some bytes of it would pass
    unchecked) is refused."""
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import integrity, store

    src = str(tmp_path / "src")
    _one_rank_checkpoint(src)
    _, layout, _ = read_checkpoint_metadata(src)
    name, size = layout.files[0]
    path = os.path.join(src, name)
    ext = {i.fqn: es[0] for i, es in layout.extents.items()}
    b = integrity.extent_ranges([(ext["b"].file_offset, ext["b"].length)])
    data = _read_ranges(path, b)
    assert data.size == ext["b"].length == 7 * 5 * 4
    integrity.check_buffer(data, layout, 0, "x", ranges=b)
    out = str(tmp_path / "out.fpd")
    ranged = store.RangesFile(out, size)
    ranged.write(b, data)
    ranged.close()
    with open(path, "rb") as f, open(out, "rb") as g:
        whole, part = f.read(), g.read()
    assert len(part) == size and part[b[0][0]: b[0][0] + b[0][1]] == whole[b[0][0]: b[0][0] + b[0][1]]
    assert part.count(0) >= size - b[0][1]  # the rest a hole
    with pytest.raises(FileExistsError):  # never over a name taken (a link to a local copy would be written through)
        store.RangesFile(out, size)
    copied = str(tmp_path / "copied.fpd")
    assert integrity.copy_checked(path, copied, layout, 0, ranges=b) == b[0][1]
    with open(copied, "rb") as g:
        assert g.read() == part
    a = (ext["a"].file_offset, ext["a"].length)
    # a transfer's parts: cut at piece boundaries, each checked alone, together the ranges
    whole = integrity.extent_ranges([(e.file_offset, e.length) for e in ext.values()])
    for limit in (1, 4096, 1 << 20, 1 << 30):
        parts = integrity.split_ranges(layout, 0, whole, limit)
        assert integrity.extent_ranges([r for p in parts for r in p]) == whole
        assert all(integrity.ranges_bytes(p) <= limit or len(p) == 1 for p in parts)
        for p in parts:
            integrity.check_buffer(_read_ranges(path, p), layout, 0, "x", ranges=p)
    assert len(integrity.split_ranges(layout, 0, whole, 1 << 30)) == 1
    assert integrity.split_ranges(layout, 0, [a], 1 << 20) == [[a]]  # one piece (1.2 MB) is never cut
    with pytest.raises(ValueError, match="cuts an extent"):
        integrity.check_file(path, layout, 0, [(a[0], a[1] // 2)])
    flip_byte(path, a[0] + 5, mask=1)  # damage in "a" does not touch a check of "b" alone
    integrity.check_file(path, layout, 0, b)
    with pytest.raises(integrity.IntegrityError, match="checksum mismatch in a"):
        integrity.check_file(path, layout, 0, integrity.extent_ranges([a, (b[0])]))
    bad = _read_ranges(path, [a])
    with pytest.raises(integrity.IntegrityError, match="checksum mismatch in a"):
        integrity.check_buffer(bad, layout, 0, "x", ranges=[a])
    assert integrity.extent_ranges([(10, 5), (0, 10), (30, 1), (12, 2)]) == [(0, 15), (30, 1)]


def test_subset_metadata_loads_what_it_names(tmp_path):
    """The metadata a restore writes for a node names only the files
    assembled there and the items they hold whole; it is a valid fp_dcp
    metadata (the reader's confinement rules unchanged)."""
    import dataclasses

    from fp_dcp import format as fmt
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers.restore import subset_layout

    src = str(tmp_path / "src")
    _one_rank_checkpoint(src)
    md, layout, extra = read_checkpoint_metadata(src)
    # pretend a second file holds "b": a layout of two files, keep only the first
    two = dataclasses.replace(layout, files=layout.files + [(fmt.data_file_name(layout.save_id, 1, 0), 4096)])
    moved = {i: [dataclasses.replace(e, file=1, file_offset=0)] for i, es in layout.extents.items()
             if i.fqn == "b" for e in es}
    two.extents = {**layout.extents, **moved}
    sub = subset_layout(two, {layout.files[0][0]})
    assert sub.files == layout.files and {i.fqn for i in sub.extents} == {"a", "n"}
    md.storage_data = sub
    fmt.decode_metadata(fmt.encode_metadata(md, sub, extra), "x")
    # ranges of files held: only the items whose extents lie inside them
    a = next(es[0] for i, es in layout.extents.items() if i.fqn == "a")
    part = subset_layout(two, {layout.files[0][0]: [(a.file_offset, a.length)], two.files[1][0]: [(0, 4096)]})
    assert part.files == two.files and {i.fqn for i in part.extents} == {"a", "b"}
    assert {i.fqn for i in subset_layout(two, {layout.files[0][0]: [(a.file_offset, a.length - 1)]}).extents} == set()


@pytest.mark.parametrize("name", ["../../victim.fpd", "/etc/passwd", "", "{sid}.r0.0.fpd/../x",
                                  "/data/{subdir}/{sid}.r0.d0.0.fpd", "other0000000000.r0.0.fpd"])
def test_a_crafted_metadata_names_nothing_outside_a_step(tmp_path, name):
    """Every metadata the tiers read (a local or persistent step, one a peer
    sends) goes through store.decode: a data file that is not a plain name
    of this save is refused, naming it, so no drain, replica, restore or
    retention ever copies, links, writes or deletes a path it names; a scan
    counts such a step as having no metadata."""
    from fp_dcp import format as fmt
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import store

    src = str(tmp_path / "src")
    _one_rank_checkpoint(src)
    md, layout, extra = read_checkpoint_metadata(src)
    store.decode(fmt.encode_metadata(md, layout, extra), "genuine")  # the writer's names pass
    root = tmp_path / "local"
    step = pathlib.Path(store.step_dir(str(root), 7))
    # a data-directory name the format accepts for this very step directory
    bad = name.format(sid=layout.save_id, subdir=fmt.data_subdir_name(str(step)))
    layout.files = [(bad, layout.files[0][1])]
    md.storage_data = layout
    blob = fmt.encode_metadata(md, layout, extra)
    with pytest.raises(fmt.CheckpointFormatError, match="^crafted: .*(bad data file name|not a plain file name)"):
        store.decode(blob, "crafted")
    root.mkdir()
    store.claim_step(str(root), 7)
    (step / fmt.METADATA_NAME).write_bytes(blob)
    assert store.scan(str(root))[7].save_id is None  # counted as absent: never restored or drained


def test_retention_keeps_newest_committed_and_pinned(tmp_path):
    from fp_dcp import format as fmt
    from fp_dcp.tiers import store

    root = str(tmp_path)
    for s in (1, 2, 3, 4, 5):
        d = store.claim_step(root, s)  # the tiers' own (marked)
        if s != 5:  # step 5: a save in progress
            open(os.path.join(d, fmt.METADATA_NAME), "wb").close()
    store.claim_step(root, 0)  # an old save that never committed
    removed = store.retain(root, 2, pinned={2})
    assert sorted(s for s, _ in store.steps(root)) == [2, 3, 4, 5]
    assert len(removed) == 2


def test_retention_does_not_count_steps_after_the_newest_replicated(tmp_path):
    """The replicator retains after step 3 while the saver has committed
    step 4 locally, not yet replicated: with ``keep=1`` step 3 must stay
    (the newest complete step everywhere), step 4 is neither counted nor
    removed."""
    from fp_dcp import format as fmt
    from fp_dcp.tiers import store

    root = str(tmp_path)
    for s in (1, 2, 3, 4):
        d = store.claim_step(root, s)
        open(os.path.join(d, fmt.METADATA_NAME), "wb").close()
    assert len(store.retain(root, 1, newest=3)) == 2
    assert sorted(s for s, _ in store.steps(root)) == [3, 4]
    assert store.retain(root, 1, newest=4) and sorted(s for s, _ in store.steps(root)) == [4]


# ------------------------------------------------------- multi-rank runs

STEPS = 6
PERSIST_EVERY = 3


def _build(seed, mesh):
    import torch

    from tests.test_frameworks import _Net

    model = _Net.fsdp2(seed, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _probe_loss(model):
    import torch

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        return float(model(x).pow(2).mean())


def _manager(root, **kw):
    from fp_dcp import TierManager

    return TierManager(os.path.join(root, "node{node}"), os.path.join(root, "persist"),
                       replicas=1, persist_every=PERSIST_EVERY, ranks_per_node=2, **kw)


def _train_and_save(rank, world_size, root):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_frameworks import _full_sd

    mesh = init_device_mesh("cpu", (world_size,))
    model, opt = _build(0, mesh)
    mgr = _manager(root, keep_local=2, keep_persistent=2)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        model(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
        mgr.wait_staged()
        opt.step()
        opt.zero_grad()
        mgr.save(step, _state(model, opt))
        if step >= STEPS - 1:  # the steps the local tiers keep: what each restores to
            want = _full_sd(_state(model, opt))
            loss = _probe_loss(model)
            if rank == 0:
                torch.save({"state": want, "loss": loss}, os.path.join(root, f"want{step}.pt"))
    mgr.wait()
    drains = {s: h["drain"].ok for s, h in mgr.history.items() if "drain" in h}
    errors = list(mgr.errors)
    mgr.close()
    return drains, errors


def _restore_and_check(rank, world_size, root, hook=None, chunk=None):
    """Restore into a model of other weights; the state and the probe loss
    must be those of the step restored, bit-exact.  ``hook``: ``(rank,
    point, exception[, n])``: ``fp_dcp.tiers.restore.fault_hook`` raises it
    on that rank (``None``: every rank) at that point (only its ``n``-th
    time there).  ``chunk``: the bytes of a replica transfer's part."""
    import torch
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_frameworks import _assert_same, _full_sd

    mesh = init_device_mesh("cpu", (world_size,))
    model, opt = _build(7, mesh)  # other weights, and no optimizer state yet: one step makes it
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    mgr = _manager(root)
    sd = _state(model, opt)
    from fp_dcp.tiers import restore as tiers_restore

    if chunk is not None:
        tiers_restore.CHUNK_BYTES = chunk
    if hook is not None and hook[0] in (None, rank):
        seen = [0]

        def fail(point):
            if point == hook[1]:
                seen[0] += 1
                if seen[0] == (hook[3] if len(hook) > 3 else seen[0]):
                    raise hook[2]

        tiers_restore.fault_hook = fail
    step = mgr.restore(sd)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    want = torch.load(os.path.join(root, f"want{step}.pt"), weights_only=False)
    _assert_same(want["state"], _full_sd(_state(model, opt)))
    loss = _probe_loss(model)
    assert loss == want["loss"], (loss, want["loss"])  # the loss curve continues where it was
    res = mgr.last_restore
    # and training goes on: the next save works on the new world
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    mgr.save(step + 1, _state(model, opt))
    mgr.close()
    return step, res.node_bytes_from, res.skipped, res.sources, sorted(res.phases)


def _lose_node(root, node):
    shutil.rmtree(os.path.join(root, f"node{node}"))


def _saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tiers"))
    drains, errors = run_ranks(4, _train_and_save, root, timeout=300)[0]
    assert errors == []
    assert drains == {3: True, 6: True}
    return root


@pytest.mark.slow
def test_lost_node_restores_from_replicas_on_4_2_3_ranks(tmp_path_factory):
    from fp_dcp.tools.verify import verify_checkpoint
    from fp_dcp.tiers import store

    root = _saved(tmp_path_factory)
    # retention: 2 steps per node, 2 in the persistent tier, every one verified whole
    for node in (0, 1):
        assert sorted(s for s, _ in store.steps(os.path.join(root, f"node{node}"))) == [STEPS - 1, STEPS]
    persisted = sorted(store.steps(os.path.join(root, "persist")))
    assert [s for s, _ in persisted] == [3, 6]
    assert all(verify_checkpoint(p).ok for _, p in persisted)
    # each node holds its own files and the other node's: the step loads from either alone
    for node in (0, 1):
        assert verify_checkpoint(store.step_dir(os.path.join(root, f"node{node}"), STEPS)).ok
    _lose_node(root, 1)
    snapshot = str(tmp_path_factory.mktemp("snapshot"))
    shutil.copytree(root, snapshot, dirs_exist_ok=True)
    for world in (4, 2, 3):
        r = os.path.join(str(tmp_path_factory.mktemp(f"w{world}")), "run")
        shutil.copytree(snapshot, r)
        results = run_ranks(world, _restore_and_check, r, timeout=300)
        step, by_tier, skipped, _, _ = results[0]
        assert step == STEPS and skipped == []
        assert by_tier["persistent"] == 0, by_tier  # 0 bytes from the persistent tier: a replica exists
        assert by_tier["local"] > 0
        if world != 2:  # 4 and 3 ranks: a replacement node with an empty disk fetched its part
            assert by_tier["replica"] > 0, by_tier
        # the transfers overlapped the load: only the ranks of the node that received waited in it
        waited = [r for r, res in enumerate(results) if "wait" in res[4]]
        assert waited == ([2, 3] if world == 4 else [2] if world == 3 else []), (world, results)
        assert all(("replicas" in res[4]) == (world != 2) for res in results), results




def _extent_of(layout, file_part, fqn):
    """(file name, file offset) of the first extent of ``fqn``'s chunk at
    the origin (rank 0's shard) whose file name contains ``file_part``."""
    for idx, exts in layout.extents.items():
        if idx.fqn == fqn and not any(idx.offset or ()):
            for e in exts:
                name = layout.files[e.file][0]
                if file_part in name:
                    return name, e.file_offset
    raise AssertionError(f"no extent of {fqn} in a file {file_part}")


def _persistent_only_for(sources, by_tier, names):
    """Every byte from the persistent tier came for ``names``, and the
    job's count is those copies' bytes."""
    pers = [src for src in sources if src[2] == "persistent"]
    assert pers and {src[1] for src in pers} <= set(names), sources
    assert by_tier["persistent"] == sum(src[3] for src in pers), (by_tier, sources)
    assert sum(src[3] for src in sources) == sum(by_tier.values()), (by_tier, sources)


@pytest.mark.slow
def test_corrupt_replica_falls_back_to_persistent(tmp_path_factory):
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import store

    root = _saved(tmp_path_factory)
    _lose_node(root, 1)
    d = store.step_dir(os.path.join(root, "node0"), STEPS)
    _, layout, _ = read_checkpoint_metadata(d)
    victim = next(n for n, _ in layout.files if ".r2." in n)  # node 1's file, node 0's replica of it
    flip_byte(os.path.join(d, victim), 100, mask=1)
    step, by_tier, skipped, sources, _ = run_ranks(4, _restore_and_check, root, timeout=300)[0]
    assert step == STEPS
    # node 1 (its disk empty) needs the file's first extent (rank 2's shard): the replica fails on arrival
    assert len(skipped) == 1, skipped
    assert skipped[0].startswith(f"{victim} from node 0's local tier, for rank 2") \
        and "checksum mismatch" in skipped[0], skipped
    _persistent_only_for(sources, by_tier, [victim])  # that file only, from the next tier
    assert [src[:3] for src in sources if src[2] == "persistent"] == [(1, victim, "persistent")]
    assert by_tier["persistent"] <= dict(layout.files)[victim]  # only what node 1 reads of it


def _node1_lost_and_node0_copy_damaged(tmp_path_factory):
    """The saved run with node 1 lost and one byte of node 0's local copy of
    rank 0's file damaged inside an extent rank 0 reads whole: (root, the
    file, the extent's offset)."""
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import store

    root = _saved(tmp_path_factory)
    _lose_node(root, 1)
    d = store.step_dir(os.path.join(root, "node0"), STEPS)
    _, layout, _ = read_checkpoint_metadata(d)
    victim, offset = _extent_of(layout, ".r0.", "model.0.weight")
    flip_byte(os.path.join(d, victim), offset + 10, mask=1)
    return root, victim, offset


@pytest.mark.slow
def test_bad_local_copy_found_by_the_load_is_refetched(tmp_path_factory):
    """A local copy is not checked twice: the load's own verification finds
    the damage (an extent rank 0 reads whole), the restore names the copy,
    fetches it from the next tier and loads again, bit-exact."""
    root, victim, offset = _node1_lost_and_node0_copy_damaged(tmp_path_factory)
    step, by_tier, skipped, sources, _ = run_ranks(4, _restore_and_check, root, timeout=300)[0]
    assert step == STEPS
    assert len(skipped) == 1 and skipped[0].startswith(f"{victim} from node 0's local tier, for rank 0"), skipped
    assert "checksum mismatch" in skipped[0] and "found after the load failed" in skipped[0], skipped
    _persistent_only_for(sources, by_tier, [victim])


@pytest.mark.slow
def test_a_step_bad_in_every_tier_falls_back_to_an_older_one(tmp_path_factory):
    """Step 6's copy of a file is bad on node 0 and in the persistent tier
    (node 1 is lost): every rank passes over step 6 and restores step 5,
    bit-exact, saying why; with no older step left, the restore raises an
    error naming the file and each tier tried."""
    from fp_dcp.tiers import store

    root, victim, offset = _node1_lost_and_node0_copy_damaged(tmp_path_factory)
    flip_byte(os.path.join(store.step_dir(os.path.join(root, "persist"), STEPS), victim), offset + 10, mask=1)
    bare = str(tmp_path_factory.mktemp("bare")) + "/run"
    shutil.copytree(root, bare)
    step, by_tier, skipped, _, _ = run_ranks(4, _restore_and_check, root, timeout=300)[0]
    assert step == STEPS - 1  # the newest step complete in some tier
    passed = [w for w in skipped if w.startswith("passed over")]
    assert len(passed) == 1 and passed[0].startswith(f"passed over step {STEPS}: no tier holds a good copy of "
                                                     f"{victim} (tried: node 0's local tier: "), skipped
    assert "the persistent tier: " in passed[0] and passed[0].count("checksum mismatch") == 2, passed
    # no older step anywhere: the error names the file and the tiers tried, on every rank
    shutil.rmtree(store.step_dir(os.path.join(bare, "node0"), STEPS - 1))
    shutil.rmtree(store.step_dir(os.path.join(bare, "persist"), 3))
    for message in run_ranks(4, _restore_expecting_error, bare, timeout=300):
        assert message.startswith(f"no step is loadable from the tiers: step {STEPS}: no tier holds a good copy "
                                  f"of {victim} (tried: node 0's local tier: "), message
        assert "the persistent tier: " in message and message.count("checksum mismatch") == 2, message


def _restore_expecting_error(rank, world_size, root, hook=None):
    """A restore that must raise TierRestoreError on every rank (none left
    waiting: every rank returns); returns its message."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fp_dcp.tiers import restore as tiers_restore

    model, opt = _build(7, init_device_mesh("cpu", (world_size,)))
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    mgr = _manager(root)
    if hook is not None and hook[0] in (None, rank):
        def fail(point):
            if point == hook[1]:
                raise hook[2]

        tiers_restore.fault_hook = fail
    try:
        mgr.restore(_state(model, opt))
    except tiers_restore.TierRestoreError as e:
        return str(e)
    finally:
        mgr.close()
    raise AssertionError("the restore did not fail")


@pytest.mark.slow
def test_a_rank_whose_read_fails_does_not_stall_the_others(tmp_path_factory):
    """Node 0 cannot read the replica it sends to node 1: the receiver
    hears it at once and takes the file from the persistent tier, naming
    the file and the rank.  Rank 0's read of its own local copy raises an
    error that is no damage: every rank raises, at once, an error naming
    rank 0 and the file (each rank returns: none waits for the group's
    timeout, which is 30 minutes, far beyond the test's)."""
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import store

    root = _saved(tmp_path_factory)
    _lose_node(root, 1)
    bare, parts = (str(tmp_path_factory.mktemp(n)) + "/run" for n in ("bare", "parts"))
    shutil.copytree(root, bare)
    shutil.copytree(root, parts)
    _, layout, _ = read_checkpoint_metadata(store.step_dir(os.path.join(root, "node0"), STEPS))
    sent = next(n for n, _ in layout.files if ".r2." in n)  # node 1's file: rank 0 sends it to rank 2
    hook = (None, f"send {sent}", OSError(5, "injected read error"))
    step, by_tier, skipped, sources, _ = run_ranks(4, _restore_and_check, root, hook, timeout=300)[0]
    assert step == STEPS
    assert len(skipped) == 1 and re.fullmatch(
        re.escape(f"{sent} from node 0's local tier, for rank 2: rank ") + "[01]" + re.escape(" could not read it"),
        skipped[0]), skipped
    _persistent_only_for(sources, by_tier, [sent])
    # the same, the file sent in parts of 4 KiB and the second part unreadable: the parts before it are
    # never named, the file comes whole from the next tier
    hook = (None, f"send {sent}", OSError(5, "injected read error"), 2)
    step, by_tier, skipped, sources, _ = run_ranks(4, _restore_and_check, parts, hook, 4096, timeout=300)[0]
    assert step == STEPS and len(skipped) == 1 and skipped[0].endswith("could not read it"), skipped
    _persistent_only_for(sources, by_tier, [sent])
    own = next(n for n, _ in layout.files if ".r0." in n)  # rank 0 links its own file
    hook = (0, f"local {own}", RuntimeError("injected failure"))
    for message in run_ranks(4, _restore_expecting_error, bare, hook, timeout=300):
        assert message.startswith(f"restore: assembling step {STEPS} failed on rank 0: TierRestoreError: {own} "
                                  f"from node 0's local tier: RuntimeError: injected failure"), message


# ---------------------------------------------------- drains under fire



@pytest.mark.parametrize("kill_at", [
    pytest.param("copied", marks=pytest.mark.slow), "before-commit",
    pytest.param("committed", marks=pytest.mark.slow), pytest.param("never", marks=pytest.mark.slow),
])
def test_drain_killed_leaves_previous_or_new_step(tmp_path, kill_at):
    from fp_dcp.tiers import store
    from fp_dcp.tools.rotation import committed_checkpoints
    from fp_dcp.tools.verify import verify_checkpoint
    from tests._tiers_child import check_loads

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "tests._tiers_child", str(tmp_path), kill_at], cwd=repo,
                       env={**os.environ, "PYTHONPATH": repo}, capture_output=True, text=True, timeout=120)
    if kill_at == "never":
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout.strip().splitlines()[-1]) == {"2": True, "4": True}
    else:
        assert p.returncode == 9, p.stderr
    persist = str(tmp_path / "persist")
    committed = committed_checkpoints(persist)
    newest = max(s for s, p in store.steps(persist) if p in committed)
    assert newest == (4 if kill_at in ("committed", "never") else 2)
    path = store.step_dir(persist, newest)
    assert verify_checkpoint(path).ok
    check_loads(path, newest)


def _failing_drain(rank, world_size, root):
    import torch

    from fp_dcp import TierManager
    from fp_dcp.tiers import drain, store

    mgr = TierManager(os.path.join(root, "node{node}"), os.path.join(root, "persist"), replicas=1,
                      persist_every=2, ranks_per_node=1, drain_retries=1, drain_retry_seconds=0.01)
    sd = {"w": torch.full((1000, 300), float(rank)), "step": 2}
    mgr.save(2, sd)
    mgr.wait()

    def damage(point):  # step 4: rank 1's local file damaged before its drain reads it
        if point == "start 4" and rank == 1:
            d = store.step_dir(mgr.local_root, 4)
            name = next(n for n in os.listdir(d) if n.endswith(".r1.0.fpd"))
            with open(os.path.join(d, name), "r+b") as f:
                f.write(b"\xff" * 64)

    drain.fault_hook = damage
    mgr.save(4, {"w": torch.full((1000, 300), 4.0 + rank), "step": 4})
    mgr.wait()
    result = mgr.history[4]["drain"]
    errors = list(mgr.errors)
    mgr.close()
    return result.ok, errors


@pytest.mark.slow
def test_failed_drain_is_reported_retried_and_harmless(tmp_path):
    from fp_dcp.tiers import store
    from fp_dcp.tools.rotation import committed_checkpoints
    from fp_dcp.tools.verify import verify_checkpoint

    root = str(tmp_path)
    results = run_ranks(2, _failing_drain, root, timeout=120)
    for ok, errors in results:
        assert not ok
        assert len(errors) == 2 and all("drain attempt" in e and "checksum mismatch" in e for e in errors), errors
    persist = os.path.join(root, "persist")
    assert committed_checkpoints(persist) == [store.step_dir(persist, 2)]
    assert verify_checkpoint(store.step_dir(persist, 2)).ok
    assert [n for n in os.listdir(store.step_dir(persist, 4)) if n.endswith(".fpd")] == []


# ------------------------------------------------------- the save side


@pytest.mark.parametrize("size", [0, 1, 4095, 4096 + 7, (3 << 20) + 5])
def test_replica_file_io_round_trips_any_size_in_reused_buffers(tmp_path, size):
    from fp_dcp import FastPersistOptions
    from fp_dcp.tiers.replicate import FileIO

    files = FileIO(FastPersistOptions(), str(tmp_path))
    want = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    buf = files.buffer(size)
    buf[:] = want
    path = str(tmp_path / "f.fpd")
    pathlib.Path(path).write_bytes(b"x" * (size + 9000))  # an older, longer file there: replaced whole
    files.write(path, buf, sync=True)
    assert pathlib.Path(path).read_bytes() == want.tobytes()  # no O_DIRECT padding left at its end
    got = files.read(path, size)
    assert np.array_equal(got, want)
    if size:
        assert files.read(path, size).ctypes.data == got.ctypes.data  # the same buffer, not a new one
        assert files.buffer(size // 2).ctypes.data == buf.ctypes.data
        with pytest.raises(OSError, match="recorded"):
            files.read(path, size + 1)  # shorter than the checkpoint says
    os.symlink(path, str(tmp_path / "link.fpd"))
    with pytest.raises(OSError):
        files.read(str(tmp_path / "link.fpd"), size)  # a link is never followed
    files.close()


def test_drain_copy_is_the_file_and_refuses_corruption(tmp_path):
    from fp_dcp import FastPersistOptions
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import integrity
    from fp_dcp.tiers.drain import DrainIO

    src = str(tmp_path / "src")
    _one_rank_checkpoint(src)
    _, layout, _ = read_checkpoint_metadata(src)
    name, size = layout.files[0]
    dst = str(tmp_path / "dst")
    os.makedirs(dst)
    io = DrainIO(FastPersistOptions())
    assert io.copy(os.path.join(src, name), os.path.join(dst, name), layout, 0, sync=True) == size
    assert pathlib.Path(dst, name).read_bytes() == pathlib.Path(src, name).read_bytes()  # padding included
    flip_byte(os.path.join(src, name), 123_457)  # one flipped byte inside tensor "a"
    os.unlink(os.path.join(dst, name))
    with pytest.raises(integrity.IntegrityError, match="checksum mismatch in a"):
        io.copy(os.path.join(src, name), os.path.join(dst, name), layout, 0, sync=True)
    assert os.listdir(dst) == []  # nothing named, no temporary left
    with pytest.raises(integrity.IntegrityError, match="missing"):
        io.copy(os.path.join(src, "nope.fpd"), os.path.join(dst, name), layout, 0, sync=True)
    os.truncate(os.path.join(src, name), size - 1)
    with pytest.raises(integrity.IntegrityError, match="recorded"):
        io.copy(os.path.join(src, name), os.path.join(dst, name), layout, 0, sync=True)
    assert os.listdir(dst) == []
    io.close()


def _thread_nice() -> dict:
    """nice value of each of this process's threads, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended since the listing
    return out


def _background_priority(rank, world_size, root):
    import threading

    import torch

    from fp_dcp import TierManager

    before = _thread_nice()
    mgr = TierManager(os.path.join(root, "node{node}"), os.path.join(root, "persist"), replicas=0,
                      persist_every=1, ranks_per_node=1, background_nice=7)
    made = {t: n for t, n in _thread_nice().items() if t not in before}  # gloo's threads of its groups
    mgr.save(1, {"w": torch.ones(1000)})
    mgr.wait()
    named = {t.native_id: t.name for t in threading.enumerate()}
    workers = {named[t]: n for t, n in _thread_nice().items()
               if named.get(t, "").startswith(("fp_dcp-tiers", "fp_dcp-drain"))}
    ok = mgr.history[1]["drain"].ok
    mgr.close()
    return made, workers, ok


def test_background_threads_and_their_gloo_threads_run_at_lower_priority(tmp_path):
    made, workers, drained = run_ranks(1, _background_priority, str(tmp_path), timeout=120)[0]
    assert drained
    assert len(made) >= 3 and set(made.values()) == {7}, made  # not the training's nice 0
    assert len(workers) == 3 and set(workers.values()) == {7}, workers  # saver, replicator, drain


def _damaged_in_flight(rank, world_size, root):
    import torch

    from fp_dcp import TierManager
    from fp_dcp.tiers import replicate

    if rank == 0:  # what rank 0 sends is damaged after it was read: its receiver must refuse it
        read = replicate.FileIO.read

        def damaged(self, path, size):
            data = read(self, path, size).copy()
            data[size // 2] ^= 1
            return data

        replicate.FileIO.read = damaged
    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=1, ranks_per_node=1, keep_local=3)
    for step in (1, 2):
        mgr.save(step, {f"w{rank}": torch.arange(300_000.0) + step + 10 * rank, "step": step})
    mgr.close()
    return list(mgr.errors), {k: v for k, v in mgr.history[2].items() if k.endswith("_bytes")}


@pytest.mark.slow
def test_a_replica_damaged_in_flight_is_refused_and_never_named(tmp_path):
    from fp_dcp.files import read_checkpoint_metadata
    from fp_dcp.tiers import store

    root = str(tmp_path)
    (errors0, stats0), (errors1, stats1) = run_ranks(2, _damaged_in_flight, root, timeout=120)
    assert errors0 == []
    assert len(errors1) == 2 and all("r0." in e and "checksum mismatch" in e for e in errors1), errors1
    for step in (1, 2):
        d0, d1 = (store.step_dir(os.path.join(root, f"node{n}"), step) for n in (0, 1))
        _, layout, _ = read_checkpoint_metadata(d0)
        r0, r1 = (next(n for n, _ in layout.files if f".r{r}." in n) for r in (0, 1))
        assert sorted(os.listdir(d1)) == sorted([".fp_dcp.meta", store.MARKER_NAME, r1])  # no damaged replica, no temporary
        # the good replica is the original file, byte for byte (padding included)
        assert pathlib.Path(d0, r1).read_bytes() == pathlib.Path(d1, r1).read_bytes()
        assert pathlib.Path(d1, ".fp_dcp.meta").read_bytes() == pathlib.Path(d0, ".fp_dcp.meta").read_bytes()
        assert os.path.getsize(os.path.join(d0, r1)) == dict(layout.files)[r1]
    assert stats0["sent_bytes"] == stats1["received_bytes"] > 0


# --------------------------------------------------------- NCCL transport


def _nccl_replicas(rank, world_size, root):
    import torch

    from fp_dcp import TierManager
    from fp_dcp.tiers import store
    from fp_dcp.tools.verify import verify_checkpoint

    torch.cuda.set_device(rank)

    def manager():
        return TierManager(os.path.join(root, "node{node}"), None, replicas=1, ranks_per_node=1, transport="nccl")

    mgr = manager()
    mgr.save(1, {f"w{rank}": torch.full((1000, 300), 1.0 + rank), "step": 1})  # one key per rank: no dedup
    mgr.close()
    assert verify_checkpoint(store.step_dir(mgr.local_root, 1)).ok  # own files and the other node's
    torch.distributed.barrier()
    if rank == 1:
        shutil.rmtree(mgr.local_root)
    torch.distributed.barrier()
    mgr = manager()
    sd = {f"w{rank}": torch.zeros(1000, 300), "step": 0}
    assert mgr.restore(sd) == 1
    by_tier = mgr.last_restore.node_bytes_from
    mgr.close()
    return bool((sd[f"w{rank}"] == 1.0 + rank).all()), by_tier


@pytest.mark.slow
def test_nccl_transport_moves_replicas(tmp_path):
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("the NCCL transport needs CUDA and one GPU per rank (2 here)")
    for same, by_tier in run_ranks(2, _nccl_replicas, str(tmp_path), timeout=300):
        assert same and by_tier["replica"] > 0 and by_tier["persistent"] == 0


def _metadata_unreadable_on_rank0(rank, world_size, root):
    import torch

    from fp_dcp import TierManager
    from fp_dcp.tiers import manager as manager_module
    from fp_dcp.tiers.agree import TierError

    if rank == 0:
        read = manager_module.store.read_metadata

        def failing(directory):
            if directory.endswith(os.path.basename(manager_module.store.step_dir("", 2))):
                raise OSError(f"{directory}: injected read failure")
            return read(directory)

        manager_module.store.read_metadata = failing
    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=1, ranks_per_node=1)
    errors = []
    try:
        for step in (1, 2, 3):
            mgr.save(step, {f"w{rank}": torch.arange(1000.0) + step})
        mgr.wait()
    except TierError as e:
        errors.append(str(e))
    finally:
        try:
            mgr.close()
        except TierError as e:
            errors.append(str(e))
    return errors


@pytest.mark.slow
def test_a_save_whose_metadata_rank0_cannot_read_fails_on_every_rank_at_once(tmp_path):
    """Rank 0 cannot read step 2's metadata: every rank's manager raises an
    error naming rank 0 and the step (within the test's timeout, not the
    group's 30 minutes), instead of the others waiting in a broadcast."""
    errs = run_ranks(2, _metadata_unreadable_on_rank0, str(tmp_path), timeout=120)
    for rank_errors in errs:
        assert rank_errors, errs
        assert "step 2" in rank_errors[0] and "rank 0" in rank_errors[0] and "injected read failure" in rank_errors[0]
