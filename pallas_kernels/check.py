"""Kernel self-test: each Pallas kernel a model uses, compiled for this device on a small case of the model's
own head dims and dtype, against its jnp reference.

A `Case` names a kernel and the dims that decide how it lowers (heads, head dims, dtype, window, sinks, block
size, decay kind); `run_case` builds seeded random inputs of those dims (a few tokens, two sequences), runs
kernel and reference, and returns None when they agree, else why not: the lowering error, a non-finite
output, or the largest difference. `plan` turns an `engine.kernels` setting into the `KernelPlan` the model
is built with: under `auto` a kernel that fails runs as its reference (the others stay kernels); an explicit
`pallas` refuses to start instead. Agreement is judged at a tolerance that admits the device's matmul
rounding (TF32 for float32 on GPUs, bf16 accumulation order) and nothing like a wrong answer.

Pure functions over small arrays; called once per engine, before the model is built. A case that passed before
on the same device and stack is taken as passed (verdicts.py: the passes kept beside the compilation cache).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import native, verdicts
from .select import KERNELS, KernelPlan, resolve

TOLERANCE = {"float32": 5e-3, "bfloat16": 3e-2, "float16": 1e-2}  # max |kernel - ref| / (1 + max |ref|)


class KernelCheckError(RuntimeError):
    """An explicitly requested kernel does not compile or does not agree with its reference on this device."""


@dataclasses.dataclass(frozen=True)
class Case:
    """kernel: a name in select.KERNELS; dims: the builder's keyword arguments (sorted pairs, hashable)."""
    kernel: str
    dims: tuple

    @classmethod
    def of(cls, kernel: str, **dims) -> "Case":
        if kernel not in _BUILD:  # flash_attention is not among them: it shares batched_attention's kernel
            raise KeyError(f"no self-test case for kernel {kernel!r}; known: {', '.join(_BUILD)}")
        if "dtype" in dims:
            dims["dtype"] = jnp.dtype(dims["dtype"]).name
        return cls(kernel, tuple(sorted(dims.items())))

    def __str__(self) -> str:
        return f"{self.kernel}({', '.join(f'{k}={v}' for k, v in self.dims)})"


def _rand(r, shape, dtype, s=1.0):
    return jnp.asarray(r.randn(*shape) * s, dtype)


