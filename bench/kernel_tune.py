"""Launch-parameter sweep of the attention kernels on a GPU: tile sizes, Triton warps and pipeline stages.

For the production shapes of bench/kernels.py, flash attention's Triton kernel over (block_q, block_k, num_warps,
num_stages) and paged decode attention over (pages_per_tile, pages_per_partition, num_warps, num_stages): the
time per call (bench.kernels._time) of each configuration (compile and warm-up excluded), the configurations
that fail to compile or disagree with the reference (max |diff| over the bf16 tolerance) marked as such, the
best configuration and its rate against the kernels' current defaults (`params` {}) measured in the same run.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import platform

from bench.kernels import PEAKS, SHAPES, _cases, _time

FLASH_GRID = dict(block_q=[64, 128, 256], block_k=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3])
PAGED_GRID = dict(pages_per_tile=[2, 4, 8], pages_per_partition=[8, 16, 32], num_warps=[2, 4, 8], num_stages=[1, 2])


def sweep(name: str, grid: dict, iters: int) -> dict:
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from pallas_kernels.select import KERNELS
    case = next(c for c in _cases(SHAPES["gpu"], jnp.bfloat16) if c[0] == name)
    _, shape, kname, args, kw, nbytes, flops, bound = case
    if name == "flash_attention":  # the Triton kernel's parameters (on a Hopper GPU the default is Mosaic GPU's)
        kw = dict(kw, hopper=False)
    ref, kernel = KERNELS[kname]
    want = jax.jit(functools.partial(ref, **kw))(*args)
    rows = []
    configs = [dict(zip(grid, v)) for v in itertools.product(*grid.values())]
    for params in [{}] + configs:
        if params.get("pages_per_partition", 0) % params.get("pages_per_tile", 1):
            continue
        fn = jax.jit(functools.partial(kernel, **kw, **params))
        try:
            got = fn(*args)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        except Exception as e:  # a configuration Triton cannot compile (shared memory, registers)
            rows.append(dict(params=params, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        t = _time(fn, args, iters)
        rows.append(dict(params=params, seconds=t, max_abs_diff=err, GBps=nbytes / t / 1e9,
                         TFLOPs=flops / t / 1e12, ok=err < 3e-2))
        tqdm.write(f"{name} {params or 'defaults'}: {t * 1e3:.3f} ms, diff {err:.2e}")
    good = [r for r in rows if r.get("ok")]
    best = min(good, key=lambda r: r["seconds"]) if good else None
    default = rows[0] if "seconds" in rows[0] else None
    return dict(kernel=name, shape=shape, bound=bound, bytes=nbytes, flops=flops, configurations=rows, best=best,
                speedup_best_vs_defaults=(default["seconds"] / best["seconds"]) if best and default else None)


def main(argv=None):
    import jax
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/kernel_tune.json")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("bench.kernel_tune needs a GPU (the sweep times compiled Triton kernels)")
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAKS.items() if k in kind), None)
    out = dict(benchmark="kernel_tune", device=kind, host=platform.node(), iters=args.iters, dtype="bfloat16",
               results=[sweep("flash_attention", FLASH_GRID, args.iters),
                        sweep("paged_attention", PAGED_GRID, args.iters)])
    for r in out["results"]:
        if r["best"] and peak:
            r["best_fraction_of_hbm_peak"] = r["bytes"] / r["best"]["seconds"] / peak[0]
            r["best_fraction_of_bf16_peak"] = r["flops"] / r["best"]["seconds"] / peak[1]
        print(r["kernel"], "best", r["best"], "x defaults", r["speedup_best_vs_defaults"])
    from bench.stamp import write
    write(args.json, out, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
