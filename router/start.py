"""Start a config's workers and stop them: as local child processes (launcher.py) or on a Ray cluster
(ray_launcher.py), the one place that chooses between them, so neither launcher module imports the other."""

from __future__ import annotations

import contextlib
import os
import tempfile

from .launcher import Launcher, wait_ready


@contextlib.asynccontextmanager
async def workers(cluster, cfg, names: list[str], progress: bool = False, echo=None, ray_address: str | None = None):
    """Open `cluster`'s control port, start `names` as child workers of exactly `cfg` (written to a temporary
    file), or with ray_address on that Ray cluster (router/ray_launcher.py), wait until they have registered;
    on exit close the cluster and stop them all."""
    import yaml
    address = await cluster.start()
    path = None
    if ray_address is not None:
        from .ray_launcher import RayLauncher  # Ray only where asked for
        launcher = RayLauncher(cfg, names, address, ray_address, echo)
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="jaxserve-", delete=False) as f:
            yaml.safe_dump(cfg.model_dump(mode="json"), f)
        path = f.name
        launcher = Launcher(path, names, address, echo,
                            hosts={i.name: (i.hosts, i.group_port) for i in cfg.instances() if i.hosts > 1})
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
