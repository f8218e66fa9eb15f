"""The price vocabulary: what an algorithm's cost formula takes and the tuner prices it with.

A link's constants, the shape of a group over hosts and the prices of a hierarchical
algorithm's phases. The algorithms state their costs in these terms and the tuning package
(topology, cost model, tuner, `tensorwire plan`) fills them in; a leaf that imports nothing of
tensorwire, so neither side needs the other to name them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """Cost constants of one tier of links (shared memory, TCP, a hypothetical fabric)."""

    name: str
    alpha: float  # seconds per message (latency)
    beta: float  # seconds per byte moved
    gamma: float  # seconds per byte reduced
    cache: float = 0.0
    """The `memory` entry only: bytes of last-level cache that a host's ranks share; its β and
    γ are then what a byte copied or reduced costs on top of a link's own beyond that cache."""


CostFn = Callable[[int, int, Link], float]  # (ranks, bytes, link) -> predicted seconds


@dataclass(frozen=True)
class Shape:
    """A group over `hosts` hosts of `per_host` ranks each, or where hosts hold different
    numbers, `per_host` on the fullest and `least` on the emptiest; `nic_share`: how many of a
    host's ranks share each of its network interfaces as they cross at once along the rails
    (the rails of a phase divide a link between them)."""

    hosts: int
    per_host: int
    nic_share: float = 1.0
    least: int | None = None

    @property
    def uniform(self) -> bool:
        return self.least is None or self.least == self.per_host

    @property
    def rails(self) -> int:
        """The rails every host has (one per rank of the emptiest host)."""
        return self.per_host if self.least is None else self.least


LocalPrice = Callable[[str, int, int], float]
"""(collective, ranks, bytes) -> seconds of the cheapest algorithm on one host's tier; for the
collective COPY, of a pass of bytes through one rank's memory."""
COPY = "copy"
RailPrice = Callable[[str, int, int, float], float]
"""(collective, ranks, bytes, flows sharing a link) -> seconds of the cheapest algorithm
between hosts, its β multiplied by the flows that share each host's link."""
