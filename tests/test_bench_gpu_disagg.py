"""bench/gpu_disagg.py end to end on a tiny checkpoint on the CPU (what gpu_check runs on the GPU): three real
deployments through `jaxserve serve` (colocated, disaggregated, PrfaaS over an emulated link), their greedy answers
compared, TTFT / TPOT per prompt length each way."""

import json

import pytest

from bench import gpu_disagg
from bench.report_engine import gpu_disagg as render


@pytest.mark.slow
def test_every_deployment_answers_as_colocated_and_is_timed(checkpoint_dir, tmp_path, monkeypatch):
    out = tmp_path / "gpu_disagg.json"
    answered, complete = [], gpu_disagg.complete
    monkeypatch.setattr(gpu_disagg, "complete", lambda *a, **k: answered.append((k, complete(*a, **k))) or
                        answered[-1][1])
    assert gpu_disagg.main(["--model", checkpoint_dir("llama"), "--lengths", "24,40", "--new", "4", "--reps", "1",
                            "--answers", "3", "--threshold", "30", "--load", "3", "--load-prompt", "16",
                            "--load-new", "5", "--busy", "2", "--busy-new", "12", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for dep in ("disaggregated", "prfaas"):
        assert r["compared"][dep]["answers_equal"] == r["answers"] == 3, dep
        assert r[dep]["ready_s"] > 0 and set(r["compared"][dep]["ratios"]) == {"24", "40"}
    for n in ("24", "40"):
        d, c, x = r["disaggregated"]["lengths"][n], r["colocated"]["lengths"][n], r["prfaas"]["lengths"][n]
        assert d["prefill_instance"] == ["p0"] and c["prefill_instance"] == ["solo"]
        assert d["kv_bytes"] > 0 == c["kv_bytes"] and d["kv_backend"] and not c["kv_backend"]
        assert d["ttft_s"] > 0 and d["tpot_s"] > 0 and r["compared"]["disaggregated"]["ratios"][n]["ttft"] > 0
        assert c["second_s"] > 0 and d["second_s"] > 0  # the first token to the second
        # where TTFT goes: the router's placement (decode's reservation; colocated is one in-process engine, no
        # router), the prefilling engine's own TTFT (its prefill began beside the reservation: the router's early
        # prefill), and decode's from its reservation to the KV in
        assert c["placed_s"] is None and 0 < d["placed_s"] < d["ttft_s"], (c, d)
        assert 0 < c["engine_ttft_s"] < c["ttft_s"] and c["prefill_ttft_s"] is None, c
        assert 0 < d["prefill_ttft_s"] < d["ttft_s"] and d["prefill_ttft_s"] < d["engine_ttft_s"], d
        # over the threshold: prefilled in the PrfaaS cluster, its KV over the emulated link (TCP); under: at home
        assert x["prefill_instance"] == (["x0"] if int(n) > 30 else ["p0"]) and x["kv_bytes"] > 0
        assert x["kv_backend"] == ["tcp"] if int(n) > 30 else x["kv_backend"] != ["tcp"]
        # each instance's engine steps over the timed request: prefill on p0, decode on d0, both in one engine
        assert d["steps"]["p0"]["prefill"]["count"] >= 1 and d["steps"]["d0"]["decode"]["count"] >= 4 - 1, d
        assert "decode" not in d["steps"]["p0"] and "prefill" not in d["steps"]["d0"]
        assert {"prefill", "decode"} <= set(c["steps"]["local"]), c
    # under load: three requests at once each way, decoded in one batch on the decode instance
    assert r["load"] == {"requests": 3, "prompt": 16, "new": 5}
    for dep, where in (("colocated", "local"), ("disaggregated", "d0"), ("prfaas", "d0")):
        ld = r[dep]["load"]
        assert ld["requests"] == 3 and 0 < ld["tpot_s"] <= ld["tpot_p90_s"] and ld["tokens_per_s"] > 0, ld
        assert ld["steps"][where]["decode"]["count"] >= 4, ld  # (5 tokens: the first from prefill)
    assert set(r["compared"]["disaggregated"]["load"]) == {"tpot_s", "tpot_p90_s", "tokens_per_s"}
    # with decode busy: a 24-token prompt timed while two requests keep decoding (one probe: 1 rep after 3 untimed)
    for dep in ("colocated", "disaggregated", "prfaas"):
        b = r[dep]["busy"]
        assert b["requests"] == 2 and b["prompt"] == 24 and b["probes"] == 1 and b["ttft_s"] > 0, b
        assert (b["placed_s"] is None) == (dep == "colocated") and (b["prefill_ttft_s"] is None) == (dep == "colocated")
    assert r["compared"]["disaggregated"]["busy"]["ttft_s"] > 0
    # the answers come with each token's gap between its two likeliest tokens (where a difference would be a tie)
    tops = [got for k, got in answered if k.get("top") == 2]
    assert len(tops) == 3 * 3 and all(len(g["gaps"]) == len(g["tokens"]) == 4 for g in tops)
    assert all(x is None or x >= 0 for g in tops for x in g["gaps"]) and any(x for g in tops for x in g["gaps"])
    text = "\n".join(render({"gpu_disagg.json": r}))
    assert "prfaas: answers equal colocated for 3 of 3 prompts;" in text and ", x0 |" in text
    assert "prefill steps colocated / disaggregated: count x ms (device ms)" in text
    assert "Under load (3 requests at once, 16-token prompts, 5 tokens each): TPOT colocated / disaggregated" in text
    assert "With 2 requests decoding: a 24-token prompt's TTFT colocated / disaggregated" in text
    assert ("| placed colocated / disaggregated (ms) | prefilling engine's TTFT colocated / disaggregated (ms) | "
            "disaggregated: decode's reservation to its first token (ms) | first token to the second colocated / "
            "disaggregated (ms) |") in text


def test_a_failed_deployment_keeps_what_the_others_measured(checkpoint_dir, tmp_path, monkeypatch):
    """The disaggregated deployment fails (a worker crashed): the JSON keeps colocated's figures and says why, the
    PrfaaS deployment still runs, and the report renders it."""

    cfgs = {}

    def serve(cfg, work, name, *args):
        cfgs[name] = cfg
        if name == "disaggregated":
            assert cfg["transfer"]["cuda_ipc"] is False  # --cuda-ipc off reaches the config
            raise RuntimeError("decode worker exited")
        return {"ready_s": 1.0, "answers": [[1, 2]], "lengths": {"24": {
            "ttft_s": 0.1, "tpot_s": 0.01, "kv_bytes": 0, "kv_backend": [], "prefill_instance": [name]}}}
    monkeypatch.setattr(gpu_disagg, "serve_and_measure", serve)
    out = tmp_path / "gpu_disagg.json"
    assert gpu_disagg.main(["--model", checkpoint_dir("llama"), "--lengths", "24", "--cuda-ipc", "off",
                            "--answers", "1", "--deployments", "colocated,disaggregated,sequential,prfaas",
                            "--json", str(out)]) == 1
    # sequential: the disaggregated deployment with the router's Prefill call after decode's reservation
    assert cfgs["sequential"] == {**cfgs["disaggregated"], "router": {"early_prefill": False}}
    assert "router" not in cfgs["disaggregated"] and "router" not in cfgs["prfaas"]  # its default: on
    r = json.loads(out.read_text())
    assert r["colocated"]["ready_s"] == 1.0 and r["disaggregated"] == {"error": "RuntimeError: decode worker exited"}
    assert r["compared"]["prfaas"] == {"answers_equal": 1, "differ": [], "ratios": {"24": {"ttft": 1.0, "tpot": 1.0}}}
    assert gpu_disagg.first_difference(3, [5, 6, 7], [5, 9, 7]) == [3, 1, 6, 9]
    assert gpu_disagg.first_difference(0, [5, 6], [5]) == [0, 1, 6, None]
    assert gpu_disagg.first_difference(3, [5, 6, 7], [5, 9, 7], [0.5, 0.0123, 0.2]) == [3, 1, 6, 9, 0.0123]
    assert gpu_disagg.first_difference(0, [5, 6], [5], [0.5]) == [0, 1, 6, None, None]
    assert gpu_disagg.top_gap({"a": -0.25, "b": -1.0, "c": -2.0}) == 0.75 and gpu_disagg.top_gap({"a": 0.0}) is None
    text = "\n".join(render({"x.json": r}))
    assert "disaggregated: failed: RuntimeError: decode worker exited" in text
    assert "prfaas: answers equal colocated for 1 of 1 prompts" in text
    assert ("sequential (disaggregated with the Prefill call after decode's reservation: router.early_prefill off): "
            "answers equal colocated for 1 of 1 prompts") in text
    r["compared"]["prfaas"].update(answers_equal=0, differ=[[0, 5, 11, 12, 0.0042], [2, 0, 3, 4, None]])
    assert ("prfaas: answers equal colocated for 0 of 1 prompts (the others first differ: prompt 0 at token 5 "
            "(colocated's two likeliest tokens there 0.0042 apart in log-probability); prompt 2 at token 0); ready "
            "after 1 s") in "\n".join(render({"x.json": r}))
    with pytest.raises(SystemExit):
        gpu_disagg.main(["--model", checkpoint_dir("llama"), "--deployments", "prfaas,colocated"])
    with pytest.raises(SystemExit):  # no slot left for the timed prompt
        gpu_disagg.main(["--model", checkpoint_dir("llama"), "--busy", "16"])
