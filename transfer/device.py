"""Device side of a transfer: staged arrays out of a KV pool (export) and into one (import), via DLPack.

Export gathers, for one layer group, what the staging layout (plan.py) names from the sender's pool: the
request's blocks in request order (padded to the bucketed row count), the sliding rings and the linear state
of its state row. The result is a fresh device array per staged array; `to_host` wraps it with
`np.from_dlpack`, which on CPU aliases the device buffer (no copy), and the sender writes the socket straight
from it; on an accelerator it is one device-to-host copy of the whole array into pinned host memory, started as
the export is dispatched (`host_copies`), which `to_host` views the same way: never a copy per block. Import is
the reverse: the receive region's views enter JAX with `jnp.from_dlpack` on a CPU (the region is 64-byte
aligned, so again no copy), with one host-to-device copy each onto an accelerator's pool, and one jitted program,
with the pool donated, scatters them into the reserved blocks and the slot's state rows. bfloat16 crosses as
uint16 bits.

Sharded pools (tensor parallelism, KV heads split over the mesh's devices): prefill and decode may shard
differently (TP=2 -> TP=1 and the reverse). A sender whose pool splits a group's heads over P ranks stages
that group's arrays as P head parts (plan.py): the export program leaves each array split over the ranks
(HND: each rank's heads one contiguous array) and each rank's part is sent as it is, with no gather; a
replicated array (MLA's single latent "head", linear state) is read from any one device. The receiver
reassembles: where its pool splits the heads the same way, part p goes to the device that holds those heads
and the parts form the sharded array without a copy; otherwise the parts are concatenated (one copy), and a
whole array is split over the decode pool's sharding on its way in. The import programs see whole arrays, so
they do not depend on the sender's parallelism. The device backend (pull.py) offers the same parts and hands
the pulled arrays to the import in place of the region's views.

Programs are cached per staging structure; the row count is a power of two, so a workload compiles a
bounded number of them, and the layer groups of equal structure share one export program (their first layers
an argument). Pure functions over the pool pytree; called from the engine thread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .plan import ArraySpec, Staging

HEAD_AXIS = ArraySpec.HEAD_AXIS


def _to_wire(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def from_wire(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x.astype(dtype)


def _key(arrays: list[ArraySpec], layers: bool = True) -> tuple:
    """What a program over these arrays depends on; layers=False: how many layers of their cache group, not
    which (`export` takes the first one traced)."""
    return tuple((a.group, a.kind, a.j0 if layers else None, a.j1 - a.j0, a.shape, a.dtype, a.parts) for a in arrays)


def _head_sharding(mesh, ndim: int):
    """KV heads (axis HEAD_AXIS of a staged array) split over the mesh's "tp" axis."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * (ndim + HEAD_AXIS)), "tp"))


def _mesh(pool: list):
    """The pool's mesh, or None for a pool on one device."""
    sh = jax.tree.leaves(pool)[0].sharding
    return sh.mesh if len(sh.device_set) > 1 else None