def _table(r, B: int, ctx: int, bs: int):
    """A shuffled block table of B rows over ctx tokens each, block 0 left unused: (num_blocks, [B, W])."""
    W = -(-ctx // bs)
    return B * W + 1, jnp.asarray(r.permutation(B * W).reshape(B, W) + 1, jnp.int32)


def _attention(r, *, Hq, Hkv, Dk, Dv, dtype, window=None, sinks=False, scale=None):
    B, T, S = 2, 5, 40
    q, k, v = _rand(r, (B, T, Hq, Dk), dtype), _rand(r, (B, S, Hkv, Dk), dtype), _rand(r, (B, S, Hkv, Dv), dtype)
    q_pos = jnp.asarray([[30, 31, 32, 33, 34], [3, 4, 5, 6, 7]], jnp.int32)
    k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    k_valid = k_pos <= jnp.asarray([[34], [7]])
    kw = dict(scale=scale or Dk ** -0.5, window=window, sinks=_rand(r, (Hq,), jnp.float32) if sinks else None)
    return (q, k, v, q_pos, k_pos, k_valid), kw


def _lengths(B: int, ctx: int, bs: int, full: bool):
    """[B] context lengths: every row ctx (full), else alternately ctx and one token past a block."""
    return jnp.asarray([ctx if full or i % 2 == 0 else bs + 1 for i in range(B)], jnp.int32)


def _paged(r, *, Hq, Hkv, Dk, Dv, dtype, block_size, window=None, sinks=False, scale=None, B=2, ctx=None,
           full=False):
    ctx = ctx or 3 * block_size + 5
    NB, table = _table(r, B, ctx, block_size)
    E, D = (2, Dk) if Dk == Dv else (1, Dk + Dv)
    kw = dict(layer=0, sliding_window=window, sinks=_rand(r, (Hq,), jnp.float32) if sinks else None, scale=scale)
    return (_rand(r, (B, Hq, Dk), dtype), _rand(r, (NB, 1, E, block_size, Hkv, D), dtype), table,
            _lengths(B, ctx, block_size, full)), kw


def _packed_step(r, B: int, ctx: int, bs: int):
    """A packed prefill step's tokens: a first chunk, a chunk after cached tokens (ending ctx tokens in) and three
    padding tokens -> (num_blocks, table [B, W], rows [N], positions [N])."""
    NB, table = _table(r, B, ctx, bs)
    chunks = [(b, s, n) for b, (s, n) in enumerate([(0, min(ctx, 2 * bs + 3)), (ctx - 7, 7)][:B])]
    rows = np.concatenate([np.full(n, b) for b, _, n in chunks] + [np.full(3, B)]).astype(np.int32)
    pos = np.concatenate([np.arange(s, s + n) for _, s, n in chunks] + [np.zeros(3)]).astype(np.int32)
    return NB, table, jnp.asarray(rows), jnp.asarray(pos)


def _paged_prefill(r, *, Hq, Hkv, Dk, Dv, dtype, block_size, window=None, sinks=False, scale=None, B=2, ctx=None,
                   full=False):
    """A packed prefill step (`_packed_step`)."""
    del full
    NB, table, rows, pos = _packed_step(r, B, ctx or 3 * block_size + 5, block_size)
    E, D = (2, Dk) if Dk == Dv else (1, Dk + Dv)
    kw = dict(layer=0, sliding_window=window, sinks=_rand(r, (Hq,), jnp.float32) if sinks else None, scale=scale)
    return (_rand(r, (len(rows), Hq, Dk), dtype), _rand(r, (NB, 1, E, block_size, Hkv, D), dtype), table,
            rows, pos), kw


def _paged_mla(r, *, H, L, R, dtype, block_size, scale, B=2, ctx=None, full=False):
    ctx = ctx or 3 * block_size + 5
    NB, table = _table(r, B, ctx, block_size)
    return (_rand(r, (B, H, L + R), dtype, 0.3), _rand(r, (NB, 1, 1, block_size, 1, L + R), dtype), table,
            _lengths(B, ctx, block_size, full)), dict(layer=0, kv_lora_rank=L, scale=scale)


def _paged_mla_prefill(r, *, H, L, R, dtype, block_size, scale, B=2, ctx=None, full=False):
    """A packed prefill step (`_packed_step`) over an MLA latent pool."""
    del full
    NB, table, rows, pos = _packed_step(r, B, ctx or 3 * block_size + 5, block_size)
    return (_rand(r, (len(rows), H, L + R), dtype, 0.3), _rand(r, (NB, 1, 1, block_size, 1, L + R), dtype), table,
            rows, pos), dict(layer=0, kv_lora_rank=L, scale=scale)


def _delta(r, *, H, Dk, Dv, dtype, per_channel, T, B=2):
    g = -jnp.abs(_rand(r, (B, T, H, Dk) if per_channel else (B, T, H), jnp.float32)) * 0.1
    args = (_rand(r, (B, T, H, Dk), dtype), _rand(r, (B, T, H, Dk), dtype), _rand(r, (B, T, H, Dv), dtype), g,
            jnp.asarray(r.rand(B, T, H), dtype))
    return args, dict(initial_state=_rand(r, (B, H, Dk, Dv), jnp.float32, 0.1), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)


def _matmul(r, *, K, N, dtype, transposed=False, rows=3):
    """rows rows of x [rows, K] against a weight [K, N] ([N, K] transposed), the weight at 1/sqrt(K)."""
    w = _rand(r, (N, K) if transposed else (K, N), dtype, K ** -0.5)
    return (_rand(r, (rows, K), dtype), w), dict(transposed=transposed)


def _grouped(r, *, E, K, N, dtype, rows=37):
    """rows rows of x [rows, K] over E groups (the second empty, the last short of the rest) against w [E, K, N]."""
    groups = [g for g in range(E) if g != 1 or E == 1]
    sizes = np.bincount([groups[i % len(groups)] for i in range(rows)], minlength=E).astype(np.int32)
    sizes[-1] -= min(2, sizes[-1])  # two rows past the groups: zero in both
    return (_rand(r, (rows, K), dtype), _rand(r, (E, K, N), dtype, K ** -0.5), jnp.asarray(sizes)), {}


_BUILD = {
    "batched_attention": _attention,
    "paged_attention": _paged,
    "paged_mla_attention": _paged_mla,
    "paged_prefill_attention": _paged_prefill,
    "paged_mla_prefill_attention": _paged_mla_prefill,
    "chunk_gated_delta_rule": functools.partial(_delta, T=37),
    "recurrent_gated_delta_rule": functools.partial(_delta, T=1),
    "matmul": _matmul,
    "grouped_matmul": _grouped,
}


def inputs(kernel: str, r: np.random.RandomState, **dims) -> tuple[tuple, dict]:
    """(args, keyword args) of seeded random inputs for `kernel` with a Case's dims; the sizes default to the
    self-test's small case (a few tokens, two sequences) and can be raised (bench/kernels.py): B rows, ctx tokens
    of context (paged; full: every row that long), T tokens (delta rule), rows (matmul, grouped_matmul)."""
    return _BUILD[kernel](r, **dims)


def run_case(case: Case, mode: str) -> str | None:
    """None when the kernel compiles in `mode` ("pallas", "interpret" or "native") and agrees with its
    reference on `case`; otherwise the reason."""
    ref, kernel = KERNELS[case.kernel]
    if mode == "native":
        kernel = native.KERNELS[case.kernel]
    else:
        kernel = functools.partial(kernel, interpret=mode == "interpret")
    dims = dict(case.dims)
    args, kw = inputs(case.kernel, np.random.RandomState(0), **dims)
    try:
        got = jax.block_until_ready(jax.jit(functools.partial(kernel, **kw))(*args))
    except Exception as e:  # lowering / compile / runtime failure of the kernel on this device
        return f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    want = jax.jit(functools.partial(ref, **kw))(*args)
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.shape != b.shape:
            return f"returns shape {a.shape}, the reference {b.shape}"
        if not np.isfinite(a).all():
            return "returns non-finite values"
        worst = max(worst, float(np.abs(a - b).max() / (1.0 + np.abs(b).max())))
    tol = TOLERANCE[dims["dtype"]]
    return None if worst <= tol else f"differs from its reference by {worst:.3g} (tolerance {tol:g})"


# the custom-call targets of a Pallas Triton kernel in lowered text: jaxlib <= 0.10.2 leaves the Triton module for XLA
# to compile; later ones compile it while lowering
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
ABSTRACT_GPU = "NVIDIA H100"  # the GPU a lowering on a machine without one targets (Hopper, as the lent machines')


def cuda_text(jitted, *args, **kwargs) -> str:
    """`jitted` (a jax.jit function) traced with these arguments and lowered for an NVIDIA GPU -> its StableHLO text,
    on any machine. Without a GPU both run under an abstract mesh naming one (ABSTRACT_GPU): JAX after 0.10.2 (the
    lent GPU machines' 0.11.2) compiles Pallas' Triton kernels while lowering, for the GPU the trace found."""
    if jax.default_backend() == "gpu":
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    mesh = AbstractMesh((1,), ("gpu",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice(ABSTRACT_GPU, None, "gpu"))
    with use_abstract_mesh(mesh):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


def triton_calls(text: str) -> int:
    """How many Triton kernel calls lowered text holds."""
    return sum(text.count(f"@{target}(") for target in TRITON_TARGETS)


def gpu_lowering(case: Case) -> str | None:
    """None when the Pallas kernel of `case` lowers for an NVIDIA GPU to one Triton kernel call, else why not.
    Runs on any machine, a CPU one included: JAX lowers for the "cuda" platform without a GPU, through Pallas'
    Triton lowering, where the tile rules are enforced (power-of-two arrays, the kernels' require_gpu_dims).
    What it cannot see is Triton's own compilation to PTX, which a GPU's self-test does."""
    ref, kernel = KERNELS[case.kernel]
    if kernel is None:
        return "has no Pallas kernel"
    args, kw = inputs(case.kernel, np.random.RandomState(0), **dict(case.dims))
    shaped = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x  # noqa: E731
    arrays = {k: shaped(v) for k, v in kw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    call = jax.jit(lambda args, arrays: kernel(*args, interpret=False, **static, **arrays))
    try:
        text = cuda_text(call, jax.tree.map(shaped, args), arrays)
    except Exception as e:  # the lowering's refusal: a Pallas or Triton tile rule, or the kernel's own check
        return f"does not lower: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    calls = triton_calls(text)
    return None if calls == 1 else f"lowers to {calls} Triton kernel calls, not one"


def _name(f) -> str:
    """A function's module and qualified name (a partial's: its function's and its bound arguments)."""
    if isinstance(f, functools.partial):
        return f"{_name(f.func)}{f.args}{sorted(f.keywords.items())}"
    return f"{getattr(f, '__module__', None)}.{getattr(f, '__qualname__', None)}"


def _checked(case: Case, mode: str) -> str:
    """What a verdict on `case` in `mode` is of: the case and the functions compared (by name, so a kernel
    replaced at run time is checked afresh)."""
    ref, kernel = KERNELS[case.kernel]
    if mode == "native":
        kernel = native.KERNELS[case.kernel]
    return f"{case} {_name(kernel)} {_name(ref)}"


def self_test(cases, mode: str, progress: bool = False, store: str | None = None) -> dict[str, str]:
    """{kernel name: reason} for the kernels that fail any of `cases` in `mode`. store: a directory of earlier
    passes (verdicts.py): a case that passed there on this device and stack is not checked again."""
    failed: dict[str, str] = {}
    cases = [c for c in sorted(set(cases), key=str) if not verdicts.passed(store, mode, _checked(c, mode))]
    if progress:
        from tqdm.auto import tqdm
        cases = tqdm(cases, desc="kernel self-test", unit="case")
    for c in cases:
        if c.kernel in failed:
            continue
        why = run_case(c, mode)
        if why is not None:
            failed[c.kernel] = f"{c}: {why}"
        else:
            verdicts.record_pass(store, mode, _checked(c, mode))
    return failed


def plan(requested: str, cases, progress: bool = False,
         store: str | None = None) -> tuple[str | KernelPlan, dict[str, str]]:
    """The kernel choice for an `engine.kernels` setting and the model's cases -> (mode or KernelPlan,
    {kernel: why it runs as its reference}). store: where earlier passes are kept (`self_test`).

    reference, interpret: taken as they are (interpret is the test mode: the kernel bodies on the CPU).
    pallas, native: every kernel is checked; one that fails raises KernelCheckError.
    auto: kernels where they pass (select.auto_mode), the reference for each one that fails.
    Under native only the kernels with a native implementation are checked (the others run as references); a
    library that does not build, or a dtype other than float32, fails them with the reason."""
    mode = resolve(requested)
    if mode == "reference" or requested == "interpret":
        return mode, {}
    failed: dict[str, str] = {}
    if mode in ("pallas", "interpret"):  # kernels with no Pallas implementation run as references (select.mode_of)
        cases = [c for c in cases if KERNELS[c.kernel][1] is not None]
    if mode == "native":
        cases = [c for c in cases if c.kernel in native.KERNELS]
        ok, why = native.available()
        for c in (c for c in cases if c.kernel not in native.LIBRARY_FREE):
            if not ok:
                failed[c.kernel] = f"{c}: the native library does not build: {why.splitlines()[0][:300]}"
            elif dict(c.dims).get("dtype") != "float32":
                failed[c.kernel] = f"{c}: the native kernels take float32"
        cases = [c for c in cases if c.kernel not in failed]
    failed.update(self_test(cases, mode, progress, store))
    if failed and requested != "auto":
        raise KernelCheckError(f"engine.kernels: {requested}, but on this device " + "; ".join(failed.values())
                               + " (engine.kernels: auto runs such kernels as their references)")
    return KernelPlan(mode, frozenset(failed)), failed
