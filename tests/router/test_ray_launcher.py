"""`jaxserve serve --launcher ray` (router/ray_launcher.py) on a two-node local Ray cluster
(`ray.cluster_utils.Cluster`, two CPUs per node, on this machine): each instance gets a placement group of one
bundle per host, and in each bundle an actor whose worker process runs there; p0 is a multi-host instance of two
processes (worker/group.py), placed on the two nodes. The cluster serves 1P1D with the answers of the local
launcher (the colocated engine's), a killed instance is restarted in place through the launcher (both of p0's
processes), and stopping leaves no placement group (and so no actor) and no worker's config file behind."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from jaxserve import LLM, SamplingParams
from jaxserve.config import parse
from tests.router.test_cluster_http import complete, disagg_config, serving, tokens

pytestmark = pytest.mark.slow

PROMPTS = [[5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15], [30, 31, 5, 7, 9]]
NODE = {"num_cpus": 2, "object_store_memory": 80 << 20}
HEAD = {**NODE, "include_dashboard": False}  # the head without its dashboard: less for Ray to start


def ray_cluster(monkeypatch) -> Cluster:
    """The two-node cluster, its start tried twice: Ray gives a node 30 s to register (fixed) and its GCS 30 s to
    write its port (RAY_gcs_server_port_wait_time_s: 120 here), which a 2-core machine running the rest of the suite
    beside it has missed; what failed is stopped before the second try (no other test runs Ray)."""
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "120")
    for attempt in (1, 2):
        try:
            rc = Cluster(initialize_head=True, head_node_args=HEAD)
            rc.add_node(**NODE)
            rc.wait_for_nodes()
            return rc
        except Exception:
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"],
                           capture_output=True, timeout=120)
            if attempt == 2:
                raise


def test_a_ray_cluster_places_the_workers_and_serves(checkpoint_dir, monkeypatch):
    path = checkpoint_dir("llama")
    cfg = disagg_config(path)
    cfg["clusters"][0]["instances"][0].update(hosts=2, tp=2)  # p0: two processes, one CPU device each
    configs = os.path.join(tempfile.gettempdir(), "jaxserve-[pd]0-*.yaml")  # the workers' config files
    before = set(glob.glob(configs))
    rc = ray_cluster(monkeypatch)
    try:
        with serving(cfg, ray_address=rc.address) as (client, router):
            got = [tokens(complete(client, p)["choices"][0]) for p in PROMPTS]
            children = router.launcher.children
            assert sorted(children) == ["d0", "p0"]
            # p0's two bundles are spread over the two nodes, a process on each
            assert len({i["node_id"] for i in children["p0"].infos}) == 2 and len(children["d0"].infos) == 1
            assert all(c.exited() is None for c in children.values())
            # a worker killed on its node is seen exited, and starts again in a fresh placement group
            router.launcher.kill("p0")
            assert children["p0"].exited() is not None
            router.launcher.start_one("p0")
            fresh = router.launcher.children["p0"].pid
            deadline = time.monotonic() + 120
            while not (router.registry.get("p0").pid == fresh and router.registry.is_up(router.registry.get("p0"))):
                assert router.launcher.children["p0"].exited() is None, router.launcher.children["p0"].output()
                assert time.monotonic() < deadline, router.launcher.children["p0"].output()
                time.sleep(0.2)
            again = [tokens(complete(client, p)["choices"][0]) for p in PROMPTS]
        # stopped: every instance's placement group (and with it its actor) is gone
        groups = {g["name"]: g["state"] for g in ray.util.placement_group_table().values()}
        left = set(glob.glob(configs)) - before
    finally:
        ray.shutdown()
        rc.shutdown()
    # the local launcher's answers are the colocated engine's (tests/router/test_cluster_http.py); JAX only
    # now, after Ray has started its processes (it forks)
    want = [o.token_ids for o in LLM(path, progress=False, engine=parse(cfg).engine.engine_config(8)).generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
    assert got == want and again == want
    assert set(groups) == {"jaxserve-p0", "jaxserve-d0"} and set(groups.values()) == {"REMOVED"}, groups
    assert not left, left  # the killed p0's too
