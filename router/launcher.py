"""Start a config's local workers as child processes of `jaxserve serve`, and stop them all on exit.

Each child is `python -m jaxserve.cli worker --config FILE --instance NAME --router ADDR`: it pins itself,
builds its engine, and registers with the router (router/cluster.py), which is how readiness is known. A
reader thread per child keeps its last output lines (shown when it dies before registering) and echoes them
prefixed with the instance name. Children are started with `--parent-pid`: they ask the kernel for SIGTERM
when this process dies (PR_SET_PDEATHSIG, worker/main.py), so a killed server leaves no orphan workers.
Concurrency: the caller's thread plus one reader thread per child.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time

from transfer.bufpool import remove_segments_of


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


class Launcher:
    def __init__(self, config_path: str | None, names: list[str], router_address: str, echo=None, wrap=None):
        """config_path: the YAML the workers load (None: the embedded local.yaml). echo: line printer or None.
        wrap: (name, argv) -> the argv that runs it (e.g. inside a network namespace), or None."""
        self.config_path, self.names, self.router_address, self.echo = config_path, names, router_address, echo
        self.wrap = wrap
        self.children: dict[str, Child] = {}

    def start(self) -> None:
        for name in self.names:
            self.start_one(name)

    def start_one(self, name: str) -> None:
        """Start (or, after `kill`, restart) the worker `name`."""
        argv = [sys.executable, "-m", "jaxserve.cli", "worker", "--instance", name, "--router", self.router_address,
                "--parent-pid", str(os.getpid())]
        if self.config_path is not None:
            argv[4:4] = ["--config", os.path.abspath(self.config_path)]
        self.children[name] = Child(name, self.wrap(name, argv) if self.wrap else argv, self.echo)

    def check(self) -> None:
        """Raise WorkerExited (with its last output) if a child has exited."""
        for c in self.children.values():
            rc = c.exited()
            if rc is not None:
                raise WorkerExited(f"worker {c.name} exited with code {rc}; its last output:\n{c.output()}")

    def kill(self, name: str) -> None:
        """SIGKILL one child (fault tests)."""
        c = self.children[name]
        c.proc.kill()
        c.proc.wait(30)
        remove_segments_of(c.pid)

    def stop_one(self, name: str, timeout: float = 30.0) -> None:
        """SIGTERM one child (a scale-in), SIGKILL after `timeout`."""
        c = self.children[name]
        if c.exited() is None:
            c.proc.terminate()
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
        for c in self.children.values():
            if c.exited() is None:
                c.proc.terminate()
        for c in self.children.values():
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


@contextlib.asynccontextmanager
async def workers(cluster, cfg, names: list[str], progress: bool = False, echo=None, ray_address: str | None = None):
    """Open `cluster`'s control port, start `names` as child workers of exactly `cfg` (written to a temporary
    file), or with ray_address on that Ray cluster (router/ray_launcher.py), wait until they have registered;
    on exit close the cluster and stop them all."""
    import yaml
    address = await cluster.start()
    path = None
    if ray_address is not None:
        from .ray_launcher import RayLauncher
        launcher = RayLauncher(cfg, names, address, ray_address, echo)
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="jaxserve-", delete=False) as f:
            yaml.safe_dump(cfg.model_dump(mode="json"), f)
        path = f.name
        launcher = Launcher(path, names, address, echo)
    cluster.launcher = launcher
    try:
        launcher.start()
        await wait_ready(cluster, launcher, names, cfg.router.ready_timeout_s, progress)
        yield cluster
    finally:
        await cluster.close()
        launcher.stop()
        if path is not None:
            os.unlink(path)