class DeviceIO:
    def __init__(self):
        self._export: dict[tuple, object] = {}
        self._import: dict[tuple, object] = {}

    # ---- export (sender)
    def export(self, pool: list, st: Staging, layer_group: int, blocks: list[int], row: int,
               spans=None) -> list[tuple[int, jax.Array]]:
        """Staged arrays of one layer group: [(index, device array)], dispatched asynchronously; an array split
        in head parts comes as its parts, each the single-device array of the rank holding those heads.

        blocks: the sender's block ids of the rows sent (len == rows); row: the request's state row; spans: the
        spans whose arrays to export (None: all; the rings and state go with the last), one program call each."""
        mesh = _mesh(pool)
        items = []
        for s, arrays in st.units({layer_group}):
            final = s == len(st.spans) - 1
            if (spans is not None and s not in spans) or not any(final or w.kind == "blocks" for w, _ in arrays):
                continue
            # one program for the layer groups of equal structure: the groups' first layers are an argument
            key = (_key([p for _, parts in arrays for p in parts], layers=False), mesh)
            fn = self._export.get(key)
            if fn is None:
                fn = self._export[key] = jax.jit(_taker([w for w, _ in arrays], [len(p) for _, p in arrays], mesh))
            # a group without block arrays takes a [1] id vector: one program for every row count
            ids = _ids(arrays, blocks, 0)
            j0s = np.array([w.j0 for w, _ in arrays], np.int32)  # [arrays] each array's first layer
            for (w, parts), x in zip(arrays, fn(pool, ids, np.int32(row), j0s)):  # host arguments: jit places them
                if w.kind == "blocks" or final:  # an earlier span's rings and state are not final: dropped
                    items += zip((p.index for p in parts), _head_shards(x, len(parts)) if len(parts) > 1 else [x])
        return items

    # ---- import (receiver)
    def import_(self, pool: list, st: Staging, views: list, blocks: list[int], row: int, num_blocks: int,
                layer_groups=None, spare_row: int | None = None) -> list:
        """The pool with the staged arrays written into `blocks` (the reserved blocks after the skipped prefix)
        and state row `row`; the pool is donated. views: the receive region's typed views (staging order), or
        pulled device arrays (pull.py); layer_groups: only the arrays of these layer groups (None: all). A staging
        in spans is written one program call per span; the calls before the last write the rings and state to
        `spare_row` (None: `row` again, the same values)."""
        mesh = _mesh(pool)
        units = st.units(layer_groups)
        for s, arrays in units:
            if not arrays:
                continue
            key = _key([w for w, _ in arrays])
            fn = self._import.get(key)
            if fn is None:
                fn = self._import[key] = jax.jit(_putter([w for w, _ in arrays]), donate_argnums=(0,))
            ids = _ids(arrays, blocks, num_blocks)  # pad rows land out of range and are dropped
            r = row if s == len(units) - 1 or spare_row is None else spare_row
            if mesh is not None:
                rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                ids, r = _place(ids, rep), _place(np.int32(r), rep)
            else:
                r = np.int32(r)  # host arguments: jit places them (cheaper than jnp.asarray)
            xs = [_assemble(w, [views[p.index] for p in parts], pool[w.group], mesh) for w, parts in arrays]
            pool = fn(pool, xs, ids, r)
        return pool


