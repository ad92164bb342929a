"""PrfaaS end to end on `configs/prfaas.yaml` over real processes (the bundled hybrid KDA + MLA model; the
engine section shrunk for test time, the workers unpinned): a PrfaaS cluster (one prefill worker) and a PD
cluster (a prefill and a decode worker) joined by an emulated link, served by `jaxserve serve`'s router
with the `prfaas` policy. A short prompt stays on the PD cluster; a long unique one is prefilled in PrfaaS and
its KV crosses the link; the conversation's next turn (that prompt + the answer + a short message) stays in
the PD cluster with the history served from the decode instance's cache (blocks and the linear state saved at
the last block boundary during decode), which the global KV index learned from the workers' cache events; a
prompt sharing the long one's prefix stays on the PD prefill, which first receives that cached prefix from
PrfaaS (a cross-cluster prefix move). Every answer equals the colocated greedy answer. Then the admin endpoint
halves the link's bandwidth live."""

from __future__ import annotations

import re
import time

import pytest
import yaml

from bench.clusters import unpinned
from jaxserve import bundled
from jaxserve.router.snapshot import link_states
from tests.router.test_cluster_http import complete as _complete
from tests.router.test_cluster_http import serving

pytestmark = pytest.mark.slow

SHORT = [5, 7, 9, 11, 13, 2, 3, 4]
LONG = [(7 * i + 3) % 60 + 1 for i in range(300)]  # above the preset's threshold_tokens (256)
MESSAGE = [21, 22, 23]
# shares the long prompt's first 288 tokens (its last block boundary: the PrfaaS prefill's snapshot), then 100
# new ones: the PD cluster's prefill computes them after the cached prefix moves across from PrfaaS
BRANCH = LONG[:288] + [(11 * i + 5) % 60 + 1 for i in range(100)]
ENGINE = dict(num_blocks=256, max_model_len=512, max_num_seqs=4, num_snapshots=16, warmup=False)


def complete(client, prompt) -> dict:
    """Greedy, 6 tokens, with the token ids in the answer (return_token_ids: the model has a tokenizer)."""
    return _complete(client, prompt, return_token_ids=True)


def tokens(choice) -> list[int]:
    return choice["token_ids"]


