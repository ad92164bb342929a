"""bench/gpu_disagg.py end to end on a tiny checkpoint on the CPU (what gpu_check runs on the GPU): two real
deployments through `jaxserve serve`, their greedy answers compared, TTFT / TPOT per prompt length both ways."""

import json

import pytest

from bench import gpu_disagg


@pytest.mark.slow
def test_disaggregated_and_colocated_answer_alike_and_are_timed(checkpoint_dir, tmp_path):
    out = tmp_path / "gpu_disagg.json"
    assert gpu_disagg.main(["--model", checkpoint_dir("llama"), "--lengths", "24,40", "--new", "4", "--reps", "1",
                            "--answers", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["answers_equal"] == r["answers"] == 3
    for n in ("24", "40"):
        d, c = r["disaggregated"]["lengths"][n], r["colocated"]["lengths"][n]
        assert d["prefill_instance"] == ["p0"] and c["prefill_instance"] == ["solo"]
        assert d["kv_bytes"] > 0 == c["kv_bytes"] and d["kv_backend"] and not c["kv_backend"]
        assert d["ttft_s"] > 0 and d["tpot_s"] > 0 and r["ratios"][n]["ttft"] > 0
    assert r["disaggregated"]["ready_s"] > 0 and r["colocated"]["ready_s"] > 0


def test_a_failed_deployment_keeps_what_the_other_measured(checkpoint_dir, tmp_path, monkeypatch):
    """The disaggregated deployment fails (a worker crashed): the JSON keeps colocated's figures and says why,
    and the report renders it."""
    from bench.report_engine import gpu_disagg as render

    def serve(cfg, work, name, *args):
        if name == "disaggregated":
            assert cfg["transfer"]["cuda_ipc"] is False  # --cuda-ipc off reaches the config
            raise RuntimeError("decode worker exited")
        return {"ready_s": 1.0, "answers": [], "lengths": {}}
    monkeypatch.setattr(gpu_disagg, "serve_and_measure", serve)
    out = tmp_path / "gpu_disagg.json"
    assert gpu_disagg.main(["--model", checkpoint_dir("llama"), "--lengths", "24", "--cuda-ipc", "off",
                            "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["colocated"]["ready_s"] == 1.0 and r["disaggregated"] == {"error": "RuntimeError: decode worker exited"}
    assert "disaggregated failed: RuntimeError: decode worker exited" in "\n".join(render({"x.json": r}))
