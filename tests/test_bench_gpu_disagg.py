"""bench/gpu_disagg.py end to end on a tiny checkpoint on the CPU (what gpu_check runs on the GPU): three real
deployments through `jaxserve serve` (colocated, disaggregated, PrfaaS over an emulated link), their greedy answers
compared, TTFT / TPOT per prompt length each way."""

import json

import pytest

from bench import gpu_disagg
from bench.report_engine import gpu_disagg as render


@pytest.mark.slow
def test_every_deployment_answers_as_colocated_and_is_timed(checkpoint_dir, tmp_path):
    out = tmp_path / "gpu_disagg.json"
    assert gpu_disagg.main(["--model", checkpoint_dir("llama"), "--lengths", "24,40", "--new", "4", "--reps", "1",
                            "--answers", "3", "--threshold", "30", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for dep in ("disaggregated", "prfaas"):
        assert r["compared"][dep]["answers_equal"] == r["answers"] == 3, dep
        assert r[dep]["ready_s"] > 0 and set(r["compared"][dep]["ratios"]) == {"24", "40"}
    for n in ("24", "40"):
        d, c, x = r["disaggregated"]["lengths"][n], r["colocated"]["lengths"][n], r["prfaas"]["lengths"][n]
        assert d["prefill_instance"] == ["p0"] and c["prefill_instance"] == ["solo"]
        assert d["kv_bytes"] > 0 == c["kv_bytes"] and d["kv_backend"] and not c["kv_backend"]
        assert d["ttft_s"] > 0 and d["tpot_s"] > 0 and r["compared"]["disaggregated"]["ratios"][n]["ttft"] > 0
        # where TTFT goes: the router's placement (decode's reservation; colocated is one in-process engine, no
        # router), the prefilling engine's own TTFT, and decode's from its reservation to the KV in
        assert c["placed_s"] is None and 0 < d["placed_s"] < d["ttft_s"], (c, d)
        assert 0 < c["engine_ttft_s"] < c["ttft_s"] and c["prefill_ttft_s"] is None, c
        assert 0 < d["prefill_ttft_s"] < d["ttft_s"] - d["placed_s"] and d["prefill_ttft_s"] < d["engine_ttft_s"], d
        # over the threshold: prefilled in the PrfaaS cluster, its KV over the emulated link (TCP); under: at home
        assert x["prefill_instance"] == (["x0"] if int(n) > 30 else ["p0"]) and x["kv_bytes"] > 0
        assert x["kv_backend"] == ["tcp"] if int(n) > 30 else x["kv_backend"] != ["tcp"]
        # each instance's engine steps over the timed request: prefill on p0, decode on d0, both in one engine
        assert d["steps"]["p0"]["prefill"]["count"] >= 1 and d["steps"]["d0"]["decode"]["count"] >= 4 - 1, d
        assert "decode" not in d["steps"]["p0"] and "prefill" not in d["steps"]["d0"]
        assert {"prefill", "decode"} <= set(c["steps"]["local"]), c
    text = "\n".join(render({"gpu_disagg.json": r}))
    assert "prfaas: answers equal colocated for 3 of 3 prompts" in text and ", x0 |" in text
    assert "prefill steps colocated / disaggregated: count x ms (device ms)" in text
    assert ("| placed colocated / disaggregated (ms) | prefilling engine's TTFT colocated / disaggregated (ms) | "
            "disaggregated: decode's reservation to its first token (ms) |") in text


def test_a_failed_deployment_keeps_what_the_others_measured(checkpoint_dir, tmp_path, monkeypatch):
    """The disaggregated deployment fails (a worker crashed): the JSON keeps colocated's figures and says why, the
    PrfaaS deployment still runs, and the report renders it."""

    def serve(cfg, work, name, *args):
        if name == "disaggregated":
            assert cfg["transfer"]["cuda_ipc"] is False  # --cuda-ipc off reaches the config
            raise RuntimeError("decode worker exited")
        return {"ready_s": 1.0, "answers": [[1, 2]], "lengths": {"24": {
            "ttft_s": 0.1, "tpot_s": 0.01, "kv_bytes": 0, "kv_backend": [], "prefill_instance": [name]}}}
    monkeypatch.setattr(gpu_disagg, "serve_and_measure", serve)
    out = tmp_path / "gpu_disagg.json"
    assert gpu_disagg.main(["--model", checkpoint_dir("llama"), "--lengths", "24", "--cuda-ipc", "off",
                            "--answers", "1", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["colocated"]["ready_s"] == 1.0 and r["disaggregated"] == {"error": "RuntimeError: decode worker exited"}
    assert r["compared"]["prfaas"] == {"answers_equal": 1, "differ": [], "ratios": {"24": {"ttft": 1.0, "tpot": 1.0}}}
    assert gpu_disagg.first_difference(3, [5, 6, 7], [5, 9, 7]) == [3, 1, 6, 9]
    assert gpu_disagg.first_difference(0, [5, 6], [5]) == [0, 1, 6, None]
    text = "\n".join(render({"x.json": r}))
    assert "disaggregated: failed: RuntimeError: decode worker exited" in text
    assert "prfaas: answers equal colocated for 1 of 1 prompts" in text
    with pytest.raises(SystemExit):
        gpu_disagg.main(["--model", checkpoint_dir("llama"), "--deployments", "prfaas,colocated"])
