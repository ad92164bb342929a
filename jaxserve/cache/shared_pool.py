"""The global KV store's pool in shared memory: prefill instances on its host read its blocks in place.

A store instance (role `store`, transfer.shared_memory on, one device) keeps its KV pool in one POSIX
shared-memory segment (transfer/bufpool.py), each pool array at a page-aligned offset in its wire dtype
(bfloat16 as its uint16 bits: DLPack carries no bfloat16 into numpy). JAX reads it in place (`views`:
`jnp.from_dlpack` aliases page-aligned host memory on CPU), so the store's export programs run unchanged. XLA
cannot write such memory in place (a donated DLPack buffer is copied, not reused), so the store's writes (a
prefix arriving, blocks restored from its disk tier) are numpy stores into the segment (`import_`,
`write_blocks`), made on the store's engine thread once the export programs already dispatched have read the
pool (engine/runner.py).

A prefill instance on the same host maps the segment (`attach`, checked against its own layout), gathers a
prefix's blocks and the state snapshot at its end from it into a staging region (`stage`: numpy, one copy) and
imports that with the import program it already compiled for KV arriving over the transfer layer (so reading a
store of any size compiles nothing): no store process, socket or receive thread in the data path. The router
leases the blocks on the store first (pinned until released, or until the lease expires), names them in the
Prefill call, and releases them once the prefill has run.

Not thread-safe: one writer (the store's engine thread); readers only read leased blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from transfer.bufpool import PAGE, attach_segment, create_segment, remove_segment
from transfer.plan import ArraySpec, Staging, layout_signature


def _wire(dtype) -> np.dtype:
    """A pool array's dtype in the segment: bfloat16 as uint16 bits, others as they are."""
    return np.dtype(np.uint16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)


