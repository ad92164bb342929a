"""Moving part of running decode requests' work to a helper instance (BanaServe 4.1, Figs. 3 and 4).

Two kinds, both applied to the requests decoding on the source at the time of the move:
  heads   attention-level: the KV of some cache heads of every full-attention layer (MLA: the latent, for some
          query heads), up to each request's current length, goes to the helper. From then on each decode step
          sends the moved heads' queries to the helper, layer by layer, and merges the partial results it
          returns (O, m, l) with the part computed here over the newer positions (models/split.py). The pool
          here stays whole (every head's new K/V is written here too), so nothing else about the request changes.
  layers  layer-level: layers lo..hi-1 of the requests move with their KV and request-level state (the weights
          are not sent: every instance of a cluster loads the same checkpoint, checked at the move). Each step
          runs layers 0..lo-1 here, the hidden states [B, 1, H] cross to the helper, which runs lo..hi-1 over its
          copy and sends them back, and layers hi.. run here. The pool here now misses those layers' KV of the
          new tokens (`Sequence.kv_partial`): the blocks are not offered to the prefix cache, a preempted
          request is recomputed.
If the helper fails during a step, nothing of the step is sampled: heads-migrated requests of a model without
request-level state run the step again here (their pool is whole), the others are recomputed (preempted); no
request is lost.

Source side: `Outbound`, one per move, owned by the engine thread; the step programs call it back through
`io_callback` (models/split.py's registry). Helper side: `Guests`, the moved state and the programs over it,
called from one thread of the helper's worker (worker/main.py `migrate_call`). Messages are `pack`ed: a JSON
header and raw array bytes; `link(payload) -> payload` carries them (the workers' control port, or a direct call
in tests).
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import struct
import threading
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ..cache.layout import gather, to_layer
from ..models.batch import Batch
from ..models.config import GQASpec, MLASpec
from ..models.paged import PagedKV
from ..models.split import HeadSplit, held_partial, install, registered, uninstall

log = logging.getLogger("jaxserve.migration")
KINDS = ("heads", "layers")
IDLE_S = 600.0  # a helper forgets a move its source has not called for this long (the source is gone)


class MigrationError(ValueError):
    """An impossible move (the admin endpoint answers 400): `param` names the field."""

    def __init__(self, msg: str, param: str | None = None):
        super().__init__(msg)
        self.param = param


class RemoteFailed(RuntimeError):
    """The helper did not answer during a step."""


@dataclass(frozen=True)
class Remote:
    """The static part of a decode program with a helper (programs.py `decode_fn`)."""
    kind: str
    split: HeadSplit | None = None  # heads
    span: tuple[int, int] | None = None  # layers


# ---- messages
def pack(header: dict, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """A message: 4-byte header length, the JSON header (with each array's name, dtype and shape), the arrays."""
    arrays = {k: np.ascontiguousarray(v) for k, v in (arrays or {}).items()}
    head = json.dumps({**header, "arrays": [[k, str(v.dtype), list(v.shape)] for k, v in arrays.items()]}).encode()
    return b"".join([struct.pack(">I", len(head)), head] + [v.tobytes() for v in arrays.values()])


def unpack(payload: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    (n,) = struct.unpack_from(">I", payload)
    header = json.loads(payload[4:4 + n])
    at, arrays = 4 + n, {}
    for name, dtype, shape in header.pop("arrays"):
        dt = jnp.dtype(dtype)
        size = int(np.prod(shape)) * dt.itemsize
        if at + size > len(payload):
            raise ValueError(f"message cut short in array {name!r}")
        arrays[name] = np.frombuffer(payload, dt, int(np.prod(shape)), at).reshape(shape)
        at += size
    return header, arrays


def fingerprint(engine) -> dict:
    """What source and helper must agree on for a move: the same model and dtype."""
    c = engine.model_config
    return {"model_type": c.model_type, "layers": c.num_layers, "hidden": c.hidden_size, "vocab": c.vocab_size,
            "dtype": engine.dtype_name}


# ---- device side of the source
def remote_hidden(x, mig, start):
    """x [B, 1, H] -> the hidden states after the helper's layers (layer-level migration)."""
    return io_callback(_hidden_host, jax.ShapeDtypeStruct(x.shape, x.dtype), mig["mid"], x, start, mig["gidx"],
                       ordered=False)


def _hidden_host(mid, x, start, gidx):
    client = registered(int(mid))
    got = client.hidden(np.asarray(x), np.asarray(start), np.asarray(gidx)) if client is not None else None
    return got if got is not None else np.zeros_like(x)


@functools.partial(jax.jit, static_argnames=("layout", "split"))
def _held_heads(pool, table, *, layout, split: HeadSplit):
    """The moved heads' KV of every full-attention layer for the rows of `table` [B, W] -> {name: [B, S, Hh, D]}
    (MLA: the latent alone, as "kv"; the helper reads the values from it as this instance does)."""
    out = {}
    kh = np.asarray(split.kv_heads)
    for gi, gl in enumerate(layout.groups):
        if gl.kind != "full":
            continue
        for j in range(len(gl.group.layers)):
            c = to_layer(gl, PagedKV(pool[gi], table, gi, j).view())  # the layer's dense cache dict
            out.update({f"{gi}.{j}.{k}": a if gl.mla else a[:, :, kh] for k, a in c.items()})
    return out


@functools.partial(jax.jit, static_argnames=("layout", "span"))
def _held_layers(pool, table, rows, start, *, layout, span: tuple[int, int]):
    """Layers span's caches of the rows, dense (the model's dense-cache dicts) -> {name: array}."""
    cache = gather(layout, pool, table, rows, start, span=span, dense=True)
    out = {}
    for i in range(*span):
        c = cache[i]
        if isinstance(c, PagedKV):
            c = to_layer(layout.groups[c.group], c.view())
        out.update({f"{i}.{k}": v for k, v in c.items()})
    return out


# ---- the source's side of one move
class Outbound:
    def __init__(self, mid: int, spec: Remote, src: str, dst: str, link, seqs: list, since: np.ndarray):
        self.mid, self.spec, self.src, self.dst, self.link = mid, spec, src, dst, link
        self.seqs = list(seqs)
        self.rows = {id(s): i for i, s in enumerate(seqs)}
        self.since = since  # [Bg] each request's length at the move
        self.failed: str | None = None
        self.calls = 0

    def step(self, seqs: list) -> "RemoteStep":
        return RemoteStep(self, [self.rows[id(s)] for s in seqs])

    def _call(self, header: dict, arrays: dict) -> dict | None:
        if self.failed:
            return None
        try:
            _, got = unpack(self.link(pack({"mid": self.mid, "src": self.src, **header}, arrays)))
            self.calls += 1
            return got
        except Exception as e:  # noqa: BLE001 - any failure of the helper: the step is redone without it
            self.failed = f"{type(e).__name__}: {e}"
            return None

    def partial(self, group: int, layer: int, q, gidx):
        got = self._call({"op": "heads", "group": group, "layer": layer}, {"q": q, "gidx": gidx})
        return None if got is None else (got["o"], got["m"], got["l"])

    def hidden(self, x, start, gidx):
        got = self._call({"op": "layers"}, {"x": x, "start": start, "gidx": gidx})
        return None if got is None else got["x"].astype(x.dtype)

    def release(self) -> None:
        uninstall(self.mid)
        if not self.failed:
            self._call({"op": "release"}, {})


@dataclass
class RemoteStep:
    """One decode step's rows of a move (runner.generate's `remote`)."""
    out: Outbound
    gidx: list[int]  # each row's index in the move's group

    @property
    def spec(self) -> Remote:
        return self.out.spec

    def arrays(self, B: int) -> dict:
        gidx = np.full(B, -1, np.int32)
        gidx[:len(self.gidx)] = self.gidx
        since = np.zeros(B, np.int32)
        since[:len(self.gidx)] = self.out.since[self.gidx]
        return {"since": jnp.asarray(since), "mid": jnp.int32(self.out.mid), "gidx": jnp.asarray(gidx)}

    def check(self) -> None:
        if self.out.failed:
            raise RemoteFailed(f"helper {self.out.dst}: {self.out.failed}")


def attention_heads(engine) -> tuple[int, int, bool] | None:
    """(query heads, cache heads, MLA) of the model's full-attention layers, or None when it has none or they
    differ (no one set of heads can move)."""
    specs = [engine.model_config.layers[i].mixer for g in engine.layout.groups if g.kind == "full"
             for i in g.group.layers]
    if not specs or not all(isinstance(s, (GQASpec, MLASpec)) for s in specs):
        return None
    counts = {(s.num_heads, getattr(s, "num_kv_heads", 1), isinstance(s, MLASpec)) for s in specs}
    return counts.pop() if len(counts) == 1 else None


def facts(engine, blocks_used: int) -> dict:
    """What the router's migration planner needs of an instance (its heartbeat stats): the layers and heads a
    move can take, the weight bytes of one layer and the KV bytes of one layer its running requests hold
    (`blocks_used` of the pool's blocks)."""
    L = engine.layout.num_layers
    if engine._move_facts is None:  # what does not change: computed once
        heads = attention_heads(engine)
        engine._move_facts = (0 if heads is None else heads[0] if heads[2] else heads[1],
                              sum(x.nbytes for x in jax.tree.leaves(engine.runner.params)) // L,
                              engine.layout.bytes(engine.dtype) / L / max(1, engine.blocks.num_blocks))
    heads, weight, kv_per_block = engine._move_facts
    return {"move_layers": L, "move_heads": heads, "layer_weight_bytes": weight,
            "layer_kv_bytes": int(kv_per_block * blocks_used),
            "moves_out": len(engine.outbound), "moves_in": engine._guests.count() if engine._guests else 0}


def plan_move(engine, kind: str, heads: list[int] | None, layers: list[int] | None) -> Remote:
    """The move's static spec, checked against the model (MigrationError naming the field)."""
    if kind not in KINDS:
        raise MigrationError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}", "kind")
    if engine.mesh is not None and engine.mesh.size > 1:
        raise MigrationError("a tensor-parallel instance does not migrate work (its step programs are sharded)",
                             "src")
    specs = [layer.mixer for layer in engine.model_config.layers]
    L = len(specs)
    if kind == "layers":
        if heads is not None:
            raise MigrationError("a layer-level move takes `layers`, not `heads`", "heads")
        if layers is None or len(layers) != 2:
            raise MigrationError("layers must be [lo, hi]: the layers lo..hi-1 move", "layers")
        lo, hi = layers
        if not 0 <= lo < hi <= L:
            raise MigrationError(f"layers [{lo}, {hi}] out of range: 0 <= lo < hi <= {L}", "layers")
        return Remote("layers", span=(lo, hi))
    if layers is not None:
        raise MigrationError("an attention-level move takes `heads`, not `layers`", "layers")
    got = attention_heads(engine)
    if got is None:
        raise MigrationError("the model has no full-attention layers of one head layout: no heads to move", "kind")
    Hq, Hkv, latent = got
    n = Hq if latent else Hkv
    if not heads or len(set(heads)) != len(heads) or not all(0 <= h < n for h in heads):
        what = "query heads (MLA: the latent is shared)" if latent else "KV heads"
        raise MigrationError(f"heads must be distinct {what} in [0, {n}), got {heads}", "heads")
    return Remote("heads", split=HeadSplit.of(heads, Hq, Hkv, latent))


def new_id() -> int:
    return secrets.randbelow(1 << 30) + 1


def start_move(engine, spec: Remote, seqs: list, src: str, dst: str, link) -> tuple[Outbound, int]:
    """Send the moved state of `seqs` to the helper (engine thread) -> (the move, bytes sent). Raises
    MigrationError when the helper refuses it."""
    runner, bs = engine.runner, engine.layout.block_size
    since = np.asarray([s.num_tokens - 1 for s in seqs], np.int32)  # KV in the cache before this step
    if spec.kind == "heads":
        W = max(-(-int(n) // bs) for n in since)
        table = runner._table([s.block_ids[:W] for s in seqs], len(seqs), W, W)
        arrays = _held_heads(runner.pool, jnp.asarray(table), layout=engine.layout, split=spec.split)
    else:
        final = [min(len(s.prompt) + s.params.max_tokens, engine.max_model_len) for s in seqs]
        W = max(-(-n // bs) for n in final)
        table = runner._table([s.block_ids for s in seqs], len(seqs), W, W)
        arrays = _held_layers(runner.pool, jnp.asarray(table), jnp.asarray([s.slot for s in seqs], jnp.int32),
                              jnp.asarray(since), layout=engine.layout, span=spec.span)
    arrays = {k: np.asarray(v) for k, v in jax.device_get(arrays).items()}
    arrays["since"] = since
    mid = new_id()
    header = {"op": "accept", "mid": mid, "src": src, "kind": spec.kind, "model": fingerprint(engine),
              "span": list(spec.span) if spec.span else None}
    payload = pack(header, arrays)
    try:
        unpack(link(payload))
    except Exception as e:  # noqa: BLE001 - the helper refused or is unreachable: nothing moved
        raise MigrationError(f"{dst} did not take the move: {e}", "dst") from None
    out = Outbound(mid, spec, src, dst, link, seqs, since)
    install(mid, out)
    return out, len(payload)


# ---- the helper's side
@dataclass
class _Guest:
    kind: str  # heads / layers: the operation its calls ask for
    arrays: dict  # name -> device array
    since: jax.Array  # [Bg] each request's length at the move
    span: tuple[int, int] | None
    used: float


class Guests:
    """The moves this instance helps with: their state and the programs over it. Called from one thread (the
    worker's migration thread); the model's weights are the engine's, read only."""

    def __init__(self, engine):
        self.engine = engine
        # the moved state this instance holds at most (outside its block pool): as much as its own cache
        self.capacity = engine.layout.bytes(engine.dtype)
        self.guests: dict[tuple[str, int], _Guest] = {}
        self._lock = threading.Lock()
        self._programs: dict = {}

    def handle(self, payload: bytes) -> bytes:
        header, arrays = unpack(payload)
        op, key = header.get("op"), (str(header.get("src")), int(header.get("mid", 0)))
        if op == "accept":
            return pack(self._accept(key, header, arrays))
        with self._lock:
            g = self.guests.get(key)
            if op == "release":
                self.guests.pop(key, None)
                return pack({})
        if g is None:
            raise KeyError(f"no move {key[1]} from {key[0]} here")
        if op != g.kind:
            raise ValueError(f"move {key[1]} from {key[0]} is a {g.kind} move, not {op}")
        g.used = time.monotonic()
        if op == "heads":
            return pack({}, self._heads(g, int(header["group"]), int(header["layer"]), arrays))
        if op == "layers":
            return pack({}, self._layers(g, arrays))
        raise ValueError(f"unknown operation {op!r}")

    def _accept(self, key, header: dict, arrays: dict) -> dict:
        mine = fingerprint(self.engine)
        if header.get("model") != mine:
            raise ValueError(f"the move is for {header.get('model')}, this instance serves {mine}")
        since = arrays.pop("since")
        span = tuple(header["span"]) if header.get("span") else None
        now = time.monotonic()
        size = sum(a.nbytes for a in arrays.values())
        with self._lock:
            for k in [k for k, g in self.guests.items() if now - g.used > IDLE_S]:
                log.warning("forgetting move %s from %s: not called for %.0fs", k[1], k[0], IDLE_S)
                del self.guests[k]
            held = sum(a.nbytes for g in self.guests.values() for a in g.arrays.values())
            if held + size > self.capacity:
                raise ValueError(f"no room: the move is {size} bytes, this instance holds {held} of at most "
                                 f"{self.capacity} bytes of moved state")
            self.guests[key] = _Guest(header["kind"], {k: jnp.asarray(v) for k, v in arrays.items()},
                                      jnp.asarray(since), span, now)
        return {"rows": int(len(since))}

    def _heads(self, g: _Guest, group: int, layer: int, arrays: dict) -> dict:
        gl = self.engine.layout.groups[group]
        spec = self.engine.model_config.layers[gl.group.layers[layer]].mixer
        latent = spec.kv_lora_rank if isinstance(spec, MLASpec) else None
        key = ("heads", spec.scale, latent)
        if key not in self._programs:
            def part(q, c, since, gidx, scale=spec.scale, latent=latent):
                k, v = (c["kv"], c["kv"][..., :latent]) if latent else (c["k"], c["v"])  # MLA: values in the latent
                return held_partial(q, k, v, since, gidx, scale=scale)
            self._programs[key] = jax.jit(part)
        c = {n: g.arrays[f"{group}.{layer}.{n}"] for n in (("kv",) if latent else ("k", "v"))}
        o, m, l = self._programs[key](jnp.asarray(arrays["q"]), c, g.since, jnp.asarray(arrays["gidx"]))
        return {"o": np.asarray(o), "m": np.asarray(m), "l": np.asarray(l)}

    def _layers(self, g: _Guest, arrays: dict) -> dict:
        lo, hi = g.span
        x, start, gidx = arrays["x"], arrays["start"], arrays["gidx"]
        Bg = len(g.since)
        rows = gidx >= 0
        xg = np.zeros((Bg,) + x.shape[1:], x.dtype)
        xg[gidx[rows]] = x[rows]
        sg = np.zeros(Bg, np.int32)
        sg[gidx[rows]] = start[rows]
        lg = np.zeros(Bg, np.int32)
        lg[gidx[rows]] = 1
        key = ("layers", lo, hi)
        if key not in self._programs:
            self._programs[key] = jax.jit(functools.partial(_guest_layers, self.engine, lo, hi),
                                          donate_argnums=(4,))  # the caches are updated in place
        xo, new = self._programs[key](self.engine.runner.params, jnp.asarray(xg), jnp.asarray(sg), jnp.asarray(lg),
                                      dict(g.arrays))
        g.arrays.update(new)
        out = np.zeros_like(x)
        out[rows] = np.asarray(xo)[gidx[rows]]
        return {"x": out}

    def count(self) -> int:
        with self._lock:
            return len(self.guests)


def _guest_layers(engine, lo: int, hi: int, params, x, start, lengths, arrays: dict):
    """Layers lo..hi-1 over the guest rows' dense caches: x [Bg, 1, H] -> (x, updated caches by name)."""
    m, stacks = engine.runner.stack.merge(engine.graphdef, params)
    cache: list = [None] * engine.layout.num_layers
    for name, a in arrays.items():
        i, k = name.split(".", 1)
        cache[int(i)] = {**(cache[int(i)] or {}), k: a}
    batch = Batch(jnp.zeros((x.shape[0], 1), jnp.int32), start, lengths)
    x, cache = m.run_layers(x, batch, cache, lo, hi, stacks)
    return x, {f"{i}.{k}": v for i in range(lo, hi) for k, v in cache[i].items()}
