"""Who is near whom: every rank's host, NUMA node, cores, GPU and network interface, the tier of
every pair of ranks, and the orders a group's algorithms run in.

Discovery is local and cheap (`local_card`): the kernel's boot id (what ranks that share cores
have in common), the host name, the cores the rank may run on (`os.sched_getaffinity`) and the
NUMA nodes they belong to (/sys), the interface that carries the advertised address
(transport/netif.py), and a GPU only where the process already imported torch and CUDA is
available (never imported here). Every rank publishes its card with the address it already
publishes at init (transport/connect.py), so the whole job's topology costs no exchange of its
own; `Topology.from_cards` turns the cards into the model every rank holds alike.

A *host* is what shared memory spans: ranks with the same host name on the same kernel. The
multi-host test bed's emulated hosts run on one kernel (one *machine*: one boot id, shared
cores) but each has a host name and network of its own, so each is a host here, as it is to the
transport; two machines that share a host name are two hosts, as their boot ids differ.

A group's `Layout` groups its ranks by host (hosts in the order of their lowest group rank) and
gives the orders its algorithms run in (algorithms/ordered.py): the ring visits each host's
ranks together, whatever the numbering, so it crosses between hosts once per host instead of
at every hop under a cyclic placement; rooted patterns start on the root's host, root first,
so a binomial tree crosses to each other host once. Where every host holds the same number of
ranks, the hierarchical algorithms (algorithms/hierarchical.py) run on its host groups and rails.
"""

from __future__ import annotations

import builtins
import glob
import os
import socket
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import log
from ..algorithms.prices import Shape
from ..transport import netif
from ..transport.processes import parse_cpulist

_log = log.get("GRAPH")

TIERS = ("self", "numa", "host", "net")
"""A pair's tier, nearest first: the same process; one host, both bound within one NUMA node;
one host (shared memory); different hosts (the network, even between emulated hosts on one
machine: they share no memory)."""


# -- discovery: this rank's card -------------------------------------------------------------------

def machine_id() -> str:
    """What ranks that compete for the same cores share: the kernel's boot id. Network
    namespaces and containers on one kernel (the multi-host test bed's emulated hosts) have
    host names of their own but run on the same cores; separate machines and VMs boot their
    own kernels. The host name where the id cannot be read."""
    try:
        with builtins.open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def format_cpulist(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def numa_nodes(cpus: Iterable[int], root: str = "/sys/devices/system/node") -> list[int]:
    """The NUMA nodes that hold any of `cpus` ([] where /sys does not say)."""
    want = set(cpus)
    nodes = []
    for path in glob.glob(os.path.join(root, "node[0-9]*", "cpulist")):
        try:
            with builtins.open(path) as f:
                if want & set(parse_cpulist(f.read())):
                    nodes.append(int(os.path.basename(os.path.dirname(path))[4:]))
        except (OSError, ValueError):
            continue
    return sorted(nodes)


def gpu_of() -> dict[str, Any] | None:
    """The CUDA device this process uses, where it already imported torch and CUDA is
    available: importing torch (seconds, hundreds of MiB) is not the topology's to decide."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        pci = (getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", None),
               getattr(props, "pci_device_id", 0))
        return {"index": int(index), "name": str(props.name), "uuid": str(getattr(props, "uuid", "")),
                "pci": f"{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}.0" if pci[1] is not None else ""}
    except Exception:  # a broken driver must not break init: the GPU is only reported
        return None


def local_card(address: str) -> dict[str, Any]:
    """This rank's entry of the topology, as it is published at init (JSON)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = list(range(os.cpu_count() or 1))
    return {"addr": address, "host": socket.gethostname(), "machine": machine_id(), "pid": os.getpid(),
            "ifname": netif.interface_of(address), "cores": format_cpulist(cores),
            "numa": numa_nodes(cores), "gpu": gpu_of()}


# -- the model -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankInfo:
    """One rank's place: what `local_card` found on it."""

    rank: int
    host: str
    machine: str
    pid: int
    address: str
    interface: str
    cores: tuple[int, ...]
    numa: tuple[int, ...]
    gpu: dict[str, Any] | None = None

    @property
    def numa_node(self) -> int:
        """The one NUMA node its cores lie in, or -1 (unknown, or spanning several)."""
        return self.numa[0] if len(self.numa) == 1 else -1

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "machine": self.machine, "pid": self.pid,
                "address": self.address, "interface": self.interface, "cores": format_cpulist(self.cores),
                "numa": list(self.numa), "gpu": self.gpu}


