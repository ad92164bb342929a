"""Network namespaces for partition tests: a process started in `Netns(i)` reaches the rest of this machine only
over a veth pair (host end 10.77.i.1, namespace end 10.77.i.2), so taking the namespace's end down is a real
silent partition: the namespace's peers keep their connections, their packets are dropped without a reset or
a FIN, exactly as when a cable or a switch between two hosts fails. Needs root (CAP_NET_ADMIN) and `ip`;
`available()` says whether this machine has them. Everything created is removed by `close()`.
Concurrency: none (the caller's thread).
"""

from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "jsfault"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command"
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    try:
        probe = Netns(99)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    probe.close()
    return None


class Netns:
    def __init__(self, index: int):
        if not 1 <= index <= 250:
            raise ValueError(f"index must be 1..250, got {index}")
        self.name, self.index = f"{PREFIX}{index}", index
        self.host_if, self.ns_if = f"{PREFIX}{index}h", f"{PREFIX}{index}n"
        self.host_ip, self.ns_ip = f"10.77.{index}.1", f"10.77.{index}.2"
        self.close()  # what a killed earlier run left
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if, ns=self.name)
            _ip("link", "set", "lo", "up", ns=self.name)
            _ip("link", "set", self.ns_if, "up", ns=self.name)
            _ip("route", "add", "default", "via", self.host_ip, ns=self.name)
        except RuntimeError:
            self.close()
            raise

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (`ip netns exec` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def partition(self) -> None:
        """Take the namespace's end down: its peers on the host see their packets vanish (the host end only
        loses carrier, so its routes stay and nothing answers with an error)."""
        _ip("link", "set", self.ns_if, "down", ns=self.name)

    def heal(self) -> None:
        _ip("link", "set", self.ns_if, "up", ns=self.name)
        _ip("route", "replace", "default", "via", self.host_ip, ns=self.name)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
