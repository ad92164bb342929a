"""Cache-group accounting and the KV-footprint benchmark's claim (hybrids an order of magnitude smaller)."""

import json

from bench import kv_footprint
from jaxserve.models.cache_spec import cache_spec
from jaxserve.models.config import parse_config


def test_kimi_linear_groups_by_hand():
    spec = cache_spec(parse_config(kv_footprint.CONFIGS["kimi-linear-48b-a3b"]))
    full = [g for g in spec.groups if g.kind == "full"][0]
    lin = [g for g in spec.groups if g.kind == "linear"][0]
    assert len(full.layers) == 7 and len(lin.layers) == 20
    assert full.token_bytes(2) == (512 + 64) * 2  # MLA: latent + rope key, one "head"
    assert lin.state_bytes(2) == 3 * 3 * 4096 * 2 + 32 * 128 * 128 * 4  # conv inputs bf16 + fp32 state
    assert spec.bytes_for(1000, 2) == 7 * 1000 * 1152 + 20 * lin.state_bytes(2)


def test_sliding_groups_stop_at_window():
    spec = cache_spec(parse_config(kv_footprint.CONFIGS["gpt-oss-120b"]))
    sw = [g for g in spec.groups if g.kind == "sliding"][0]
    assert sw.window == 128 and sw.bytes_for(10_000, 2) == sw.bytes_for(128, 2) == 18 * 128 * 8 * (64 + 64) * 2


def test_benchmark_hybrids_an_order_of_magnitude_smaller(tmp_path):
    out = tmp_path / "kv.json"
    kv_footprint.main(["--json", str(out)])
    res = json.loads(out.read_text())["models"]
    at32k = lambda m, d: res[m]["ratio_vs_dense"][d]["32768"]
    assert at32k("kimi-linear-48b-a3b", "minimax-m2.5") >= 10
    assert at32k("mimo-v2-flash", "minimax-m2.5") >= 10
    assert at32k("qwen3-next-80b-a3b", "qwen3-235b-a22b") >= 5
    for m in ("kimi-linear-48b-a3b", "mimo-v2-flash", "qwen3-next-80b-a3b"):
        assert res[m]["kv_bytes"]["131072"] < res["qwen3-235b-a22b"]["kv_bytes"]["131072"] / 5
