"""What one request's KV transfer moves, and where it lands: the staging layout and the transfer plan.

Decode needs, after prefill of `num_tokens` tokens: the full-attention blocks it does not already hold (its
prefix-cache hits are skipped), the whole ring of every sliding-window layer (the last `window` tokens),
and the fixed conv / recurrent state of every linear layer. Nothing else is sent.

Both ends derive the same *staging layout* from the cache layout, the dtype, the number of blocks and the
layer groups (prefill streams layer group by layer group), so a transfer needs no per-array negotiation:
  for each layer group k, for each cache group with layers in k (in pool order):
    full     "blocks" [M, L_k, E, block_size, H, D]  row i = the request's block (skip + i); M = rows rounded
             up to a power of two so the device import compiles a bounded number of programs (pad rows are
             never sent); with `span_rows` P, one such array per span of P rows (the last holds the rest),
             back to back
    sliding  "ring"   [L_k, E, window, H, D]
    linear   "conv"   [L_k, K-1, C] and "ssm" [L_k, H, Dk, Dv] (float32)
Arrays sit back to back at 64-byte-aligned offsets in one receive region (an array's head parts and spans back to
back inside its aligned place). bfloat16 travels as its uint16 bits (DLPack does not carry bfloat16 into numpy).

Head parts (sharded senders): when the sender's pool splits a group's KV heads over P tensor-parallel ranks,
the plan says so (`head_parts`) and each of that group's blocks / ring arrays is staged as P parts, part p
holding heads [p H/P, (p+1) H/P) (HND: each rank's heads are one contiguous array), back to back, so every
rank's export is sent as it is, with no gather on the sender. The parts together take exactly the bytes of
the whole array; the receiver reassembles them (transfer/device.py).

Spans (a prompt prefilled in several chunks): the sender may split the block rows into spans of P rows (a power
of two, `TransferPlan.span_rows`) so that a span whose tokens an earlier chunk computed travels while later chunks
compute, as SGLang sends a chunked prefill's KV chunk by chunk. A span's arrays have the shapes of a staging of
its own rows alone, so the export and import programs of spans are those of unsplit transfers of P rows (and of
the last span's rows): nothing more to compile. The sliding rings and the linear state belong to the last span
(they are final only after the last chunk). Without span_rows, or with no more rows than P, one span.

The *plan* (the PLAN frame) adds the block runs from FlowKV alignment (align.py): one send per run per
block array, one per state array. The receiver checks a plan against its reservation before any byte is
accepted: same layout signature and dtype, runs that tile exactly the reserved blocks, layer groups that
partition the layers. Plain Python.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field, replace

import numpy as np

from .align import Run, align

WIRE_DTYPES = {"float32": "float32", "bfloat16": "uint16"}
ALIGN = 64


class PlanError(ValueError):
    """A plan the receiver refuses (the reason is logged and sent back)."""


def bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


@dataclass(frozen=True)
class ArraySpec:
    index: int
    group: int  # cache group (index into the pool list)
    layer_group: int
    kind: str  # blocks | ring | conv | ssm
    j0: int  # layers [j0, j1) of the cache group
    j1: int
    shape: tuple[int, ...]
    dtype: str  # wire dtype (numpy name)
    offset: int  # bytes into the staging region
    rows: int | None = None  # blocks: rows sent (shape[0] is the padded count)
    part: int = 0  # which head part of its array this is (plan.head_parts)
    parts: int = 1
    span: int = 0  # which span of its layer group's rows (rings and state: the last span)
    row0: int = 0  # blocks: the first of the request's sent rows this array holds

    HEAD_AXIS = -2  # blocks [M, L, E, block, H, D] and ring [L, E, window, H, D]

    def span_of(self, rows: list):
        """A block array's part of the request's sent rows `rows` (its span's)."""
        return rows[self.row0:self.row0 + self.rows]

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:])) * self.itemsize

    @property
    def padded_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.itemsize

    @property
    def sent_bytes(self) -> int:
        return self.rows * self.row_bytes if self.kind == "blocks" else self.padded_bytes


