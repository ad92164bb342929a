"""The KV moved in and out of a ModelRunner's pool: whole blocks to and from the host (the disk tier), a request's
staged KV exported for a transfer and imported from one (transfer/device.py), the global KV store's pool moved
into shared memory and the one-pass copies out of it (cache/shared_pool.py, cache/pool_copy.py).

`PoolIO` is ModelRunner's base: it works on the runner's state (`pool`, `layout`, `shared`, `_io`, `copies`,
`_reads`, `_full`, and the `_read_blocks` / `_write_blocks` programs, all set up by ModelRunner). Not thread-safe:
the engine thread drives it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .rows import pow2_bucket


class PoolIO:
    def read_blocks(self, ids: list[int]) -> list[list[np.ndarray]]:
        """The KV of blocks `ids` on host: per block, its [layers, E, block_size, kv_heads, D] array of every full
        cache group (what the disk tier keeps)."""
        n = len(ids)
        padded = np.zeros(pow2_bucket(n, 1, self.layout.num_blocks), np.int32)  # a program per power of two
        padded[:n] = ids
        got = jax.device_get(self._read_blocks(self.pool, jnp.asarray(padded)))
        return [[a[i] for a in got] for i in range(n)]

    def write_blocks(self, ids: list[int], data: list[list[np.ndarray]]) -> None:
        """Write `read_blocks`-shaped KV into blocks `ids`."""
        if self.shared is not None:
            self._writable()
            self.shared.write_blocks(self._full, ids, data)
            return
        n = len(ids)
        B = pow2_bucket(n, 1, self.layout.num_blocks)
        padded = np.full(B, self.layout.num_blocks, np.int32)  # padding rows are dropped
        padded[:n] = ids
        vals = [np.zeros((B,) + d.shape, d.dtype) for d in data[0]]
        for i, arrays in enumerate(data):
            for v, a in zip(vals, arrays):
                v[i] = a
        self.pool = self._write_blocks(self.pool, jnp.asarray(padded), vals)

    def share_pool(self):
        """Move the pool into shared memory (the global KV store, whose prefill instances on this host then read
        it in place: cache/shared_pool.py) -> the SharedPool. From then on the pool is only read by programs;
        `import_kv` and `write_blocks` store into it with numpy once the reads dispatched before are done. Only
        for a pool on one device that no model step writes."""
        from ..cache.shared_pool import SharedPool
        if len(jax.tree.leaves(self.pool)[0].sharding.device_set) > 1:
            raise ValueError("a shared pool is kept on one device")
        self.shared = SharedPool.create(self.layout, jnp.dtype(self.dtype).name)
        self.pool = self.shared.views()
        return self.shared

    def _writable(self) -> None:
        """Shared pool: wait until the programs dispatched on it have read it (a block they read may be written
        next)."""
        jax.block_until_ready(self._reads)
        self._reads = []

    def export_kv(self, staging, layer_group: int, blocks: list[int], row: int,
                  spans=None) -> list[tuple[int, jax.Array]]:
        """A request's staged KV for one layer group (dispatched; read before any later step writes the pool);
        spans: only these spans of its rows (None: all)."""
        with jax.profiler.TraceAnnotation("kv.export", layer_group=layer_group, blocks=len(blocks)):
            items = self._io.export(self.pool, staging, layer_group, blocks, row, spans)
        if self.shared is not None:
            self._reads = [x for x in self._reads if not x.is_ready()] + [x for _, x in items]
        return items

    def import_kv(self, staging, views: list[np.ndarray], blocks: list[int], row: int, layer_groups=None,
                  wait: bool = True) -> None:
        """Write received staged KV into `blocks` and state row `row` (layer_groups: only those of these layer
        groups); returns once the views may be reused (wait False: once dispatched; `settle` waits)."""
        with jax.profiler.TraceAnnotation("kv.import", blocks=len(blocks)):
            if self.shared is not None:  # numpy stores: done when this returns
                self._writable()
                self.shared.import_(staging, views, blocks, row, layer_groups)
                return
            self.pool = self._io.import_(self.pool, staging, views, blocks, row, self.layout.num_blocks,
                                         layer_groups, self.layout.scratch_row)
            if wait:
                self.settle()

    def prepare_copies(self, src: list) -> int:
        """Compile the one-pass copy out of a store pool shaped as `src` (arrays or ShapeDtypeStructs), for any
        block count (any thread: the pool is not read) -> the programs compiled (0: none, as for a pool off the
        CPU, or compiled before)."""
        return 0 if self.copies is None else self.copies.compile(src)

    def can_copy(self, src: list, n: int) -> bool:
        """Whether n blocks copy from a store pool shaped as `src` (SharedPool.arrays) in one pass (`copy_from`)."""
        return self.copies is not None and self.shared is None and self.copies.ready(src, n)

    def copy_from(self, src: list, src_blocks: list[int], blocks: list[int], src_row: int | None,
                  row: int | None) -> None:
        """Copy blocks src_blocks (and state row src_row) of store arrays `src` (SharedPool.views) into blocks
        `blocks` (and row `row`) in one pass; returns once done (the store's arrays are read). Needs `can_copy`."""
        self.pool = self.copies.copy(self.pool, src, src_blocks, blocks, src_row, row)
        self.settle()

    def settle(self) -> None:
        """Wait for every program dispatched on the pool (the views they read may be reused after)."""
        jax.block_until_ready(self.pool)
