"""Device layout of the cache pool and the gather/scatter between it and the model's per-layer caches.

Per cache group (models/cache_spec.py):
  full      one array [num_blocks, layers_in_group, E, block_size, kv_heads, D] indexed by block id
            (block-major, FlowKV's (B, L, 2, H): all layers of one block are contiguous). Block ids are shared
            by all full groups: a block is `block_size` tokens of one request across every full layer.
  sliding   [rows, layers_in_group, E, window, kv_heads, D]: a ring of the last `window` tokens per request
  linear    {"conv": [rows, layers_in_group, K-1, C], "ssm": [rows, layers_in_group, H, Dk, Dv] float32}
Entries E: 2 (K and V) when their head dims agree; 1 with K and V concatenated on D when they differ;
1 for MLA (latent + rope key). Request-level groups (sliding, linear) have `rows` state rows: one per
decode slot, then the prefix-cache snapshots, then one scratch row that padding rows of a batch write to.

`gather` gives the model its per-layer caches for a batch: each layer of a full group a `PagedKV` view of the
group's blocks (models/paged.py; the layer writes its new tokens into the blocks itself, then attends with paged
attention in decode, over a dense copy of its own blocks in prefill), and dense copies of the request-level
state from the batch's state rows. `scatter` writes the state back into its row (and a snapshot row when asked)
and returns the pool. No program copies a whole group: a scan over a run of layers carries the group's array.
In decode a sliding group's rings are `PagedKV` views too (`ring_table`: a ring is a block of `window` tokens
that every entry of its row's table names), written and attended in place: no copy of the batch's rings in or
out (gpt-oss on a CPU: a decode step of 48 requests took 81 ms with the copies, 32 ms without).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..models.cache_spec import CacheGroup, CacheSpec
from ..models.paged import PagedKV


@dataclass(frozen=True)
class GroupLayout:
    group: CacheGroup
    entries: int  # E
    width: int  # D

    @property
    def kind(self) -> str:
        return self.group.kind

    @property
    def mla(self) -> bool:
        return self.group.v_dim == 0


def group_layout(g: CacheGroup) -> GroupLayout:
    if g.kind == "linear":
        return GroupLayout(g, 0, 0)
    if g.v_dim == 0:
        return GroupLayout(g, 1, g.k_dim)
    if g.k_dim == g.v_dim:
        return GroupLayout(g, 2, g.k_dim)
    return GroupLayout(g, 1, g.k_dim + g.v_dim)


@dataclass(frozen=True)
class PoolLayout:
    groups: tuple[GroupLayout, ...]
    num_layers: int
    block_size: int
    num_blocks: int
    num_rows: int  # state rows: slots + snapshots + 1 scratch

    @staticmethod
    def build(spec: CacheSpec, block_size: int, num_blocks: int, num_slots: int, num_snapshots: int) -> "PoolLayout":
        n = max(max(g.layers) for g in spec.groups) + 1
        return PoolLayout(tuple(group_layout(g) for g in spec.groups), n, block_size, num_blocks,
                          num_slots + num_snapshots + 1)

    @property
    def scratch_row(self) -> int:
        return self.num_rows - 1

    @property
    def has_request_state(self) -> bool:
        return any(g.kind != "full" for g in self.groups)

    def shapes(self, dtype) -> list:
        """jax.ShapeDtypeStruct pytree of the pool (one entry per group)."""
        out = []
        for gl in self.groups:
            g, L = gl.group, len(gl.group.layers)
            if g.kind == "full":
                out.append(jax.ShapeDtypeStruct(
                    (self.num_blocks, L, gl.entries, self.block_size, g.kv_heads, gl.width), dtype))
            elif g.kind == "sliding":
                out.append(jax.ShapeDtypeStruct((self.num_rows, L, gl.entries, g.window, g.kv_heads, gl.width), dtype))
            else:
                out.append({"conv": jax.ShapeDtypeStruct((self.num_rows, L) + g.conv_shape, dtype),
                            "ssm": jax.ShapeDtypeStruct((self.num_rows, L) + g.ssm_shape, jnp.float32)})
        return out

    def bytes(self, dtype) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.shapes(dtype)))


def _split_heads(layout: PoolLayout, mesh) -> list[int]:
    """Per group, how many ways the pool splits its KV heads over the mesh's "tp" axis (1: not split):
    attention groups whose heads divide evenly over "tp", as the step programs' outputs are; MLA latents (one
    head) and linear states are never split."""
    tp = 1 if mesh is None else mesh.shape.get("tp", 1)
    return [tp if gl.group.kind in ("full", "sliding") and not gl.mla and tp > 1 and gl.group.kv_heads % tp == 0
            else 1 for gl in layout.groups]


def head_parts(layout: PoolLayout, mesh) -> list[int]:
    """Per group, the head parts a transfer from this pool sends (each rank's heads as they lie): the pool's
    split where the mesh is this process's devices; none on a mesh spanning processes (a multi-host instance:
    its leader sends the KV, gathered whole by the export program)."""
    local = mesh is None or all(d.process_index == mesh.devices.flat[0].process_index for d in mesh.devices.flat)
    split = _split_heads(layout, mesh)
    return split if local else [1] * len(split)


def pool_shardings(layout: PoolLayout, mesh) -> list:
    """Where each pool array lives on a TP mesh: attention groups split over KV heads (axis 4 of
    [rows, layers, entries, tokens, heads, width]) where `_split_heads` says so, else replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    out = []
    for gl, parts in zip(layout.groups, _split_heads(layout, mesh)):
        if parts > 1:
            out.append(NamedSharding(mesh, P(None, None, None, None, "tp")))
        elif gl.group.kind in ("full", "sliding"):
            out.append(NamedSharding(mesh, P()))
        else:
            out.append({"conv": NamedSharding(mesh, P()), "ssm": NamedSharding(mesh, P())})
    return out


