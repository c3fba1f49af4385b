"""Emulated datacenters on this machine (``network.emulate``): a Linux network namespace per
datacenter, each joined to this (the hub's) namespace by a veth link shaped with ``tc``.

Datacenter k is the namespace ``ddl-<tag>-dc<k>`` with one interface, ``eth0``, at ``10.A.B.(k+2)``;
its link's other end is ``ddl<tag><k>`` on the bridge ``ddl<tag>b`` here, which holds the hub's
address ``10.A.B.1`` (a /24 no route of this host uses). With a bandwidth, both ends carry a token
bucket filter (``tc qdisc … tbf``) at that rate, so the datacenter sends and receives at most that
many bits a second, as its own full-duplex link to the others. Processes run in a datacenter through
:meth:`Datacenters.wrap`: ``ip netns exec`` into its namespace and ``unshare --uts`` into a host name
of its own, its address (gloo, JAX's CPU collectives, connects to what the host name resolves to).

Latency is not emulated: this kernel has no ``netem`` qdisc; every figure measured here has the links'
queueing but no added propagation delay. Bytes are counted by the kernel on each link
(:meth:`Datacenters.link_bytes`: what each datacenter sent and received, every protocol's headers
and control traffic included).

Root, ``ip`` (iproute2), ``tc`` and ``unshare`` (util-linux) are needed (:func:`emulation_problem`
says which is missing, in one line, before anything is made). Everything made is removed when the
:func:`datacenters` block ends, and by a reaper process when the process that made it dies however
it dies (SIGKILL included): the processes left in the namespaces are killed, the namespaces, links
and bridge deleted (:func:`remove`). No JAX, no Prefect here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PREFIX = "ddl"  # every namespace and link made here starts with it (leftovers() finds them)
TOOLS = ("ip", "tc", "unshare")
_ROOT = Path(__file__).resolve().parents[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def emulation_problem() -> str | None:
    """Why datacenters cannot be emulated here, in one line (None: they can): not root, a missing
    tool (iproute2's ``ip`` and ``tc``, util-linux's ``unshare``), or network namespaces refused."""
    if sys.platform != "linux":
        return f"network.emulate needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "network.emulate needs root (network namespaces and tc): run as root, or set network.emulate false"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"network.emulate needs {', '.join(missing)} (apt-get install iproute2 util-linux), not found on PATH"
    probe = f"{PREFIX}-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"network.emulate: this host refuses a network namespace ({made.stderr.strip()})"
    return None


@dataclass(frozen=True)
class Datacenters:
    """``count`` emulated datacenters (the module docstring). ``tag``: the names' unique part;
    ``bandwidth_gbps``: each link's rate each way (None: unshaped); ``hub``: this namespace's address
    on the bridge; ``addresses``, ``namespaces``, ``links`` (hub-side interfaces): per datacenter."""

    tag: str
    bandwidth_gbps: float | None
    hub: str
    addresses: tuple[str, ...]
    namespaces: tuple[str, ...]
    links: tuple[str, ...]

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.tag}b"

    def wrap(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` run in datacenter ``k``: its network namespace, a UTS namespace whose host name is
        its address. The command keeps the PID of the process started (every step ``exec``s)."""
        ns, address = self.namespaces[k], self.addresses[k]
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', address, *argv]

    def link_bytes(self) -> list[dict[str, int]]:
        """Per datacenter, the bytes its link carried so far: ``sent`` (datacenter → hub) and
        ``received`` (hub → datacenter), counted by the kernel (every header and protocol included)."""
        out = []
        for link in self.links:
            stats = Path("/sys/class/net") / link / "statistics"
            out.append(
                {"sent": int((stats / "rx_bytes").read_text()), "received": int((stats / "tx_bytes").read_text())}
            )
        return out

    def save(self, path: str | Path) -> None:
        """Write these datacenters (JSON) for the processes that start work in them (:meth:`load`)."""
        from run.atomic import write_json

        write_json(path, {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()})

    @classmethod
    def load(cls, path: str | Path) -> Datacenters:
        import json

        raw = json.loads(Path(path).read_text())
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})

    def describe(self) -> dict:
        """What was emulated, for the run's records."""
        return {
            "datacenters": len(self.namespaces),
            "bandwidth_gbps": self.bandwidth_gbps,
            "latency": "not emulated (no netem qdisc in this kernel)",
            "hub": self.hub,
            "addresses": list(self.addresses),
            "shaping": "tc tbf on both ends of each datacenter's veth link" if self.bandwidth_gbps else "none",
        }


