"""bench/transfer.py runs end to end on a small transfer and writes its JSON."""

import json

from bench import transfer


def test_transfer_bench_smoke(tmp_path):
    out = tmp_path / "t.json"
    transfer.main(["--json", str(out), "--mb", "8", "--reps", "1", "--requests", "50", "--connections", "2"])
    r = json.loads(out.read_text())
    e, s = r["efficiency"], r["sends_per_request"]
    assert e["bytes"] == 8 << 20 and len(e["kv_bytes_per_s"]) == 1 and e["efficiency"] > 0
    assert s["aligned_sends_mean"] >= 1 and s["per_block_per_layer_sends_mean"] > 10 * s["aligned_sends_mean"]
