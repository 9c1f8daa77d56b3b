"""The tiers touch only what they made, follow no link and wait on no FIFO.

Attacks and accidents on ``fp_dcp.tiers``, in the style of
``tests/test_security.py``: a user's checkpoint, another job's stock DCP
checkpoint and folders named like steps in the tiers' roots; step
directories planted as symbolic links; a second spelling of a step number;
FIFOs where the tiers read.  In every case what is not the tiers' keeps its
bytes and its modification time, nothing is written or deleted through a
link, and a FIFO is a named error on every rank at once (no rank is left in
a collective until the group's 30-minute timeout: each test's own timeout is
far shorter).
"""

from __future__ import annotations

import os
import pathlib

import pytest

from tests._dist import run_ranks

# ------------------------------------------------------------ helpers


def _plant(path, data: bytes = b"precious bytes, not the tiers' " * 50) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    return str(path)


def _snapshot(*paths) -> dict:
    """Every file and directory under ``paths`` (links not followed): its
    bytes (or kind) and modification time."""
    out = {}
    for top in paths:
        top = str(top)
        for d, dirs, files in os.walk(top, followlinks=False):
            for n in dirs + files:
                p = os.path.join(d, n)
                st = os.lstat(p)
                if os.path.islink(p):
                    out[p] = ("link", os.readlink(p))
                elif os.path.isdir(p):
                    out[p] = ("dir", None)
                else:
                    out[p] = (pathlib.Path(p).read_bytes(), st.st_mtime_ns)
        out[top] = ("top", os.path.isdir(top))
    return out


def _assert_untouched(before: dict) -> None:
    after = _snapshot(*[p for p, v in before.items() if v[0] == "top"])
    for p, v in before.items():
        assert p in after, f"{p} was deleted"
        assert after[p] == v, f"{p} was changed"
    new = sorted(set(after) - set(before))
    assert not new, f"written beside what was not the tiers': {new}"


def _user_checkpoint(path, seed=0):
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    sd = {"w": torch.arange(1000.0) + seed, "n": seed}
    dcp.save(sd, storage_writer=FastPersistWriter(str(path)), no_dist=True)


def _stock_checkpoint(path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save({"w": torch.ones(100)}, storage_writer=FileSystemWriter(str(path)), no_dist=True)


def _state(step, rank=0):
    import torch

    return {f"w{rank}": torch.full((300, 100), float(step) + 10 * rank), "step": step}


# ------------------------------------------------------------ names


def test_only_the_one_ascii_spelling_is_a_step():
    from fp_dcp.tiers import store

    assert store.step_name(6) == "step_000000006" and store.parse_step("step_000000006") == 6
    assert store.parse_step("step_1234567890") == 1234567890
    for name in ("step_6", "step_0000000006", "step_00000000\u0666",  # ARABIC-INDIC DIGIT SIX
                 "step_\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff16",  # FULLWIDTH digits
                 "step_000000006 ", "step_+00000006", "step_-00000006", "STEP_000000006", "step_00000_006"):
        assert store.parse_step(name) is None, name


# ------------------------------------------------------- ownership


def _six_steps(rank, world_size, root):
    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), os.path.join(root, "persist"), replicas=1,
                      ranks_per_node=1, persist_every=2, keep_local=2, keep_persistent=2)
    for step in range(1, 7):
        mgr.save(step, _state(step, rank))
        mgr.wait_staged()
    mgr.close()
    return list(mgr.errors)


