"""Native CPU kernels: C++ compiled on first use and called from XLA as FFI custom calls.

On a CPU the Pallas kernels run only in interpret mode, and the jnp reference of paged decode attention gathers
every block the batch holds into a dense copy before its products. `native/paged_attention.cc` reads the blocks
in place instead, and `native/matmul.cc` runs a decode step's few rows against a layer's weights, which XLA's CPU
dot does at full memory bandwidth only for one row, and the experts' grouped products, each expert's weight read
where it lies in its stack (their headers say how). They are compiled once per machine
with the system's C++ compiler (g++, else c++) against the FFI headers jaxlib ships, into one library in
`~/.cache/jaxserve/native/` (named by a hash of the sources, the flags and the CPU), and registered with XLA on
first use.

`available()` says whether it built (and why not); `paged_attention` / `paged_mla_attention` /
`paged_prefill_attention` / `paged_mla_prefill_attention` have the signatures of their references in
paged_attention.py, `matmul` that of matmul.py's, `grouped_matmul` that of grouped_matmul.py's. float32 runs
the kernels; another dtype runs the reference (as do products of more than MATMUL_ROWS rows; the grouped
product's other form is the jnp loop), as does every call where the library is not available. select.py routes
"native" mode here; check.py compares each kernel with its reference on the model's own dims before an engine uses it.

Thread-safety: the build runs under a lock, once per process; the kernels are pure functions.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from .grouped_matmul import check_grouped, tiled_grouped_matmul
from .matmul import check_matmul, ref_matmul
from .paged_attention import (GRID_ORDER, _check_mla, _views, gqa_args, mla_prefill_args, prefill_args,
                              ref_paged_attention, ref_paged_mla_attention, ref_paged_mla_prefill_attention,
                              ref_paged_prefill_attention)

NATIVE_DIR = os.path.join(os.path.dirname(__file__), "native")
SOURCES = tuple(os.path.join(NATIVE_DIR, f) for f in ("paged_attention.cc", "matmul.cc"))
HEADERS = tuple(os.path.join(NATIVE_DIR, f) for f in ("run_items.h",))
TARGETS = {"jaxserve_paged_decode": "JaxservePagedDecode", "jaxserve_paged_prefill": "JaxservePagedPrefill",
           "jaxserve_matmul": "JaxserveMatmul", "jaxserve_matmul_t": "JaxserveMatmulT",
           "jaxserve_grouped_matmul": "JaxserveGroupedMatmul"}
MATMUL_ROWS = 8  # the most rows a native product takes (a decode step's few); more run as XLA's dot
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fopenmp-simd")
CACHE_DIR = os.path.expanduser("~/.cache/jaxserve/native")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "why": str, "path": library


def _cpu_key() -> str:
    """What a -march=native build depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def library_path(cache_dir: str = CACHE_DIR) -> str:
    src = b""
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            src += f.read()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + _cpu_key().encode() + jax.__version__.encode())
    return os.path.join(cache_dir, f"jaxserve_native-{key.hexdigest()[:16]}.so")