class Topology:
    """The job's topology, the same on every rank: `ranks[r]` is world rank r's RankInfo,
    `hosts[h]` the world ranks on host h (hosts in the order of their lowest rank)."""

    def __init__(self, ranks: Sequence[RankInfo]) -> None:
        self.ranks = list(ranks)
        keys: dict[tuple[str, str], int] = {}
        self.host_of = [keys.setdefault((i.host, i.machine), len(keys)) for i in self.ranks]
        self.hosts: list[tuple[int, ...]] = [tuple(r for r, h in enumerate(self.host_of) if h == k)
                                             for k in range(len(keys))]
        machines: dict[str, int] = {}
        self.machine_of = [machines.setdefault(i.machine, len(machines)) for i in self.ranks]

    def __repr__(self) -> str:
        return f"<tensorwire.Topology: {len(self.ranks)} ranks on {len(self.hosts)} host(s)>"

    @classmethod
    def from_cards(cls, cards: dict[int, dict[str, Any]]) -> Topology:
        return cls([RankInfo(r, c["host"], c["machine"], int(c.get("pid", 0)), c["addr"], c.get("ifname", ""),
                             tuple(parse_cpulist(c.get("cores", ""))), tuple(c.get("numa", ())),
                             c.get("gpu"))
                    for r, c in sorted(cards.items())])

    @property
    def size(self) -> int:
        return len(self.ranks)

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of[a] == self.host_of[b]

    def near(self, rank: int) -> tuple[int, ...]:
        """The other ranks on `rank`'s host: its shared-memory peers."""
        return tuple(r for r in self.hosts[self.host_of[rank]] if r != rank)

    def tier(self, a: int, b: int) -> str:
        """The tier of a pair of world ranks (one of TIERS)."""
        x, y = self.ranks[a], self.ranks[b]
        if not self.same_host(a, b):
            return "net"
        if x.pid == y.pid:
            return "self"
        if x.numa_node >= 0 and x.numa_node == y.numa_node:
            return "numa"
        return "host"

    def layout(self, ranks: Sequence[int], name: str = "") -> Layout | None:
        """Where the group of these world ranks lies (group rank i = ranks[i]); None for a
        group on one host, whose algorithms need no order but the plain one."""
        by_host: dict[int, list[int]] = {}
        for i, w in enumerate(ranks):
            by_host.setdefault(self.host_of[w], []).append(i)
        if len(by_host) < 2:
            return None
        hosts = tuple(tuple(v) for v in by_host.values())  # dicts keep insertion: lowest rank first
        nics = tuple(len({self.ranks[ranks[i]].interface for i in h}) for h in hosts)
        out = Layout(hosts, nics)
        if name and _log.isEnabledFor(20):
            _log.info("group %s: %s; ring %s; rooted patterns start on the root's host, root first; %s",
                      name, out.describe(), " ".join(map(str, out.ring)), out.describe_hierarchy())
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.size,
                "hosts": [{"host": self.ranks[h[0]].host, "machine": self.ranks[h[0]].machine,
                           "ranks": list(h)} for h in self.hosts],
                "ranks": [i.as_dict() for i in self.ranks]}

    def describe(self, orders: bool = True) -> list[str]:
        """Lines for `tensorwire topo`: hosts with their ranks, each rank's binding, GPU and
        interface, and the orders the world group's algorithms run in."""
        machines = len(set(self.machine_of))
        lines = [f"{self.size} rank(s) on {len(self.hosts)} host(s)"
                 + (f", {machines} machine(s)" if machines != len(self.hosts) else "")]
        for h, members in enumerate(self.hosts):
            first = self.ranks[members[0]]
            lines.append(f"host {h}: {first.host} (machine {first.machine[:8]}), ranks "
                         f"{format_cpulist(members) if list(members) == sorted(members) else members}")
            for r in members:
                i = self.ranks[r]
                numa = ",".join(map(str, i.numa)) if i.numa else "?"
                gpu = "" if not i.gpu else \
                    f"  gpu {i.gpu.get('index')} {i.gpu.get('name', '')} {i.gpu.get('pci', '')}".rstrip()
                lines.append(f"  rank {r:<4} pid {i.pid:<8} cores {format_cpulist(i.cores):<10} "
                             f"numa {numa:<4} {i.interface or '?'} {i.address}{gpu}")
        if self.size > 1:
            counts: dict[str, int] = {}
            for a in range(self.size):
                for b in range(a + 1, self.size):
                    t = self.tier(a, b)
                    counts[t] = counts.get(t, 0) + 1
            lines.append("pairs by tier: " + ", ".join(f"{t} {counts[t]}" for t in TIERS if t in counts))
        if orders:
            lay = self.layout(range(self.size))
            if lay is None:
                lines.append("orders: one host: the ring and trees follow rank order")
            else:
                lines.append(f"ring order: {' '.join(map(str, lay.ring))}")
                lines.append(f"tree order from rank 0: {' '.join(map(str, lay.rooted(0)))} "
                             f"(from any root: the root's host first, the root first)")
                lines.append(lay.describe_hierarchy())
        return lines


