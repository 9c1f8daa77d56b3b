"""A restore's records and its planning from gathered facts (pure):
:func:`choose`, :func:`reads`, :func:`node_needs`."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from fp_dcp import format as fmt
from fp_dcp import wire
from fp_dcp.load.jobs import whole_chunk_read
from fp_dcp.tiers.integrity import extent_ranges, ranges_bytes
from fp_dcp.tiers.store import Holding
from fp_dcp.tiers.topology import Topology

__all__ = ["TIERS", "Inventory", "Candidate", "FileReads", "Need", "Failure", "Pick", "Source",
           "choose", "reads", "node_needs", "subset_layout"]

TIERS = ("local", "replica", "persistent")

Range = tuple[int, int]  # (file offset, length)

#: one tier's holdings on the wire: ``[step, save_id, [[file, size], ...], {file: size on disk}]``
HOLDINGS_SPEC = [(int, wire.maybe(str), wire.maybe([(str, int)]), {str: int})]


def holdings_to_wire(holdings: dict[int, Holding]) -> list:
    return [[s, h.save_id, h.meta_files, h.files] for s, h in sorted(holdings.items())]


def holdings_from_wire(rows: list) -> dict[int, Holding]:
    return {s: Holding(sid, None if mf is None else list(mf), dict(files)) for s, sid, mf, files in rows}


@dataclasses.dataclass(frozen=True)
class Inventory:
    """What every tier holds, as every rank gathered it: ``local[r]``, rank
    ``r``'s node's local tier; ``persistent``, the committed steps of the
    persistent tier (rank 0's scan)."""

    local: list[dict[int, Holding]]
    persistent: dict[int, Holding]

    def holds(self, rank: int, step: int, name: str, size: int) -> bool:
        """Whether rank ``rank``'s node holds data file ``name`` of ``step`` at ``size`` bytes."""
        h = self.local[rank].get(step)
        return h is not None and h.files.get(name) == size

    def persistent_holds(self, step: int, name: str, size: int) -> bool:
        h = self.persistent.get(step)
        return h is not None and h.files.get(name) == size

    def has_metadata(self, rank: int, step: int, save_id: str) -> bool:
        h = self.local[rank].get(step)
        return h is not None and h.save_id == save_id


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A step complete somewhere: its save and its data files' sizes."""

    step: int
    save_id: str
    sizes: dict[str, int]


def choose(step: int | None, inv: Inventory, excluded: set[int] | frozenset[int] = frozenset()) -> Candidate | None:
    """The newest step (or ``step``) not ``excluded`` whose metadata some tier
    holds and each of whose data files some tier holds at its recorded size."""
    tiers = inv.local + [inv.persistent]
    candidates: dict[tuple[int, str], Candidate] = {}
    for holdings in tiers:
        for s, h in holdings.items():
            if h.save_id is not None and h.meta_files is not None:
                candidates.setdefault((s, h.save_id), Candidate(s, h.save_id, dict(h.meta_files)))
    for c in sorted(candidates.values(), key=lambda c: c.step, reverse=True):
        if (step is not None and c.step != step) or c.step in excluded:
            continue
        if all(any(t.get(c.step) is not None and t[c.step].files.get(n) == z for t in tiers)
               for n, z in c.sizes.items()):
            return c
    return None


@dataclasses.dataclass(frozen=True)
class FileReads:
    """The extents of one data file a rank's load reads (``ranges``), of
    which ``check`` it reads only in part (so will not verify whole)."""

    ranges: tuple[Range, ...]
    check: tuple[Range, ...]


#: a rank's reads on the wire: ``{file: [[[offset, length], ...], [[offset, length], ...]]}``
READS_SPEC = {str: ([(int, int)], [(int, int)])}


def reads_to_wire(r: dict[str, FileReads]) -> dict:
    return {name: [list(f.ranges), list(f.check)] for name, f in r.items()}


def reads_from_wire(doc: dict) -> dict[str, FileReads]:
    return {name: FileReads(tuple(a), tuple(b)) for name, (a, b) in doc.items()}


def reads(state_dict: dict, metadata, layout: fmt.StorageLayout, planner, is_coordinator: bool) -> dict[str, FileReads]:
    """The extents this rank's load plan reads, by data file."""
    planner.set_up_planner(state_dict, metadata, is_coordinator)
    plan = planner.create_local_plan()
    spans: dict[str, list[Range]] = {}
    check: dict[str, list[Range]] = {}
    for item in plan.items:
        idx = MetadataIndex(item.storage_index.fqn, item.storage_index.offset)
        exts = layout.extents.get(idx)
        if exts is None:
            raise fmt.CheckpointFormatError(f"{item.storage_index.fqn}: the checkpoint has no extents for it")
        verified = item.type == LoadItemType.BYTE_IO or _read_whole(item, metadata, planner)
        for e in exts:
            name = _file_name(layout, e.file)
            spans.setdefault(name, []).append((e.file_offset, e.length))
            check.setdefault(name, [])
            if not verified:
                check[name].append((e.file_offset, e.length))
    return {name: FileReads(tuple(extent_ranges(spans[name])), tuple(extent_ranges(check[name]))) for name in spans}


def _read_whole(item, metadata, planner) -> bool:
    """Whether the reader reads ``item``'s stored chunk as its extents whole
    (and so checks every block of them)."""
    md = metadata.state_dict_metadata.get(item.storage_index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return False
    want = item.storage_index.offset
    chunk = next((c for c in md.chunks if want is None or list(c.offsets) == list(want)), None)
    try:
        dest = planner.resolve_tensor(item)
    except Exception:  # noqa: BLE001 - a planner that cannot say: check it at assembly
        return False
    if chunk is None or not isinstance(dest, torch.Tensor):
        return False
    return whole_chunk_read(chunk.sizes, md.properties.dtype, item.storage_offsets, item.lengths, dest.detach())


@dataclasses.dataclass(frozen=True)
class Need:
    """What node ``node`` needs of data file ``name``: ``ranges`` (whole
    extents its ranks read), of which ``check`` the load reads only in part.
    ``receiver``: the rank that fetches it."""

    node: int
    name: str
    receiver: int
    ranges: tuple[Range, ...]
    check: tuple[Range, ...]


def node_needs(topology: Topology, every_reads: list[dict[str, FileReads]], sizes: Mapping[str, int],
               step: int) -> list[Need]:
    """Every node's needs, from every rank's reads.  A file's receiver is
    the rank of the node that reads most of it (each rank fetches its own
    shard's file, so the node's ranks fetch side by side)."""
    needs = []
    for node, ranks in enumerate(topology.nodes):
        spans: dict[str, list[Range]] = {}
        check: dict[str, list[Range]] = {}
        by_rank: dict[str, dict[int, int]] = {}
        for r in ranks:
            for name, f in every_reads[r].items():
                if name not in sizes:
                    raise ValueError(f"restore: rank {r} asked for {name!r}, not a file of step {step}")
                spans.setdefault(name, []).extend(f.ranges)
                check.setdefault(name, []).extend(f.check)
                by_rank.setdefault(name, {})[r] = ranges_bytes(f.ranges)
        for name in sorted(spans):
            receiver = min(by_rank[name], key=lambda r: (-by_rank[name][r], r))
            needs.append(Need(node, name, receiver, tuple(extent_ranges(spans[name])),
                              tuple(extent_ranges(check[name]))))
    return needs


@dataclasses.dataclass(frozen=True, order=True)
class Failure:
    """A copy of data file ``name`` from ``source`` that failed for rank
    ``rank``, and why."""

    name: str
    source: str
    why: str
    rank: int


#: a phase's failed copies on the wire: ``[[file, source, why, rank], ...]``
FAILURES_SPEC = [(str, str, str, int)]


def failures_to_wire(failures: list[Failure]) -> list:
    return [[f.name, f.source, f.why, f.rank] for f in failures]


def failures_from_wire(rows: list) -> list[Failure]:
    return [Failure(*row) for row in rows]


@dataclasses.dataclass(frozen=True)
class Pick:
    """The source chosen for a need: ``tier`` and the rank that holds it
    (``-1``: the persistent tier)."""

    need: Need
    tier: str
    src: int


class Source(NamedTuple):
    """A copy a restore loaded: ``node`` took ``bytes`` of data file ``name`` from ``tier``."""

    node: int
    name: str
    tier: str
    bytes: int


#: what each rank took, on the wire: ``[{tier: bytes}, [[node, file, tier, bytes], ...]]``
TAKEN_SPEC = ({str: int}, [(int, str, str, int)])


def _file_name(layout: fmt.StorageLayout, fid: int) -> str:
    name, _ = layout.files[fid]
    return name


def subset_layout(layout: fmt.StorageLayout, held: Any) -> fmt.StorageLayout:
    """``layout`` with only the files ``held`` and the items whose extents
    they hold.  ``held``: file names (held whole) or ``{name: ranges}``
    (only those ``(offset, length)`` ranges held; ``None``: whole)."""
    ranges: Mapping = held if isinstance(held, Mapping) else {n: None for n in held}
    keep = [fid for fid, (n, _) in enumerate(layout.files) if n in ranges]
    new_id = {old: new for new, old in enumerate(keep)}
    starts = {fid: [o for o, _ in ranges[_file_name(layout, fid)]] for fid in keep
              if ranges[_file_name(layout, fid)] is not None}

    def inside(e) -> bool:
        if e.file not in new_id:
            return False
        if e.file not in starts:
            return True
        i = bisect.bisect_right(starts[e.file], e.file_offset) - 1
        if i < 0:
            return False
        off, n = ranges[_file_name(layout, e.file)][i]
        return e.file_offset + e.length <= off + n

    extents = {
        idx: [dataclasses.replace(e, file=new_id[e.file]) for e in exts]
        for idx, exts in layout.extents.items()
        if all(inside(e) for e in exts)
    }
    return dataclasses.replace(layout, files=[layout.files[f] for f in keep], extents=extents)
