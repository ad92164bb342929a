"""Prefill flash attention for Hopper GPUs (H100, H200): Pallas' Mosaic GPU backend, sequences packed along T.

`flash_attention` (flash_attention.py) calls this on a Hopper GPU for what it covers (causal, no window, no
sinks, 16-bit q/k/v, head dim a multiple of 64 up to 256) and its Triton kernel otherwise. Its reference is
`ref_flash_attention`, the same as the Triton kernel's.

The FlashAttention-3 scheme, written for packed variable-length sequences and GQA:
  - one program per (query head, 2 * block_q packed query rows); three warpgroups: two compute a block_q-row
    tile each, one (the memory warpgroup, few registers) streams K and V tiles of block_kv keys into a ring of
    `steps` shared-memory slots with the bulk tensor copy engine (TMA), one barrier per slot and direction;
  - QK^T and PV on the tensor cores (wgmma) from shared memory, softmax in registers with exp2 and the scale
    folded into it; the two compute warpgroups take turns on the tensor cores (a shared "schedule" barrier),
    so one's softmax overlaps the other's matmuls;
  - sequences: each query row t of segment s sees keys u with cu_seqlens[s] <= u <= t. Per compute tile, the key
    tiles [lo, hi) that hold any visible key are found outside the kernel (`_ranges`), split into those that
    need the element mask (the diagonal, and a segment start inside a tile) and those that do not. The memory
    warpgroup streams the union of the two tiles' ranges; a compute warpgroup passes over the steps outside its
    own range (it still releases their slots and keeps its turn on the tensor cores, and waits on the slots'
    barriers where later waits depend on their phase).
Rows past cu_seqlens[-1] give zeros. A masked score is -inf and the running max of a masked step is floored at
a large finite negative, so a row that sees no key of a tile adds exactly nothing (its exponentials are 0) and
no rescale factor is NaN. (A finite masked score does not do: exp2 takes s * c - m as one fused multiply-add,
whose rounding residual for a huge s can be positive and overflow.)

Compiled only on a GPU; on other machines the module still lowers for CUDA (`lower_for_cuda`, a CPU test).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_Q = 64  # rows of one compute warpgroup's tile (a wgmma's M)
BLOCK_KV = 128  # keys per streamed tile (64 for head dim 256: shared memory)
STEPS = 2  # slots in the K/V ring
_NEG = -1e30  # floor of a masked step's running max (see the module docstring)
_NO_ROW = 1 << 30  # segment start of a padding row: it sees no key
_LOG2E = math.log2(math.e)


def unsupported(q, k, v, *, causal: bool, sliding_window, sinks) -> str | None:
    """Why this kernel cannot take a call (the caller then uses the Triton kernel), or None.
    q [T, Hq, Dk]; k [T, Hkv, Dk]; v [T, Hkv, Dv]."""
    if not causal or sliding_window is not None or sinks is not None:
        return "only causal attention without window or sinks"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must be bfloat16 or float16, got {q.dtype}"
    D = q.shape[-1]
    if v.shape[-1] != D or D % 64 or D > 256:
        return f"head dims must be equal multiples of 64 up to 256, got Dk {D}, Dv {v.shape[-1]}"
    return None


def is_hopper(device=None) -> bool:
    """Whether `device` (default: JAX's first) is a compute capability 9.x GPU with a CUDA runtime outside the
    range whose ptxas miscompiles masked kernels (12.8.0 to 12.9.0)."""
    d = device or jax.devices()[0]
    if d.platform != "gpu" or str(getattr(d, "compute_capability", "")).split(".")[0] != "9":
        return False
    try:
        from jax._src.lib import cuda_versions
        ver = cuda_versions.cuda_runtime_get_version()
    except Exception:  # noqa: BLE001 - a build without CUDA version info: trust the self-test
        return True
    return not 12080 <= ver < 12091


def _ranges(cu_seqlens, Tp: int, bq: int, bkv: int):
    """Per compute tile (Tp // bq of them, pairs forming a program): int32 [Tp // bq, 4] = (lo, mlo, mhi, hi),
    key tiles [lo, mlo) and [mhi, hi) masked, [mlo, mhi) unmasked; and per program [Tp // (2 bq), 2] = the
    union (plo, phi) the memory warpgroup streams. An empty tile's range is (plo, plo, plo, plo): it only
    passes over the program's steps. Also the segment start of every row ([Tp] int32, _NO_ROW past the end).
    cu_seqlens [N+1] int32."""
    total = cu_seqlens[-1]
    t = jnp.arange(Tp, dtype=jnp.int32)
    seg = jnp.searchsorted(cu_seqlens[1:], t, side="right")
    start = jnp.where(t < total, cu_seqlens[jnp.minimum(seg, cu_seqlens.shape[0] - 1)], _NO_ROW).astype(jnp.int32)
    first = jnp.arange(0, Tp, bq, dtype=jnp.int32)
    last = jnp.minimum(first + bq, total) - 1
    empty = last < first
    s_first, s_last = start[first], start[jnp.maximum(last, 0)]
    lo = s_first // bkv
    hi = last // bkv + 1
    mlo = jnp.clip(-(-s_last // bkv), lo, hi)
    mhi = jnp.clip((first + 1) // bkv, mlo, hi)
    lo2, hi2 = lo.reshape(-1, 2), hi.reshape(-1, 2)
    e2 = empty.reshape(-1, 2)
    plo = jnp.where(e2, _NO_ROW, lo2).min(1)
    phi = jnp.where(e2, 0, hi2).max(1)
    plo = jnp.where(e2.all(1), 0, plo)
    phi = jnp.maximum(phi, plo)
    p = jnp.repeat(plo, 2)
    rng = jnp.stack([lo, mlo, mhi, hi], 1)
    rng = jnp.where(empty[:, None], p[:, None], rng).astype(jnp.int32)
    return rng, jnp.stack([plo, phi], 1).astype(jnp.int32), start


def _transposed(ref):
    """ref's last two dims swapped, as wgmma's B operand (the API moved between JAX releases)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if hasattr(plgpu, "transpose_ref"):
        return plgpu.transpose_ref(ref, (1, 0))
    return ref.transpose((1, 0))


def _load_rows(ref, layout):
    """A 1-D GMEM ref loaded into registers with `layout`, element by element (once per tile: no TMA needed; the
    signature of plgpu.load moved between releases)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    try:
        return plgpu.load(ref, (), layout=layout, optimized=False)
    except TypeError:
        return plgpu.load(ref, layout=layout, optimized=False)


def _kernel_fn(Hq: int, Hkv: int, D: int, dtype, scale: float, bq: int, bkv: int, steps: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    G = Hq // Hkv
    c = scale * _LOG2E  # scores in log2 units: p = exp2(s * c - m)
    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)

    def kernel(q_ref, k_ref, v_ref, rng_ref, prg_ref, start_ref, out_ref, scoped):
        # q_ref [Tp, Hq, D]; k_ref, v_ref [Tp, Hkv, D]; rng_ref [Tp // bq, 4]; prg_ref [Tp // (2 bq), 2];
        # start_ref [Tp] int32; out_ref [Tp, Hq, D]
        head, prog = jax.lax.axis_index("heads"), jax.lax.axis_index("q_seq")
        wg = jax.lax.axis_index("wg")
        (qo_smem2, k_smem, v_smem), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scoped
        plo, phi = prg_ref[prog, 0], prg_ref[prog, 1]
        n_steps = phi - plo

        def slot(step):  # ring slot of absolute key tile `step`
            return jax.lax.rem(step - plo, jnp.int32(steps))

        def turn():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            tile = prog * 2 + wg
            base = tile * bq
            lo, mlo, mhi, hi = (rng_ref[tile, i] for i in range(4))
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(base, bq), head], qo_smem, q_bar.at[wg])
            row_start = _load_rows(start_ref.at[pl.ds(base, bq)], wgmma_rows)
            plgpu.barrier_wait(q_bar.at[wg])
            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), wgmma_rows)
            l_i = plgpu.layout_cast(jnp.full((bq,), 0, jnp.float32), wgmma_rows)
            acc = plgpu.layout_cast(jnp.full((bq, D), 0, jnp.float32), plgpu.Layout.WGMMA)

            def pass_over(step, carry, wait: bool):
                """A step outside this tile's range: release the slot, keep the turn order; `wait`: flip the
                slot barriers' phases (steps before the range, whose later phases this warpgroup waits on)."""
                s = slot(step)
                if wait:
                    plgpu.barrier_wait(k_bar.at[s])
                    plgpu.barrier_wait(v_bar.at[s])
                plgpu.barrier_arrive(k_free.at[s])
                plgpu.barrier_arrive(v_free.at[s])
                turn()
                turn()
                return carry

            def attend(step, carry, masked: bool):
                acc, m_i, l_i = carry
                s = slot(step)

                def qk_scope(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, _transposed(k_smem.at[s]))
                    turn()
                    return acc_ref[...]
                qk = pl.run_scoped(qk_scope, plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[s])
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA) + base
                    cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA) + step * bkv
                    first = jax.lax.broadcast_in_dim(row_start, (bq, bkv), [0])
                    qk = jnp.where((cols <= rows) & (cols >= first), qk, -jnp.inf)
                    m_new = jnp.maximum(m_i, jnp.maximum(qk.max(axis=1) * c, _NEG))
                else:
                    m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(qk * c - jax.lax.broadcast_in_dim(m_new, qk.shape, [0]))
                acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l_i, m_new, p16 = jax.lax.optimization_barrier((acc, l_i, m_new, p16))
                plgpu.barrier_arrive(sched)  # softmax done
                plgpu.barrier_wait(v_bar.at[s])
                plgpu.barrier_wait(sched)  # the tensor cores are ours

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[s])

                    @pl.when(step + 1 < hi)
                    def _():
                        plgpu.barrier_wait(k_bar.at[slot(step + 1)])
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[s])
                return acc, m_new, l_i

            pl.when(wg == 1)(turn)
            jax.lax.fori_loop(plo, lo, functools.partial(pass_over, wait=True), None)

            @pl.when(hi > lo)
            def _():
                plgpu.barrier_wait(k_bar.at[slot(lo)])
            carry = (acc, m_i, l_i)
            carry = jax.lax.fori_loop(lo, mlo, functools.partial(attend, masked=True), carry)
            carry = jax.lax.fori_loop(mlo, mhi, functools.partial(attend, masked=False), carry)
            acc, m_i, l_i = jax.lax.fori_loop(mhi, hi, functools.partial(attend, masked=True), carry)
            jax.lax.fori_loop(hi, phi, functools.partial(pass_over, wait=False), None)
            pl.when(wg == 0)(turn)

            inv = jnp.where((row_start < _NO_ROW) & (l_i > 0), 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)
            acc = acc * jax.lax.broadcast_in_dim(inv, acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(base, bq), head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = jax.lax.div(head, jnp.int32(G))

            def load(step, s):
                rows = (pl.ds(step * bkv, bkv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[s], k_bar.at[s])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[s], v_bar.at[s])

            for i in range(steps):
                pl.when(i < n_steps)(functools.partial(load, plo + i, i))

            @pl.loop(0, jnp.maximum(n_steps - steps, 0))
            def _(r):
                s = jax.lax.rem(r, jnp.int32(steps))
                plgpu.barrier_wait(k_free.at[s])
                plgpu.barrier_wait(v_free.at[s])
                load(plo + r + steps, s)

    def entry(q_ref, k_ref, v_ref, rng_ref, prg_ref, start_ref, out_ref):
        swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, rng_ref, prg_ref, start_ref, out_ref, scoped),
            (plgpu.SMEM((2, bq, D), dtype, transforms=swz),
             plgpu.SMEM((steps, bkv, D), dtype, transforms=swz),
             plgpu.SMEM((steps, bkv, D), dtype, transforms=swz)),
            (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=2)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=steps),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return entry


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "steps"))
def hopper_flash_attention(q, k, v, cu_seqlens, *, scale: float, block_q: int = BLOCK_Q, block_kv: int | None = None,
                           steps: int = STEPS):
    """Causal attention over sequences packed along T (the `flash_attention` contract, without window or sinks).

    q [T, Hq, D]; k, v [T, Hkv, D] (bfloat16 or float16, D a multiple of 64 up to 256); cu_seqlens [N+1] int32
    -> [T, Hq, D] (zeros past cu_seqlens[-1])"""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    bq, bkv = block_q, block_kv or (BLOCK_KV if D <= 128 else 64)
    unit = math.lcm(2 * bq, bkv)
    Tp = -(-T // unit) * unit
    pad = [(0, Tp - T), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    rng, prg, start = _ranges(cu_seqlens.astype(jnp.int32), Tp, bq, bkv)
    out = plgpu.kernel(
        _kernel_fn(Hq, Hkv, D, q.dtype, float(scale), bq, bkv, steps),
        out_type=jax.ShapeDtypeStruct((Tp, Hq, D), q.dtype),
        grid=(Hq, Tp // (2 * bq)),
        grid_names=("heads", "q_seq"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, rng, prg, start)
    return out[:T]


def lower_for_cuda(T: int = 384, Hq: int = 8, Hkv: int = 2, D: int = 128, dtype=jnp.bfloat16, segments: int = 3):
    """The kernel lowered for CUDA (no GPU needed): the StableHLO text holding its Mosaic GPU custom call."""
    q = jax.ShapeDtypeStruct((T, Hq, D), dtype)
    kv = jax.ShapeDtypeStruct((T, Hkv, D), dtype)
    cu = jax.ShapeDtypeStruct((segments + 1,), jnp.int32)
    fn = functools.partial(hopper_flash_attention, scale=D ** -0.5)
    return jax.jit(fn).trace(q, kv, kv, cu).lower(lowering_platforms=("cuda",)).as_text()
