"""bench.online's figures from per-request records, and its engine overrides (the servers' run is a benchmark)."""

import pytest

from bench import online


def test_figures_pool_every_requests_chunk_gaps():
    recs = [{"ok": True, "ttft_s": 0.2, "tpot_s": 0.05, "e2e_s": 1.0, "gaps": [0.04, 0.05, 0.6]},
            {"ok": True, "ttft_s": 0.4, "tpot_s": 0.03, "e2e_s": 2.0, "gaps": [0.03] * 7},
            {"ok": False, "error": "HTTP 500: b''"}]
    f = online.figures(recs, 10.0)
    assert f["requests"] == 3 and f["failed"] == 1 and f["errors"] == ["HTTP 500: b''"]
    assert f["ttft_s"]["p50"] == pytest.approx(0.3) and f["tpot_s"]["mean"] == pytest.approx(0.04)
    assert f["itl_s"]["max"] == 0.6 and f["itl_s"]["p50"] == pytest.approx(0.03)  # 10 gaps, 7 of them 30 ms
    assert f["itl_s"]["p99"] > 0.5 and f["itl_s"]["mean"] == pytest.approx((0.69 + 0.21) / 10)


def test_engine_overrides_read_yaml_values():
    assert online.engine_overrides(["mixed_batched_tokens=128", "chunk_size=null", "prefix_caching=true"]) == {
        "mixed_batched_tokens": 128, "chunk_size": None, "prefix_caching": True}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        online.engine_overrides(["mixed_batched_tokens"])


def test_figures_keep_each_requests_latencies_in_order():
    recs = [{"ok": True, "ttft_s": 0.123456789, "tpot_s": 0.05, "e2e_s": 1.0, "gaps": [0.05]},
            {"ok": False, "error": "timeout"},
            {"ok": True, "ttft_s": 0.3, "tpot_s": 0.07, "e2e_s": 2.0, "gaps": [0.07]}]
    assert online.figures(recs, 3.0)["per_request"] == [[0.12346, 0.05], None, [0.3, 0.07]]


def test_paired_ratios_pair_passes_of_the_same_round():
    def p(ttft, tpot, itl):
        return {"ttft_s": {"p50": ttft, "p99": 2 * ttft}, "tpot_s": {"p50": tpot, "p99": tpot},
                "itl_s": {"p50": itl, "p99": None}}
    r = online.paired_ratios([p(1.0, 2.0, 1.0), p(3.0, 2.0, 1.0), p(2.0, 4.0, 1.0)],
                             [p(2.0, 1.0, 1.0), p(1.0, 4.0, 1.0), p(2.0, 2.0, 1.0)])
    assert r["ttft_s_p50"] == {"median": 1.0, "min": 0.5, "max": 3.0}
    assert r["tpot_s_p99"] == {"median": 2.0, "min": 0.5, "max": 2.0}
    assert r["itl_s_p99"] == {}  # no pass had the figure
