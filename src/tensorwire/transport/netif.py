"""Which local IPv4 address a rank advertises for its peers to connect to.

The hostname is deliberately never consulted: on many machines it resolves to 127.0.1.1 or to
an address of the wrong network, which yields a job that hangs instead of failing. The
answer is either the user's interface choice (NCCL_SOCKET_IFNAME syntax) or the address the
kernel routes through toward the store host, which all peers already proved they can reach.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Iterable
from typing import cast

from ..errors import InvalidArgumentError, RendezvousError

_SIOCGIFADDR = 0x8915  # Linux: get the primary IPv4 address of an interface


def _ipv4_of(sock: socket.socket, name: str) -> str | None:
    try:
        packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None  # no IPv4 address on this interface (or it went away)
    return socket.inet_ntoa(packed[20:24])


def list_interfaces() -> list[tuple[str, str]]:
    """(name, IPv4 address) of every interface that has an IPv4 address, in kernel index order."""
    out: list[tuple[str, str]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            addr = _ipv4_of(sock, name)
            if addr is not None:
                out.append((name, addr))
    return out


def match_ifname(spec: str, names: Iterable[str]) -> list[str]:
    """Filter interface names with NCCL_SOCKET_IFNAME syntax, keeping the order of `names`.

    'eth0,ib' keeps names starting with eth0 or ib; '^docker,lo' keeps all but those
    prefixes; '=eth0' keeps exactly eth0; '^=lo' drops exactly lo. An empty spec keeps all.
    """
    names = list(names)
    spec = spec.strip()
    if not spec:
        return names
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    patterns = [p.strip() for p in spec.split(",") if p.strip()]
    if not patterns:
        raise InvalidArgumentError(f"interface filter {spec!r} names no interface")

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [n for n in names if hit(n) != exclude]


def route_source_address(toward_host: str, port: int) -> str:
    """The local IPv4 the kernel would use to reach `toward_host` (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(toward_host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise RendezvousError(
            f"cannot resolve {toward_host!r} to an IPv4 address to route toward: {exc}") from exc
    target = cast(tuple[str, int], infos[0][4])  # AF_INET's (address, port)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(target)
            return sock.getsockname()[0]
        except OSError as exc:
            raise RendezvousError(
                f"no route from this host toward {toward_host} ({target[0]}:{target[1]}): {exc}") from exc


def select_address(spec: str, toward: str | None, port: int | None, *, multi_host: bool = False) -> str:
    """The address to advertise: the first interface matching `spec` if set, else the route
    source toward the store host `toward`, else (single process, no store host) loopback.

    When the job spans hosts, a loopback route (MASTER_ADDR naming this host through a
    127.0.1.1 line in /etc/hosts, as Debian writes it) would be unreachable for the others:
    then the first non-loopback interface is advertised instead."""
    if spec and spec.strip():
        interfaces = list_interfaces()
        chosen = match_ifname(spec, [name for name, _ in interfaces])
        if not chosen:
            available = ", ".join(f"{n}={a}" for n, a in interfaces) or "none with an IPv4 address"
            raise RendezvousError(
                f"no network interface matches TENSORWIRE_SOCKET_IFNAME={spec!r}; available: {available}")
        return dict(interfaces)[chosen[0]]
    if not toward:
        return "127.0.0.1"
    address = route_source_address(toward, port or 1)
    if multi_host and address.startswith("127."):
        external = [a for _, a in list_interfaces() if not a.startswith("127.")]
        if not external:
            raise RendezvousError(
                f"the job spans several hosts but {toward} routes to loopback here and no other "
                f"interface has an IPv4 address; set TENSORWIRE_SOCKET_IFNAME")
        return external[0]
    return address


def interface_of(address: str) -> str:
    """The name of the interface that holds `address` ('' where none does, e.g. a wildcard)."""
    return next((name for name, addr in list_interfaces() if addr == address), "")
