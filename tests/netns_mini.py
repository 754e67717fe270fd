"""A minimal network lab: N network namespaces on one bridge (in a hub namespace), one veth each,
for tests that count a peer's bytes on its own interface. Needs root and iproute2.

Names carry this process's pid, so parallel runs do not collide; ``close()`` kills what still runs
in the namespaces and deletes them. Traffic stays inside the namespaces the lab created.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"dl4probe{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create network namespaces: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Lab:
    def __init__(self, peers: int):
        tag = f"dl4x{os.getpid()}"
        self.hub = f"{tag}hub"
        self.names = [f"{tag}p{i}" for i in range(peers)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(peers)]
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}", "netns", self.hub)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0", "up")

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program in peer ``i``'s namespace (``ip`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.names[i]]

    def counters(self, i: int) -> tuple[int, int]:
        """(tx bytes, rx bytes) of peer ``i``'s own interface."""
        out = _ip("-n", self.names[i], "-s", "-j", "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def close(self) -> None:
        for name in reversed(self._made):
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
