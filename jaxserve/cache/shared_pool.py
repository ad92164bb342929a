"""The global KV store's pool in shared memory: prefill instances on its host read its blocks in place.

A store instance (role `store`, transfer.shared_memory on, one device) keeps its KV pool in one POSIX
shared-memory segment (transfer/bufpool.py), each pool array at a page-aligned offset in its wire dtype
(bfloat16 as its uint16 bits: DLPack carries no bfloat16 into numpy). JAX reads it in place (`views`:
`jnp.from_dlpack` aliases page-aligned host memory on CPU), so the store's export programs run unchanged. XLA
cannot write such memory in place (a donated DLPack buffer is copied, not reused), so the store's writes (a
prefix arriving, blocks restored from its disk tier) are numpy stores into the segment (`import_`,
`write_blocks`), made on the store's engine thread once the export programs already dispatched have read the
pool (engine/runner.py).

A prefill instance on the same host (the router's Load call) maps the segment (`attach`, checked against its
own layout), gathers a prefix's blocks and the state snapshot at its end from it into a staging region (`stage`:
numpy, one copy) and imports that with the import program it already compiled for KV arriving over the transfer
layer (so reading a store of any size compiles nothing): no store process, socket, receive thread or call in the
data path.

Reads take no lock and no lease: the segment ends with a table, one entry per block and per state row, of a
generation counter and the chain hash of what the entry holds (a snapshot row: the hash of the prefix it ends;
0: nothing readable). A seqlock (one writer, any number of readers):
  writer  `begin`: generation made odd and hash cleared, then the KV written (`import_` / `write_blocks`), then
          `publish`: hash set, generation made even (the next even number)
  reader  `locate` the prefix's entries by hash and read their generations (all even) and hashes (all the
          prefix's), stage the KV, then `intact`: every generation unchanged, so nothing was written meanwhile
A read that raced a write (the store reused a block for another prefix) is refused and the prefill computes
those tokens. x86-64 keeps ordinary stores in program order and loads in program order (TSO), which is what the
protocol needs from the numpy stores and loads on each side; the non-temporal stores a large memcpy may use are
the exception, so the writer fences (`mfence`, a four-byte function mapped executable) between marking entries
and writing their KV, and between writing it and publishing. On other hosts, or where no such function can be
mapped, the store keeps its pool private and the KV goes over the transfer layer (`readable_here`). A block the
store evicted keeps its hash until it is written again, its KV still that prefix's, so it stays readable.

Not thread-safe on the writing side: one writer (the store's engine thread).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.transfer.bufpool import PAGE, attach_segment, create_segment, remove_segment
from jaxserve.transfer.plan import ArraySpec, Staging, layout_signature


def _wire(dtype) -> np.dtype:
    """A pool array's dtype in the segment: bfloat16 as uint16 bits, others as they are."""
    return np.dtype(np.uint16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)


@functools.cache
def _mfence():
    """A callable that runs x86-64 `mfence` (every store before it is visible before any after it, non-temporal
    ones included), or None where it cannot be had."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, AttributeError):  # no executable mapping allowed here
        return None
    code.write(b"\x0f\xae\xf0\xc3")  # mfence; ret
    fn = ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
    fn._code = code  # the mapping lives as long as the function
    fn()
    return fn


def readable_here() -> bool:
    """Whether the seqlock holds on this host: x86-64 memory order, and the writer's fence to hand."""
    return _mfence() is not None


class Missed(Exception):
    """The pool does not hold the prefix (any more), or a write to its blocks raced the read."""


def _keys(hashes: list[bytes]) -> np.ndarray:
    """Chain hashes (16 bytes each) as the table's [n, 2] uint64 keys."""
    if any(len(h) != 16 for h in hashes):
        raise ValueError("the shared pool's table keys chain hashes of 16 bytes")
    return np.frombuffer(b"".join(hashes), np.uint64).reshape(-1, 2)


