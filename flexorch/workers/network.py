"""Where a worker's collectives listen and whether its peers can reach it: binding gloo and NCCL to the address
Ray knows the node by, and a reachability check before a world forms.

Why: gloo (and NCCL's bootstrap) pick the address they announce to their peers from the hostname unless told an
interface. On many real hosts the hostname resolves to loopback (``/etc/hosts``: 127.0.0.1, or Ubuntu's
127.0.1.1), so every worker announced 127.0.0.1 and a world spanning hosts never formed: ``Gloo connectFullMesh
failed ... remote=[127.0.0.1]:... Connection refused`` after the collective timeout, read by the driver as dying
workers. Torch takes the interface from ``GLOO_SOCKET_IFNAME`` (read each time a gloo process group is constructed
without options, ``ProcessGroupGloo``'s Python constructor in torch 2.13) and NCCL from ``NCCL_SOCKET_IFNAME``
(``=name`` matches exactly, not as a prefix). :func:`bind_collectives` sets both to the interface that holds the
node's Ray address (``ray.util.get_node_ip_address()``, the address of ``ray start --node-ip-address``), unless
the user set them: a user's own setting wins.

:func:`check_reachable` is the part that makes a world that cannot connect fail in seconds with a message naming
the two addresses, instead of after the collective timeout as lost workers: every rank listens on the address its
collectives will announce, publishes it in the world's rendezvous store, connects to every other rank's address
with a short timeout and a handshake (so a port that happens to be open on the wrong host does not pass), and
publishes what failed; every rank then reads every rank's result and, when any pair failed, raises the same
:class:`~flexorch.workers.errors.WorldUnreachableError`. gloo connects every pair of a world (a full mesh), so
this checks what gloo needs, no more.

Linux only for the interface lookup (``SIOCGIFADDR``); elsewhere nothing is set and the check still runs.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from flexorch.workers.errors import WorldUnreachableError

__all__ = ["Binding", "bind_collectives", "check_reachable", "interface_address", "interface_of"]

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"
CONNECT_S = 5.0
"""How long one rank's connect (and handshake) to another may take before the pair counts as unreachable."""
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: get an interface's (primary) IPv4 address


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (None: no such interface, no IPv4 address, or not Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])  # struct ifreq: 16 bytes of name, then sockaddr_in (family, port, addr)


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds IPv4 address ``ip`` (None when none does)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if interface_address(name) == ip:
            return name
    return None


@dataclass(frozen=True)
class Binding:
    """What this worker's collectives announce to their peers."""

    address: str
    """The IPv4 address gloo announces (the node's Ray address, or that of the user's ``GLOO_SOCKET_IFNAME``)."""
    interface: str | None
    """The interface holding it (None: not found; gloo then falls back to the hostname)."""
    source: str
    """'ray' (chosen here from the node's Ray address) or 'user' (the environment already named the interface)."""

    def describe(self) -> str:
        where = f"interface {self.interface}" if self.interface else "no interface found for it"
        how = f"{GLOO_IFNAME} set by the user" if self.source == "user" else "Ray's node address"
        return f"{self.address} ({where}; from {how})"


def bind_collectives(node_ip: str, environ=os.environ) -> Binding:
    """Point gloo and NCCL at the interface holding ``node_ip`` (the address Ray knows this node by) by setting
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` in this process's environment, unless already set (a user's
    own setting wins). Returns the address the collectives will announce. Call before the world forms."""
    user = environ.get(GLOO_IFNAME, "").strip()
    if user:
        first = user.split(",")[0].strip()
        return Binding(interface_address(first) or node_ip, first, "user")
    name = interface_of(node_ip)
    if name is not None:
        environ[GLOO_IFNAME] = name
        environ.setdefault(NCCL_IFNAME, f"={name}")  # '=': this interface exactly, not every name it prefixes
    return Binding(node_ip, name, "ray")


def _hello(epoch: int, rank: int) -> bytes:
    return f"flexorch-reach {epoch} {rank}\n".encode()


