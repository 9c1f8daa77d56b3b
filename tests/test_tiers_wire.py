"""No pickle between ranks: fp_dcp.wire and the tiers' exchanges.

A lying peer (one of 2 gloo ranks) sends garbage, an oversized message,
data of the wrong shape, or an object whose pickle would run a command:
every rank raises a named error naming that rank (none waits for the
group's timeout: each test's own timeout is far shorter), and the command
never runs.
"""

from __future__ import annotations

import os

import pytest

from tests._dist import run_ranks


class _Evil:
    """Pickles as a call of os.system: unpickling it runs a command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ------------------------------------------------------------ decoding


def test_decode_checks_shape_and_refuses_what_is_not_plain_json():
    from fp_dcp import wire

    spec = {"a": [(int, str)], "b": wire.maybe({str: float}), "c": bool}
    good = wire.encode({"a": [(1, "x"), [2, "y"]], "b": {"k": 1}, "c": True})
    assert wire.decode(good, spec, "here") == {"a": [(1, "x"), (2, "y")], "b": {"k": 1.0}, "c": True}
    bad = {
        b"\x80\x04K\x01.": "not a plain JSON message",  # a pickle
        b"[1, 2": "not a plain JSON message",
        b'{"a": [], "b": NaN, "c": true}': "not a plain JSON message",
        b'{"a": [], "a": [], "b": null, "c": true}': "key twice",
        b"[" * 100_000 + b"]" * 100_000: "",
        b'{"a": [[true, "x"]], "b": null, "c": true}': "$.a[0][0] must be an integer, got bool",
        b'{"a": [[1, "x", 3]], "b": null, "c": true}': "$.a[0] must be a list of 2, got 3",
        b'{"a": [], "b": null, "c": 1}': "$.c must be a bool",
        b'{"a": [], "b": null, "c": true, "d": 0}': "must have the keys",
        b'{"a": [], "b": {"k": "1"}, "c": true}': "must be a number",
        b'{"a": [[99999999999999999999999, "x"]], "b": null, "c": true}': "must be an integer",
    }
    for blob, why in bad.items():
        with pytest.raises(wire.WireError, match="^here: ") as e:
            wire.decode(blob, spec, "here")
        assert why in str(e.value), (blob[:40], str(e.value))
    with pytest.raises(ValueError):
        wire.encode(float("nan"))


def test_no_pickling_collective_in_the_tiers():
    """The tiers' modules call none of torch.distributed's ``*_object``
    collectives (they pickle): every exchange goes through fp_dcp.wire."""
    import ast
    import pathlib

    import fp_dcp

    package = pathlib.Path(fp_dcp.__file__).parent
    found = []
    for path in sorted((package / "tiers").glob("*.py")) + sorted(package.glob("wire.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (node.attr.endswith("_object") or node.attr.endswith("_object_list")):
                found.append(f"{path.name}:{node.lineno}: {node.attr}")
    assert found == []


# ------------------------------------------------------------ two ranks


def _round_trip(rank, world_size):
    from fp_dcp import wire

    got = wire.gather({"rank": rank, "ranges": [(rank, 10)]}, {"rank": int, "ranges": [(int, int)]})
    value, payload = wire.broadcast(["from", 1], (str, int), 1, payload=b"\x00raw bytes\xff" if rank == 1 else b"x")
    return got, value, payload


def test_gather_and_broadcast_round_trip_plain_data():
    for got, value, payload in run_ranks(2, _round_trip, timeout=60):
        assert got == [{"rank": 0, "ranges": [(0, 10)]}, {"rank": 1, "ranges": [(1, 10)]}]
        assert value == ("from", 1) and payload == b"\x00raw bytes\xff"


def _lying_gather(rank, world_size, lie):
    from fp_dcp import wire

    if rank == 1:
        encode = wire.encode
        wire.encode = lambda value: {
            "garbage": b"\x80\x04\x95 not json at all",
            "wrong-type": encode({"rank": "1", "files": {"a.fpd": -1.5}}),
            "oversized": b"[" + b"0," * 600 + b"0]",
        }[lie]
    try:
        wire.gather({"rank": rank, "files": {"a.fpd": 1}}, {"rank": int, "files": {str: int}}, what="test exchange",
                    limit=1000)
    except wire.WireError as e:
        return str(e)
    raise AssertionError("a lying peer's message was accepted")


@pytest.mark.parametrize("lie", ["garbage", "wrong-type", "oversized"])
def test_a_lying_peer_is_a_named_error_on_every_rank(lie):
    want = {"garbage": "test exchange: rank 1's message: not a plain JSON message",
            "wrong-type": "test exchange: rank 1's message: $.rank must be an integer, got str",
            "oversized": "test exchange: rank 1 sent a message of 1203 bytes (at most 1000 are accepted)"}[lie]
    for message in run_ranks(2, _lying_gather, lie, timeout=60):
        assert message.startswith(want), message


def _lying_broadcast(rank, world_size):
    from fp_dcp import wire

    try:
        wire.broadcast("x" * 5000, str, 1, what="test broadcast", limit=1000)
    except wire.WireError as e:
        return str(e)
    raise AssertionError("an oversized broadcast was accepted")


def test_an_oversized_broadcast_is_refused_before_it_is_received():
    for message in run_ranks(2, _lying_broadcast, timeout=60):
        assert message == "test broadcast: rank 1 sent a message of 5002 + 0 bytes (at most 1000 are accepted)"


# ------------------------------------------------------------ the tiers' exchanges


def _saved_two_nodes(rank, world_size, root):
    import torch

    from fp_dcp import TierManager

    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=1, ranks_per_node=1)
    mgr.save(1, {f"w{rank}": torch.full((100, 10), 1.0 + rank), "step": 1})
    mgr.close()


def _restore_with_a_lying_peer(rank, world_size, root, lie):
    import torch

    from fp_dcp import TierManager
    from fp_dcp.tiers import store

    marker = os.path.join(root, "PWNED")
    if rank == 1:
        if lie == "pickle":  # an object whose pickle runs a command, in the inventory it sends
            store.scan = lambda path: {1: store.Holding(_Evil(marker), None, {})}
        else:  # a step number that is a string, through the real wire
            from fp_dcp.tiers import plan

            plan.holdings_to_wire = lambda holdings: [["1", None, None, {}]]
    mgr = TierManager(os.path.join(root, "node{node}"), None, replicas=1, ranks_per_node=1)
    try:
        mgr.restore({f"w{rank}": torch.zeros(100, 10), "step": 0})
    except Exception as e:  # noqa: BLE001 - the test checks which error
        return type(e).__name__, str(e), os.path.exists(marker)
    finally:
        mgr.close()
    return None, "restored", os.path.exists(marker)


@pytest.mark.parametrize("lie", ["pickle", "wrong-shape"])
def test_a_lying_peer_in_a_restore_runs_nothing_and_fails_every_rank(tmp_path, lie):
    """Rank 1 sends, as its inventory, an object whose pickle would run a
    command (it is not plain data: rank 1's own error, sent as such), or a
    message of the wrong shape: every rank raises naming rank 1; the
    command never runs."""
    root = str(tmp_path)
    run_ranks(2, _saved_two_nodes, root, timeout=120)
    results = run_ranks(2, _restore_with_a_lying_peer, root, lie, timeout=60)
    for kind, message, ran in results:
        assert not ran, "a peer's pickle ran a command"
        if lie == "pickle":
            assert kind == "TierRestoreError" and "failed on rank 1: TypeError" in message \
                and "not JSON serializable" in message, message
        else:
            assert kind == "WireError" and message.startswith(
                "restore: taking stock of the tiers: rank 1's message: $[0][0][0][0] must be an integer, got str"), \
                message
    assert not os.path.exists(os.path.join(root, "PWNED"))