def _free_subnet(tag: str) -> ipaddress.IPv4Network:
    """A 10.A.B.0/24 that no route or address of this host overlaps (from the tag, then onwards)."""
    used = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines() + _ip("-4", "-o", "addr").stdout.split():
        for word in line.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word.count(".") == 3:
                    used.append(ipaddress.ip_network(word, strict=False))
    start = int(tag, 16) % (250 * 250)
    for i in range(250 * 250):
        n = (start + i) % (250 * 250)
        net = ipaddress.ip_network(f"10.{n // 250 + 3}.{n % 250}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("network.emulate: no free 10.x.y.0/24 subnet on this host")


def _shape(args: list[str], dev: str, gbps: float) -> None:
    rate = int(gbps * 1e9)
    burst = max(64 * 1024, int(rate / 8 * 0.004))  # 4 ms at the rate; ≥ one GSO packet (64 KiB)
    subprocess.run(
        [
            "tc",
            *args,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{rate}bit",
            "burst",
            str(burst),
            "latency",
            "100ms",
        ],
        capture_output=True,
        text=True,
        check=True,
    )


def create(count: int, bandwidth_gbps: float | None, tag: str | None = None) -> Datacenters:
    """Make ``count`` datacenters (the module docstring) with links of ``bandwidth_gbps`` each way
    (None: unshaped). Raises ``subprocess.CalledProcessError`` (after removing what was made) when a
    command fails; check :func:`emulation_problem` first."""
    tag = tag or secrets.token_hex(3)
    net = _free_subnet(tag)
    hosts = list(net.hosts())
    dcs = Datacenters(
        tag=tag,
        bandwidth_gbps=bandwidth_gbps,
        hub=str(hosts[0]),
        addresses=tuple(str(hosts[k + 1]) for k in range(count)),
        namespaces=tuple(f"{PREFIX}-{tag}-dc{k}" for k in range(count)),
        links=tuple(f"{PREFIX}{tag}{k}" for k in range(count)),
    )
    try:
        _ip("link", "add", dcs.bridge, "type", "bridge")
        _ip("addr", "add", f"{dcs.hub}/{net.prefixlen}", "dev", dcs.bridge)
        _ip("link", "set", dcs.bridge, "up")
        for k, (ns, link, address) in enumerate(zip(dcs.namespaces, dcs.links, dcs.addresses, strict=True)):
            peer = f"{PREFIX}{tag}p{k}"
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", link, "master", dcs.bridge)
            _ip("link", "set", link, "up")
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{address}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if bandwidth_gbps is not None:
                _shape([], link, bandwidth_gbps)  # hub → datacenter
                _shape(["-n", ns], "eth0", bandwidth_gbps)  # datacenter → hub
    except BaseException:
        remove(tag)
        raise
    return dcs


def leftovers(tag: str = "") -> list[str]:
    """Namespaces and links of this host made here (of ``tag``, or any) that still exist."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
        if line.count(":") >= 2
    ]
    return [
        n for n in names + links if n.startswith(f"{PREFIX}-{tag}" if tag else PREFIX) or n.startswith(PREFIX + tag)
    ]


def remove(tag: str) -> None:
    """Remove datacenters ``tag``: SIGKILL every process still in one of its namespaces, delete the
    namespaces, then the links and the bridge. Idempotent; never raises for what is already gone."""
    namespaces = [n for n in leftovers(tag) if n.startswith(f"{PREFIX}-{tag}-")]
    for ns in namespaces:
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while namespaces and time.monotonic() < deadline:  # the killed processes leave their namespaces
        if not any(_ip("netns", "pids", ns, check=False).stdout.split() for ns in namespaces):
            break
        time.sleep(0.05)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
    for link in leftovers(tag):
        if not link.startswith(f"{PREFIX}-"):
            _ip("link", "del", link, check=False)


# The reaper's program (``python -c REAPER <pid> <start time> <tag> <project>``): once the process
# that made the datacenters is gone (or a zombie) it removes them. It runs outside that process's
# tree (started through a short-lived middle process), so that what ends the tree's processes when
# the run dies (``flows.server.start_reaper``) does not end it first; SIGKILLed (by PID) when the
# datacenters were removed the normal way.
REAPER = """\
import os, signal, sys, time
import psutil
parent, born, tag = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
sys.path.insert(0, sys.argv[4])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
def alive():
    try:
        p = psutil.Process(parent)
        return p.create_time() == born and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
while alive():
    time.sleep(0.5)
from run.netem import remove
remove(tag)
"""
_DETACH = (
    "import subprocess as s, sys; d = s.DEVNULL; "
    "print(s.Popen(sys.argv[1:], start_new_session=True, stdin=d, stdout=d, stderr=d).pid)"
)


def _start_reaper(tag: str) -> int:
    """Start the reaper (:data:`REAPER`) detached from this process's tree; returns its PID."""
    import psutil

    me = psutil.Process()
    reaper = [sys.executable, "-c", REAPER, str(me.pid), repr(me.create_time()), tag, str(_ROOT)]
    out = subprocess.run(
        [sys.executable, "-c", _DETACH, *reaper], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@contextlib.contextmanager
def datacenters(count: int, bandwidth_gbps: float | None) -> Iterator[Datacenters]:
    """:func:`create` for the block; everything is removed when it ends, and by a reaper process if
    this process dies first (however it dies)."""
    dcs = create(count, bandwidth_gbps)
    reaper = _start_reaper(dcs.tag)
    try:
        yield dcs
    finally:
        remove(dcs.tag)
        with contextlib.suppress(ProcessLookupError):
            os.kill(reaper, signal.SIGKILL)