def init_pool(layout: PoolLayout, dtype, sharding) -> list:
    """Zeros of the pool's shapes; sharding: one for every array, or a `pool_shardings` pytree."""
    shapes = layout.shapes(dtype)
    if not isinstance(sharding, list):
        sharding = jax.tree.map(lambda _: sharding, shapes)
    return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), shapes, sharding)


def to_layer(gl: GroupLayout, x):
    """[B, E, S, H, D] -> the model's per-layer cache dict."""
    if gl.mla:
        return {"kv": x[:, 0]}
    if gl.entries == 2:
        return {"k": x[:, 0], "v": x[:, 1]}
    return {"k": x[:, 0, ..., :gl.group.k_dim], "v": x[:, 0, ..., gl.group.k_dim:]}


def _from_layer(gl: GroupLayout, c):
    """The model's per-layer cache dict -> [B, E, S, H, D]."""
    if gl.mla:
        return c["kv"][:, None]
    if gl.entries == 2:
        return jnp.stack([c["k"], c["v"]], axis=1)
    return jnp.concatenate([c["k"], c["v"]], axis=-1)[:, None]


def _span(g: CacheGroup, span: tuple[int, int] | None) -> tuple[int, int]:
    """The group's layer indices [j0, j1) that fall in the model layer range `span` (all when None)."""
    return (0, len(g.layers)) if span is None else g.span(*span)


def _index(rows, j0: int, j1: int, shift):
    """Index of state rows [B] x group layers j0 + shift..j1 - 1 + shift: a [B, j1 - j0, ...] block."""
    if isinstance(shift, int):
        return rows, slice(j0 + shift, j1 + shift)
    return rows[:, None], (jnp.arange(j0, j1) + shift)[None, :]


def _read_rows(a, rows, index):
    """a[index(rows)]: the request-level state of the batch's rows [B] (index: rows -> the index of their
    entries). A batch of one reads its row twice and keeps one: XLA makes a one-row read a dynamic slice, fuses
    it into each of its users, some of them after the step's write of `a`, and then copies all of `a` first,
    every slot's state, at each step (on a CPU a hybrid model's batch-1 decode step with 512 slots took 9x as
    long: tests/engine/test_hot_path.py checks the compiled programs). XLA:GPU fuses the two rows' read too (a
    Kimi Linear's conv state was copied twice a step: bench/gpu_programs.py), so there the read is kept behind
    an optimization barrier; XLA:CPU keeps the read without one (lowered per platform, no conditional)."""
    if rows.shape[0] != 1:
        return a[index(rows)]
    read = lambda: a[index(jnp.concatenate([rows, rows]))]  # noqa: E731
    return jax.lax.platform_dependent(cpu=read, default=lambda: jax.lax.optimization_barrier(read()))[:1]


