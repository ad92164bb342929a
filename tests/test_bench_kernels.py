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
    assert written == [1, 2, 3, 4, 5, 6, 7, 8]
    data = json.loads(out.read_text())
    assert data["mode"] == "interpret" and "interpret mode" in data["note"]
    names = [r["kernel"] for r in data["results"]]
    assert names == ["flash_attention", "paged_attention", "paged_prefill_attention", "paged_mla_attention",
                     "grouped_matmul", "recurrent_gated_delta_rule", "chunk_gated_delta_rule",
                     "chunk_gated_delta_rule"]  # the slowest to compile last
    assert "gather + batched_attention" in data["results"][2]["shape"]  # against the engine's dense path
    for r in data["results"]:
        assert r["max_abs_diff"] < 1e-3, r
        assert r["kernel_s"] > 0 and r["reference_s"] > 0 and r["bytes"] > 0 and r["flops"] > 0
        assert abs(r["speedup_vs_reference"] - r["reference_s"] / r["kernel_s"]) < 1e-9


def test_per_sequence_reference_equals_the_packed_one():
    """bench.kernels.per_sequence: flash attention's dense reference one sequence at a time gives the packed
    reference's numbers for sequences of one length, and is the packed reference itself otherwise."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.pallas_kernels.flash_attention import ref_flash_attention
    r = np.random.RandomState(0)
    q, k, v = (jnp.asarray(r.randn(96, h, 16), jnp.float32) for h in (4, 2, 2))
    cu = jnp.asarray([0, 32, 64, 96], jnp.int32)
    one_by_one = kernels.per_sequence(ref_flash_attention, cu)
    assert one_by_one is not ref_flash_attention
    got = jax.jit(lambda *a: one_by_one(*a, cu_seqlens=cu))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref_flash_attention(q, k, v, cu_seqlens=cu)), atol=1e-6)
    assert kernels.per_sequence(ref_flash_attention, jnp.asarray([0, 32, 96], jnp.int32)) is ref_flash_attention
