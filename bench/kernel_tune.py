"""Launch-parameter sweep of the attention kernels on a GPU: tiles, ring depth, grid order, warps, stages.

For the production shapes of bench/kernels.py, per sweep (`--sweeps`, run in the order given):
  hopper  prefill flash attention's Mosaic GPU kernel (flash_attention_hopper.py) over key tile (block_kv) and
          K/V ring slots (steps);
  paged   paged decode attention's Triton kernel: the six orders of its grid's axes on three tilings, then in
          the best order over pages_per_tile, pages_per_partition and num_warps, then num_stages 2 and 3 on the
          three best of that pass;
  flash   prefill flash attention's Triton kernel over (block_q, block_k, num_warps, num_stages);
  candidates  paged decode attention's candidate designs (bench/paged_candidates.py: prefetch, fused, heads and
          pairs of them) over pages_per_tile, num_warps (and for heads pages_per_partition), and the product's
          design in one partition (beside fused: the merge's cost), on each of bench.kernels' paged shapes; the
          defaults are the product kernel's design, in the same run.
The time per call (bench.kernels._time) of each configuration (compile and warm-up excluded); configurations
that fail to compile or disagree with the reference (max |diff| over the bf16 tolerance) are marked as such;
the best configuration and its rate against the kernel's current defaults (`params` {}) measured in the same
run. The JSON is rewritten after every configuration, and no configuration starts once `--budget-s` has
passed, so a run cut short keeps what it measured. Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import platform
import time

from bench.kernels import PEAKS, SHAPES, _cases, _time, warm_gpu

HOPPER_GRID = [dict(block_kv=b, steps=s) for b, s in
               [(128, 2), (128, 3), (64, 2), (64, 3), (64, 4)]]  # 128 keys x 4 slots exceed shared memory
PAGED_ORDERS = [dict(grid_order="".join(o), **t) for t in ({}, dict(pages_per_tile=4, pages_per_partition=64,
                num_warps=4), dict(pages_per_tile=2, pages_per_partition=16, num_warps=1))
                for o in itertools.permutations("bhp")]
PAGED_GRID = [dict(pages_per_tile=t, pages_per_partition=p, num_warps=w) for t, p, w in
              itertools.product([2, 4, 8, 16], [8, 16, 32, 64], [1, 2, 4]) if p % t == 0]
CANDIDATE_GRID = ([dict(design, pages_per_tile=t, num_warps=w, grid_order="bph") for design in
                   (dict(prefetch=True), dict(fused=True), dict(prefetch=True, fused=True))
                   for t, w in [(1, 1), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4)]]
                  + [dict(design, pages_per_tile=t, pages_per_partition=p, num_warps=w, grid_order="bph")
                     for design in (dict(heads=True), dict(heads=True, prefetch=True))  # a block: 32 KB of K
                     for t, p, w in [(1, 8, 4), (1, 16, 4), (1, 8, 8), (2, 16, 8)]]
                  # the product's design in one partition, merged outside: beside `fused`, what the merge costs
                  + [dict(pages_per_tile=2, pages_per_partition=1024, num_warps=w, grid_order="bph") for w in (1, 2)])
FLASH_GRID = [dict(zip(("block_q", "block_k", "num_warps", "num_stages"), v)) for v in
              itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3])]


def _case(name: str, index: int = 0, shapes: str = "gpu"):
    """The `index`-th of bench.kernels' cases of kernel `name` (`shapes`: its "gpu" or "cpu" set), drawn alone (the
    cases are drawn as they are reached, and the long ones take seconds each: 2.1 GB of paged K/V)."""
    import jax.numpy as jnp
    key = {"flash_attention": "flash", "paged_attention": "paged"}[name]
    only = dict(SHAPES[shapes], flash=[], paged=[])
    only[key] = [SHAPES[shapes][key][index]]
    return next(c for c in _cases(only, jnp.bfloat16) if c[0] == name)


def _kernel(sweep_name: str):
    """(case name, kernel callable taking the case's args and kwargs plus a configuration, the reference)."""
    from jaxserve.pallas_kernels.select import KERNELS
    if sweep_name == "hopper":
        from jaxserve.pallas_kernels import flash_attention_hopper as fh
        ref, _ = KERNELS["flash_attention"]

        def hopper(q, k, v, *, cu_seqlens, **params):
            return fh.hopper_flash_attention(q, k, v, cu_seqlens, scale=q.shape[-1] ** -0.5, **params)
        return "flash_attention", hopper, ref
    if sweep_name == "flash":  # the Triton kernel (on a Hopper GPU the default is Mosaic GPU's)
        ref, kernel = KERNELS["flash_attention"]
        return "flash_attention", functools.partial(kernel, hopper=False), ref
    ref, kernel = KERNELS["paged_attention"]
    if sweep_name == "candidates":
        from bench import paged_candidates
        kernel = paged_candidates.paged_attention
    return "paged_attention", kernel, ref


def sweep(sweep_name: str, configs: list, iters: int, deadline: float, emit, case_index: int = 0,
          interpret: bool = False) -> dict:
    """Time `configs` (and the defaults, first) on the kernel's `case_index`-th shape; `emit(result)` after each;
    stops at `deadline`. interpret: the Triton kernels' bodies interpreted on bench.kernels' CPU shapes (a test
    of the sweep on a machine without a GPU; the times are the interpreter's)."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    case_name, kernel, ref = _kernel(sweep_name)
    _, shape, _, args, kw, nbytes, flops, bound = _case(case_name, case_index, "cpu" if interpret else "gpu")
    if interpret:
        kw = dict(kw, interpret=True)
    want = jax.jit(functools.partial(ref, **kw))(*args)
    result = dict(sweep=sweep_name, kernel=case_name, shape=shape, bound=bound, bytes=nbytes, flops=flops,
                  configurations=[], best=None, speedup_best_vs_defaults=None, cut_at_budget=False)
    rows = result["configurations"]

    def measure(params):
        if time.monotonic() > deadline:
            result["cut_at_budget"] = True
            return None
        fn = jax.jit(functools.partial(kernel, **kw, **params))
        try:
            got = fn(*args)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            t = _time(fn, args, iters)
            row = dict(params=params, seconds=t, max_abs_diff=err, GBps=nbytes / t / 1e9, TFLOPs=flops / t / 1e12,
                       ok=err < 3e-2)
            tqdm.write(f"{sweep_name} {params or 'defaults'}: {t * 1e6:.1f} us, diff {err:.2e}")
        except Exception as e:  # a configuration that does not compile (shared memory, registers)
            row = dict(params=params, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            tqdm.write(f"{sweep_name} {params}: {row['error']}")
        rows.append(row)
        good = [r for r in rows if r.get("ok")]
        result["best"] = min(good, key=lambda r: r["seconds"]) if good else None
        default = rows[0] if "seconds" in rows[0] else None
        if result["best"] and default:
            result["speedup_best_vs_defaults"] = default["seconds"] / result["best"]["seconds"]
        emit(result)
        return row

    def best(among):
        return sorted((r for r in among if r.get("ok")), key=lambda r: r["seconds"])

    if measure({}) is None:  # the defaults, first
        return result
    if sweep_name == "paged":  # the grid's axis orders; the tiles in the best of them
        for params in tqdm(PAGED_ORDERS, desc="paged orders", unit="config"):
            if measure(params) is None:
                return result
        top = best(rows[1:])
        order = dict(grid_order=top[0]["params"]["grid_order"]) if top else {}
        configs = [dict(c, **order) for c in configs]
    for params in tqdm(configs, desc=sweep_name, unit="config"):
        if measure(params) is None:
            break
    if sweep_name == "paged" and not result["cut_at_budget"]:  # pipeline stages on the three best
        for r, stages in itertools.product(best(rows[1:])[:3], (2, 3)):
            if measure(dict(r["params"], num_stages=stages)) is None:
                break
    return result


def main(argv=None):
    import jax
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/kernel_tune.json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweeps", default="hopper,paged,flash", help="comma-separated, run in this order")
    ap.add_argument("--budget-s", type=float, default=None, help="start no configuration after this many seconds")
    args = ap.parse_args(argv)
    grids = {"hopper": HOPPER_GRID, "paged": PAGED_GRID, "flash": FLASH_GRID, "candidates": CANDIDATE_GRID}
    names = [s for s in args.sweeps.split(",") if s]
    unknown = [s for s in names if s not in grids]
    if unknown:
        raise SystemExit(f"--sweeps: unknown {', '.join(unknown)}; known: {', '.join(grids)}")
    if jax.default_backend() != "gpu":
        raise SystemExit("bench.kernel_tune needs a GPU (the sweep times compiled kernels)")
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAKS.items() if k in kind), None)
    deadline = time.monotonic() + (args.budget_s if args.budget_s is not None else float("inf"))
    out = dict(benchmark="kernel_tune", device=kind, host=platform.node(), iters=args.iters, dtype="bfloat16",
               jax=jax.__version__, results=[])
    from bench.stamp import write
    warm_gpu()

    def emit(result):
        if result not in out["results"]:
            out["results"].append(result)
        if result["best"] and peak:
            result["best_fraction_of_hbm_peak"] = result["bytes"] / result["best"]["seconds"] / peak[0]
            result["best_fraction_of_bf16_peak"] = result["flops"] / result["best"]["seconds"] / peak[1]
        write(args.json, out, indent=1)

    for name in names:
        if name == "hopper":
            from jaxserve.pallas_kernels import flash_attention_hopper as fh
            if not fh.is_hopper():
                print("hopper: skipped, not a Hopper GPU")
                continue
        for index in range(len(SHAPES["gpu"]["paged"]) if name == "candidates" else 1):  # candidates: every shape
            r = sweep(name, grids[name], args.iters, deadline, emit, index)
            print(name, r["shape"], "best", r["best"], "x defaults", r["speedup_best_vs_defaults"])
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