def test_a_six_step_run_removes_nothing_that_is_not_the_tiers(tmp_path):
    """The issue's run: what the user and other jobs keep in the tiers'
    roots survives retention, the drains' tidy-up and keep_persistent, byte
    for byte and with its modification time; the tiers still keep exactly
    their own newest steps."""
    from fp_dcp.tiers import store

    root = str(tmp_path)
    persist, node0, node1 = (os.path.join(root, n) for n in ("persist", "node0", "node1"))
    _user_checkpoint(os.path.join(persist, "final_model"))  # the user's own fp_dcp checkpoint
    _stock_checkpoint(os.path.join(persist, "step_000000001"))  # another job's, named like a step
    _plant(os.path.join(persist, "step_000000003", "precious.txt"))  # a step folder without metadata
    _plant(os.path.join(persist, "step_3", "precious.txt"))
    _plant(os.path.join(persist, "step_00000000\u0663", "precious.txt"))  # non-ASCII digit
    _plant(os.path.join(node0, "step_0", "precious.txt"))
    _plant(os.path.join(node0, "step_000000000", "precious.txt"))
    _user_checkpoint(os.path.join(node1, "step_000000000"), seed=3)  # a committed one, not the tiers'
    foreign = [os.path.join(persist, n) for n in os.listdir(persist)] \
        + [os.path.join(d, n) for d in (node0, node1) for n in os.listdir(d)]
    before = _snapshot(*foreign)
    errors = run_ranks(2, _six_steps, root, timeout=180)
    assert errors == [[], []]
    _assert_untouched(before)
    assert [s for s, _ in store.owned_steps(persist)] == [4, 6]
    for node in (node0, node1):
        assert [s for s, _ in store.owned_steps(node)] == [5, 6]


def test_retention_and_tidy_up_leave_foreign_folders_alone(tmp_path):
    """Unit level: ``retain`` over a root full of folders spelt like steps
    removes only the tiers' marked ones, and inside those only fp_dcp's own
    files (a user's file in a marked folder keeps the folder)."""
    from fp_dcp import format as fmt
    from fp_dcp.tiers import store

    root = str(tmp_path / "r")
    for s in (1, 2, 3, 4):
        d = store.claim_step(root, s)
        _plant(os.path.join(d, fmt.METADATA_NAME), b"m")
    _plant(os.path.join(root, "step_000000000", "precious.txt"))
    _plant(os.path.join(root, "step_000000001", "x.0.fpd"))  # not marked: not the tiers', though named so
    _plant(os.path.join(store.step_dir(root, 2), "notes.txt"))  # the user's file in a tiers' folder
    os.remove(os.path.join(root, "step_000000001", store.MARKER_NAME))
    keep = [os.path.join(root, "step_000000000"), os.path.join(root, "step_000000001"),
            os.path.join(store.step_dir(root, 2), "notes.txt")]
    before = _snapshot(*keep)
    store.retain(root, 1)
    _assert_untouched(before)
    assert [s for s, _ in store.owned_steps(root)] == [2, 4]  # step 2 keeps its marker: still known
    assert sorted(os.listdir(store.step_dir(root, 2))) == [store.MARKER_NAME, "notes.txt"]


def _save_into_foreign(rank, world_size, root):
    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), os.path.join(root, "persist"), replicas=0,
                      ranks_per_node=1, persist_every=2, drain_retries=0)
    out = {}
    for step in (1, 2, 3):
        try:
            mgr.save(step, _state(step))
            mgr.wait()
        except Exception as e:  # noqa: BLE001 - the test checks which error, and that it is the only one
            out[step] = f"{type(e).__name__}: {e}"
    mgr.close()
    return out, list(mgr.errors), {s: h["drain"].ok for s, h in mgr.history.items() if "drain" in h}


def test_a_step_folder_the_tiers_did_not_make_is_never_written_into(tmp_path):
    """A folder of a step's name that is not the tiers' (the local root's
    step 3, the persistent root's step 2): the save of that step is refused
    naming it, the drain fails naming it; neither folder gets a byte."""
    root = str(tmp_path)
    local3 = _plant(os.path.join(root, "node0", "step_000000003", "precious.txt"))
    pers2 = _plant(os.path.join(root, "persist", "step_000000002", "precious.txt"))
    before = _snapshot(os.path.dirname(local3), os.path.dirname(pers2))
    refused, errors, drains = run_ranks(1, _save_into_foreign, root, timeout=120)[0]
    assert list(refused) == [3] and refused[3].startswith("TierPathError: ") and "step_000000003" in refused[3] \
        and "did not make it" in refused[3], refused
    assert drains == {2: False}
    assert len(errors) == 1 and "step_000000002" in errors[0] and "did not make it" in errors[0], errors
    _assert_untouched(before)