@dataclass(frozen=True)
class Staging:
    arrays: tuple[ArraySpec, ...]
    nbytes: int  # region size (padding included)
    sent_bytes: int  # bytes on the wire

    @functools.cached_property
    def logical(self) -> list[tuple[ArraySpec, list[ArraySpec]]]:
        """Each staged array whole, with its head parts: [(the whole array's spec, its parts in head order)]
        (an array not split is its own single part). Computed once per staging."""
        out: list[tuple[ArraySpec, list[ArraySpec]]] = []
        for a in self.arrays:
            if a.part:
                out[-1][1].append(a)
                continue
            heads = list(a.shape)
            if a.parts > 1:
                heads[ArraySpec.HEAD_AXIS] *= a.parts
            out.append((replace(a, shape=tuple(heads), parts=1), [a]))
        return out

    @functools.cached_property
    def spans(self) -> list[tuple[int, int]]:
        """[(first row, rows)] of each span (one span: (0, the rows sent))."""
        out: dict[int, tuple[int, int]] = {}
        for a in self.arrays:
            if a.kind == "blocks":
                out.setdefault(a.span, (a.row0, a.rows))
        return [out[k] for k in sorted(out)] or [(0, 0)]

    def units(self, layer_groups=None) -> list[tuple[int, list[tuple[ArraySpec, list[ArraySpec]]]]]:
        """What one export or import program call moves: per span s, [(s, the `logical` arrays of span s's blocks
        and every ring and state array)] of the layer groups `layer_groups` (None: all). Each unit has the
        structure of an unsplit staging of its span's rows, so it runs that staging's program; the rings and state
        are real only in the last unit (an earlier unit's are read or written on a spare row)."""
        arrays = [(w, parts) for w, parts in self.logical if layer_groups is None or w.layer_group in layer_groups]
        return [(s, [(w, parts) for w, parts in arrays if w.kind != "blocks" or w.span == s])
                for s in range(len(self.spans))]

    def views(self, buf: np.ndarray) -> list[np.ndarray]:
        """Typed views of a uint8 region laid out by this staging."""
        if buf.nbytes < self.nbytes:
            raise ValueError(f"staging region of {buf.nbytes} bytes, need {self.nbytes}")
        return [buf[a.offset:a.offset + a.padded_bytes].view(a.dtype).reshape(a.shape) for a in self.arrays]


def check_layer_groups(layer_groups, num_layers: int) -> list[tuple[int, int]]:
    groups = [tuple(int(x) for x in g) for g in layer_groups]
    pos = 0
    for a, b in groups:
        if a != pos or b <= a:
            raise PlanError(f"layer groups {groups} do not partition layers [0, {num_layers})")
        pos = b
    if pos != num_layers:
        raise PlanError(f"layer groups {groups} do not partition layers [0, {num_layers})")
    return groups


def layer_groups(num_layers: int, per_group: int | None) -> list[tuple[int, int]]:
    """Contiguous groups of `per_group` layers (None or >= num_layers: one group)."""
    n = num_layers if not per_group else min(per_group, num_layers)
    return [(a, min(a + n, num_layers)) for a in range(0, num_layers, n)]


def check_head_parts(layout, head_parts) -> list[int]:
    """One part count per cache group; only attention groups split, into parts that divide their KV heads."""
    if head_parts is None:
        return [1] * len(layout.groups)
    try:
        parts = [int(p) for p in head_parts]
    except (TypeError, ValueError):
        raise PlanError(f"head_parts {head_parts!r} is not a list of integers") from None
    if len(parts) != len(layout.groups):
        raise PlanError(f"head_parts {parts} names {len(parts)} cache groups, the layout has {len(layout.groups)}")
    for p, gl in zip(parts, layout.groups):
        g = gl.group
        if p < 1 or (p > 1 and (g.kind not in ("full", "sliding") or g.kv_heads % p)):
            raise PlanError(f"head_parts {parts}: a {g.kind} group of {g.kv_heads} KV heads cannot be split in {p}")
    return parts


def spans(nblocks: int, span_rows: int | None) -> list[tuple[int, int]]:
    """[(first row, rows)] of nblocks rows in spans of span_rows (None, or no more rows than that: one span)."""
    if not span_rows or nblocks <= span_rows:
        return [(0, nblocks)]
    return [(r, min(span_rows, nblocks - r)) for r in range(0, nblocks, span_rows)]


def check_span_rows(span_rows) -> int | None:
    if span_rows is not None and (type(span_rows) is not int or span_rows < 1 or span_rows & (span_rows - 1)):
        raise PlanError(f"span_rows {span_rows!r} is not a power of two")
    return span_rows


