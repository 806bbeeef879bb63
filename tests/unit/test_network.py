"""Binding collectives to the node's address, and the reachability check before a world forms
(``flexorch.workers.network``), on real sockets and a real TCPStore on loopback. The multi-host case (hosts whose
hostname resolves to loopback, in network namespaces) is ``tests/cluster/test_emulated_hosts.py``."""

from __future__ import annotations

import json
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from flexorch.workers.errors import WorldUnreachableError
from flexorch.workers.network import Binding, bind_collectives, check_reachable, interface_address, interface_of


def test_interface_lookup_finds_loopback():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_address("lo") == "127.0.0.1"
    assert interface_of("192.0.2.254") is None  # TEST-NET-1: held by no interface here
    assert interface_address("no-such-if0") is None


def test_bind_sets_the_interface_of_the_node_address_and_a_users_setting_wins():
    env: dict = {}
    b = bind_collectives("127.0.0.1", env)
    assert (b.address, b.interface, b.source) == ("127.0.0.1", "lo", "ray")
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}
    env = {"GLOO_SOCKET_IFNAME": "lo,eth9"}  # the user's own: kept, and its first interface's address announced
    b = bind_collectives("10.1.2.3", env)
    assert (b.address, b.interface, b.source) == ("127.0.0.1", "lo", "user")
    assert env == {"GLOO_SOCKET_IFNAME": "lo,eth9"}
    env = {}
    b = bind_collectives("192.0.2.254", env)  # no interface holds it: nothing set, gloo falls back to the hostname
    assert (b.interface, env) == (None, {})


def _ranks(n: int, store_port: int, epoch: int, fn):
    out: dict = {}

    def one(r):
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=20))
        try:
            out[r] = fn(store, r)
        except Exception as e:  # noqa: BLE001 - collected for the test
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_pair_connects_on_loopback():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lo = Binding("127.0.0.1", "lo", "ray")
    got = _ranks(3, master.port, 1, lambda store, r: check_reachable(store, r, 3, 1, lo, timeout_s=20))
    assert all(isinstance(v, float) and v < 10 for v in got.values()), got


def test_an_unreachable_rank_fails_every_rank_in_seconds_naming_both_addresses():
    """Rank 2 announces a port nobody listens on (as a worker bound to another host's loopback does): ranks 0 and 1
    both raise, naming the pair and what to set, in seconds."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]  # bound, never listening: a connect is refused
        prefix = "flexorch/reach/epoch4"
        master.set(f"{prefix}/addr/2", json.dumps(["127.0.0.1", dead_port, "127.0.0.1 (interface lo)"]))
        master.set(f"{prefix}/result/2", json.dumps([]))
        lo = Binding("127.0.0.1", "lo", "ray")
        got = _ranks(2, master.port, 4, lambda store, r: check_reachable(store, r, 3, 4, lo, timeout_s=20))
    for r in (0, 1):
        assert isinstance(got[r], WorldUnreachableError), got
        msg = str(got[r])
        assert f"rank {r} at 127.0.0.1 could not connect to rank 2 at 127.0.0.1:{dead_port}" in msg
        assert "GLOO_SOCKET_IFNAME" in msg and "--node-ip-address" in msg and "Not a lost worker" in msg
    assert str(got[0]) == str(got[1])  # every rank reaches the same verdict


def test_a_port_answered_by_something_else_does_not_pass():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.create_server(("127.0.0.1", 0)) as other:  # a listener that says nothing and closes
        other.settimeout(10)
        port = other.getsockname()[1]
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                try:
                    c, _ = other.accept()
                    c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                    c.close()
                except OSError:
                    return

        threading.Thread(target=serve, daemon=True).start()
        master.set("flexorch/reach/epoch2/addr/1", json.dumps(["127.0.0.1", port, "x"]))
        master.set("flexorch/reach/epoch2/result/1", json.dumps([]))
        lo = Binding("127.0.0.1", "lo", "ray")
        got = _ranks(1, master.port, 2, lambda store, r: check_reachable(store, r, 2, 2, lo, timeout_s=20))
        stop.set()
    assert isinstance(got[0], WorldUnreachableError) and "something else answered" in str(got[0])


def test_a_world_of_one_checks_nothing():
    assert check_reachable(None, 0, 1, 0, Binding("127.0.0.1", "lo", "ray"), timeout_s=1) == 0.0


def test_repeated_epochs_on_one_store():
    n = 2
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lo = Binding("127.0.0.1", "lo", "ray")
    for epoch in (1, 2):
        got = _ranks(n, master.port, epoch, lambda store, r, e=epoch: check_reachable(store, r, n, e, lo, 20))
        assert all(isinstance(v, float) for v in got.values()), got


def test_an_address_no_interface_here_holds_is_listened_for_on_all(monkeypatch):
    """A node address no local interface holds (behind a NAT) cannot be bound: the check listens on every interface
    and its peers dial the announced address (here loopback, where the listener on all interfaces answers)."""
    from flexorch.workers import network

    real = socket.create_server
    refused = []

    def create_server(address, **kw):
        if address[0]:  # binding the announced address fails, as for an address held by no interface here
            refused.append(address[0])
            raise OSError(99, "Cannot assign requested address")
        return real(address, **kw)

    monkeypatch.setattr(network.socket, "create_server", create_server)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lo = Binding("127.0.0.1", None, "ray")
    got = _ranks(2, master.port, 3, lambda store, r: check_reachable(store, r, 2, 3, lo, timeout_s=20))
    assert all(isinstance(v, float) for v in got.values()), got
    assert refused == ["127.0.0.1", "127.0.0.1"]
