"""``Lab``: network namespaces with a public segment, NATed homes, shaping, cuts and byte counters."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dedloc_core import proctree

HUB_NET = "192.0.0.128/25"  # the "public" segment (see the package docstring)
_FIRST_HOST = 129
CPU_ROOT = Path("/sys/fs/cgroup/cpu")  # cgroup v1 cpu controller (LAB.md: v2 is an empty hierarchy here)
CPU_PERIOD_US = 100_000
# A lab node's cpu.shares: its weight against the machine's other tasks (1024 each at nice 0), high
# enough that a node gets its quota on a busy machine (8192 was not at load 30); the quota caps it.
# The delay programs (the links) get a group with these shares and no quota.
CPU_SHARES = 65536


class LabUnavailable(RuntimeError):
    """The lab cannot run here (not root, or a tool is missing)."""


def lab_unavailable_reason() -> str | None:
    """Why the lab cannot run on this machine, or None if it can."""
    if sys.platform != "linux":
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, iptables, tc)"
    missing = [tool for tool in ("ip", "iptables", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network lab needs {', '.join(missing)} (apt-get install iproute2 iptables)"
    return None


@dataclass
class Shape:
    """Shaping of one host's link: rates in Mbit/s (None: unlimited), one-way delay in ms added to
    the packets the host receives, loss as a fraction of the packets it receives."""

    up_mbit: float | None = None
    down_mbit: float | None = None
    delay_ms: float = 0.0
    loss: float = 0.0


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    public: bool
    link_ns: str  # namespace holding the far end of the link that cut() takes down
    link_dev: str
    router: str | None = None  # a home host's router namespace
    cpu: float | None = None  # cores its processes may use (a cgroup quota), None: no limit
    cgroup: Path | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result


class Lab:
    """Build with ``with Lab() as lab:``; ``lab.public(...)``/``lab.home(...)`` add hosts."""

    def __init__(self, prefix: str | None = None):
        reason = lab_unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        self.prefix = prefix or f"nl{os.getpid():x}"
        self.hub = f"{self.prefix}-hub"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._next_ip = _FIRST_HOST
        self._homes = 0
        self._queues = 0
        self._netem: bool | None = None
        self._cgroups: list[Path] = []
        self._after_close: list = []  # callables, called once the lab's processes are gone
        self._closed = True

    # ---- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        reap_stale_labs()
        self._closed = False
        atexit.register(self.close)
        self._add_ns(self.hub)
        self.ns_run(self.hub, "ip", "link", "add", "br0", "type", "bridge")
        self.ns_run(self.hub, "ip", "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the lab's namespaces and delete them (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            for proc in host.processes:
                _kill_group(proc)
        for ns in reversed(self._namespaces):
            _kill_namespace(ns)
        for group in self._cgroups:
            _remove_cgroup(group)
        for tidy in self._after_close:
            try:
                tidy()
            except Exception as exc:  # one that fails leaves the others to run
                print(f"netlab: {tidy!r} failed at close: {exc}", file=sys.stderr)
        atexit.unregister(self.close)

    def after_close(self, tidy) -> None:
        """Call ``tidy()`` at close, once the lab's processes are gone (a worker's socket folder)."""
        self._after_close.append(tidy)

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        self.ns_run(ns, "ip", "link", "set", "lo", "up")

    # ---- building ---------------------------------------------------------------------------------

    def ns_run(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", ns, *args, check=check)

    def _hub_ip(self) -> str:
        if self._next_ip > 254:
            raise RuntimeError("the lab's public segment is full")
        ip = f"192.0.0.{self._next_ip}"
        self._next_ip += 1
        return ip

    def _uplink(self, ns: str, dev: str, ip: str) -> str:
        """A veth from ``ns`` (named ``dev``) to the hub's bridge; returns the hub end's name."""
        hub_dev = f"p{len(self._namespaces)}"
        _run("ip", "link", "add", hub_dev, "netns", self.hub, "type", "veth", "peer", "name", dev, "netns", ns)
        self.ns_run(self.hub, "ip", "link", "set", hub_dev, "master", "br0", "up")
        self.ns_run(ns, "ip", "addr", "add", f"{ip}/25", "dev", dev)
        self.ns_run(ns, "ip", "link", "set", dev, "up")
        return hub_dev

    def public(self, name: str, shape: Shape | None = None, cpu: float | None = None) -> Host:
        """A host on the public segment: anyone in the lab can connect to it. ``cpu``: the cores its
        processes may use together (a cgroup quota; see ``cpu_group``)."""
        ns = f"{self.prefix}-{name}"
        self._add_ns(ns)
        ip = self._hub_ip()
        hub_dev = self._uplink(ns, "eth0", ip)
        host = self.hosts[name] = Host(name, ns, ip, True, self.hub, hub_dev)
        self._shape(host, shape, far_ns=self.hub, far_dev=hub_dev)
        if cpu is not None:
            self.cpu_group(host, cpu)
        return host

    def cpu_group(self, host: Host, cores: float) -> Path:
        """Hold the host's processes started from now on to ``cores`` of CPU time (cgroup v1
        ``cpu.cfs_quota_us``); the group is removed at close. Processes started earlier (the delay
        program: it stands for the link, not the node) stay outside."""
        reason = cpu_quota_unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        group = CPU_ROOT / f"{self.prefix}-{host.name}"
        group.mkdir(exist_ok=True)
        self._cgroups.append(group)
        (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, round(cores * CPU_PERIOD_US))))
        (group / "cpu.shares").write_text(str(CPU_SHARES))
        host.cpu, host.cgroup = cores, group
        return group

    def _net_group(self) -> Path | None:
        if cpu_quota_unavailable_reason():
            return None
        group = CPU_ROOT / f"{self.prefix}-links"
        if group not in self._cgroups:
            group.mkdir(exist_ok=True)
            self._cgroups.append(group)
            (group / "cpu.shares").write_text(str(CPU_SHARES))
        return group

    def cpu_stat(self, host: Host) -> dict[str, int]:
        """The host's cgroup ``cpu.stat`` (nr_periods, nr_throttled, throttled_time in ns)."""
        if host.cgroup is None:
            return {}
        lines = (host.cgroup / "cpu.stat").read_text().split("\n")
        return {k: int(v) for k, v in (line.split() for line in lines if line.strip())}

    def home(self, name: str, shape: Shape | None = None) -> Host:
        """A host behind its own masquerading router: it can connect out, nobody can connect in."""
        self._homes += 1
        n = self._homes
        ns, router = f"{self.prefix}-{name}", f"{self.prefix}-{name}-gw"
        self._add_ns(router)
        self._add_ns(ns)
        wan_ip = self._hub_ip()
        hub_dev = self._uplink(router, "wan", wan_ip)
        _run("ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.ns_run(router, "ip", "addr", "add", f"10.{n}.0.1/24", "dev", "lan")
        self.ns_run(router, "ip", "link", "set", "lan", "up")
        self.ns_run(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.ns_run(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        # belt and braces: even with a route to 10.N, nothing new gets in
        self.ns_run(router, "iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "NEW",
                    "-j", "DROP")
        ip = f"10.{n}.0.2"
        self.ns_run(ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        self.ns_run(ns, "ip", "link", "set", "eth0", "up")
        self.ns_run(ns, "ip", "route", "add", "default", "via", f"10.{n}.0.1")
        host = self.hosts[name] = Host(name, ns, ip, False, self.hub, hub_dev, router=router)
        self._shape(host, shape, far_ns=router, far_dev="lan")
        return host

    def _shape(self, host: Host, shape: Shape | None, *, far_ns: str, far_dev: str) -> None:
        if shape is None:
            return
        if shape.up_mbit:
            _tbf(self, host.ns, "eth0", shape.up_mbit)
        if shape.down_mbit:
            _tbf(self, far_ns, far_dev, shape.down_mbit)
        if shape.delay_ms or shape.loss:
            if self._has_netem(host.ns):
                args = ["delay", f"{shape.delay_ms}ms"] if shape.delay_ms else []
                args += ["loss", f"{shape.loss * 100}%"] if shape.loss else []
                # netem on the far end's egress = the packets this host receives
                if shape.down_mbit:
                    self.ns_run(far_ns, "tc", "qdisc", "add", "dev", far_dev, "parent", "1:1", "handle", "10:",
                                "netem", *args)
                else:
                    self.ns_run(far_ns, "tc", "qdisc", "add", "dev", far_dev, "root", "netem", *args)
                return
            if shape.loss:
                self.ns_run(host.ns, "iptables", "-A", "INPUT", "-i", "eth0", "-m", "statistic", "--mode",
                            "random", "--probability", str(shape.loss), "-j", "DROP")
            if shape.delay_ms:
                self._delay(host, shape.delay_ms)

    def _has_netem(self, ns: str) -> bool:
        if self._netem is None:
            probe = self.ns_run(ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
            self._netem = probe.returncode == 0
            if self._netem:
                self.ns_run(ns, "tc", "qdisc", "del", "dev", "lo", "root")
        return self._netem

    def _delay(self, host: Host, delay_ms: float) -> None:
        """No netem here: delay what the host receives with our NFQUEUE program (``delay.py``)."""
        queue = self._queues
        self._queues += 1
        argv = [sys.executable, str(Path(__file__).with_name("delay.py")), str(queue), str(delay_ms)]
        # in the links' group: the link must not starve on a busy machine
        proc = self.popen(host, argv, stdout=subprocess.PIPE, text=True, group=self._net_group())
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"the delay program did not start in {host.ns}: {line!r}")
        self.ns_run(host.ns, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "NFQUEUE", "--queue-num", str(queue))

    # ---- using ------------------------------------------------------------------------------------

    def launcher(self, host: Host, group: Path | None = None) -> list[str]:
        """The command prefix that runs a program inside ``host``'s namespace and CPU group (or
        ``group``): the shell joins the group, then execs, so all the program forks stays in it."""
        netns = ["ip", "netns", "exec", host.ns]
        group = group or host.cgroup
        if group is None:
            return netns
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *netns]

    def popen(self, host: Host, argv: list[str], group: Path | None = None, **kwargs) -> subprocess.Popen:
        """Start a process inside ``host``'s namespace, in its own process group; killed at close."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.launcher(host, group) + list(argv), **kwargs)
        host.processes.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Take the host's link to the public segment down (for a home host: its router's uplink)."""
        self.ns_run(host.link_ns, "ip", "link", "set", host.link_dev, "down")

    def restore(self, host: Host) -> None:
        self.ns_run(host.link_ns, "ip", "link", "set", host.link_dev, "up")

    def counters(self, host: Host) -> tuple[int, int]:
        """(bytes sent, bytes received) on the host's own interface, headers included."""
        out = self.ns_run(host.ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes",
                          "/sys/class/net/eth0/statistics/rx_bytes").stdout.split()
        return int(out[0]), int(out[1])

    def can_connect(self, src: Host, dst_ip: str, port: int, timeout: float = 2.0) -> bool:
        """Whether a TCP connection from ``src`` to ``dst_ip:port`` succeeds."""
        code = (f"import socket; socket.create_connection(({dst_ip!r}, {port}), timeout={timeout}).close()")
        return self.ns_run(src.ns, sys.executable, "-c", code, check=False).returncode == 0


def _tbf(lab: Lab, ns: str, dev: str, mbit: float) -> None:
    # an htb root with one class, so a netem (where the kernel has it) can hang below it
    lab.ns_run(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    lab.ns_run(ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate",
               f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", "32kb")


def cpu_quota_unavailable_reason() -> str | None:
    """Why lab nodes cannot get a CPU quota here, or None if they can."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT} (CPU quotas for lab nodes)"
    if not os.access(CPU_ROOT, os.W_OK):
        return f"{CPU_ROOT} is not writable (root needed for CPU quotas)"
    return None


def _remove_cgroup(group: Path) -> None:
    """Remove a CPU group once its processes are gone (they were killed with their namespace)."""
    for _ in range(20):
        try:
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    if not proctree.signal_group(proc.pid, signal.SIGKILL):
        proc.kill()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _kill_namespace(ns: str) -> None:
    for _ in range(3):
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.2)
    _run("ip", "netns", "del", ns, check=False)


def reap_stale_labs() -> None:
    """Delete the namespaces of labs whose process (named in the prefix) is gone."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        head = name.split("-", 1)[0]
        if not (head.startswith("nl") and "-" in name):
            continue
        try:
            pid = int(head[2:], 16)
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            _kill_namespace(name)
    for group in CPU_ROOT.glob("nl*-*") if CPU_ROOT.is_dir() else []:
        try:
            pid = int(group.name.split("-", 1)[0][2:], 16)
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            _remove_cgroup(group)
