"""The kernel benchmark runs end to end (interpret mode on CPU) and its kernels agree with the references."""

import json

from bench import kernels


def test_kernel_benchmark_writes_json(tmp_path):
    out = tmp_path / "k.json"
    kernels.main(["--json", str(out), "--iters", "1", "--dtype", "float32"])
    data = json.loads(out.read_text())
    assert data["mode"] == "interpret" and "interpret mode" in data["note"]
    names = [r["kernel"] for r in data["results"]]
    assert names == ["flash_attention", "paged_attention", "paged_mla_attention", "chunk_gated_delta_rule",
                     "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]
    for r in data["results"]:
        assert r["max_abs_diff"] < 1e-3, r
        assert r["kernel_s"] > 0 and r["reference_s"] > 0 and r["bytes"] > 0 and r["flops"] > 0
        assert abs(r["speedup_vs_reference"] - r["reference_s"] / r["kernel_s"]) < 1e-9
