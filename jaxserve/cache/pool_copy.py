"""One program that copies a cached prefix out of the global KV store's shared pool into this instance's pool.

The store's pool lives in a shared-memory segment on this host (cache/shared_pool.py); `SharedPool.views` gives
its arrays to JAX in place. A program here gathers the prefix's blocks (and the state row at its end) from those
arrays and scatters them into this instance's pool (donated): one pass over the bytes. Staging them into a host
region with numpy and importing the region with the transfer layer's import program (what a pool on an
accelerator, or a load before these programs are compiled, does) reads and writes every byte twice.

The program depends on the store pool's shapes (its block and state-row counts differ from this pool's), not on
the prefix's length, so `compile` builds it ahead of time, from shapes alone: it touches no pool and may run on
any thread (the worker runs it on a thread of its own once it learns of a store on its host). `ready` says
whether the program a load needs is there; until it is, the load stages. Nothing compiles on a request's path.
Only for a pool on one CPU device: the store's arrays are host memory.

Thread-safety: `compile` on any thread (a program appears in the dict whole, and `ready` reads it); `copy` on the
engine thread, which owns the pool.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.transfer.device import from_wire


def _copy(kinds: tuple[str, ...], pool: list, src: list, where) -> list:
    """pool with blocks src_ids[:n] of src written into blocks ids[:n] and, for a model with request-level state,
    state row src_row into row: a loop of n block copies (a gather and a scatter over padded id vectors ran at
    half the speed of memory here, the loop at its speed), whose trip count is an argument, so one program serves
    every length.

    pool: this instance's pool pytree (cache/layout.py PoolLayout.shapes); src: the store's, in wire dtypes (its
    block and row counts its own); where: [2 M + 3] int32, src_ids ++ ids ++ [n, src_row, row] (one argument:
    each placed argument costs a call)."""
    M = (where.shape[0] - 3) // 2
    src_ids, ids, (n, src_row, row) = where[:M], where[M:2 * M], where[2 * M:]
    full = [i for i, k in enumerate(kinds) if k == "full"]

    def block(i, arrays):  # block i of the prefix, in every full cache group
        return [jax.lax.dynamic_update_slice_in_dim(
            g, from_wire(jax.lax.dynamic_slice_in_dim(src[j], src_ids[i], 1), g.dtype), ids[i], 0)
            for j, g in zip(full, arrays)]
    copied = iter(jax.lax.fori_loop(0, n, block, [pool[j] for j in full]))
    out = []
    for kind, g, s in zip(kinds, pool, src):
        if kind == "full":  # [blocks, layers, entries, block_size, kv_heads, width]
            out.append(next(copied))
        elif kind == "sliding":  # [rows, layers, entries, window, kv_heads, width]
            out.append(g.at[row].set(from_wire(s[src_row], g.dtype)))
        else:  # linear state: {"conv": [rows, layers, ...], "ssm": [rows, layers, ...]}
            out.append({k: g[k].at[row].set(from_wire(s[k][src_row], g[k].dtype)) for k in g})
    return out


def signature(src: list) -> tuple:
    """What a program depends on of the store's pool: its arrays' shapes and dtypes (views or descriptions)."""
    return tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in jax.tree.leaves(src))


class PoolCopy:
    def __init__(self, kinds: tuple[str, ...], max_blocks: int, pool: list):
        """kinds: each cache group's kind (cache/layout.py: "full", "sliding", or linear state); max_blocks: the
        most blocks one load copies (a sequence's); pool: the instance's pool (on one device), whose shapes and
        device the programs take."""
        self.kinds, self.max_blocks = kinds, max_blocks
        self._dev = next(iter(jax.tree.leaves(pool)[0].sharding.device_set))
        self._pool = jax.tree.map(self._like, pool)  # its shapes: compiling reads no pool
        self._programs: dict[tuple, object] = {}  # store signature -> compiled program
        self._lock = threading.Lock()  # one compile of a signature at a time

    def _like(self, a) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(self._dev))

    def __len__(self) -> int:
        """How many store pools (by shape) a load copies from in one pass."""
        return len(self._programs)

    def compile(self, src: list) -> int:
        """Compile the program copying from a store pool shaped as `src` (arrays, or ShapeDtypeStructs) into the
        pool; any thread -> the programs compiled now (0 or 1)."""
        key = signature(src)
        where = self._like(jax.ShapeDtypeStruct((2 * self.max_blocks + 3,), jnp.int32))
        with self._lock:
            if key in self._programs:
                return 0
            fn = jax.jit(lambda *a: _copy(self.kinds, *a), donate_argnums=(0,))
            self._programs[key] = fn.lower(self._pool, jax.tree.map(self._like, src), where).compile()
        return 1

    def ready(self, src: list, n: int) -> bool:
        """Whether copying n blocks from a store pool shaped as `src` has its program."""
        return n <= self.max_blocks and signature(src) in self._programs

    def nbytes(self, src: list, n: int, state: bool) -> int:
        """The bytes of n blocks of a store pool shaped as `src` (and of one state row, with state)."""
        per = lambda a: int(np.prod(a.shape[1:])) * jnp.dtype(a.dtype).itemsize  # noqa: E731 - one block or row
        return sum(sum(per(a) for a in jax.tree.leaves(s)) * (n if k == "full" else int(state))
                   for k, s in zip(self.kinds, src))

    def copy(self, pool: list, src: list, src_blocks: list[int], blocks: list[int], src_row: int | None,
             row: int | None) -> list:
        """pool (donated) with the store's blocks src_blocks in blocks (and its state row src_row in row, where
        given) -> the new pool, dispatched. Needs `ready`."""
        M, n = self.max_blocks, len(blocks)
        where = np.zeros(2 * M + 3, np.int32)
        where[:n], where[M:M + n] = src_blocks, blocks
        where[2 * M:] = n, src_row or 0, row or 0
        return self._programs[signature(src)](pool, src, where)  # a host array: its transfer is the call's