# ------------------------------------------------------------ links


def test_a_step_planted_as_a_link_is_never_written_or_deleted_through(tmp_path):
    """``step_000000002`` of the persistent root and ``step_000000003`` of
    the local root are links to a folder outside: the drain of step 2 and
    the save of step 3 are refused naming the link, retention passes them
    by; the folder they point to keeps every byte."""
    root = str(tmp_path)
    outside = tmp_path / "outside"
    _plant(str(outside / "canary.txt"))
    _user_checkpoint(str(outside / "ckpt"))  # a committed checkpoint there: retention must not count it
    os.makedirs(os.path.join(root, "persist"))
    os.makedirs(os.path.join(root, "node0"))
    os.symlink(str(outside), os.path.join(root, "persist", "step_000000002"))
    os.symlink(str(outside / "ckpt"), os.path.join(root, "node0", "step_000000003"))
    before = _snapshot(str(outside))
    refused, errors, drains = run_ranks(1, _save_into_foreign, root, timeout=120)[0]
    assert list(refused) == [3] and refused[3].startswith("TierPathError: ") \
        and "step_000000003: a symbolic link" in refused[3], refused
    assert drains == {2: False}
    assert len(errors) == 1 and "step_000000002: a symbolic link" in errors[0], errors
    _assert_untouched(before)
    assert os.path.islink(os.path.join(root, "persist", "step_000000002"))


def _save_two(rank, world_size, root):
    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=0, ranks_per_node=1)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()


def _restore_one(rank, world_size, root):
    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=0, ranks_per_node=1)
    sd = {"w0": _state(0)["w0"].clone(), "step": -1}
    step = mgr.restore(sd)
    mgr.close()
    return step, float(sd["w0"][0, 0]), sd["step"]


def test_restore_reads_no_linked_step_and_no_second_spelling(tmp_path):
    """Steps 1 and 2 saved; then step 2's folder is renamed to another
    spelling of 2 and a link under the canonical name points to a folder of
    the attacker's (marked for step 2, holding another checkpoint): the
    restore reads neither and loads step 1."""
    import shutil

    from fp_dcp.tiers import store

    root = str(tmp_path)
    run_ranks(1, _save_two, root, timeout=120)
    node = os.path.join(root, "node0")
    evil = tmp_path / "evil"
    shutil.copytree(store.step_dir(node, 2), str(evil))  # the tiers' marker for step 2, and a good checkpoint
    _user_checkpoint(str(tmp_path / "other"), seed=99)
    os.rename(store.step_dir(node, 2), os.path.join(node, "step_0000000002"))
    os.symlink(str(evil), store.step_dir(node, 2))
    before = _snapshot(str(evil))
    step, w, saved_step = run_ranks(1, _restore_one, root, timeout=120)[0]
    assert (step, w, saved_step) == (1, 1.0, 1)
    _assert_untouched(before)


# ------------------------------------------------------------ FIFOs


def _restore_expecting_error(rank, world_size, root):
    from fp_dcp import TierManager
    from fp_dcp.tiers.restore import TierRestoreError

    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=1, ranks_per_node=1)
    try:
        mgr.restore(_state(0, rank))
    except TierRestoreError as e:
        return str(e)
    finally:
        mgr.close()
    raise AssertionError("the restore did not fail")


def _save_two_ranks(rank, world_size, root):
    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=1, ranks_per_node=1)
    mgr.save(1, _state(1, rank))
    mgr.close()


