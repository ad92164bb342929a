"""bench/transfer.py and bench/interference.py run end to end on small settings and write their JSON."""

import json
import os

import pytest

from bench import interference, transfer


def test_transfer_bench_smoke(tmp_path):
    out = tmp_path / "t.json"
    transfer.main(["--json", str(out), "--parts", "a,b", "--mb", "8", "--reps", "1", "--requests", "50",
                   "--connections", "2"])
    r = json.loads(out.read_text())
    e, s = r["efficiency"], r["sends_per_request"]
    assert e["bytes"] == 8 << 20 and len(e["kv_bytes_per_s"]) == 1 and e["efficiency"] > 0
    assert len(e["device_backend"]["bytes_per_s"]) == 1 and e["device_backend"]["vs_raw"] > 0
    assert len(e["device_copy"]["bytes_per_s"]) == 1 and e["device_backend"]["vs_device_copy"] > 0
    assert "needs a GPU" in e["cuda_ipc"]["not_measured"]  # on a GPU: its rate beside the device copy's
    cpu = e["cpu_s_per_gb"]
    assert set(cpu) == {"raw", "raw_checksum", "kv", "kv_tls", "device"}
    t = e["tls"]  # the TLS link moved the bytes (a failed transfer raises) and says what it negotiated
    assert len(t["bytes_per_s"]) == 1 and t["vs_kv"] > 0 and t["cipher"].startswith("TLS")
    rc = e["raw_checksum"]  # checksummed raw transfers were acknowledged as matching, and timed
    assert len(rc["bytes_per_s"]) == 1 and rc["vs_raw"] > 0 and rc["kv_vs_this"] > 0
    for k in cpu.values():  # both processes did work, on no more cores than the host has
        assert k["sender"] > 0 and k["receiver"] > 0 and k["total"] == pytest.approx(k["sender"] + k["receiver"])
        assert 0 < k["cores_busy"] <= os.cpu_count() + 0.05
    assert e["checksum_cpu_s_per_gb"] > 0 and 0 < e["checksum_ceiling"] < 1
    assert s["aligned_sends_mean"] >= 1 and s["per_block_per_layer_sends_mean"] > 10 * s["aligned_sends_mean"]


@pytest.mark.slow
def test_ttft_phi_and_interference_benches_smoke(tmp_path, checkpoint_dir):
    """(c) and (d) with the tests' tiny llama standing in for the bench-size checkpoints; interference likewise.
    Their workers unpinned, as the suite's others (bench/clusters.py `unpinned`)."""
    models = tmp_path / "models"
    os.makedirs(models)
    os.symlink(checkpoint_dir("llama"), models / "bench-llama")  # bench/families.py finds it built
    out = tmp_path / "t.json"
    transfer.main(["--json", str(out), "--parts", "c,d", "--models", str(models), "--ttft-lengths", "32",
                   "--ttft-reps", "1", "--ttft-setups", "disagg_link_layerwise", "--ttft-chunk", "16",
                   "--phi-families", "llama",
                   "--phi-lengths", "16,32", "--phi-reps", "1", "--connections", "2", "--unpinned"])
    r = json.loads(out.read_text())
    c = r["ttft"]["setups"]
    assert set(c) == {"colocated", "disagg_link_layerwise"} and r["ttft"]["pinned"] is False
    assert r["ttft"]["chunk_size"] == 16  # 32-token prompts in two chunks
    assert c["colocated"]["route"]["prefill_instance"] == "c0"
    assert c["disagg_link_layerwise"]["route"]["prefill_instance"] == "p0"
    assert c["disagg_link_layerwise"]["route"]["kv_bytes_transferred"] > 0
    assert c["disagg_link_layerwise"]["overhead"]["32"] > -1
    d = r["phi_kv"]["families"]["llama"]["by_length"]
    assert d["32"]["s_kv_bytes"] == 2 * d["16"]["s_kv_bytes"] > 0 and d["32"]["phi_kv_bytes_per_s"] > 0
    out = tmp_path / "i.json"
    interference.main(["--json", str(out), "--models", str(models), "--decodes", "2", "--decode-tokens", "6",
                       "--decode-prompt", "8", "--prefills", "1", "--prefill-len", "48", "--chunk", "16",
                       "--gap", "0", "--unpinned"])
    r = json.loads(out.read_text())
    # a gap per update after the first, as vLLM's benchmark counts inter-token latency per streamed chunk: 2 requests
    # of 6 tokens give 10, fewer where an update carried two tokens (a loaded machine)
    for setup in ("colocated", "disaggregated"):
        assert 0 < r["setups"][setup]["tpot_samples"] <= 10, (setup, r["setups"][setup])
    assert r["p99_tpot_ratio"] > 0


def test_the_report_puts_cuda_ipc_beside_the_device_copy():
    from pathlib import Path

    from bench.report_cluster import transfer as render
    r = json.loads((Path(__file__).parent.parent / "bench/results/transfer_h200.json").read_text())
    e = r["efficiency"]
    assert "| - |" in "\n".join(render({"transfer_h200.json": r}))  # measured before CUDA IPC: no figure
    e["device_copy"] = {"bytes_per_s_median": 2.0e12, "bytes_per_s": [2.0e12]}
    e["cuda_ipc"] = {"bytes_per_s_median": 1.5e12, "bytes_per_s": [1.5e12]}
    assert "| 1500.0 / 2000.0 |" in "\n".join(render({"transfer_h200.json": r}))
