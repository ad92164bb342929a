"""The kernel benchmark runs end to end (interpret mode on CPU) and its kernels agree with the references."""

import json

from bench import kernels, stamp


def test_kernel_benchmark_writes_json(tmp_path, monkeypatch):
    out = tmp_path / "k.json"
    written = []  # the results in the file at each write: after every case, so a run cut short keeps them
    real_write = stamp.write
    monkeypatch.setattr(stamp, "write", lambda path, o, **kw: (written.append(len(o["results"])),
                                                               real_write(path, o, **kw)))
    kernels.main(["--json", str(out), "--iters", "1", "--dtype", "float32"])
    assert written == [1, 2, 3, 4, 5, 6]
    data = json.loads(out.read_text())
    assert data["mode"] == "interpret" and "interpret mode" in data["note"]
    names = [r["kernel"] for r in data["results"]]
    assert names == ["flash_attention", "paged_attention", "paged_mla_attention", "recurrent_gated_delta_rule",
                     "chunk_gated_delta_rule", "chunk_gated_delta_rule"]  # the slowest to compile last
    for r in data["results"]:
        assert r["max_abs_diff"] < 1e-3, r
        assert r["kernel_s"] > 0 and r["reference_s"] > 0 and r["bytes"] > 0 and r["flops"] > 0
        assert abs(r["speedup_vs_reference"] - r["reference_s"] / r["kernel_s"]) < 1e-9