class SharedPool:
    def __init__(self, name: str, mapping, leaves: list[dict], treedef, signature: str, owner: bool,
                 table: dict):
        self.name, self.signature, self.owner = name, signature, owner
        self._mapping, self._leaves, self._treedef, self._table = mapping, leaves, treedef, table
        flat = [np.frombuffer(mapping, np.dtype(lf["dtype"]), int(np.prod(lf["shape"])), lf["offset"])
                .reshape(lf["shape"]) for lf in leaves]
        self.arrays = jax.tree.unflatten(treedef, flat)  # the pool pytree as numpy arrays over the segment
        self._views = None  # `views`, once made
        self.num_blocks, self.num_rows = table["blocks"], table["rows"]
        n = self.num_blocks + self.num_rows  # entries: the blocks, then the state rows
        self.gens = np.frombuffer(mapping, np.uint64, n, table["offset"])
        self.keys = np.frombuffer(mapping, np.uint64, 2 * n, table["offset"] + 8 * n).reshape(n, 2)

    @classmethod
    def create(cls, layout, dtype: str) -> "SharedPool":
        """A zeroed pool of `layout` (cache.layout.PoolLayout) in a new segment, owned here. Raises ValueError
        where readers could not read it safely (`readable_here`)."""
        if not readable_here():
            raise ValueError("a shared KV pool needs an x86-64 host that can map its writer's fence")
        leaves, treedef = jax.tree.flatten(layout.shapes(jnp.dtype(dtype)))
        specs, off = [], 0
        for s in leaves:
            dt = _wire(s.dtype)
            specs.append({"offset": off, "shape": list(s.shape), "dtype": dt.name})
            off += -(-int(np.prod(s.shape)) * dt.itemsize // PAGE) * PAGE
        table = {"offset": off, "blocks": layout.num_blocks, "rows": layout.num_rows}
        name, mapping = create_segment(off + 24 * (layout.num_blocks + layout.num_rows),
                                       "a store with fewer kv_blocks, transfer.shared_memory: false")
        return cls(name, mapping, specs, treedef, layout_signature(layout, dtype), True, table)

    def describe(self) -> dict:
        """What a reader needs to map it (the store's heartbeat carries it)."""
        return {"name": self.name, "bytes": len(self._mapping), "signature": self.signature,
                "leaves": self._leaves, "table": self._table}

    @staticmethod
    def shapes(desc: dict, layout, dtype: str) -> list:
        """The arrays of another process's pool (`describe()`) as a ShapeDtypeStruct pytree, in their wire dtypes.
        Raises ValueError when it is not a pool of the same model layout and dtype as `layout` (sizes may differ:
        the store holds more blocks)."""
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
        table = desc.get("table") or {}
        by_block = [gl.kind == "full" for gl, shp in zip(layout.groups, layout.shapes(jnp.dtype(dtype)))
                    for _ in jax.tree.leaves(shp)]  # per leaf: indexed by block (else by state row)
        if not isinstance(table.get("offset"), int) or table["offset"] % 8 or any(
                lf["shape"][0] != table.get("blocks" if b else "rows") for b, lf in zip(by_block, leaves)):
            raise ValueError(f"the shared pool {desc.get('name')!r} has a table {table} that does not index its "
                             f"arrays {leaves}")
        return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(tuple(lf["shape"]), np.dtype(lf["dtype"]))
                                            for lf in leaves])

    @classmethod
    def attach(cls, desc: dict, layout, dtype: str) -> "SharedPool":
        """Map another process's pool (`describe()`) here, for reading. Raises ValueError when it is not a pool of
        the same model layout and dtype as `layout` (`shapes`)."""
        treedef = jax.tree.structure(cls.shapes(desc, layout, dtype))
        leaves, table = desc["leaves"], desc["table"]
        mapping = attach_segment(desc["name"])
        end = max([lf["offset"] + int(np.prod(lf["shape"])) * np.dtype(lf["dtype"]).itemsize for lf in leaves] +
                  [table["offset"] + 24 * (table["blocks"] + table["rows"])])
        if end > len(mapping):
            mapping.close()
            raise ValueError(f"the shared pool {desc['name']!r} is {len(mapping)} bytes, its arrays need {end}")
        return cls(desc["name"], mapping, leaves, treedef, desc["signature"], False, table)

    def views(self):
        """The pool pytree as JAX arrays over the segment (no copy): what the programs that read it take. Made
        once (each costs a DLPack import)."""
        if self._views is None:
            self._views = jax.tree.map(jnp.from_dlpack, self.arrays)
        return self._views

    # ---- the seqlock (module docstring)
    def _entries(self, blocks: list[int], row: int | None) -> np.ndarray:
        return np.asarray(list(blocks) + ([self.num_blocks + row] if row is not None else []), np.intp)

    def locate(self, hashes: list[bytes], row_key: bytes | None) -> tuple[list[int], int | None, tuple]:
        """Find the blocks holding the chain `hashes` (and, with row_key, the state row holding the snapshot
        keyed by it) -> (block ids, row, a ticket for `intact`). Raises Missed when any is not held or is being
        written."""
        want = _keys(hashes)
        bk = self.keys[:self.num_blocks]
        cand = np.flatnonzero(np.isin(bk[:, 0], want[:, 0]))  # a few (stale duplicates of a hash: any serves)
        where = {bk[b].tobytes(): int(b) for b in cand}
        blocks = [where.get(w.tobytes()) for w in want]
        if None in blocks:
            raise Missed(f"the store's pool does not hold block {blocks.index(None)} of the prefix")
        row = None
        if row_key is not None:
            rk = _keys([row_key])[0]
            rows = np.flatnonzero((self.keys[self.num_blocks:] == rk).all(axis=1))
            if not len(rows):
                raise Missed("the store's pool holds no state snapshot at the prefix's end")
            row = int(rows[0])
        idx = self._entries(blocks, row)
        gens = self.gens[idx]  # a copy: read before the hashes, compared after the KV is read
        keys = np.concatenate([want, _keys([row_key])]) if row is not None else want
        if (gens & 1).any() or not (self.keys[idx] == keys).all():
            raise Missed("the store is writing the prefix's blocks")
        return blocks, row, (idx, gens)

    def intact(self, ticket: tuple) -> bool:
        """Whether nothing was written to the located entries since `locate` (what was read since is theirs)."""
        idx, gens = ticket
        return bool((self.gens[idx] == gens).all())

    def begin(self, blocks: list[int], row: int | None) -> None:
        """Writer: the entries about to be written become unreadable (odd generation, no hash)."""
        idx = self._entries(blocks, row)
        self.gens[idx] |= np.uint64(1)
        self.keys[idx] = 0
        _mfence()()  # marked before any byte of their KV changes

    def publish(self, blocks: list[int], hashes: list[bytes], row: int | None = None,
                row_key: bytes | None = None) -> None:
        """Writer: blocks `blocks` hold the chain `hashes` (and state row `row` the snapshot keyed by row_key):
        readable from now on."""
        blocks = list(blocks)[:len(hashes)]
        row = row if row_key is not None else None
        idx = self._entries(blocks, row)
        keys = _keys(list(hashes)[:len(blocks)] + ([row_key] if row is not None else []))
        # entries published with these hashes and not written since are left as they are (a prefix sharing
        # blocks with one held already must not refuse the readers of those)
        new = ((self.gens[idx] & 1) == 1) | (self.keys[idx] != keys).any(axis=1)
        idx, keys = idx[new], keys[new]
        _mfence()()  # the KV written before is visible before the entries are
        self.gens[idx] |= np.uint64(1)
        self.keys[idx] = keys
        self.gens[idx] += np.uint64(1)

    def stage(self, st: Staging, views: list, blocks: list[int], row: int | None) -> None:
        """Gather blocks `blocks` and state row `row` into staging region views (st's order, heads whole): what
        transfer/device.py `DeviceIO.export` stages from a device pool, for every layer group of `st`."""
        ids = np.asarray(blocks, np.intp)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"blocks {blocks} lie outside the shared pool's {self.num_blocks}")
        for w, parts in st.logical:
            if len(parts) != 1:
                raise ValueError("a shared pool is read into one device: its staging splits no heads")
            g, out = self.arrays[w.group], views[parts[0].index]
            if w.kind == "blocks":  # one gather (vectorised: a layer group's blocks are many small copies)
                sel = w.span_of(ids)
                out[:len(sel)] = g[sel, w.j0:w.j1]  # the padding rows are left (their ids drop)
            elif w.kind == "ring":
                out[...] = g[row, w.j0:w.j1]
            else:
                out[...] = g[w.kind][row, w.j0:w.j1]

    # ---- writes (the owner's engine thread)
    def import_(self, st: Staging, views: list, blocks: list[int], row: int, layer_groups=None) -> None:
        """Write received staged arrays (region views in staging order) into `blocks` and state row `row`: what
        transfer/device.py `DeviceIO.import_` does to a device pool. layer_groups: only these (None: all).
        Unreadable until `publish`."""
        self.begin(blocks, row)
        ids = np.asarray(blocks, np.intp)
        for w, parts in st.logical:
            if layer_groups is not None and w.layer_group not in layer_groups:
                continue
            x = (np.asarray(views[parts[0].index]) if len(parts) == 1 else
                 np.concatenate([np.asarray(views[p.index]) for p in parts], axis=ArraySpec.HEAD_AXIS))
            g = self.arrays[w.group]
            if w.kind == "blocks":
                sel = w.span_of(ids)
                g[sel, w.j0:w.j1] = x[:len(sel)]
            elif w.kind == "ring":
                g[row, w.j0:w.j1] = x
            else:
                g[w.kind][row, w.j0:w.j1] = x

    def write_blocks(self, full: list[int], ids: list[int], data: list[list[np.ndarray]]) -> None:
        """Per block of `ids`, its arrays of the full cache groups `full` (runner.read_blocks' shape). Unreadable
        until `publish`."""
        self.begin(ids, None)
        for b, arrays in zip(ids, data):
            for gi, a in zip(full, arrays):
                self.arrays[gi][b] = a

    def close(self) -> None:
        """Unmap (views handed out keep their memory only while the mapping lives); the owner removes the
        segment."""
        self.arrays = self._views = None
        try:
            self._mapping.close()
        except BufferError:  # arrays over it are still referenced: the mapping goes with them
            pass
        if self.owner:
            remove_segment(self.name)
