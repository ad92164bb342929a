"""Start a config's local workers as child processes of `jaxserve serve`, and stop them all on exit.

Each child is `python -m jaxserve.cli worker --config FILE --instance NAME --router ADDR`: it pins itself,
builds its engine, and registers with the router (router/cluster.py), which is how readiness is known. A
reader thread per child keeps its last output lines (shown when it dies before registering) and echoes them
prefixed with the instance name. Children are started with `--parent-pid`: they ask the kernel for SIGTERM
when this process dies (PR_SET_PDEATHSIG, worker/process.py), so a killed server leaves no orphan workers. A
multi-host instance (instance.hosts > 1) is started as its group of processes on this machine (`GroupChild`:
`--coordinator 127.0.0.1:PORT --num-processes N --process-id I`, worker/group.py), stopped, killed and restarted
together.
Concurrency: the caller's thread plus one reader thread per child.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import subprocess
import sys
import threading
import time

from jaxserve.transfer.bufpool import remove_segments_of


class WorkerExited(RuntimeError):
    """A child worker exited before it registered."""


class Child:
    def __init__(self, name: str, argv: list[str], echo):
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._echo = echo
        self._reader = threading.Thread(target=self._read, name=f"worker-{name}-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self._echo is not None:
                self._echo(f"[{self.name}] {line.rstrip()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def output(self) -> str:
        self._reader.join(timeout=2)
        return "\n".join(self.tail)

    @property
    def members(self) -> list["Child"]:
        return [self]


class GroupChild:
    """A multi-host instance's processes, here all on this machine (worker/group.py): started, stopped and
    killed together; down as soon as one of them has exited (the others follow it down)."""

    def __init__(self, name: str, argvs: list[list[str]], echo):
        self.name = name
        self.members = [Child(f"{name}[{i}]", argv, echo) for i, argv in enumerate(argvs)]

    @property
    def proc(self):
        return self.members[0].proc

    @property
    def pid(self) -> int:
        return self.members[0].pid  # the leader's: the process the router talks to

    def exited(self) -> int | None:
        return next((rc for rc in (m.exited() for m in self.members) if rc is not None), None)

    def output(self) -> str:
        return "\n".join(f"--- {m.name}\n{m.output()}" for m in self.members)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (the ports it gives outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(host: str = "127.0.0.1", n: int = 1) -> int:
    """A port p with p .. p + n - 1 free on host (n = 2: a group's coordinator and its step channel), drawn at
    random below the kernel's ephemeral range: a port the kernel handed out (bind to port 0) could go to another
    process's outgoing connection between this check and the server's bind; below that range only servers
    bind, and a random draw keeps two processes that look at the same moment apart."""
    import random
    import socket
    low = _ephemeral_low()
    lo, hi = (10000, low - n) if low - n > 12000 else (low, 65536 - n)
    draw = random.SystemRandom()
    for _ in range(200):
        p = draw.randrange(lo, hi)
        socks = [socket.socket() for _ in range(n)]
        try:
            for k, s in enumerate(socks):
                s.bind((host, p + k))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host} in {lo} .. {hi + n - 1}")


class Launcher:
    def __init__(self, config_path: str | None, names: list[str], router_address: str, echo=None, wrap=None,
                 hosts: dict[str, tuple[int, int]] | None = None):
        """config_path: the YAML the workers load (None: the embedded local.yaml). echo: line printer or None.
        wrap: (name, argv) -> the argv that runs it (e.g. inside a network namespace), or None. hosts: name ->
        (instance.hosts, instance.group_port) of the multi-host instances, started as a group of processes."""
        self.config_path, self.names, self.router_address, self.echo = config_path, names, router_address, echo
        self.wrap = wrap
        self.hosts = hosts or {}
        self.children: dict[str, Child | GroupChild] = {}

    def start(self) -> None:
        for name in self.names:
            self.start_one(name)

    def start_one(self, name: str) -> None:
        """Start (or, after `kill` or its exit, restart) the worker `name`. A process of its last start that
        exited loses its shared-memory segments here (one that ended without removing them)."""
        for c in getattr(self.children.get(name), "members", ()):
            if c.exited() is not None:
                remove_segments_of(c.pid)
        argv = [sys.executable, "-m", "jaxserve.cli", "worker", "--instance", name, "--router", self.router_address,
                "--parent-pid", str(os.getpid())]
        if self.config_path is not None:
            argv[4:4] = ["--config", os.path.abspath(self.config_path)]
        size, port = self.hosts.get(name, (1, 0))
        if size > 1:  # its processes on this machine, the first one the coordinator
            at = ["--coordinator", f"127.0.0.1:{port or free_ports(n=2)}", "--num-processes", str(size)]
            argvs = [argv + at + ["--process-id", str(i)] for i in range(size)]
            self.children[name] = GroupChild(name, [self.wrap(name, a) if self.wrap else a for a in argvs], self.echo)
            return
        self.children[name] = Child(name, self.wrap(name, argv) if self.wrap else argv, self.echo)

    def check(self) -> None:
        """Raise WorkerExited (with its last output) if a child has exited."""
        for c in self.children.values():
            rc = c.exited()
            if rc is not None:
                raise WorkerExited(f"worker {c.name} exited with code {rc}; its last output:\n{c.output()}")

    def kill(self, name: str) -> None:
        """SIGKILL one child (fault tests)."""
        for c in self.children[name].members:
            c.proc.kill()
            c.proc.wait(30)
            remove_segments_of(c.pid)

    def stop_one(self, name: str, timeout: float = 30.0) -> None:
        """SIGTERM one child (a scale-in), SIGKILL after `timeout`."""
        members = self.children[name].members
        for c in members:
            if c.exited() is None:
                c.proc.terminate()
        for c in members:
            self._reap(c, timeout)

    @staticmethod
    def _reap(c: Child, timeout: float) -> None:
        """Wait for a terminated child, SIGKILL it after `timeout`; remove its shared-memory segments."""
        try:
            c.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait(10)
        remove_segments_of(c.pid)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every child, then SIGKILL what is left after `timeout`; remove the shared-memory segments
        of any that could not remove their own."""
        members = [m for c in self.children.values() for m in c.members]
        for c in members:
            if c.exited() is None:
                c.proc.terminate()
        for c in members:
            self._reap(c, timeout)


async def wait_ready(cluster, launcher: Launcher, names: list[str], timeout: float, progress: bool) -> None:
    """Until every worker in `names` has registered with `cluster` (a progress bar), or raise WorkerExited
    when one exits first (with its output) or `timeout` passes."""
    from tqdm import tqdm
    t0 = time.monotonic()
    ready: set = set()
    with tqdm(total=len(names), desc="starting workers", unit="worker", disable=not progress,
              file=sys.stdout) as bar:
        while len(ready) < len(names):
            launcher.check()
            for n in names:
                w = cluster.registry.workers.get(n)
                if n not in ready and w is not None and cluster.registry.is_up(w):
                    ready.add(n)
                    bar.update(1)
                    bar.set_postfix_str(f"{n} ({w.role}) after {time.monotonic() - t0:.1f}s")
            if time.monotonic() - t0 > timeout:
                raise WorkerExited(f"workers {sorted(set(names) - ready)} did not register within {timeout}s "
                                   "(router.ready_timeout_s)")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cluster.joined(), 0.5)
