"""In-place role flips on a live cluster (POST /admin/roles): a prefill instance becomes a decode instance and
back while requests keep coming, over real worker processes. No request fails or changes its greedy answer,
the flipped instance serves its new role, and after the flip's warm-up it compiles nothing more for it.
Refusals: the last instance of a role, an unknown instance or role, a colocated server."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.router.test_cluster_http import ENGINE, complete, config, disagg_config, serving, tokens, worker_stats

pytestmark = pytest.mark.slow

WARM = {**ENGINE, "warmup": True}
PROMPTS = [[(i * 7 + j) % 40 + 3 for j in range(4 + i % 9)] for i in range(24)]


def answers(client, prompts) -> list[list[int]]:
    """Greedy answers of `prompts`, sent 4 at a time (every one must succeed)."""
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        return [tokens(r["choices"][0]) for r in ex.map(lambda p: complete(client, p, max_tokens=8), prompts)]


def flip(client, instance, role):
    r = client.post("/admin/roles", json={"instance": instance, "role": role})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefill_instance_turns_decode_and_back_under_load(checkpoint_dir):
    cfg = disagg_config(checkpoint_dir("llama"), [{"name": "p1", "role": "prefill"}])
    cfg["engine"] = WARM
    with serving(cfg) as (client, cluster):
        want = answers(client, PROMPTS)  # before any flip
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            load = ex.submit(answers, client, PROMPTS)  # requests in flight while p1 drains and switches
            ans = flip(client, "p1", "decode")
            assert load.result() == want
        assert ans["previous"] == "prefill" and ans["role"] == "decode" and ans["programs_compiled"] > 0
        p1 = cluster.registry.get("p1")
        assert p1.role == "decode" and not p1.draining
        compiled = worker_stats([p1])["p1"]["compiled_programs"]
        seen = set()
        for _ in range(4):  # both decode instances take requests now (4 at a time: the least loaded of the two)
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                rs = list(ex.map(lambda p: complete(client, p, max_tokens=8), PROMPTS[:8]))
            assert [tokens(r["choices"][0]) for r in rs] == want[:8]
            seen |= {r["jaxserve"]["decode_instance"] for r in rs}
            if "p1" in seen:
                break
        assert "p1" in seen, seen
        assert all(r["jaxserve"]["prefill_instance"] in ("p0", None) for r in rs)
        assert worker_stats([p1])["p1"]["compiled_programs"] == compiled  # nothing compiled after the warm-up
        # and back, under load again
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            load = ex.submit(answers, client, PROMPTS)
            ans = flip(client, "p1", "prefill")
            assert load.result() == want
        assert ans["role"] == "prefill" and cluster.registry.get("p1").role == "prefill"
        assert answers(client, PROMPTS) == want  # its prefix cache from the decode role: hits, and still right
        # the last decode instance cannot leave; unknown instances and bad roles are 4xx
        r = client.post("/admin/roles", json={"instance": "d0", "role": "prefill"})
        assert r.status_code == 400 and "d0 is the only instance up that can decode" in r.json()["error"]["message"]
        r = client.post("/admin/roles", json={"instance": "nope", "role": "decode"})
        assert r.status_code == 400 and "no instance 'nope'" in r.json()["error"]["message"]
        r = client.post("/admin/roles", json={"instance": "p1", "role": "boss"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "role"
        # nothing left behind on any worker
        stats = worker_stats(cluster.registry.all())
        assert all(s["running"] == 0 and s["waiting"] == 0 and s["reservations"] == 0 for s in stats.values()), stats


def test_a_colocated_server_has_no_roles_to_change(checkpoint_dir):
    cfg = config(checkpoint_dir("llama"), [{"name": "c0", "role": "both"}])
    with serving(cfg) as (client, _):
        r = client.post("/admin/roles", json={"instance": "c0", "role": "decode"})
        assert r.status_code == 400 and "no instance roles to change" in r.json()["error"]["message"]