def prfaas_config(path: str) -> dict:
    with open("configs/prfaas.yaml") as f:
        cfg = unpinned(yaml.safe_load(f))
    cfg["model"].update(path=path, name="m")
    cfg["engine"].update(ENGINE)
    cfg["router"].update(heartbeat_s=0.3)
    # the emulated link's transfers are slow under the parallel suite on 2 cores: no deadline is under test here
    cfg.setdefault("transfer", {})["deadline_s"] = 120.0
    return cfg


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_short_local_long_prfaas_next_turn_from_the_decode_cache(tmp_path):
    path = str(tmp_path / "model")
    bundled.build(path)
    cfg = prfaas_config(path)
    colocated = {"model": cfg["model"], "engine": cfg["engine"],
                 "clusters": [{"name": "c", "instances": [{"name": "c0"}]}]}
    with serving(colocated) as (client, _):
        want_short = tokens(complete(client, SHORT)["choices"][0])
        want_long = tokens(complete(client, LONG)["choices"][0])
        turn = LONG + want_long + MESSAGE
        want_turn = tokens(complete(client, turn)["choices"][0])
        want_branch = tokens(complete(client, BRANCH)["choices"][0])
    with serving(cfg) as (client, router):
        short = complete(client, SHORT)
        assert tokens(short["choices"][0]) == want_short
        js = short["jaxserve"]
        assert (js["route"], js["prefill_instance"], js["decode_instance"]) == ("pd", "pd-p0", "pd-d0")
        assert js["prefill_cluster"] == js["decode_cluster"] == "pd" and js["uncached_tokens"] == len(SHORT)

        long = complete(client, LONG)
        assert tokens(long["choices"][0]) == want_long
        js = long["jaxserve"]
        assert (js["route"], js["prefill_instance"], js["decode_instance"]) == ("prfaas", "prfaas-p0", "pd-d0")
        assert (js["prefill_cluster"], js["decode_cluster"], js["kv_backend"]) == ("prfaas", "pd", "tcp")
        assert js["kv_bytes_transferred"] > 0

        # the decode instance now holds the long prompt's KV (received) and the answer's (generated): the index
        # hears it with the next heartbeats
        history = (len(LONG) + len(want_long) - 1) // 16 * 16
        wait_for(lambda: router.index.match(turn).get("pd-d0") == history, "the index to see pd-d0's history")
        nxt = complete(client, turn)
        assert tokens(nxt["choices"][0]) == want_turn
        js = nxt["jaxserve"]
        assert js["route"] != "prfaas" and js["decode_instance"] == "pd-d0" and js["prefill_cluster"] == "pd"
        assert js["cached_tokens"] == history and js["prefix_source"] == "pd-d0"
        assert js["uncached_tokens"] == len(turn) - history and js["kv_bytes_transferred"] == 0

        # bandwidth abundant: the best prefix anywhere counts (PrfaaS holds 288 of BRANCH's tokens, the PD
        # prefill none, the decode instance no state there), so the 100 uncached tokens stay on the PD
        # prefill and the cached prefix moves across the link first (Import on pd-p0, Export on prfaas-p0)
        branch = complete(client, BRANCH)
        assert tokens(branch["choices"][0]) == want_branch
        js = branch["jaxserve"]
        assert (js["route"], js["prefill_instance"], js["decode_instance"]) == ("pd", "pd-p0", "pd-d0"), js
        assert js["prefix_source"] == "prfaas-p0" and js["uncached_tokens"] == 100
        move = js["prefix_move"]
        assert (move["src"], move["dst"], move["tokens"]) == ("prfaas-p0", "pd-p0", 288) and move["kv_bytes"] > 0
        # pd-p0 served the 288 tokens from the moved cache (its hit rate was 0), and the index heard of them and
        # of the blocks it computed on top (to BRANCH's last block boundary, with the state snapshot there)
        wait_for(lambda: router.registry.get("pd-p0").stats.get("prefix_hit_rate", 0) > 0, "pd-p0's prefix hit")
        wait_for(lambda: router.index.match(BRANCH).get("pd-p0") == 384, "the index to see the moved prefix")

        metrics = client.get("/metrics").text
        assert re.search(r'jaxserve_prefix_moves{outcome="done"} 1\.0', metrics)
        assert re.search(r'jaxserve_prefix_moves{outcome="failed"} 0\.0', metrics)
        for route, n in (("pd", 2), ("prfaas", 1), ("colocated", 1)):
            assert re.search(rf'jaxserve_route_requests{{route="{route}"}} {n}\.0', metrics), route
        sent = [float(v) for v in re.findall(r'jaxserve_link_bytes_sent{link="prfaas-p0->[^"]*"} (\S+)', metrics)]
        assert sent and sum(sent) >= long["jaxserve"]["kv_bytes_transferred"]
        assert re.search(r'jaxserve_kv_index{what="instances"} 3\.0', metrics)

        # the admin endpoint reshapes the live link (a bandwidth drop staged at run time)
        r = client.post("/admin/links", json={"src": "prfaas", "dst": "pd", "bandwidth_gbps": 0.2})
        # prfaas-p0's links to the PD cluster: to pd-d0 (LONG's KV) and to pd-p0 (the moved prefix)
        assert r.status_code == 200 and r.json()["instances"] == {"prfaas-p0": {"links": 2}}, r.text
        wait_for(lambda: re.search(r'jaxserve_link_bandwidth_bytes_s{link="prfaas-p0->[^"]*"} 2\.5e\+07',
                                   client.get("/metrics").text), "the new bandwidth in the link's report")
        links = link_states(router.cfg, router.registry.all(), router.topology.bandwidth)
        assert [(lk.src, lk.dst, lk.capacity_bytes_s) for lk in links] == [("prfaas", "pd", 0.2e9 / 8)]
        r = client.post("/admin/links", json={"src": "pd", "dst": "prfaas", "bandwidth_gbps": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "src"
        r = client.post("/admin/links", json={"src": "prfaas", "dst": "pd", "bandwidth_gbps": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bandwidth_gbps"
