"""Kernel benchmark: each Pallas kernel against its jnp reference, same inputs, same run (paged prefill
attention, a chunk after cached tokens, against the engine's path without it: the row's blocks gathered into a
dense cache, then flash attention; the experts' grouped products, XLA's `ragged_dot` against the CPU's form,
which has no Pallas kernel (pallas_kernels/native.py `grouped_matmul`: the C++ kernel, or where it does not run,
a GPU included, the tiled jnp loop): whether XLA's GPU backend runs ragged_dot as its CPU backend does, a product
over every expert).

Per kernel and shape: the time per call at steady state (`_time`: groups of `--iters` calls dispatched back to
back, the median group; compile and warm-up excluded), the bytes a kernel must at least move (inputs read
once, outputs written once; for paged attention the K/V of every token in context), the FLOPs of the useful
work (visible query-key pairs only), the achieved GB/s and TFLOP/s, the reference / kernel time ratio, and the
largest difference between the two outputs (flash attention's reference runs one sequence at a time where the
packed sequences are of one length: `per_sequence`). On a GPU flash attention is measured twice: as
`flash_attention` runs it (the Mosaic GPU kernel on a Hopper GPU) and through its Triton kernel
(`flash_attention_triton`).

Modes: `pallas` compiles the kernels for the device (GPU), `interpret` runs the kernel bodies in Pallas
interpret mode (CPU; that times the interpreter, not the kernel: only the correctness columns and the
reference's rates mean something there). Default: pallas on GPU with production shapes, interpret with
small shapes elsewhere. On a GPU the JSON also gives decode attention's bandwidth as a fraction of the
device's HBM peak and prefill attention's FLOP rate as a fraction of its dense bf16 peak (targets: 80% and 60%).
A kernel that does not compile on the device is recorded with its error (and its reference's time). The JSON
is written after every case (the chunked delta rule, slowest to compile, last), so a run cut short keeps what it
measured; on a GPU two seconds of matrix products first raise its clocks.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import numpy as np

PEAKS = {  # device_kind substring -> (HBM bytes/s, dense bf16 FLOP/s)
    "H100": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
    "A100": (2.0e12, 312e12),
}

SHAPES = {
    "gpu": dict(flash=[dict(lens=[1024, 2048, 512, 512], Hq=32, Hkv=8, D=128),
                       dict(lens=[8192, 8192], Hq=32, Hkv=8, D=128)],  # 1.1 TFLOP: launch and tail costs amortised
                paged=[dict(B=32, ctx=2048, Hq=32, Hkv=8, D=128, bs=16),  # 269 MB of K/V: ~95 us on an H200
                       dict(B=64, ctx=8192, Hq=32, Hkv=8, D=128, bs=16)],  # 2.1 GB: launch and tail costs amortised
                mla=dict(B=32, ctx=2048, H=16, L=512, R=64, bs=16),
                prefill=[dict(T=256, ctx=8192, Hq=32, Hkv=8, D=128, bs=16)],  # the engine's chunk after 8K cached
                gdn=dict(B=1, T=4096, H=16, Dk=128, Dv=128, C=64),
                rec=dict(B=64, H=16, Dk=128, Dv=128),
                # gpt-oss-20b's experts (gate and up as one product): a 64-request decode step's rows (4 experts a
                # token: every expert read, 1.06 GB) and a 2,048-token prefill's
                moe=[dict(E=32, K=2880, N=5760, M=256), dict(E=32, K=2880, N=5760, M=8192)]),
    "cpu": dict(flash=[dict(lens=[96, 160], Hq=8, Hkv=2, D=64)],
                paged=[dict(B=8, ctx=256, Hq=8, Hkv=2, D=64, bs=16)],
                mla=dict(B=8, ctx=256, H=8, L=64, R=16, bs=16),
                prefill=[dict(T=32, ctx=256, Hq=8, Hkv=2, D=64, bs=16)],
                gdn=dict(B=1, T=256, H=4, Dk=64, Dv=64, C=64),
                rec=dict(B=8, H=4, Dk=64, Dv=64),
                moe=[dict(E=8, K=128, N=256, M=64)]),
}


def _time(fn, args, iters: int, groups: int = 5) -> float:
    """Seconds per call at steady state: `groups` times, `iters` calls dispatched back to back and waited for
    once (the device runs them one after another, as a serving step's programs run), the median per call.
    Waiting for each call instead would add the host's dispatch-and-sync round trip (tens of microseconds on a
    GPU) to every kernel of a few hundred."""
    import jax
    jax.block_until_ready(fn(*args))  # compile + warm up
    ts = []
    for _ in range(groups):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def _cases(shapes: dict, dtype, triton: bool = False):
    """(name, shape description, kernel name, args, kwargs, bytes, flops, kind) per benchmark, each case's inputs
    drawn when it is reached (the long shapes take seconds each), the chunked delta rule, slowest to compile, last;
    triton: flash attention also through its Triton kernel (on a Hopper GPU the default is the Mosaic GPU
    kernel)."""
    import jax.numpy as jnp

    from jaxserve.pallas_kernels.check import inputs
    from jaxserve.pallas_kernels.gated_delta_rule import SUB
    from jaxserve.pallas_kernels.native import grouped_matmul
    r = np.random.RandomState(0)
    it = jnp.dtype(dtype).itemsize
    rnd = lambda *s: jnp.asarray(r.randn(*s) * 0.5, dtype)  # noqa: E731
    for f in shapes["flash"]:
        T, Hq, Hkv, D = sum(f["lens"]), f["Hq"], f["Hkv"], f["D"]
        pairs = sum(n * (n + 1) // 2 for n in f["lens"])
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(f["lens"])]), jnp.int32)
        qkv = (rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D))
        for name, kw in [("flash_attention", {})] + ([("flash_attention_triton", dict(hopper=False))] if triton
                                                     else []):
            yield (name, f"T={T} seqs={f['lens']} Hq={Hq} Hkv={Hkv} D={D} causal", "flash_attention", qkv,
                   dict(cu_seqlens=cu, **kw), it * T * D * (2 * Hq + 2 * Hkv), 4 * pairs * Hq * D, "compute")
    for p in shapes["paged"]:
        B, ctx, bs = p["B"], p["ctx"], p["bs"]
        args, kw = inputs("paged_attention", r, Hq=p["Hq"], Hkv=p["Hkv"], Dk=p["D"], Dv=p["D"], dtype=dtype,
                          block_size=bs, B=B, ctx=ctx, full=True)
        yield ("paged_attention", f"B={B} ctx={ctx} Hq={p['Hq']} Hkv={p['Hkv']} D={p['D']} block={bs}",
               "paged_attention", args, kw, it * (B * ctx * 2 * p["Hkv"] * p["D"] + 2 * B * p["Hq"] * p["D"]),
               4 * B * ctx * p["Hq"] * p["D"], "memory")
    for p in shapes["prefill"]:
        yield _prefill_case(r, p, dtype)
    m = shapes["mla"]
    Dm = m["L"] + m["R"]
    args, kw = inputs("paged_mla_attention", r, H=m["H"], L=m["L"], R=m["R"], dtype=dtype, block_size=m["bs"],
                      scale=0.1, B=m["B"], ctx=m["ctx"], full=True)
    yield ("paged_mla_attention", f"B={m['B']} ctx={m['ctx']} H={m['H']} latent={m['L']} rope={m['R']} "
           f"block={m['bs']}", "paged_mla_attention", args, kw,
           it * (m["B"] * m["ctx"] * Dm + m["B"] * m["H"] * (Dm + m["L"])),
           2 * m["B"] * m["ctx"] * m["H"] * (Dm + m["L"]), "memory")
    for e in shapes["moe"]:  # XLA's ragged_dot (the reference: the GPU's path) against the CPU's form
        E, K, N, M = e["E"], e["K"], e["N"], e["M"]
        sizes = np.bincount(np.sort(r.randint(0, E, M)), minlength=E).astype(np.int32)
        w = jnp.asarray(r.randn(E, K, N) * K ** -0.5, dtype)
        yield ("grouped_matmul", f"E={E} K={K} N={N} rows={M}", "grouped_matmul", (rnd(M, K), w, jnp.asarray(sizes)),
               dict(_kernel=grouped_matmul), it * (int((sizes > 0).sum()) * K * N + M * (K + N)),
               2.0 * M * K * N, "memory" if M <= 64 * E else "compute")
    q = shapes["rec"]
    Br, H, Dk, Dv = q["B"], q["H"], q["Dk"], q["Dv"]
    args, kw = inputs("recurrent_gated_delta_rule", r, H=H, Dk=Dk, Dv=Dv, dtype=dtype, per_channel=True, B=Br)
    yield ("recurrent_gated_delta_rule", f"B={Br} H={H} Dk={Dk} Dv={Dv} one decode step, per-channel decay",
           "recurrent_gated_delta_rule", args, kw,
           2 * 4 * Br * H * Dk * Dv + it * Br * H * (2 * Dk + 2 * Dv), 6 * Br * H * Dk * Dv, "memory")
    g = shapes["gdn"]
    Bg, Tg, H, Dk, Dv, C = g["B"], g["T"], g["H"], g["Dk"], g["Dv"], g["C"]
    state = 4 * Bg * H * Dk * Dv  # float32 state, read at the start and written at the end
    for per_channel in (False, True):
        args, kw = inputs("chunk_gated_delta_rule", r, H=H, Dk=Dk, Dv=Dv, dtype=dtype, per_channel=per_channel,
                          T=Tg, B=Bg)
        Ck = min(C, SUB) if per_channel else C  # the kernel's chunk: per-channel decay runs in chunks of SUB
        # per chunk: KK, QK (C^2 Dk each), T inverse (log2 C matmuls C^3), U/W (C^2 (Dv + Dk)), state terms (3 C Dk Dv)
        per_chunk = 2 * (2 * Ck * Ck * Dk + np.log2(Ck) * 2 * Ck ** 3 + Ck * Ck * (Dv + Dk) + 3 * Ck * Dk * Dv
                         + Ck * Ck * Dv)
        yield ("chunk_gated_delta_rule", f"B={Bg} T={Tg} H={H} Dk={Dk} Dv={Dv} C={C} "
               + ("per-channel decay (KDA)" if per_channel else "scalar decay (GDN)"), "chunk_gated_delta_rule",
               args, dict(kw, chunk_size=C),
               it * Bg * Tg * H * (2 * Dk + 2 * Dv + 1) + 4 * Bg * Tg * H * (Dk if per_channel else 1)
               + 2 * state, float(Bg * H * (Tg // Ck) * per_chunk), "compute")


def _prefill_case(r, p: dict, dtype):
    """Paged prefill attention over one chunk of T tokens ending ctx tokens into its request (the engine's chunk
    after cached tokens), against the dense path the engine takes without it (`gather_then_attend`)."""
    import jax.numpy as jnp

    from jaxserve.pallas_kernels.check import _table
    T, ctx, bs, Hq, Hkv, D = p["T"], p["ctx"], p["bs"], p["Hq"], p["Hkv"], p["D"]
    NB, table = _table(r, 1, ctx, bs)
    pos = jnp.arange(ctx - T, ctx, dtype=jnp.int32)
    args = (jnp.asarray(r.randn(T, Hq, D) * 0.5, dtype), jnp.asarray(r.randn(NB, 1, 2, bs, Hkv, D) * 0.5, dtype),
            table, jnp.zeros(T, jnp.int32), pos)
    pairs = T * (ctx - T) + T * (T + 1) // 2  # visible query-key pairs
    it = jnp.dtype(dtype).itemsize
    return ("paged_prefill_attention", f"T={T} after {ctx - T} cached Hq={Hq} Hkv={Hkv} D={D} block={bs}, "
            "reference: gather + batched_attention", "paged_prefill_attention", args,
            dict(layer=0, _reference=gather_then_attend), it * (ctx * 2 * Hkv * D + 2 * T * Hq * D),
            4 * pairs * Hq * D, "compute")


def gather_then_attend(q, pool, block_tables, rows, positions, *, layer, interpret=False):
    """One row's chunk (rows all 0) as the engine attends without the paged prefill kernel: the row's blocks
    gathered into a dense cache, then batched_attention (its Pallas kernel; interpreted where interpret)."""
    from jaxserve.pallas_kernels.paged_attention import _dense_view
    from jaxserve.pallas_kernels.select import select
    del rows
    x, k_pos = _dense_view(pool, block_tables, None, layer)  # [1, S, E, Hkv, D]
    attend = select("batched_attention", "interpret" if interpret else "pallas")
    return attend(q[None], x[:, :, 0], x[:, :, 1], positions[None], k_pos, k_pos <= positions[-1],
                  scale=q.shape[-1] ** -0.5)[0]


def per_sequence(ref, cu_seqlens):
    """flash attention's dense reference `ref` run one sequence at a time where the packed sequences are all of
    one length (its [Hq, T, T] scores for 16K packed tokens would take 34 GB), else `ref` itself."""
    import jax
    import jax.numpy as jnp
    lens = np.diff(np.asarray(cu_seqlens))
    if len(lens) < 2 or (lens != lens[0]).any():
        return ref
    L, N = int(lens[0]), len(lens)

    def one_by_one(q, k, v, *, cu_seqlens, **kw):
        del cu_seqlens
        one = jnp.asarray([0, L], jnp.int32)
        split = lambda x: x.reshape((N, L) + x.shape[1:])  # noqa: E731
        out = jax.lax.map(lambda x: ref(*x, cu_seqlens=one, **kw), (split(q), split(k), split(v)))
        return out.reshape((N * L,) + out.shape[2:])
    return one_by_one


def warm_gpu(seconds: float = 2.0) -> None:
    """Matrix products for `seconds`, so the GPU's clocks have risen before the first timed call (an idle GPU's
    first kernel otherwise runs at its idle clocks: the first configuration timed 18% slow on an H200)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda a: (a @ a) * jnp.bfloat16(1e-4))
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        x = f(x)
        x.block_until_ready()


