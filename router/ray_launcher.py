"""`jaxserve serve --launcher ray --address ADDR`: start a config's workers on a Ray cluster instead of as local
child processes (router/launcher.py), for bare-metal clusters without Kubernetes.

Each instance gets a placement group of one bundle per host (`instance.hosts` bundles of its cores,
`max(1, len(cpus))` CPUs each, strategy STRICT_SPREAD so a multi-host instance's bundles land on distinct
nodes), and in each bundle a `WorkerHost` actor that runs `jaxserve worker` as a child process on that node:
the config written to a local file there, `--router` the router's control address, `--advertise` the node's IP
when the instance listens on a wildcard address, and `--parent-pid` the actor's process, so a worker does not
outlive its actor. A multi-host instance's processes get `--coordinator` (the first bundle's node, on a port
pair free there, or `group_port`), `--num-processes` and `--process-id` (worker/group.py), and are
seen exited, killed and released together. The router learns readiness from registrations, as with local
children. `RayLauncher` is a `Launcher` (start, start_one, check, kill, stop_one, stop,
children[name].exited()), so the fault tests' kill and the flowkv controller's scaling work the same way.
Concurrency: the caller's thread; each actor is a process on its node (Ray calls block the caller briefly).
"""

from __future__ import annotations

import contextlib
import os
import sys

from .launcher import Launcher, WorkerExited

READY_S = 120.0  # how long a placement group may wait for its bundles


class WorkerHost:
    """Ray actor: one worker process on this node (decorated with ray.remote when the launcher starts)."""

    def __init__(self):
        self.proc = None
        self.path: str | None = None  # the worker's config file, removed once it has exited
        self.tail: list[str] = []

    def node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def free_port_pair(self) -> int:
        """Two consecutive ports free on this node (a group's coordinator and channel)."""
        from jaxserve.router.launcher import free_ports
        return free_ports("0.0.0.0", 2)

    def start(self, name: str, config_text: str, router: str, wildcard: bool, extra: list[str]) -> dict:
        import subprocess
        import tempfile
        import threading

        import ray
        fd, self.path = tempfile.mkstemp(prefix=f"jaxserve-{name}-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(config_text)
        argv = [sys.executable, "-m", "jaxserve.cli", "worker", "--config", self.path, "--instance", name,
                "--router", router, "--parent-pid", str(os.getpid())]
        node_ip = ray.util.get_node_ip_address()
        if wildcard:
            argv += ["--advertise", node_ip]
        argv += extra
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def read():
            for line in self.proc.stdout:
                self.tail = (self.tail + [line.rstrip("\n")])[-60:]
        threading.Thread(target=read, daemon=True).start()
        return {"pid": self.proc.pid, "node_ip": node_ip, "node_id": ray.get_runtime_context().get_node_id()}

    def poll(self) -> int | None:
        return self.proc.poll()

    def output(self) -> str:
        return "\n".join(self.tail)

    def signal(self, kill: bool, timeout: float) -> int | None:
        """SIGKILL (kill) or SIGTERM the worker, then wait up to `timeout` (SIGKILL after it) -> its exit code."""
        import subprocess

        from jaxserve.transfer.bufpool import remove_segments_of
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        remove_segments_of(self.proc.pid)  # what a killed worker could not remove itself, on this node
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None
        return rc


class RayChild:
    """One instance's placement group, and per host an actor and its worker process (Launcher's Child, on Ray
    nodes): exited as soon as one of them has."""

    def __init__(self, name: str, actors: list, group, infos: list[dict]):
        self.name, self.actors, self.group, self.infos = name, actors, group, infos
        self.rc: int | None = None

    @property
    def info(self) -> dict:
        return self.infos[0]  # the leader's: the process the router talks to

    @property
    def pid(self) -> int:
        return self.info["pid"]

    def exited(self) -> int | None:
        import ray
        for actor in self.actors:
            if self.rc is not None:
                break
            try:
                self.rc = ray.get(actor.poll.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self.rc = -9  # its actor (or node) is gone: so is the worker
        return self.rc

    def output(self) -> str:
        import ray
        out = []
        for i, actor in enumerate(self.actors):
            try:
                text = ray.get(actor.output.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                text = f"(its Ray actor is gone: {type(e).__name__})"
            out.append(text if len(self.actors) == 1 else f"--- {self.name}[{i}]\n{text}")
        return "\n".join(out)


class RayLauncher(Launcher):
    """Launcher's `start` and `check` over RayChild children; placing, stopping and killing through Ray."""

    def __init__(self, cfg, names: list[str], router_address: str, address: str, echo=None):
        """cfg: the config the workers run (sent to each node); address: the Ray cluster's (ray.init's)."""
        import ray
        import yaml
        super().__init__(None, names, router_address, echo)
        self.cfg = cfg
        self.config_text = yaml.safe_dump(cfg.model_dump(mode="json"))
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        self._host = ray.remote(WorkerHost)

    def start_one(self, name: str) -> None:
        """Place instance `name` (a placement group of one bundle per host) and start its workers there."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        old = self.children.pop(name, None)
        if old is not None:  # a restart after `kill`: the old actor and placement group go first
            self._release(old, 10.0)
        inst = self.cfg.instance(name)
        cpus, n = max(1, len(inst.cpus)), inst.hosts
        group = placement_group([{"CPU": cpus}] * n, strategy="STRICT_SPREAD", name=f"jaxserve-{name}")
        try:
            ray.get(group.ready(), timeout=READY_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise WorkerExited(f"worker {name}: the Ray cluster has no {n} nodes with {cpus} free CPUs each for "
                               f"it (waited {READY_S:.0f}s)") from None
        actors = [self._host.options(num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=i)).remote() for i in range(n)]
        extras = [[]]
        wildcard = inst.host in ("0.0.0.0", "::")
        if n > 1:  # the group's coordinator on the first bundle's node, where the leader listens
            leader = ray.get(actors[0].node_ip.remote(), timeout=READY_S) if wildcard else inst.host
            port = inst.group_port or ray.get(actors[0].free_port_pair.remote(), timeout=READY_S)
            extras = [["--coordinator", f"{leader}:{port}", "--num-processes", str(n), "--process-id", str(i)]
                      for i in range(n)]
        infos = ray.get([a.start.remote(name, self.config_text, self.router_address, wildcard, extra)
                         for a, extra in zip(actors, extras)], timeout=READY_S)
        if self.echo is not None:
            for info in infos:
                self.echo(f"[{name}] started on Ray node {info['node_ip']} ({info['node_id'][:12]}), "
                          f"pid {info['pid']}")
        self.children[name] = RayChild(name, actors, group, infos)

    def kill(self, name: str) -> None:
        """SIGKILL one worker (fault tests)."""
        self._signal(self.children[name], True, 30.0)

    def stop_one(self, name: str, timeout: float = 30.0) -> None:
        """SIGTERM one worker (a scale-in), SIGKILL after `timeout`; its actor and placement group go."""
        self._release(self.children[name], timeout)

    def stop(self, timeout: float = 30.0) -> None:
        for c in self.children.values():
            self._release(c, timeout)

    @staticmethod
    def _signal(c: RayChild, kill: bool, timeout: float) -> None:
        import ray
        rcs = []
        for actor in c.actors:
            try:
                rcs.append(ray.get(actor.signal.remote(kill, timeout), timeout=timeout + 30))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                rcs.append(-9)
        c.rc = rcs[0]

    def _release(self, c: RayChild, timeout: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        self._signal(c, False, timeout)  # every process of the group, whichever of them has exited
        for actor in c.actors:
            ray.kill(actor)
        remove_placement_group(c.group)