class SharedPool:
    def __init__(self, name: str, mapping, leaves: list[dict], treedef, signature: str, owner: bool):
        self.name, self.signature, self.owner = name, signature, owner
        self._mapping, self._leaves, self._treedef = mapping, leaves, treedef
        flat = [np.frombuffer(mapping, np.dtype(lf["dtype"]), int(np.prod(lf["shape"])), lf["offset"])
                .reshape(lf["shape"]) for lf in leaves]
        self.arrays = jax.tree.unflatten(treedef, flat)  # the pool pytree as numpy arrays over the segment

    @classmethod
    def create(cls, layout, dtype: str) -> "SharedPool":
        """A zeroed pool of `layout` (cache.layout.PoolLayout) in a new segment, owned here."""
        leaves, treedef = jax.tree.flatten(layout.shapes(jnp.dtype(dtype)))
        specs, off = [], 0
        for s in leaves:
            dt = _wire(s.dtype)
            specs.append({"offset": off, "shape": list(s.shape), "dtype": dt.name})
            off += -(-int(np.prod(s.shape)) * dt.itemsize // PAGE) * PAGE
        name, mapping = create_segment(max(off, PAGE))
        return cls(name, mapping, specs, treedef, layout_signature(layout, dtype), True)

    def describe(self) -> dict:
        """What a reader needs to map it (the store's heartbeat carries it)."""
        return {"name": self.name, "bytes": len(self._mapping), "signature": self.signature,
                "leaves": self._leaves}

    @classmethod
    def attach(cls, desc: dict, layout, dtype: str) -> "SharedPool":
        """Map another process's pool (`describe()`) here, for reading. Raises ValueError when it is not a pool of
        the same model layout and dtype as `layout` (sizes may differ: the store holds more blocks)."""
        if desc.get("signature") != layout_signature(layout, dtype):
            raise ValueError(f"the shared pool {desc.get('name')!r} holds another model's KV (layout signature "
                             f"{desc.get('signature')} != {layout_signature(layout, dtype)})")
        mine, treedef = jax.tree.flatten(layout.shapes(jnp.dtype(dtype)))
        leaves = desc.get("leaves") or []
        if len(leaves) != len(mine) or any(
                list(lf["shape"][1:]) != list(s.shape[1:]) or lf["dtype"] != _wire(s.dtype).name
                for lf, s in zip(leaves, mine)):
            raise ValueError(f"the shared pool {desc.get('name')!r} has arrays {leaves} that do not match this "
                             f"instance's pool")
        mapping = attach_segment(desc["name"])
        end = max((lf["offset"] + int(np.prod(lf["shape"])) * np.dtype(lf["dtype"]).itemsize for lf in leaves),
                  default=0)
        if end > len(mapping):
            mapping.close()
            raise ValueError(f"the shared pool {desc['name']!r} is {len(mapping)} bytes, its arrays need {end}")
        return cls(desc["name"], mapping, leaves, treedef, desc["signature"], False)

    def holds(self, layout, blocks: list[int], row: int) -> bool:
        """Whether block ids `blocks` and state row `row` lie inside this pool (of `layout`'s groups)."""
        for gl, g in zip(layout.groups, self.arrays):
            n = (g if not isinstance(g, dict) else next(iter(g.values()))).shape[0]
            if (max(blocks, default=0) if gl.kind == "full" else row) >= n:
                return False
        return True

    def views(self):
        """The pool pytree as JAX arrays over the segment (no copy): what the programs that read it take."""
        return jax.tree.map(jnp.from_dlpack, self.arrays)

    def stage(self, st: Staging, views: list, blocks: list[int], row: int) -> None:
        """Gather blocks `blocks` and state row `row` into staging region views (st's order, heads whole): what
        transfer/device.py `DeviceIO.export` stages from a device pool, for every layer group of `st`."""
        for w, parts in st.logical:
            if len(parts) != 1:
                raise ValueError("a shared pool is read into one device: its staging splits no heads")
            g, out = self.arrays[w.group], views[parts[0].index]
            if w.kind == "blocks":  # block by block (no temporary); the padding rows are left (their ids drop)
                for i, b in enumerate(blocks):
                    out[i] = g[b, w.j0:w.j1]
            elif w.kind == "ring":
                out[...] = g[row, w.j0:w.j1]
            else:
                out[...] = g[w.kind][row, w.j0:w.j1]

    # ---- writes (the owner's engine thread)
    def import_(self, st: Staging, views: list, blocks: list[int], row: int, layer_groups=None) -> None:
        """Write received staged arrays (region views in staging order) into `blocks` and state row `row`: what
        transfer/device.py `DeviceIO.import_` does to a device pool. layer_groups: only these (None: all)."""
        ids = np.asarray(blocks, np.intp)
        for w, parts in st.logical:
            if layer_groups is not None and w.layer_group not in layer_groups:
                continue
            x = (np.asarray(views[parts[0].index]) if len(parts) == 1 else
                 np.concatenate([np.asarray(views[p.index]) for p in parts], axis=ArraySpec.HEAD_AXIS))
            g = self.arrays[w.group]
            if w.kind == "blocks":
                g[ids, w.j0:w.j1] = x[:len(ids)]
            elif w.kind == "ring":
                g[row, w.j0:w.j1] = x
            else:
                g[w.kind][row, w.j0:w.j1] = x

    def write_blocks(self, full: list[int], ids: list[int], data: list[list[np.ndarray]]) -> None:
        """Per block of `ids`, its arrays of the full cache groups `full` (runner.read_blocks' shape)."""
        for b, arrays in zip(ids, data):
            for gi, a in zip(full, arrays):
                self.arrays[gi][b] = a

    def close(self) -> None:
        """Unmap (views handed out keep their memory only while the mapping lives); the owner removes the
        segment."""
        self.arrays = None
        try:
            self._mapping.close()
        except BufferError:  # arrays over it are still referenced: the mapping goes with them
            pass
        if self.owner:
            remove_segment(self.name)