def gather(layout: PoolLayout, pool: list, block_table, src_rows, start, span: tuple[int, int] | None = None,
           total_blocks: int | None = None, dense: bool = False, shift=0, inplace: bool = False) -> list:
    """Per-layer caches for a batch: `PagedKV` views of the full groups (decode: paged attention over the
    blocks; dense, for prefill: each layer attends over a dense copy of its own blocks; models/paged.py) and
    dense copies of the request-level state (sliding rings, linear state).

    block_table [B, W] int32 block ids (capacity W * block_size tokens); src_rows [B] int32 state rows;
    start [B] int32 tokens already cached (state of rows with start == 0 reads as zeros); span: only the
    model layers [lo, hi) (the others stay None); total_blocks: the views' bound on the blocks the batch holds
    (models/paged.py); shift: the entries of span's layers hold those of layers lo + shift..hi - 1 + shift
    (traced: one program for every layer group of a run of one cache group, CausalLM.run_layers); inplace: a
    dense prefill attends over the pool in place (models/paged.py).
    """
    B = block_table.shape[0]
    cache: list = [None] * layout.num_layers
    fresh = start == 0
    for gi, (gl, arr) in enumerate(zip(layout.groups, pool)):
        g = gl.group
        j0, j1 = _span(g, span)
        if j0 == j1:
            continue
        if g.kind == "full":
            for j in range(j0, j1):
                cache[g.layers[j]] = PagedKV(arr, block_table, gi, j + shift, total_blocks, dense, inplace)
            continue
        if g.kind == "sliding" and not dense:  # decode: each ring read and written where it lies
            ring = ring_table(src_rows, block_table.shape[1] * layout.block_size, g.window)
            for j in range(j0, j1):
                cache[g.layers[j]] = PagedKV(arr, ring, gi, j + shift)
            continue
        rows = jax.tree.map(lambda a: _read_rows(a, src_rows, lambda r: _index(r, j0, j1, shift)), arr)
        rows = jax.tree.map(lambda a: jnp.where(fresh.reshape((B,) + (1,) * (a.ndim - 1)), 0, a), rows)
        for j in range(j0, j1):
            if g.kind == "sliding":
                cache[g.layers[j]] = to_layer(gl, rows[:, j - j0])
            else:
                cache[g.layers[j]] = {"conv": rows["conv"][:, j - j0], "ssm": rows["ssm"][:, j - j0]}
    return cache


def scatter(layout: PoolLayout, pool: list, cache: list, dst_rows, snap_rows,
            span: tuple[int, int] | None = None, shift=0, after=None) -> list:
    """Write what a step added back into the pool: the full groups' layers wrote their tokens into the blocks
    themselves (their `PagedKV`s hold the group's array), the request-level state goes into its row (and a
    snapshot row when asked).

    cache: the model's updated per-layer caches (from `gather`); dst_rows [B] and snap_rows [B] int32 state rows
    (the scratch row where nothing is to be saved); span: only the model layers [lo, hi) were run (the rest of
    the pool is returned as it was); shift: as `gather`'s; after: in decode, where the rings were written in
    place, the step's output (its hidden states): the rings' snapshots are taken after it (`_snapshot`).
    """
    out = []
    for gl, arr in zip(layout.groups, pool):
        g = gl.group
        j0, j1 = _span(g, span)
        if j0 == j1:
            out.append(arr)
            continue
        layers = g.layers[j0:j1]
        if g.kind == "full":
            out.append(cache[layers[-1]].pool)
            continue
        if isinstance(cache[layers[-1]], PagedKV):  # rings written in place (decode): the snapshots alone
            out.append(_snapshot(cache[layers[-1]].pool, dst_rows, snap_rows, layout.scratch_row, after))
            continue
        if g.kind == "sliding":
            vals = jnp.stack([_from_layer(gl, cache[layer]) for layer in layers], axis=1)
        else:
            vals = {k: jnp.stack([cache[layer][k] for layer in layers], axis=1) for k in ("conv", "ssm")}
        for rows in (dst_rows, snap_rows):
            arr = jax.tree.map(lambda a, v, r=rows: a.at[_index(r, j0, j1, shift)].set(v.astype(a.dtype)), arr, vals)
        out.append(arr)
    return out


