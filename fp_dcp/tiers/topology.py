"""Which ranks form a node, and where each node's replicas go (nodes
``n+1 .. n+r`` on a ring; each rank to the same local index there).  Pure."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

__all__ = ["Topology", "ranks_per_node_from_env"]

# tests and single-machine runs: ranks 0..k-1 are node 0, k..2k-1 node 1, ...
RANKS_PER_NODE_ENV = "FP_DCP_RANKS_PER_NODE"


@dataclasses.dataclass(frozen=True)
class Topology:
    """``nodes[i]``: the ranks of node ``i``, ascending; every rank of the
    world in exactly one node."""

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen = sorted(r for node in self.nodes for r in node)
        if seen != list(range(len(seen))) or any(not node for node in self.nodes):
            raise ValueError(f"a topology must place every rank 0..n-1 in exactly one non-empty node, got {self.nodes}")

    @classmethod
    def by_ranks_per_node(cls, world_size: int, ranks_per_node: int) -> "Topology":
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        return cls(tuple(tuple(range(s, min(s + ranks_per_node, world_size)))
                         for s in range(0, world_size, ranks_per_node)))

    @classmethod
    def by_host(cls, hosts: Sequence[str]) -> "Topology":
        """One node per distinct host name, in order of each host's lowest rank."""
        order: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            order.setdefault(host, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in order.values()))

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    def node_of(self, rank: int) -> int:
        for i, node in enumerate(self.nodes):
            if rank in node:
                return i
        raise ValueError(f"rank {rank} is in no node of {self.nodes}")

    def leader(self, node: int) -> int:
        """The rank that does a node's one-per-node work (its lowest)."""
        return self.nodes[node][0]

    def holders(self, node: int, replicas: int) -> list[int]:
        """The nodes that keep a replica of ``node``'s files."""
        n = len(self.nodes)
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        if replicas >= n and replicas:
            raise ValueError(
                f"{replicas} replica(s) need at least {replicas + 1} nodes (a replica never shares a node "
                f"with its original); this job has {n}"
            )
        return [(node + k) % n for k in range(1, replicas + 1)]

    def partner(self, rank: int, node: int) -> int:
        """The rank of ``node`` that receives ``rank``'s files."""
        mine = self.nodes[self.node_of(rank)]
        there = self.nodes[node]
        return there[mine.index(rank) % len(there)]

    def replication_pairs(self, replicas: int) -> list[tuple[int, int]]:
        """Every ``(sender, receiver)`` of one replication round, in one
        global order that every rank computes alike."""
        pairs: list[tuple[int, int]] = []
        for node, ranks in enumerate(self.nodes):
            for holder in self.holders(node, replicas):
                pairs.extend((r, self.partner(r, holder)) for r in ranks)
        return pairs


def ranks_per_node_from_env() -> int | None:
    """``FP_DCP_RANKS_PER_NODE``, else torchrun's ``LOCAL_WORLD_SIZE``, else None."""
    for name in (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                k = int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a number of ranks") from None
            if k < 1:
                raise ValueError(f"{name}={value!r}: a node has at least one rank")
            return k
    return None
