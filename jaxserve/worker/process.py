"""`jaxserve worker --config FILE --instance NAME`: one instance of a cluster as its own process, and its lifetime.

Start-up order matters: the process pins itself to the instance's `cpus` (os.sched_setaffinity), its devices and
its share of their memory *before* JAX is imported (setup.py `pin`); only then does it build the engine on a mesh
over its own devices, warm it up, and serve (main.py `Worker`) until SIGTERM / SIGINT. Launched by a router, it
asks the kernel to stop it when the router dies. In a multi-host instance the first process serves and the
others follow it (group.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from ..config import Config
from .main import Worker
from .setup import Refused, build_engine, pin

log = logging.getLogger("jaxserve.worker")


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when `parent_pid` (the router that launched it) dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.warning("PR_SET_PDEATHSIG unavailable: this worker outlives its launcher")
    if os.getppid() != parent_pid:  # it died before the request took effect
        raise SystemExit(f"the launching process {parent_pid} is gone")


def run(cfg: Config, name: str, router: str | None = None, parent_pid: int | None = None,
        advertise: str | None = None, group=None) -> None:
    """Run instance `name` of `cfg` in this process until SIGTERM / SIGINT; router: register there; advertise:
    the host other processes dial for it (Worker); group: this process's place in a multi-host instance
    (worker/group.py `resolve`): the leader serves, the others follow it."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    inst = cfg.instance(name)
    cfg.check_exposure()
    pin(inst, cfg.device_share(name))
    label = name if group is None else f"{name}[{group.index}]"
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s")
    if group is not None:
        from . import group as grp
        channel = grp.LeaderChannel(group, inst.host, cfg.transfer.token) if group.leader else None
        grp.join(group)
        if not group.leader:  # a follower: the same engine, its runner driven by the leader's calls
            llm = build_engine(cfg, inst)
            print(f"{label}: following {group.host}:{group.port + 1}", flush=True)
            grp.exit_now(grp.follow(llm.runner, grp.connect(group, cfg.transfer.token)))
    try:
        asyncio.run(Worker(cfg, inst, advertise=advertise, group=channel if group else None).serve(router))
    except Refused as e:
        log.error("%s", e)
        if group is not None:
            grp.exit_now(2)
        raise SystemExit(2) from None
    if group is not None:
        channel.close()
        grp.exit_now(0)
