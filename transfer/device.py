"""Device side of a transfer: staged arrays out of a KV pool (export) and into one (import), via DLPack.

Export gathers, for one layer group, what the staging layout (plan.py) names from the sender's pool: the
request's blocks in request order (padded to the bucketed row count), the sliding rings and the linear state
of its state row. The result is a fresh device array per staged array; `to_host` wraps it with
`np.from_dlpack`, which on CPU aliases the device buffer (no copy), and the sender writes the socket straight
from it. Import is the reverse: the receive region's views enter JAX with `jnp.from_dlpack` (the region is
64-byte aligned, so again no copy) and one jitted program, with the pool donated, scatters them into the
reserved blocks and the slot's state rows. bfloat16 crosses as uint16 bits.

Sharded pools (tensor parallelism, KV heads split over the mesh's devices): prefill and decode may shard
differently (TP=2 -> TP=1 and the reverse). The staged arrays are the full arrays: on the sending side a
sharded export result is rebuilt by an all-gather on the instance's own devices (`to_host`; a replicated
one, as MLA's single latent "head" is, is read from any one device, no gather), and on the receiving side the
import program splits the full arrays over the decode pool's sharding. So the wire format does not depend on
either side's parallelism. The device backend (pull.py) offers `whole(x)` and hands the pulled arrays to the
import program in place of the region's views.

Programs are cached per staging structure; the row count is a power of two, so a workload compiles a
bounded number of them. Pure functions over the pool pytree; called from the engine thread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .plan import ArraySpec, Staging


def _to_wire(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _from_wire(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x.astype(dtype)


def _key(arrays: list[ArraySpec]) -> tuple:
    return tuple((a.group, a.kind, a.j0, a.j1, a.shape, a.dtype) for a in arrays)


class DeviceIO:
    def __init__(self):
        self._export: dict[tuple, object] = {}
        self._import: dict[tuple, object] = {}

    # ---- export (sender)
    def export(self, pool: list, st: Staging, layer_group: int, blocks: list[int], row: int) -> list[tuple[int, jax.Array]]:
        """Staged arrays of one layer group: [(index, device array)], dispatched asynchronously.

        blocks: the sender's block ids of the rows sent (len == rows); row: the request's state row."""
        arrays = [a for a in st.arrays if a.layer_group == layer_group]
        if not arrays:
            return []
        key = _key(arrays)
        fn = self._export.get(key)
        if fn is None:
            fn = self._export[key] = jax.jit(lambda pool, ids, row: [_to_wire(_take(pool, a, ids, row)) for a in arrays])
        # a group without block arrays takes a [1] id vector: one program for every row count
        ids = _ids(st, blocks, 0) if any(a.kind == "blocks" for a in arrays) else np.zeros(1, np.int32)
        return list(zip((a.index for a in arrays), fn(pool, jnp.asarray(ids), jnp.int32(row))))

    # ---- import (receiver)
    def import_(self, pool: list, st: Staging, views: list[np.ndarray], blocks: list[int], row: int,
                num_blocks: int) -> list:
        """The pool with the staged arrays written into `blocks` (the reserved blocks after the skipped prefix)
        and state row `row`; the pool is donated. views: the receive region's typed views (staging order)."""
        key = _key(list(st.arrays))
        fn = self._import.get(key)
        if fn is None:
            specs = list(st.arrays)

            def put(pool, xs, ids, row):
                pool = list(pool)
                for a, x in zip(specs, xs):
                    g = pool[a.group]
                    if a.kind == "blocks":
                        pool[a.group] = g.at[ids, a.j0:a.j1].set(_from_wire(x, g.dtype), mode="drop")
                    elif a.kind == "ring":
                        pool[a.group] = g.at[row, a.j0:a.j1].set(_from_wire(x, g.dtype))
                    else:
                        part = g[a.kind].at[row, a.j0:a.j1].set(_from_wire(x, g[a.kind].dtype))
                        pool[a.group] = {**g, a.kind: part}
                return pool
            fn = self._import[key] = jax.jit(put, donate_argnums=(0,))
        ids = _ids(st, blocks, num_blocks)  # pad rows land out of range and are dropped
        xs = [v if isinstance(v, jax.Array) else jnp.from_dlpack(v) for v in views]  # jax.Array: pulled (pull.py)
        sharding = jax.tree.leaves(pool)[0].sharding
        if len(sharding.device_set) > 1:  # a sharded pool: the program splits the full arrays over its devices
            rep = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            xs = [jax.device_put(x, rep) for x in xs]
            ids, row = jax.device_put(jnp.asarray(ids), rep), jax.device_put(jnp.int32(row), rep)
        return fn(pool, xs, jnp.asarray(ids), jnp.int32(row))


def _ids(st: Staging, blocks: list[int], pad: int) -> np.ndarray:
    """Block ids of the staged rows, padded to the bucketed row count ([1] unused when no block array)."""
    M = next((a.shape[0] for a in st.arrays if a.kind == "blocks"), 0)
    ids = np.full(max(M, 1), pad, np.int32)
    if M:
        ids[:len(blocks)] = blocks
    return ids


def _take(pool: list, a: ArraySpec, ids, row):
    g = pool[a.group]
    if a.kind == "blocks":
        return g[ids][:, a.j0:a.j1]
    if a.kind == "ring":
        return g[row, a.j0:a.j1]
    return g[a.kind][row, a.j0:a.j1]


def whole(x: jax.Array) -> jax.Array:
    """The full array on one device. An array over several devices: replicated, any one device's copy;
    sharded (KV heads over TP ranks), rebuilt first by an all-gather onto every device of its mesh."""
    if len(x.sharding.device_set) > 1:
        if not x.is_fully_replicated:
            x = jax.device_put(x, jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec()))
        x = x.addressable_shards[0].data
    return x


def to_host(x: jax.Array) -> np.ndarray:
    """A numpy view of `whole(x)` (waits until it is computed; no copy on CPU)."""
    return np.from_dlpack(whole(x))