def ring_table(rows, capacity: int, window: int):
    """rows [B] int32 state rows -> [B, ceil(capacity / window)] int32: a sliding group's rings as a `PagedKV`
    table. A ring of `window` slots holds position p at slot p % window (models/attention.py), which is where
    a paged pool of blocks of `window` tokens holds p when every entry of the row's table names its ring: the
    block p // window, offset p % window. The window's positions lie in distinct slots, the newest write of
    each, so paged attention with the window (which reads only the window's blocks: the native and Pallas
    kernels) and a layer's write of its new token need no copy of the ring. Decode only: a prefill chunk's
    early tokens would be overwritten by its later ones before they are attended."""
    return jnp.broadcast_to(rows[:, None], (rows.shape[0], -(-capacity // window))).astype(jnp.int32)


RING_SNAPSHOTS = 4  # the most decode rows whose rings one step snapshots (the scheduler asks for no more)


def _snapshot(a, rows, snap_rows, scratch: int, after):
    """A sliding group's pool a [R, ...] with the rings of rows [B] copied into snap_rows [B] (the scratch row:
    none), after the array `after` is computed: at most RING_SNAPSHOTS of them, the first rows that ask. A step
    copies that many rings whether or not they are asked for (a conditional's branch is read on the host on a GPU:
    a sync), not the batch's (on a GPU, gpt-oss-20b's 256-row step: 800 MB).

    The layers' attention read the rings, and nothing in the data orders those reads before the snapshots'
    write: XLA then copies the whole pool (an optimization barrier does not order them: XLA lowers it away
    first). The copies' rows depend on `after`, the step's output, which follows every read (a step whose
    output is NaN takes no snapshot)."""
    keep = (snap_rows != scratch) & ~jnp.isnan(after.reshape(-1)[0])
    first = jnp.argsort(~keep, stable=True)[:min(RING_SNAPSHOTS, rows.shape[0])]  # the rows that ask, first
    return a.at[jnp.where(keep[first], snap_rows[first], a.shape[0])].set(a[rows[first]], mode="drop")


def layer_places(layout: PoolLayout) -> np.ndarray:
    """[L, 2] int32: each model layer's cache group and its index in the group."""
    out = np.zeros((layout.num_layers, 2), np.int32)
    for gi, gl in enumerate(layout.groups):
        for j, layer in enumerate(gl.group.layers):
            out[layer] = gi, j
    return out


def _span_index(layout: PoolLayout, gi: int, at, n: int, drop: bool):
    """Group gi's layer index at each position of the model layers at..at+n-1 (at traced) [n] int32; a
    position whose layer lies in another group: 0 (a read), or past the group's layers (drop: a write dropped)."""
    places = jax.lax.dynamic_slice_in_dim(jnp.asarray(layer_places(layout)), at, n)  # [n, 2]
    other = len(layout.groups[gi].group.layers) if drop else 0
    return jnp.where(places[:, 0] == gi, places[:, 1], other)


def gather_span(layout: PoolLayout, pool: list, block_table, src_rows, start, at, n: int, dense: bool = False,
                inplace: bool = False) -> list:
    """`gather` for the model layers at..at+n-1, at traced (models/model.py `switch_span`): per cache group, a
    `PagedKV` of its array (full groups; the layer index is set per layer) or the request-level state of the
    batch's rows at each position of the span, per-layer entries stacked [n, ...] (zeros for rows with start
    == 0; a position whose layer lies in another group reads group layer 0, unused)."""
    B = block_table.shape[0]
    fresh = start == 0
    views = []
    for gi, (gl, arr) in enumerate(zip(layout.groups, pool)):
        if gl.kind == "full":
            views.append(PagedKV(arr, block_table, gi, 0, None, dense, inplace))
            continue
        js = _span_index(layout, gi, at, n, drop=False)
        rows = jax.tree.map(lambda a: _read_rows(a, src_rows, lambda r: (r[:, None], js[None, :])), arr)  # [B, n, ...]
        rows = jax.tree.map(lambda a: jnp.moveaxis(jnp.where(fresh.reshape((B,) + (1,) * (a.ndim - 1)), 0, a), 1, 0),
                            rows)
        views.append(jax.vmap(lambda r: to_layer(gl, r))(rows) if gl.kind == "sliding" else rows)
    return views


def scatter_span(layout: PoolLayout, pool: list, views: list, dst_rows, snap_rows, at, n: int) -> list:
    """`scatter` after `switch_span` over the model layers at..at+n-1: each full group's array as the layers
    left it, each request-level group's entries [n, ...] written into rows dst_rows [B] and snap_rows [B] at
    the positions whose layers are the group's."""
    out = []
    for gi, (gl, arr, v) in enumerate(zip(layout.groups, pool, views)):
        if gl.kind == "full":
            out.append(v.pool)
            continue
        vals = jax.vmap(lambda c: _from_layer(gl, c))(v) if gl.kind == "sliding" else v
        vals = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), vals)  # [B, n, ...]
        js = _span_index(layout, gi, at, n, drop=True)
        for rows in (dst_rows, snap_rows):
            arr = jax.tree.map(lambda a, x, r=rows: a.at[r[:, None], js[None, :]].set(x.astype(a.dtype), mode="drop"),
                               arr, vals)
        out.append(arr)
    return out


def copy_rows(layout: PoolLayout, pool: list, src, dst) -> list:
    """Copy request-level state rows src [N] -> dst [N] (restoring or taking snapshots outside a step)."""
    return [arr if gl.kind == "full" else jax.tree.map(lambda a: a.at[dst].set(a[src]), arr)
            for gl, arr in zip(layout.groups, pool)]
