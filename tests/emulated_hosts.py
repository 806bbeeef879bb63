"""Emulated hosts that share no loopback: a Ray cluster of network namespaces on this one machine
(``../shared/DESIGN.md`` §8).

Each host is a network namespace with one veth pair into a bridge in the root namespace, an address on a private
/24 of the harness's own (``10.213.K.0/24``, K the first one no interface and no other harness uses), the interface
inside renamed ``eth1`` on every host, ``lo`` up and a default route to the bridge. The Ray head runs on the bridge
address in the root namespace with no CPU slots; each host runs ``ray start --address=HEAD --node-ip-address=HOST_IP
--num-cpus=WORKERS_PER_HOST --block`` inside its namespace. The hostname still resolves to 127.0.0.1 inside every
namespace (``/etc/hosts`` is shared, as on this machine): that is the condition under which a process announcing
"its hostname's address" to peers on other hosts announces an address they cannot reach.

Each host has a ``resolv.conf`` of its own (``/etc/netns/NAME/resolv.conf``, which ``ip netns exec`` mounts over
``/etc/resolv.conf``) naming a nameserver on the host's own loopback, where none listens: a DNS query fails at once,
as on a host whose resolver answers. This machine's nameserver cannot be reached from a namespace, so each query
timed out after 10 s instead (c10d looks up the name of every peer that connects to its store: every world took 10 s
longer to form, seen on 2026-12-03), with the same answer.

Used as a context manager (a benchmark script) or through the ``emulated_hosts`` fixture of ``tests/cluster``::

    with EmulatedHosts(2, workers_per_host=2, rate="200mbit") as hosts:
        subprocess.run(["flexorch", "train", "--address", hosts.head_address, ...], env=hosts.client_env())
        hosts.run(0, ["ip", "addr"])                           # a command inside host 0
        hosts.restart_host(1, env={"GLOO_SOCKET_IFNAME": "lo"})  # its Ray node again, with extra environment
        hosts.kill_raylet(1)                                    # host 1 crashes (its raylet SIGKILLed)

Teardown (``close``, also on an exception or KeyboardInterrupt, and at interpreter exit as a last resort) SIGKILLs
exactly the processes the harness started: every process inside its namespaces, and the head's ``ray start``
process tree plus any process naming the harness's private Ray temp dir; then it deletes the namespaces (their veth
ends go with them) and their ``/etc/netns/NAME``, the root-side veths, the bridge and the temp dir. It never runs
``ray stop`` (which ends every Ray on the machine) and touches nothing it did not create; a harness whose process
was SIGKILLed before its teardown is cleaned up by the next one to start (``/tmp/flexorch-emulated-hosts/K.json``
names what it made and its pid). Ray's token authentication is set explicitly on every node
(``EmulatedHosts._auth``) and subprocess clients take ``client_env()``. Where namespaces cannot be made (not root,
no ``ip``, ``ip netns add`` refused) the constructor's ``start`` raises :class:`EmulatedHostsUnavailable`, whose
message is the reason (the fixture skips with it); :func:`unavailable_reason` checks without starting anything.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["EmulatedHosts", "EmulatedHostsUnavailable", "Host", "unavailable_reason"]

BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
IFACE = "eth1"
"""The interface name inside every namespace (renamed from the veth's peer end)."""
SUBNETS = "10.213.{k}.0/24"
"""The harness's address space: K from 0 to 255, the first no interface of the root namespace uses."""
_STATE = Path("/tmp/flexorch-emulated-hosts")
"""``lock`` (held while a harness picks its subnet and names and makes its bridge, so two never pick the same) and
one ``K.json`` per live harness: its owner's pid and what it made, so a harness whose process died without its
teardown (SIGKILL) is cleaned up by the next one."""
_NETNS_DIR = Path("/var/run/netns")
_NETNS_ETC = Path("/etc/netns")
"""Per-namespace files ``ip netns exec`` mounts over ``/etc`` (``NAME/resolv.conf``)."""
_RESOLV = "# flexorch emulated host: no nameserver listens here, so a DNS query fails at once\nnameserver 127.0.0.1\n"
_TBF = ("burst", "256kb", "latency", "100ms")


class EmulatedHostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made here (None: they can): not root, no ``ip``/``tc``, ``ip netns add`` refused."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veths, a bridge)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` (iproute2) on PATH"
    probe = f"fxprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(_NETNS_DIR / name).st_ino
    except OSError:
        return None


def _processes() -> dict[int, tuple[int, bytes]]:
    """Every process now: pid -> (parent pid, command line)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            out[int(d.name)] = (ppid, (d / "cmdline").read_bytes())
        except (OSError, ValueError, IndexError):
            continue
    return out


def _tree(root: int, procs: dict[int, tuple[int, bytes]]) -> set[int]:
    """``root`` and its descendants among ``procs``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _in_netns(inode: int | None) -> set[int]:
    """Processes whose network namespace is the one of ``inode``."""
    if inode is None:
        return set()
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.stat(d / "ns" / "net").st_ino == inode:
                    out.add(int(d.name))
            except OSError:
                continue
    return out


def _sigkill(pids) -> None:
    for pid in pids:
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _reap_dead_owners() -> None:
    """Tear down what harnesses whose process is gone left behind (their ``K.json``): the processes in their
    namespaces and naming their temp dir, the namespaces, veths, bridge and temp dir. Called under the lock."""
    for state in _STATE.glob("*.json"):
        try:
            made = json.loads(state.read_text())
            os.kill(int(made["pid"]), 0)
            continue  # its owner lives: not ours to touch
        except ProcessLookupError:
            pass
        except (OSError, ValueError, KeyError):
            continue
        pids = set().union(*(_in_netns(_netns_inode(ns)) for ns in made["namespaces"]))
        needle = made["temp"].encode()
        pids |= {pid for pid, (_, cmd) in _processes().items() if needle in cmd}
        _sigkill(pids)
        for ns in made["namespaces"]:
            _ip("netns", "del", ns, check=False)
            _remove_resolv(ns)
        for link in [*made["veths"], made["bridge"]]:
            _ip("link", "del", link, check=False)
        shutil.rmtree(made["temp"], ignore_errors=True)
        state.unlink(missing_ok=True)


def _remove_resolv(netns: str) -> None:
    """Delete the namespace's ``/etc/netns/NAME`` (``/etc/netns``, iproute2's own directory, stays)."""
    shutil.rmtree(_NETNS_ETC / netns, ignore_errors=True)


@dataclass
class Host:
    """One emulated host: its namespace, address, the root-side veth of its link, its Ray node's process."""

    index: int
    netns: str
    ip: str
    veth: str
    """The root namespace's end of the host's link (inside, the other end is ``IFACE``)."""
    env: dict = field(default_factory=dict)
    """Extra environment its Ray node was started with, beyond the harness's ``env`` (its workers inherit it)."""
    rate: str | None = None
    proc: subprocess.Popen | None = None
    log: Path | None = None
    starts: int = 0


class EmulatedHosts:
    """``n`` emulated hosts of ``workers_per_host`` CPU slots each around a Ray head with none (module docstring).

    ``rate``: a ``tc`` rate (``"200mbit"``) for every host's link, both directions (None: unlimited); ``env``: extra
    environment of every Ray node, the head's included (their workers inherit it); ``root``: where the ``ray start``
    logs go, and Ray's own logs when the cluster fails to form (default: the temp dir, removed at close);
    ``node_timeout_s``: how long ``start`` waits for all nodes to register."""

    def __init__(
        self,
        n: int,
        workers_per_host: int = 2,
        rate: str | None = None,
        env: dict | None = None,
        root: Path | str | None = None,
        node_timeout_s: float = 120.0,
    ):
        if n < 1 or workers_per_host < 1:
            raise ValueError(f"EmulatedHosts needs n >= 1 and workers_per_host >= 1, got {n} and {workers_per_host}")
        self.n = n
        self.workers_per_host = workers_per_host
        self.rate = rate
        self.env = dict(env or {})
        self.node_timeout_s = node_timeout_s
        self._root_arg = Path(root) if root is not None else None
        self.hosts: list[Host] = []
        self.bridge: str | None = None
        self.bridge_ip: str | None = None
        self.head_port: int | None = None
        self.temp: Path | None = None
        self.root: Path | None = None
        self._head: subprocess.Popen | None = None
        self._head_tree: set[int] = set()
        self._logs: list = []
        self._closed = False
        self._state: Path | None = None
        self.auth_mode = "disabled"
        """Ray's token authentication on this cluster: 'token' or 'disabled' (``_auth``)."""
        self._token_path: Path | None = None
        self.timings: dict[str, float] = {}
        """Seconds of ``network``, ``head``, ``hosts`` (started and registered) and ``close``."""

    # ---- addresses -------------------------------------------------------------------------------------------
    @property
    def head_address(self) -> str:
        """``BRIDGE_IP:GCS_PORT``: what ``ray.init(address=...)`` and ``flexorch train --address`` take."""
        return f"{self.bridge_ip}:{self.head_port}"

    @property
    def host_ips(self) -> list[str]:
        return [h.ip for h in self.hosts]

    # ---- context manager -------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedHosts:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> EmulatedHosts:
        """Make the network, start the head and every host's node, wait until all are registered. On any failure
        (and on KeyboardInterrupt) what was made is torn down before the exception goes on."""
        reason = unavailable_reason()
        if reason is not None:
            raise EmulatedHostsUnavailable(reason)
        atexit.register(self.close)
        try:
            self.temp = Path(tempfile.mkdtemp(prefix="fxeh-", dir="/tmp"))  # short: Ray's socket paths < 108 bytes
            self.root = self._root_arg or self.temp / "logs"
            self.root.mkdir(parents=True, exist_ok=True)
            self._auth()
            t = time.monotonic()
            self._make_network()
            self.timings["network"] = time.monotonic() - t
            t = time.monotonic()
            self._start_head()
            self.wait_for_nodes(hosts=False)  # hosts that come before the GCS time out starting
            self.timings["head"] = time.monotonic() - t
            t = time.monotonic()
            for h in self.hosts:
                self._start_node(h)
            self.wait_for_nodes()
            self.timings["hosts"] = time.monotonic() - t
        except BaseException:
            self._save_ray_logs()
            self.close()
            raise
        return self

    # ---- the network -----------------------------------------------------------------------------------------
    def _make_network(self) -> None:
        _STATE.mkdir(exist_ok=True)
        with open(_STATE / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _reap_dead_owners()
            used = _ip("-o", "-4", "addr", "show").stdout
            links = _ip("-o", "link", "show").stdout
            namespaces = _ip("netns", "list").stdout
            for k in range(256):
                net = ipaddress.ip_network(SUBNETS.format(k=k))
                prefix = str(net.network_address).rsplit(".", 1)[0] + "."
                taken = (_STATE / f"{k}.json").exists() or prefix in used
                if taken or f" fxb{k}:" in links or f"fx{k}h" in namespaces:
                    continue
                break
            else:
                raise EmulatedHostsUnavailable("every 10.213.K.0/24 is in use here")
            hosts = list(net.hosts())
            self.bridge, self.bridge_ip = f"fxb{k}", str(hosts[0])
            self._state = _STATE / f"{k}.json"
            self._state.write_text(json.dumps({
                "pid": os.getpid(), "bridge": self.bridge, "temp": str(self.temp),
                "namespaces": [f"fx{k}h{i}" for i in range(self.n)], "veths": [f"fxv{k}h{i}" for i in range(self.n)],
            }))  # fmt: skip
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            h = Host(index=i, netns=f"fx{k}h{i}", ip=str(hosts[10 + i]), veth=f"fxv{k}h{i}")
            self.hosts.append(h)
            peer = f"fxp{k}h{i}"
            _ip("netns", "add", h.netns)
            (_NETNS_ETC / h.netns).mkdir(parents=True, exist_ok=True)
            (_NETNS_ETC / h.netns / "resolv.conf").write_text(_RESOLV)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", h.netns)
            _ip("link", "set", h.veth, "master", self.bridge)
            _ip("link", "set", h.veth, "up")
            _ip("-n", h.netns, "link", "set", peer, "name", IFACE)
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", IFACE)
            _ip("-n", h.netns, "link", "set", IFACE, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "route", "add", "default", "via", self.bridge_ip)
            if self.rate:
                self.set_rate(i, self.rate)

    def set_rate(self, host: int, rate: str) -> None:
        """Limit host ``host``'s link to ``rate`` (``tc`` units: ``200mbit``) both ways (tbf, burst 256kb)."""
        h = self.hosts[host]
        for prefix in ([], ["ip", "netns", "exec", h.netns]):
            dev = h.veth if not prefix else IFACE
            cmd = [*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, *_TBF]
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        h.rate = rate

    def clear_rate(self, host: int) -> None:
        """Take host ``host``'s rate limit off (both ends)."""
        h = self.hosts[host]
        for prefix in ([], ["ip", "netns", "exec", h.netns]):
            dev = h.veth if not prefix else IFACE
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
        h.rate = None

    # ---- Ray nodes -------------------------------------------------------------------------------------------
    def client_env(self) -> dict:
        """The environment for a Ray client of this cluster started as a subprocess (``flexorch train --address``,
        ``ray status``): this process's, without ``RAY_ADDRESS``, with the cluster's token-authentication mode."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
        env["RAY_AUTH_MODE"] = self.auth_mode
        if self._token_path is not None:
            env["RAY_AUTH_TOKEN_PATH"] = str(self._token_path)
        return env

    def _auth(self) -> None:
        """Ray's token authentication, decided once: as this process's ``RAY_AUTH_MODE`` says (the suite's shared
        local Ray exports ``token``, and a client in this process must match the cluster), else off. Left unset,
        ``ray start --head`` turns it on whenever ``~/.ray/auth_token`` exists (any local ``ray.init`` writes one)
        while a client with it unset connects without a token and is refused. In token mode the nodes read this
        process's token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, shared through the
        filesystem); where there is none, one is made in the harness's temp dir (``client_env`` names it)."""
        self.auth_mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower() or "disabled"
        self._token_path = None
        if self.auth_mode != "token" or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
            return
        if not (Path.home() / ".ray" / "auth_token").is_file():
            self._token_path = self.temp / "auth_token"
            self._token_path.write_text(os.urandom(32).hex())

    def _base_env(self, extra: dict) -> dict:
        env = self.client_env()
        # a node killed by SIGKILL is declared dead in ~3 s, not Ray's default ~15-30 s (a restarted host's old node
        # stops counting sooner); set on every node, read by the head's GCS
        env.setdefault("RAY_health_check_period_ms", "1000")
        env.setdefault("RAY_health_check_failure_threshold", "3")
        # workers at niceness 0, as flexorch's own local Ray starts them: on this shared 2-core machine Ray's default
        # 15 leaves them a few per cent of a core beside other busy processes
        env.setdefault("RAY_worker_niceness", "0")
        return {**env, **{k: str(v) for k, v in {**self.env, **extra}.items()}}

    def _ports(self) -> list[str]:
        return [
            f"--node-manager-port={_free_port()}",
            f"--object-manager-port={_free_port()}",
            f"--metrics-export-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}",
        ]

    def _start_head(self) -> None:
        self.head_port = _free_port()
        cmd = [RAY, "start", "--head", "--block", f"--node-ip-address={self.bridge_ip}", f"--port={self.head_port}"]
        cmd += ["--num-cpus=0", f"--temp-dir={self.temp}", "--include-dashboard=false", "--disable-usage-stats"]
        cmd += [f"--ray-client-server-port={_free_port()}", *self._ports()]
        log = open(self.root / "head.log", "w")  # noqa: SIM115 - closed at close()
        self._logs.append(log)
        self._head = subprocess.Popen(
            cmd, env=self._base_env({}), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _start_node(self, h: Host) -> None:
        cmd = ["ip", "netns", "exec", h.netns, RAY, "start", "--block", f"--address={self.head_address}"]
        cmd += [f"--node-ip-address={h.ip}", f"--num-cpus={self.workers_per_host}", "--disable-usage-stats"]
        # a temp dir of its own, as a real host has: nodes sharing one pick their socket names by looking for free
        # ones, a race when two start at once (a raylet then dies on `bind: Address already in use`)
        cmd += [f"--temp-dir={self.temp / f'h{h.index}'}", *self._ports()]
        h.log = self.root / f"host{h.index}.log"
        log = open(h.log, "a" if h.starts else "w")  # noqa: SIM115 - closed at close()
        h.starts += 1
        self._logs.append(log)
        h.proc = subprocess.Popen(
            cmd, env=self._base_env(h.env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def nodes(self) -> list[dict]:
        """The cluster's alive nodes as the GCS lists them: ``[{"ip", "cpus", "node_id"}, ...]`` (asked from a
        subprocess, so the calling process's own Ray connection, if any, is left alone)."""
        return self._list_nodes(None, 0.0)

    _NODES_SCRIPT = """
import json, sys, time, ray
want, deadline = json.loads(sys.argv[2]), time.monotonic() + float(sys.argv[3])
ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)
while True:
    got = [{'ip': n['NodeManagerAddress'], 'cpus': n['Resources'].get('CPU', 0), 'node_id': n['NodeID']}
           for n in ray.nodes() if n['Alive']]
    if want is None or sorted([g['ip'], g['cpus']] for g in got) == sorted(want) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print('FXNODES', json.dumps(got), flush=True)
"""
    """Lists the alive nodes, once or (a wanted ``[[ip, cpus], ...]``) every 0.2 s over one connection until they
    are the wanted ones or the time is up: one Ray client start (~1.5 s of CPU) for a whole wait, not one a poll."""

    def _list_nodes(self, want: list | None, timeout_s: float) -> list[dict]:
        """The alive nodes, once the GCS lists ``want`` (None: at once) or ``timeout_s`` passed; RuntimeError when
        the listing failed (the head not up yet) or a node's ``ray start`` exited meanwhile."""
        cmd = [sys.executable, "-c", self._NODES_SCRIPT, self.head_address, json.dumps(want), str(timeout_s)]
        with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:  # no pipe to fill up
            proc = subprocess.Popen(cmd, env=self._base_env({}), stdout=out_f, stderr=err_f, text=True)
            try:
                give_up = time.monotonic() + timeout_s + 120
                while proc.poll() is None:
                    for who, p in [("head", self._head), *((f"host {h.index}", h.proc) for h in self.hosts)]:
                        if p is not None and p.poll() is not None:
                            raise RuntimeError(f"the {who}'s `ray start` exited ({p.returncode}); see {self.root}")
                    if time.monotonic() > give_up:
                        raise RuntimeError("listing the nodes did not answer")
                    time.sleep(0.2)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            out_f.seek(0)
            err_f.seek(0)
            out, err = out_f.read(), err_f.read()
        if proc.returncode != 0:
            raise RuntimeError(f"listing the nodes failed: {err[-2000:]}")
        found = [ln for ln in out.splitlines() if ln.startswith("FXNODES ")]  # Ray may print more
        if not found:
            raise RuntimeError(f"listing the nodes printed no list: {out[-2000:]} {err[-2000:]}")
        return json.loads(found[-1].split(" ", 1)[1])

    def wait_for_nodes(self, timeout_s: float | None = None, hosts: bool = True) -> list[dict]:
        """Wait until the alive nodes are exactly the head and (``hosts``) every host not stopped, each host with
        its slots (an old node of a restarted host must have been declared dead); returns them."""
        deadline = time.monotonic() + (timeout_s or self.node_timeout_s)
        want = {self.bridge_ip: 0.0}
        if hosts:
            want.update({h.ip: float(self.workers_per_host) for h in self.hosts if h.proc is not None})
        got: list[dict] = []
        error = ""
        while True:
            try:
                left = max(0.0, deadline - time.monotonic())
                got = self._list_nodes(sorted([ip, cpus] for ip, cpus in want.items()), left)
                if sorted((g["ip"], g["cpus"]) for g in got) == sorted(want.items()):
                    return got
            except json.JSONDecodeError as e:
                error = f" (the last listing: {e})"
            except RuntimeError as e:
                if "`ray start` exited" in str(e):
                    raise
                error = f" (the last listing: {e})"
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the emulated cluster did not form: want {want}, alive {got}{error}; logs in {self.root}"
                )
            time.sleep(1)  # the listing failed (the head not answering yet): ask again

    # ---- inside a host ---------------------------------------------------------------------------------------
    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` as a command run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def run(self, host: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``host`` (``subprocess.run`` keywords; output captured as text by default)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 120)
        return subprocess.run(self.command(host, argv), **kw)

    def host_pids(self, host: int) -> set[int]:
        """Every process inside host ``host``'s namespace."""
        return _in_netns(_netns_inode(self.hosts[host].netns))

    def raylet_pid(self, host: int) -> int | None:
        for pid in self.host_pids(host):
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if argv0.endswith(b"/raylet"):
                return pid
        return None

    def kill_raylet(self, host: int) -> int | None:
        """SIGKILL host ``host``'s raylet (a crashed machine: its workers and ``ray start`` go with it); its pid."""
        pid = self.raylet_pid(host)
        if pid is not None:
            _sigkill([pid])
        return pid

    def stop_host(self, host: int) -> None:
        """SIGKILL every process inside host ``host`` (its Ray node and workers); the network stays."""
        h = self.hosts[host]
        for _ in range(20):
            pids = self.host_pids(host)
            if not pids:
                break
            _sigkill(pids)
            time.sleep(0.1)
        if h.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.proc.wait(timeout=10)
        h.proc = None

    def start_host(self, host: int, env: dict | None = None) -> None:
        """Start host ``host``'s Ray node (again), with ``env`` added to the harness's (None: as before), and wait
        until the cluster is whole."""
        h = self.hosts[host]
        if env is not None:
            h.env = dict(env)
        self._start_node(h)
        self.wait_for_nodes()

    def restart_host(self, host: int, env: dict | None = None) -> None:
        """Stop host ``host``'s Ray node and start it again with ``env`` added (``{}``: the harness's own env)."""
        self.stop_host(host)
        self.start_host(host, env if env is not None else {})

    def restart_hosts(self, env: dict | None = None) -> None:
        """Every host's node again with ``env`` added (``{}``/None: the harness's own env); one wait for all."""
        for h in self.hosts:
            self.stop_host(h.index)
        for h in self.hosts:
            h.env = dict(env or {})
            self._start_node(h)
        self.wait_for_nodes()

    def use_env(self, env: dict | None = None) -> bool:
        """Make every host's node run with exactly ``env`` added (restarting every node when one has another, ~10 s;
        else starting only those that are down, e.g. a host an earlier test stopped); whether any was (re)started. A
        test that needs an environment calls this, so the tests of a module that share a cluster do not depend on
        each other's order, and a test that stops a host may leave it stopped."""
        want = {k: str(v) for k, v in (env or {}).items()}
        if any(h.env != want for h in self.hosts):
            self.restart_hosts(want)
            return True
        # the environment is right: only hosts a test stopped (and left for the next test to start) start again
        down = [h for h in self.hosts if h.proc is None or h.proc.poll() is not None]
        if not down:
            return False
        for h in down:
            self.stop_host(h.index)  # anything left of a node whose `ray start` exited
            self._start_node(h)
        self.wait_for_nodes()
        return True

    def _save_ray_logs(self) -> None:
        """Copy Ray's session logs into ``root`` when one was given (the temp dir goes at close)."""
        if self._root_arg is None or self.temp is None:
            return
        for name, where in [("head", self.temp), *((f"h{h.index}", self.temp / f"h{h.index}") for h in self.hosts)]:
            with contextlib.suppress(OSError):
                logs = where / "session_latest" / "logs"
                shutil.copytree(logs, self._root_arg / f"ray-logs-{name}", dirs_exist_ok=True)

    # ---- teardown --------------------------------------------------------------------------------------------
    def _head_pids(self) -> set[int]:
        procs = _processes()
        mine = set(self._head_tree)
        if self._head is not None:
            mine |= _tree(self._head.pid, procs)
        if self.temp is not None:
            needle = str(self.temp).encode()
            mine |= {pid for pid, (_, cmd) in procs.items() if needle in cmd}
        return {pid for pid in mine if pid in procs}

    def close(self) -> None:
        """Kill every process the harness started, delete its namespaces, veths, bridge and temp dir (idempotent;
        errors are collected and raised at the end, after everything was tried)."""
        if self._closed:
            return
        self._closed = True
        t = time.monotonic()
        errors = []
        for h in self.hosts:  # the hosts' nodes first (they would otherwise try to reach a dead head)
            try:
                self.stop_host(h.index)
            except Exception as e:  # noqa: BLE001 - go on tearing down
                errors.append(f"host {h.index}: {e}")
        if self._head is not None:
            self._head_tree = _tree(self._head.pid, _processes())
            for _ in range(20):
                pids = self._head_pids()
                if not pids:
                    break
                _sigkill(pids)
                time.sleep(0.1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._head.wait(timeout=10)
        for h in self.hosts:
            for args in (("netns", "del", h.netns), ("link", "del", h.veth)):
                out = _ip(*args, check=False)
                if out.returncode != 0 and "Cannot find" not in out.stderr and "No such" not in out.stderr:
                    errors.append(f"ip {' '.join(args)}: {out.stderr.strip()}")
            _remove_resolv(h.netns)
        if self.bridge is not None:
            out = _ip("link", "del", self.bridge, check=False)
            if out.returncode != 0 and "Cannot find" not in out.stderr:
                errors.append(f"ip link del {self.bridge}: {out.stderr.strip()}")
        for log in self._logs:
            log.close()
        if self.temp is not None:  # Ray's temp dir (and the logs, unless ``root`` was given)
            shutil.rmtree(self.temp, ignore_errors=True)
        if self._state is not None and not errors:
            self._state.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        self.timings["close"] = time.monotonic() - t
        if errors:
            raise RuntimeError("emulated hosts teardown: " + "; ".join(errors))

    def leftovers(self) -> list[str]:
        """What of the harness is still there (after ``close``: should be empty): namespaces, links, processes."""
        left = []
        namespaces = _ip("netns", "list").stdout.split()
        links = _ip("-o", "link", "show").stdout
        for h in self.hosts:
            if h.netns in namespaces:
                left.append(f"netns {h.netns}")
            if (_NETNS_ETC / h.netns).exists():
                left.append(f"dir {_NETNS_ETC / h.netns}")
            if f" {h.veth}@" in links or f" {h.veth}:" in links:
                left.append(f"link {h.veth}")
        if self.bridge and f" {self.bridge}:" in links:
            left.append(f"link {self.bridge}")
        left += [f"process {pid}" for pid in self._head_pids()]
        return left