def staging(layout, dtype: str, nblocks: int, groups: list[tuple[int, int]], head_parts=None,
            span_rows: int | None = None) -> Staging:
    """The staging layout for `nblocks` transferred blocks (layout: cache.layout.PoolLayout); head_parts: per
    cache group, the head parts its attention arrays are sent in (None: whole); span_rows: the block rows split in
    spans of that many (a power of two; None: one span). A split staging takes no more bytes than the unsplit one
    (each span's rows are padded to a power of two no larger than the whole's)."""
    wire = WIRE_DTYPES[dtype]
    parts = check_head_parts(layout, head_parts)
    cuts = spans(nblocks, check_span_rows(span_rows))
    last = len(cuts) - 1  # the span the rings and state belong to
    arrays, off, sent = [], 0, 0
    for k, (a, b) in enumerate(groups):
        for gi, gl in enumerate(layout.groups):
            g = gl.group
            j0, j1 = g.span(a, b)
            if j0 == j1:
                continue
            L = j1 - j0
            if g.kind == "full":
                if nblocks == 0:
                    continue
                specs = [("blocks", (bucket(max(rows, 1)), L, gl.entries, layout.block_size, g.kv_heads, gl.width),
                          wire, rows, s, row0) for s, (row0, rows) in enumerate(cuts)]
            elif g.kind == "sliding":
                specs = [("ring", (L, gl.entries, g.window, g.kv_heads, gl.width), wire, None, last, 0)]
            else:
                specs = [("conv", (L,) + tuple(g.conv_shape), wire, None, last, 0),
                         ("ssm", (L,) + tuple(g.ssm_shape), "float32", None, last, 0)]
            for kind, shape, dt, rows, s, row0 in specs:
                P = parts[gi] if kind in ("blocks", "ring") else 1
                shape = shape[:-2] + (shape[-2] // P, shape[-1])
                for p in range(P):  # the parts back to back: together, the whole array's bytes
                    spec = ArraySpec(len(arrays), gi, k, kind, j0, j1, shape, dt, off, rows, p, P, s, row0)
                    arrays.append(spec)
                    off += spec.padded_bytes
                    sent += spec.sent_bytes
                if kind != "blocks" or s == last:  # a cache group's spans back to back, then aligned
                    off = -(-off // ALIGN) * ALIGN
    return Staging(tuple(arrays), off, sent)


def layout_signature(layout, dtype: str) -> str:
    """Names what must agree between the two pools (not their sizes): groups, shapes per block/row, dtype."""
    parts = [dtype, str(layout.block_size), str(layout.num_layers)]
    for gl in layout.groups:
        g = gl.group
        parts.append(f"{g.kind}:{g.layers}:{gl.entries}:{gl.width}:{g.kv_heads}:{g.window}:{g.conv_shape}:"
                     f"{g.ssm_shape}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


@dataclass
class TransferPlan:
    signature: str
    dtype: str
    num_tokens: int  # tokens whose KV / state is sent
    skip: int  # leading blocks the receiver already holds (not sent)
    nblocks: int  # blocks sent
    layer_groups: list[tuple[int, int]]
    runs: list[Run] = field(default_factory=list)
    head_parts: list[int] | None = None  # per cache group: the sender's KV-head shards (None: whole)
    shm_base: int | None = None  # the sender writes into the receiver's shared-memory region at this offset
    span_rows: int | None = None  # block rows sent in spans of this many (None: one span)

    @staticmethod
    def build(layout, dtype: str, num_tokens: int, src: list[int], dst: list[int], skip: int,
              groups: list[tuple[int, int]], head_parts: list[int] | None = None,
              span_rows: int | None = None) -> "TransferPlan":
        """src / dst: the request's blocks in each pool, covering `num_tokens` tokens; head_parts: how the
        sender's pool splits each group's KV heads (cache.layout.head_parts); span_rows: rows per span, kept only
        where the rows sent are more (a power of two; None: one span)."""
        n = -(-num_tokens // layout.block_size)
        if len(src) < n or len(dst) < n:
            raise PlanError(f"{num_tokens} tokens need {n} blocks: sender has {len(src)}, receiver {len(dst)}")
        runs = align(list(src[skip:n]), list(dst[skip:n]))
        parts = None if head_parts is None or all(p == 1 for p in head_parts) else list(head_parts)
        span_rows = check_span_rows(span_rows) if span_rows is not None and n - skip > span_rows else None
        return TransferPlan(layout_signature(layout, dtype), dtype, num_tokens, skip, n - skip, list(groups), runs,
                            parts, span_rows=span_rows)

    def to_meta(self) -> dict:
        m = {"signature": self.signature, "dtype": self.dtype, "num_tokens": self.num_tokens, "skip": self.skip,
             "nblocks": self.nblocks, "layer_groups": [list(g) for g in self.layer_groups],
             "runs": [[r.index, r.src, r.dst, r.length] for r in self.runs], "head_parts": self.head_parts,
             "shm_base": self.shm_base}
        if self.span_rows is not None:  # an unsplit plan's frame is as before spans
            m["span_rows"] = self.span_rows
        return m

    @staticmethod
    def from_meta(m: dict) -> "TransferPlan":
        """A PLAN frame's meta -> the plan; raises PlanError naming the field that does not fit."""
        def ints(v, n=None):
            return isinstance(v, list) and (n is None or len(v) == n) and all(type(x) is int and x >= 0 for x in v)
        fields = {"signature": lambda v: isinstance(v, str), "dtype": lambda v: v in WIRE_DTYPES,
                  "num_tokens": lambda v: type(v) is int and v > 0, "skip": lambda v: type(v) is int and v >= 0,
                  "nblocks": lambda v: type(v) is int and v >= 0,
                  "layer_groups": lambda v: isinstance(v, list) and 0 < len(v) <= 4096 and all(ints(g, 2) for g in v),
                  "runs": lambda v: isinstance(v, list) and all(ints(r, 4) for r in v),
                  "head_parts": lambda v: v is None or (ints(v) and len(v) <= 4096),
                  "shm_base": lambda v: v is None or (type(v) is int and v >= 0),
                  "span_rows": lambda v: v is None or (type(v) is int and 0 < v <= 1 << 30 and not v & (v - 1))}
        for name in m:
            if name not in fields:
                raise PlanError(f"malformed plan: unknown field {name!r}")
        for name, ok in fields.items():
            if name not in m and name not in ("head_parts", "shm_base", "span_rows"):
                raise PlanError(f"malformed plan: missing field {name!r}")
            if not ok(m.get(name)):
                raise PlanError(f"malformed plan: bad value of {name!r}: {str(m.get(name))[:80]}")
        return TransferPlan(m["signature"], m["dtype"], m["num_tokens"], m["skip"], m["nblocks"],
                            [tuple(g) for g in m["layer_groups"]], [Run(*r) for r in m["runs"]], m.get("head_parts"),
                            m.get("shm_base"), m.get("span_rows"))

    def sends(self, st: Staging) -> list[tuple[int, int, int]]:
        """The logical sends (array index, byte offset, bytes): one per run of each block array (of each head
        part; a span's array: per run, its part inside the span), one per ring or state array (part), in
        layer-group order."""
        out = []
        for a in st.arrays:
            if a.kind == "blocks":
                for r in self.runs:
                    lo, hi = max(r.index, a.row0), min(r.index + r.length, a.row0 + a.rows)
                    if lo < hi:
                        out.append((a.index, (lo - a.row0) * a.row_bytes, (hi - lo) * a.row_bytes))
            else:
                out.append((a.index, 0, a.padded_bytes))
        return out

    def check(self, layout, dtype: str, dst: list[int], num_tokens: int, skip: int) -> Staging:
        """Receiver side: accept the plan for a reservation of blocks `dst` (raises PlanError)."""
        sig = layout_signature(layout, dtype)
        if self.dtype != dtype:
            raise PlanError(f"mismatched dtype: sender {self.dtype}, receiver {dtype}")
        if self.signature != sig:
            raise PlanError(f"mismatched cache layout: sender signature {self.signature}, receiver {sig}")
        if self.num_tokens != num_tokens or self.skip != skip:
            raise PlanError(f"plan for {self.num_tokens} tokens skipping {self.skip} blocks; reserved for "
                            f"{num_tokens} tokens skipping {skip}")
        n = -(-num_tokens // layout.block_size)
        if self.nblocks != n - skip:
            raise PlanError(f"plan sends {self.nblocks} blocks, {n - skip} expected")
        want = list(dst[skip:n])
        pos = 0
        for r in self.runs:
            if (r.index != pos or r.length < 1 or r.index + r.length > len(want)
                    or want[r.index:r.index + r.length] != list(range(r.dst, r.dst + r.length))):
                raise PlanError(f"run {r} does not match the reserved blocks")
            pos += r.length
        if pos != len(want):
            raise PlanError(f"runs cover {pos} blocks, {len(want)} reserved")
        if self.span_rows is not None and self.span_rows >= self.nblocks:
            raise PlanError(f"spans of {self.span_rows} rows for {self.nblocks} rows: one span needs no span_rows")
        groups = check_layer_groups(self.layer_groups, layout.num_layers)
        return staging(layout, dtype, self.nblocks, groups, self.head_parts, self.span_rows)