@pytest.mark.parametrize("where", ["metadata", "marker", "data", "other"])
def test_a_fifo_in_a_tier_fails_a_restore_on_every_rank_at_once(tmp_path, where):
    """A FIFO in node 1's step folder (as its metadata, its marker, a data
    file, or any other name): rank 1 raises naming it before opening it, and
    every rank learns it through the agreement exchange and raises too."""
    from fp_dcp import format as fmt
    from fp_dcp.tiers import store

    root = str(tmp_path)
    run_ranks(2, _save_two_ranks, root, timeout=120)
    d = store.step_dir(os.path.join(root, "node1"), 1)
    name = {"metadata": fmt.METADATA_NAME, "marker": ".fp_dcp.tier", "other": "notes.pipe",
            "data": next(n for n in os.listdir(d) if n.endswith(".fpd"))}[where]
    os.unlink(os.path.join(d, name)) if os.path.exists(os.path.join(d, name)) else None
    os.mkfifo(os.path.join(d, name))
    messages = run_ranks(2, _restore_expecting_error, root, timeout=60)
    for m in messages:
        assert "failed on rank 1" in m and f"{d}/{name}: a FIFO" in m, m


def _drain_into_fifo(rank, world_size, root):
    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), os.path.join(root, "persist"), replicas=0,
                      ranks_per_node=1, persist_every=1, drain_retries=1, drain_retry_seconds=0.01)
    mgr.save(1, _state(1))
    mgr.close()  # returns: no drain waits on the FIFO
    return list(mgr.errors), mgr.history[1]["drain"].ok


@pytest.mark.parametrize("owned", [True, False])
def test_a_fifo_in_the_persistent_step_fails_the_drain_and_close_returns(tmp_path, owned):
    """The persistent step folder holds a FIFO as its metadata (in a folder
    the tiers marked, or in one they did not make): the drain fails with an
    error naming it, is retried, reported, and ``close`` returns."""
    from fp_dcp import format as fmt
    from fp_dcp.tiers import store

    root = str(tmp_path)
    d = store.step_dir(os.path.join(root, "persist"), 1)
    if owned:
        store.claim_step(os.path.join(root, "persist"), 1)
    else:
        os.makedirs(d)
    os.mkfifo(os.path.join(d, fmt.METADATA_NAME))
    errors, ok = run_ranks(1, _drain_into_fifo, root, timeout=60)[0]
    assert not ok and len(errors) == 2, errors
    want = f"{d}/{fmt.METADATA_NAME}: a FIFO" if owned else f"{d}: a directory of that name"
    assert all(want in e for e in errors), errors


def _restore_expecting_error_one(rank, world_size, root):
    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=0, ranks_per_node=1)
    try:
        mgr.restore({"w0": _state(0)["w0"].clone(), "step": -1})
    except Exception as e:  # noqa: BLE001 - the test checks which error
        return f"{type(e).__name__}: {e}"
    finally:
        mgr.close()
    return "restored"


@pytest.mark.parametrize("planted", ["folder", "link"])
def test_a_restore_folder_that_is_not_the_tiers_is_refused(tmp_path, planted):
    """``<local root>/.restore`` is a folder of the user's, or a link to
    one: the restore fails naming it and removes nothing there."""
    root = str(tmp_path)
    run_ranks(1, _save_two, root, timeout=120)
    outside = tmp_path / "outside"
    _plant(str(outside / "precious.txt"))
    target = os.path.join(root, "node0", ".restore")
    if planted == "link":
        os.symlink(str(outside), target)
    else:
        _plant(os.path.join(target, "precious.txt"))
    before = _snapshot(str(outside), target)
    message = run_ranks(1, _restore_expecting_error_one, root, timeout=120)[0]
    assert message.startswith("TierRestoreError: restore: preparing the restore directory failed on rank 0: "
                              "TierPathError: " + target), message
    _assert_untouched(before)