@dataclass(frozen=True)
class Layout:
    """A group spread over hosts: `hosts[h]` its ranks on host h (group ranks), `nics[h]` how
    many network interfaces they use there. Orders map a virtual rank (the position an
    algorithm runs at) to a group rank."""

    hosts: tuple[tuple[int, ...], ...]
    nics: tuple[int, ...]
    _rooted: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def ring(self) -> tuple[int, ...]:
        """Each host's ranks together, hosts in order: H host crossings around the ring."""
        return tuple(r for h in self.hosts for r in h)

    def rooted(self, root: int) -> tuple[int, ...]:
        """The order of a pattern rooted at `root`: the root, the rest of its host, the other
        hosts as in the ring. Virtual rank 0 is the root; a binomial tree over it then crosses
        to each other host once where hosts hold a power of two of ranks."""
        order = self._rooted.get(root)
        if order is None:
            home = next(h for h in self.hosts if root in h)
            others = (r for h in self.hosts if h is not home for r in h)
            order = (root, *(r for r in home if r != root), *others)
            if len(self._rooted) < 4096:
                self._rooted[root] = order
            _log.debug("rooted order from group rank %d: %s", root, " ".join(map(str, order)))
        return order

    @property
    def placement(self) -> tuple[int, ...]:
        """Each group rank's host (an index into `hosts`)."""
        where = {g: k for k, on in enumerate(self.hosts) for g in on}
        return tuple(where[g] for g in range(len(where)))

    @property
    def shape(self) -> Shape | None:
        """The hierarchy's shape where a host holds 2 or more ranks; None where every host
        holds one."""
        per = [len(h) for h in self.hosts]
        if max(per) < 2:
            return None
        least = min(per)
        return Shape(len(self.hosts), max(per), least / min(self.nics), None if least == max(per) else least)

    @property
    def rails(self) -> tuple[tuple[int, ...], ...]:
        """Rail i: the i-th rank of every host that has one."""
        return tuple(tuple(h[i] for h in self.hosts if i < len(h)) for i in range(max(map(len, self.hosts))))

    def describe(self) -> str:
        return f"{sum(map(len, self.hosts))} ranks on {len(self.hosts)} hosts " + _lists(self.hosts)

    def describe_hierarchy(self) -> str:
        shape = self.shape
        if shape is None:
            return "no hierarchy (one rank per host)"
        if shape.uniform:
            return f"hierarchy: {shape.hosts} hosts x {shape.per_host} ranks; rails {_lists(self.rails)}"
        return (f"hierarchy: {shape.hosts} hosts of {'/'.join(str(len(h)) for h in self.hosts)} ranks; "
                f"rails every host has {_lists(self.rails[:shape.rails])}")


def _lists(groups: Iterable[Iterable[int]]) -> str:
    return " ".join("[" + " ".join(map(str, g)) + "]" for g in groups)