def run(mode: str | None, iters: int, dtype_name: str, emit=None) -> dict:
    """The benchmark's result; emit(result so far) after every case, when given."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from jaxserve.pallas_kernels.select import KERNELS
    on_gpu = jax.default_backend() == "gpu"
    mode = mode or ("pallas" if on_gpu else "interpret")
    dtype = jnp.dtype(dtype_name)
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAKS.items() if k in kind), None) if on_gpu else None
    results = []
    out = dict(benchmark="kernels", mode=mode, dtype=dtype_name, device=kind, backend=jax.default_backend(),
               host=platform.node(), iters=iters, results=results,
               note=("Pallas kernels compiled for the GPU against the jnp references in the same run."
                     if mode == "pallas" else
                     "No GPU: kernels ran in Pallas interpret mode, which times the interpreter, not the kernel. "
                     "Only max_abs_diff (kernel vs reference) and the reference rates are meaningful here."))
    cases = _cases(SHAPES["gpu" if on_gpu else "cpu"], dtype, triton=on_gpu)
    if on_gpu:
        warm_gpu()
    for name, shape, kname, args, kw, nbytes, flops, bound in tqdm(cases, desc="kernels", unit="case"):
        if emit is not None and results:
            emit(out)
        ref, kernel = KERNELS[kname]
        if kname == "flash_attention":
            ref = per_sequence(ref, kw["cu_seqlens"])
        if "_reference" in kw:  # a baseline other than the jnp reference (paged prefill: the dense path)
            kw = dict(kw)
            ref = functools.partial(kw.pop("_reference"), interpret=mode == "interpret")
        if "_kernel" in kw:  # a form other than a Pallas kernel (the experts' products: the CPU's)
            kw = dict(kw)
            kfn = jax.jit(functools.partial(kw.pop("_kernel"), **kw))
        else:
            kfn = jax.jit(functools.partial(kernel, interpret=mode == "interpret", **kw))
        rfn = jax.jit(functools.partial(ref, **kw))
        ro = rfn(*args)
        try:
            ko = kfn(*args)
        except Exception as e:  # a kernel that does not lower on this device: recorded, the others still run
            results.append(dict(kernel=name, shape=shape, bound=bound, error=f"{type(e).__name__}: {e}"[:2000],
                                reference_s=_time(rfn, args, iters)))
            continue
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                  for a, b in zip(jax.tree.leaves(ko), jax.tree.leaves(ro)))
        tk, tr = _time(kfn, args, iters), _time(rfn, args, iters)
        row = dict(kernel=name, shape=shape, bound=bound, bytes=int(nbytes), flops=float(flops),
                   kernel_s=tk, reference_s=tr, speedup_vs_reference=tr / tk,
                   kernel_GBps=nbytes / tk / 1e9, reference_GBps=nbytes / tr / 1e9,
                   kernel_TFLOPs=flops / tk / 1e12, reference_TFLOPs=flops / tr / 1e12, max_abs_diff=err)
        if peak is not None:
            row["fraction_of_hbm_peak"] = nbytes / tk / peak[0]
            row["fraction_of_bf16_peak"] = flops / tk / peak[1]
        results.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/kernels.json")
    ap.add_argument("--mode", choices=["pallas", "interpret"], default=None)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args(argv)
    from bench.stamp import write
    out = run(args.mode, args.iters, args.dtype, emit=lambda partial: write(args.json, partial, indent=1))
    write(args.json, out, indent=1)
    print(f"{out['device']} ({out['mode']}, {out['dtype']})")
    print(f"{'kernel':28s} {'kernel ms':>10s} {'ref ms':>9s} {'ref/kern':>8s} {'GB/s':>8s} {'TFLOP/s':>8s} {'max diff':>9s}")
    for r in out["results"]:
        if "error" in r:
            print(f"{r['kernel']:28s} did not compile: {r['error'].splitlines()[0][:160]}")
            continue
        print(f"{r['kernel']:28s} {r['kernel_s'] * 1e3:10.2f} {r['reference_s'] * 1e3:9.2f} "
              f"{r['speedup_vs_reference']:8.3f} {r['kernel_GBps']:8.2f} {r['kernel_TFLOPs']:8.4f} "
              f"{r['max_abs_diff']:9.2e}")
    print(out["note"])
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