class _Listener:
    """Answers every connection with this rank's hello until closed (a daemon thread)."""

    def __init__(self, address: str, epoch: int, rank: int):
        try:
            self.sock = socket.create_server((address, 0), backlog=128)
        except OSError:  # an address no interface here holds (a NAT's): listen on all, peers still dial `address`
            self.sock = socket.create_server(("", 0), backlog=128)
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.2)
        self._hello = _hello(epoch, rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="flexorch-reach", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(self._hello)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()


def _reach(address: str, port: int, expect: bytes, timeout_s: float) -> str | None:
    """None when ``address:port`` answers with ``expect``; else why not."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            got = b""
            while len(got) < len(expect):
                chunk = s.recv(len(expect) - len(got))
                if not chunk:
                    break
                got += chunk
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    if got != expect:
        return f"something else answered there ({got[:40]!r})"
    return None


def check_reachable(
    store, rank: int, world_size: int, epoch: int, binding: Binding, timeout_s: float, connect_s: float = CONNECT_S
) -> float:
    """Before a world of ``world_size`` forms on ``store``: check that every rank can connect to every other rank's
    collective address (see the module docstring). Returns the seconds it took; raises
    :class:`WorldUnreachableError` on every rank when any pair could not connect, naming the pairs."""
    t0 = time.perf_counter()
    if world_size <= 1:
        return 0.0
    prefix = f"flexorch/reach/epoch{epoch}"
    listener = _Listener(binding.address, epoch, rank)
    try:
        store.set(f"{prefix}/addr/{rank}", json.dumps([binding.address, listener.port, binding.describe()]))
        keys = [f"{prefix}/addr/{r}" for r in range(world_size)]
        store.wait(keys, timedelta(seconds=timeout_s))
        peers = {r: json.loads(store.get(k)) for r, k in enumerate(keys)}
        others = [r for r in range(world_size) if r != rank]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(others))) as pool:
            why = dict(
                zip(
                    others,
                    pool.map(lambda r: _reach(peers[r][0], peers[r][1], _hello(epoch, r), connect_s), others),
                    strict=True,
                )
            )
        failed = [[r, w] for r, w in why.items() if w is not None]
        store.set(f"{prefix}/result/{rank}", json.dumps(failed))
        results = [f"{prefix}/result/{r}" for r in range(world_size)]
        store.wait(results, timedelta(seconds=timeout_s + connect_s * world_size))
        pairs = [(r, q, w) for r, k in enumerate(results) for q, w in json.loads(store.get(k))]
    finally:
        listener.close()
    if pairs:
        raise WorldUnreachableError(_message(pairs, peers, world_size))
    return time.perf_counter() - t0


def _message(pairs, peers: dict, world_size: int) -> str:
    shown = "; ".join(
        f"rank {r} at {peers[r][0]} could not connect to rank {q} at {peers[q][0]}:{peers[q][1]} ({why})"
        for r, q, why in pairs[:4]
    )
    more = f" (and {len(pairs) - 4} more pairs)" if len(pairs) > 4 else ""
    loop = any(str(peers[q][0]).startswith("127.") for _, q, _ in pairs)
    hint = (
        " A loopback address was announced: that rank's collectives are bound to its loopback interface."
        if loop
        else ""
    )
    addresses = ", ".join(f"rank {r}: {peers[r][2]}" for r in sorted(peers)[:8])
    return (
        f"the torch.distributed world of {world_size} workers could not connect: {shown}{more}.{hint} Each worker's "
        f"collectives announce the address Ray knows its node by unless {GLOO_IFNAME} (and, on GPUs, "
        f"{NCCL_IFNAME}) is set in the environment of its `ray start`: unset them, or set them to the interface "
        f"that holds the node's address on the network the nodes share, and start each node with "
        f"`ray start --node-ip-address=<that address>`. Addresses: {addresses}. Not a lost worker: the run stops "
        f"here instead of shrinking."
    )