def _taker(specs: list[ArraySpec], nparts: list[int], mesh):
    """The export program of one unit: its arrays gathered from the pool, on the wire dtype, placed."""
    def take(pool, ids, row, j0s):
        out = []
        for i, (w, n) in enumerate(zip(specs, nparts)):
            x = _to_wire(_take(pool, w, ids, row, j0s[i]))
            if mesh is not None:  # where each result lives is fixed: split in its parts, or replicated
                where = (_head_sharding(mesh, x.ndim) if n > 1
                         else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
                x = jax.lax.with_sharding_constraint(x, where)
            out.append(x)
        return out
    return take


def _putter(specs: list[ArraySpec]):
    """The import program of one unit: its arrays written into the (donated) pool."""
    def put(pool, xs, ids, row):
        pool = list(pool)
        for a, x in zip(specs, xs):
            g = pool[a.group]
            if a.kind == "blocks":
                pool[a.group] = g.at[ids, a.j0:a.j1].set(from_wire(x, g.dtype), mode="drop")
            elif a.kind == "ring":
                pool[a.group] = g.at[row, a.j0:a.j1].set(from_wire(x, g.dtype))
            else:
                part = g[a.kind].at[row, a.j0:a.j1].set(from_wire(x, g[a.kind].dtype))
                pool[a.group] = {**g, a.kind: part}
        return pool
    return put


def _head_shards(x: jax.Array, parts: int) -> list[jax.Array]:
    """The single-device arrays of x's head parts, in head order."""
    by_start: dict[int, jax.Array] = {}
    for s in x.addressable_shards:
        by_start.setdefault(s.index[HEAD_AXIS].start or 0, s.data)
    if len(by_start) != parts:
        raise ValueError(f"export split in {len(by_start)} head parts, the plan says {parts}")
    return [by_start[k] for k in sorted(by_start)]


def _place(x: np.ndarray, sharding) -> jax.Array:
    """Host array x as a jax.Array with `sharding`: on a mesh spanning processes (a multi-host instance, whose
    every process passes the same x) each process places its own devices' shards."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _device_array(v, device=None) -> jax.Array:
    """Region view or pulled array v as a jax.Array on `device` (None: where it is; a view: the CPU). A view
    enters a CPU pool without a copy (64-byte aligned), an accelerator's with one host-to-device copy."""
    if not isinstance(v, jax.Array):
        if device is not None and device.platform != "cpu":
            return jax.device_put(v, device)
        v = jnp.from_dlpack(v)
    return v if device is None or v.devices() == {device} else jax.device_put(v, device)


def _assemble(w: ArraySpec, parts: list, pool_group, mesh) -> jax.Array:
    """Staged array w whole, from its head parts (region views or pulled arrays), placed as the import program
    takes it: split over KV heads like the decode pool's group, or replicated, or on the pool's one device."""
    split = mesh is not None and w.kind in ("blocks", "ring") and not pool_group.sharding.is_fully_replicated
    target = (_head_sharding(mesh, len(w.shape)) if split else
              jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None)
    if target is not None and not target.is_fully_addressable:  # a multi-host instance: from the host's copy
        return _place(np.concatenate([np.asarray(p) for p in parts], axis=HEAD_AXIS), target)
    home = None if target is not None else next(iter(jax.tree.leaves(pool_group)[0].devices()))
    if len(parts) == 1:
        x = _device_array(parts[0], home)
    else:
        homes = sorted(target.addressable_devices_indices_map(w.shape).items(),
                       key=lambda kv: kv[1][HEAD_AXIS].start or 0) if split else []
        if len(homes) == len(parts) == mesh.shape["tp"]:  # each part straight to the device of its heads
            return jax.make_array_from_single_device_arrays(
                w.shape, target, [jax.device_put(_device_array(p), d) for p, (d, _) in zip(parts, homes)])
        if all(isinstance(p, jax.Array) for p in parts):  # rebuilt here: one copy
            at = home or next(iter(parts[0].devices()))
            x = jnp.concatenate([jax.device_put(p, at) for p in parts], axis=HEAD_AXIS)
        else:
            x = _device_array(np.concatenate(parts, axis=HEAD_AXIS), home)
    return x if target is None else jax.device_put(x, target)


def _ids(arrays: list, blocks: list[int], pad: int) -> np.ndarray:
    """Block ids of one unit's staged rows (its span's part of `blocks`), padded to the span's bucketed row count
    with `pad` ([1] unused when the unit has no block array)."""
    w = next((w for w, _ in arrays if w.kind == "blocks"), None)
    if w is None:
        return np.zeros(1, np.int32)
    ids = np.full(w.shape[0], pad, np.int32)
    sel = w.span_of(blocks)
    ids[:len(sel)] = sel
    return ids


def _take(pool: list, a: ArraySpec, ids, row, j0):
    """a's layers j0..j0 + (a.j1 - a.j0) - 1 of its cache group (j0 traced) for the rows `ids` / state row."""
    g = pool[a.group]
    layers = jnp.arange(a.j1 - a.j0) + j0
    if a.kind == "blocks":
        return g[ids[:, None], layers[None, :]]
    if a.kind == "ring":
        return g[row, layers]
    return g[a.kind][row, layers]


def whole(x: jax.Array) -> jax.Array:
    """x on one device: itself, or any one device's copy of an array replicated over several (a sharded export
    is sent as its head parts, never gathered)."""
    if len(x.sharding.device_set) > 1:
        if not x.is_fully_replicated:
            raise ValueError(f"a sharded array ({x.sharding}) is sent as its head parts, not whole")
        x = x.addressable_shards[0].data
    return x


def _on_cpu(x: jax.Array) -> bool:
    return next(iter(x.devices())).platform == "cpu"


def _pinned(x: jax.Array) -> bool:
    return x.sharding.memory_kind == "pinned_host"


def host_copies(items: list[tuple[int, jax.Array]], pinned: bool | None = None) -> list[tuple[int, jax.Array]]:
    """Exported arrays with, on an accelerator, each one's copy into pinned host memory started as they are
    dispatched (one device-to-host DMA, running while later layer groups compute; `to_host` then views it without
    another copy); on a CPU the arrays themselves (already host memory). pinned: True copies a CPU's arrays too
    (what tests exercise), False none (the arrays go to host memory when read)."""
    out = []
    for i, x in items:
        x = whole(x)
        if pinned if pinned is not None else not _on_cpu(x):
            kinds = {m.kind for m in next(iter(x.devices())).addressable_memories()}
            if "pinned_host" in kinds:
                x = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
            elif not _on_cpu(x):
                x.copy_to_host_async()  # a device without pinned host memory: its own copy to host, started now
        out.append((i, x))
    return out


def to_host(x: jax.Array) -> np.ndarray:
    """`whole(x)` as numpy (waits until it is computed): on a CPU, and for an array in pinned host memory
    (`host_copies`), a view of its buffer (no copy); on an accelerator's own memory one device-to-host copy
    (np.from_dlpack takes only host memory)."""
    x = whole(x)
    if _on_cpu(x) and not _pinned(x):
        return np.from_dlpack(x)
    if _pinned(x):
        x.block_until_ready()  # the copy has landed (a view of a host buffer has no stream to order it by)
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError):  # a consumer refusing the device kind: copy
            pass
    return np.asarray(x)