def build(cache_dir: str = CACHE_DIR, compiler: str | None = None) -> str:
    """Compile the library unless the cache has it; -> its path. Raises RuntimeError with the compiler's
    output when it does not build."""
    path = library_path(cache_dir)
    if os.path.isfile(path):
        return path
    cxx = compiler or shutil.which("g++") or shutil.which("c++")
    if cxx is None or shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({compiler or 'g++ or c++'}) on PATH")
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp], capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {', '.join(SOURCES)}:\n{(r.stderr or r.stdout)[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder's file is as good as this one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def available(cache_dir: str = CACHE_DIR, compiler: str | None = None) -> tuple[bool, str]:
    """(True, "") once the library is built and registered with XLA's CPU backend, else (False, why).
    The first call builds; later calls return the first answer."""
    with _lock:
        if "ok" not in _state and jax.default_backend() != "cpu":  # registered for XLA's CPU backend only
            _state.update(ok=False, why=f"the native kernels run on XLA's CPU backend; this process computes on "
                                        f"{jax.default_backend()}", path=None)
        if "ok" not in _state:
            try:
                path = build(cache_dir, compiler)
                lib = ctypes.cdll.LoadLibrary(path)
                for target, symbol in TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state.update(ok=True, why="", path=path)
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                _state.update(ok=False, why=str(e), path=None)
        return _state["ok"], _state["why"]


def _call(q, pool, block_tables, per_query, sinks, layer, *, k_dim, v_entry, v_lo, v_hi, window, scale):
    """Decode (per_query: (lengths,)) or prefill (per_query: (rows, positions)) -> [B or N, Hq, v_hi - v_lo]."""
    B, Hq = q.shape[:2]
    has_sinks = sinks is not None
    sinks = sinks.astype(jnp.float32) if has_sinks else jnp.zeros((Hq,), jnp.float32)
    target = "jaxserve_paged_decode" if len(per_query) == 1 else "jaxserve_paged_prefill"
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((B, Hq, v_hi - v_lo), jnp.float32),
                            vmap_method="sequential")
    return call(q, pool, block_tables.astype(jnp.int32), *(x.astype(jnp.int32) for x in per_query),
                jnp.asarray(layer, jnp.int32), sinks, k_dim=np.int64(k_dim), v_entry=np.int64(v_entry),
                v_lo=np.int64(v_lo), v_hi=np.int64(v_hi), window=np.int64(window or 0), scale=np.float32(scale),
                has_sinks=has_sinks)


def _runs(pool) -> bool:
    return pool.dtype == jnp.float32 and available()[0]


def paged_attention(q, pool, block_tables, lengths, *, layer, sliding_window=None, sinks=None, scale=None,
                    interpret=False, pages_per_tile=None, pages_per_partition=None, num_warps=None, num_stages=None,
                    total_blocks=None, grid_order=GRID_ORDER):
    """`ref_paged_attention`'s arguments and result (GQA decode over the pool, one query token per request),
    computed by the native kernel; the tiling arguments are the GPU kernel's and are ignored."""
    if not _runs(pool):
        return ref_paged_attention(q, pool, block_tables, lengths, layer=layer, sliding_window=sliding_window,
                                   sinks=sinks, scale=scale, total_blocks=total_blocks)
    Dk, v_entry, v_lo, v_hi = gqa_args(q, pool, block_tables, lengths, layer, sliding_window, sinks)
    return _call(q, pool, block_tables, (lengths,), sinks, layer, k_dim=Dk, v_entry=v_entry, v_lo=v_lo, v_hi=v_hi,
                 window=sliding_window, scale=Dk ** -0.5 if scale is None else float(scale))


def paged_mla_attention(q, pool, block_tables, lengths, *, layer, kv_lora_rank, scale, interpret=False,
                        pages_per_tile=None, pages_per_partition=None, total_blocks=None):
    """`ref_paged_mla_attention`'s arguments and result (absorbed MLA decode over the latent cache), computed by
    the native kernel."""
    if not _runs(pool):
        return ref_paged_mla_attention(q, pool, block_tables, lengths, layer=layer, kv_lora_rank=kv_lora_rank,
                                       scale=scale, total_blocks=total_blocks)
    _views(q, pool, block_tables, lengths, layer)
    _check_mla(q, pool, kv_lora_rank)
    return _call(q, pool, block_tables, (lengths,), None, layer, k_dim=q.shape[2], v_entry=0, v_lo=0,
                 v_hi=int(kv_lora_rank), window=None, scale=float(scale))


def paged_prefill_attention(q, pool, block_tables, rows, positions, *, layer, sliding_window=None, sinks=None,
                            scale=None):
    """`ref_paged_prefill_attention`'s arguments and result (a packed prefill step's GQA attention over the pool,
    each token over its row's tokens up to itself), computed by the native kernel."""
    if not _runs(pool):
        return ref_paged_prefill_attention(q, pool, block_tables, rows, positions, layer=layer,
                                           sliding_window=sliding_window, sinks=sinks, scale=scale)
    Dk, v_entry, v_lo, v_hi = prefill_args(q, pool, block_tables, rows, positions, layer, sliding_window, sinks)
    return _call(q, pool, block_tables, (rows, positions), sinks, layer, k_dim=Dk, v_entry=v_entry, v_lo=v_lo,
                 v_hi=v_hi, window=sliding_window, scale=Dk ** -0.5 if scale is None else float(scale))


def paged_mla_prefill_attention(q, pool, block_tables, rows, positions, *, layer, kv_lora_rank, scale):
    """`ref_paged_mla_prefill_attention`'s arguments and result (absorbed MLA prefill over the latent pool, each
    token over its row's tokens up to itself), computed by the native kernel."""
    if not _runs(pool):
        return ref_paged_mla_prefill_attention(q, pool, block_tables, rows, positions, layer=layer,
                                               kv_lora_rank=kv_lora_rank, scale=scale)
    mla_prefill_args(q, pool, block_tables, rows, positions, layer, kv_lora_rank)
    return _call(q, pool, block_tables, (rows, positions), None, layer, k_dim=q.shape[2], v_entry=0, v_lo=0,
                 v_hi=int(kv_lora_rank), window=None, scale=float(scale))


def matmul(x, w, *, transposed: bool = False):
    """`ref_matmul`'s arguments and result (x [..., K] times w [K, N], or w [N, K] transposed -> [..., N]),
    computed by the native kernel when x has at most MATMUL_ROWS rows and both are float32. A single row against
    an [in, out] weight stays XLA's (its matrix-vector product reads such a weight at full bandwidth already)."""
    rows = math.prod(x.shape[:-1])
    if not (x.dtype == w.dtype == jnp.float32 and (1 if transposed else 2) <= rows <= MATMUL_ROWS
            and available()[0]):
        return ref_matmul(x, w, transposed=transposed)
    check_matmul(x, w, transposed)
    N = w.shape[0] if transposed else w.shape[1]
    call = jax.ffi.ffi_call("jaxserve_matmul_t" if transposed else "jaxserve_matmul",
                            jax.ShapeDtypeStruct((rows, N), jnp.float32), vmap_method="sequential")
    return call(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], N)


def grouped_matmul(x, w, sizes, *, layer=None):
    """`ref_grouped_matmul`'s arguments and result (each group of sorted rows x [M, K] times its expert's weight of
    w [E, K, N] or [L, E, K, N] at `layer`), computed by the native kernel (float32). It reads each chosen expert's
    weight where it lies in the stack, once per MATMUL_ROWS rows of the group; the jnp loop (`tiled_grouped_matmul`)
    slices the weight out first, a copy that cost as much as a decode step's product (at gpt-oss-mini's experts,
    32 of 512 x 512, 2 cores: 192 rows in 2.2 ms against the loop's 2.8, 4,096 rows in 14 ms against 20). Another
    dtype, or no library: the jnp loop."""
    check_grouped(x, w, sizes, layer)
    if not (x.dtype == w.dtype == jnp.float32 and available()[0]):
        return tiled_grouped_matmul(x, w, sizes, layer=layer)
    w4 = w[None] if layer is None else w
    call = jax.ffi.ffi_call("jaxserve_grouped_matmul", jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32),
                            vmap_method="sequential")
    return call(x, w4, sizes.astype(jnp.int32), jnp.asarray(0 if layer is None else layer, jnp.int32))


KERNELS = {"paged_attention": paged_attention, "paged_mla_attention": paged_mla_attention,  # for select.py
           "paged_prefill_attention": paged_prefill_attention,
           "paged_mla_prefill_attention": paged_mla_prefill_attention, "matmul": matmul,
           "grouped_matmul": grouped_matmul}
LIBRARY_FREE = frozenset({"grouped_matmul"})  # runs without the library (the jnp loop), in any dtype
