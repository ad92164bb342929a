"""The decoder shared by every family: embeddings, a stack of (mixer, MLP/MoE) layers, final norm, LM head.

What differs between families lives in the per-layer specs (config.py) and in the checkpoint names
(`CHECKPOINT_ALIASES`, plus the prefixes each module records). `CausalLM.__call__` is one forward step over
a `Batch` and a per-layer cache; prefill, chunked prefill and decode are all calls of it.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.pallas_kernels.check import Case
from jaxserve.pallas_kernels.select import resolve, select

from .attention import GQAAttention, MLAAttention
from .batch import Batch
from .config import GDNSpec, GQASpec, KDASpec, MLASpec, MLPSpec, ModelConfig, MoESpec
from .linear_attention import GatedDeltaNet, KimiDeltaAttention
from .modules import MLP, Linear, MoE, RMSNorm
from .paged import PagedKV, scatter
from .params import ParamInfo, declare
from .stack import LayerStack, Switched, take_layer

# Alternative spellings of checkpoint tensor names, per family: (regex, replacement) tried in order when
# the canonical name is absent. Kimi Linear's hub checkpoints keep `block_sparse_moe` and w1/w2/w3.
CHECKPOINT_ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    "kimi_linear": (
        (r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
        (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
        (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
        (r"\.mlp\.", ".block_sparse_moe."),
    ),
}


def packs_prefill(cfg: ModelConfig) -> bool:
    """Whether every layer's mixer takes a packed batch (`packed_input`: GQA attention), so that several
    prompts packed into one prefill program cost their real tokens, not the [B, T] padded rows."""
    return all(isinstance(spec.mixer, GQASpec) and GQAAttention.packed_input for spec in cfg.layers)


def _mixer(prefix, hidden, spec, cfg: ModelConfig, dtype, kernels: str):
    if isinstance(spec, GQASpec):
        return GQAAttention(prefix, hidden, spec, cfg.rms_norm_eps, dtype, cfg.norm_plus_one, kernels)
    if isinstance(spec, MLASpec):
        return MLAAttention(prefix, hidden, spec, cfg.rms_norm_eps, dtype, kernels)
    if isinstance(spec, GDNSpec):
        return GatedDeltaNet(prefix, hidden, spec, cfg.rms_norm_eps, dtype, kernels)
    if isinstance(spec, KDASpec):
        return KimiDeltaAttention(prefix, hidden, spec, cfg.rms_norm_eps, dtype, kernels)
    raise TypeError(type(spec))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, i: int, dtype, kernels: str):
        spec = cfg.layers[i]
        p = f"model.layers.{i}"
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(f"{p}.input_layernorm", H, cfg.rms_norm_eps, dtype, cfg.norm_plus_one)
        self.post_attention_layernorm = RMSNorm(f"{p}.post_attention_layernorm", H, cfg.rms_norm_eps, dtype,
                                                cfg.norm_plus_one)
        self.mixer = _mixer(f"{p}.{spec.mixer_name}", H, spec.mixer, cfg, dtype, kernels)
        if isinstance(spec.mlp, MLPSpec):
            self.mlp = MLP(f"{p}.mlp", H, spec.mlp, dtype, kernels=kernels)
        else:
            gpt = cfg.model_type == "gpt_oss"
            self.mlp = MoE(f"{p}.mlp", H, spec.mlp, dtype, router_name="router" if gpt else "gate",
                           shared_name="shared_expert" if cfg.model_type == "qwen3_next" else "shared_experts",
                           kernels=kernels)

    def __call__(self, x, batch: Batch, cache: dict):
        """x [B, T, H], or [1, N, H] packed (models/batch.py): a mixer that takes packed input (GQA attention:
        its projections) gets it as it is, the others their [B, T] rows."""
        h = self.input_layernorm(x)
        if getattr(self.mixer, "packed_input", False):
            h, cache = self.mixer(h, batch, cache)
        else:
            h, cache = self.mixer(batch.unpack(h), batch, cache)
            h = batch.pack(h)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, kernels: str = "reference"):
        """kernels: "reference", "pallas", "interpret" or "auto" (pallas_kernels/select.py)."""
        self.cfg = cfg
        self.kernels = kernels = resolve(kernels)
        V, H = cfg.vocab_size, cfg.hidden_size
        declare(self, "embed_tokens", (V, H), dtype, ParamInfo((("model.embed_tokens.weight",),)))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, kernels) for i in range(cfg.num_layers)])
        self.norm = RMSNorm("model.norm", H, cfg.rms_norm_eps, dtype, cfg.norm_plus_one)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear("lm_head", H, V, dtype, tp="col", kernels=kernels)

    def __call__(self, batch: Batch, cache: list[dict], logits_idx, stacks=None):
        """batch: B sequences of T new tokens; cache: per-layer dicts (or PagedKV views of the engine's pool, in
        decode); logits_idx [B, P] token indices in [0, T); stacks: layer runs to scan (run_layers)
        -> (logits [B, P, V] float32, new cache)"""
        x, new_cache = self.run_layers(self.embed(batch), batch, cache, 0, len(self.layers), stacks)
        return self.head(batch.unpack(x), logits_idx), new_cache

    def embed(self, batch: Batch):
        """-> hidden states [B, T, H] of the batch's tokens ([1, N, H] packed)."""
        return self.embed_tokens[...][batch.pack(batch.tokens)]

    def run_layers(self, x, batch: Batch, cache: list, lo: int, hi: int, stacks=None, shift=0):
        """Layers lo..hi-1 over hidden states x [B, T, H]; cache: per-layer entries (only lo..hi-1 are read)
        -> (x, cache with lo..hi-1 replaced). Prefill runs the stack in layer groups this way (layer-wise
        KV streaming: each group's KV can leave while the next group computes). stacks: {(lo, hi): (layer
        graphdef, stacked state)} of runs of identical layers (models/stack.py), each run as one lax.scan.
        shift: run the weights of layers lo + shift..hi - 1 + shift instead (traced: one program for every
        group of a run; lo..hi-1 and the shifted layers must lie in one run, and the cache entries, which
        the scan carries as they are, must be the shifted layers')."""
        new_cache = list(cache)
        shared = {}  # paged groups: the pool array as the last layer of the group left it
        if isinstance(stacks, Switched):  # switch mode: the span as one scan over the layers' classes
            if not (isinstance(shift, int) and shift == 0):
                raise ValueError("layers stacked by class run unshifted")
            if lo >= hi:  # an empty span (a migration's layers at either end)
                return x, new_cache
            P = stacks.period
            if P and lo % P == 0 and hi % P == 0:  # whole periods: a scan over them, no conditional
                out = _period_layers(x, batch, cache, new_cache, shared, stacks, lo, hi)
                if out is not None:
                    return out, new_cache
            return _switch_layers(x, batch, cache, new_cache, shared, stacks, lo, hi), new_cache
        i = lo
        while i < hi:
            run = next((r for r in stacks or () if r[0] <= i < r[1]), None)
            if run is not None:
                end = min(hi, run[1])
                x = _scan_layers(x, batch, cache, new_cache, shared, *stacks[run], i - run[0] + shift, i, end)
                i = end
                continue
            if not (isinstance(shift, int) and shift == 0):
                raise ValueError(f"layer {i} is not in a stacked run: its layer group cannot be shifted")
            c = cache[i]
            if isinstance(c, PagedKV) and c.group in shared:
                c = replace(c, pool=shared[c.group])
            x, c = self.layers[i](x, batch, c)
            if isinstance(c, PagedKV):
                shared[c.group] = c.pool
            new_cache[i] = c
            i += 1
        return x, new_cache

    def head(self, x, logits_idx):
        """x [B, T, H] (unpacked), logits_idx [B, P] -> logits [B, P, V] float32."""
        x = self.norm(x)
        x = jnp.take_along_axis(x, logits_idx[..., None], axis=1)
        if self.cfg.tie_word_embeddings:
            logits = select("matmul", self.kernels)(x, self.embed_tokens[...], transposed=True)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)


def _scan_layers(x, batch: Batch, cache: list, new_cache: list, shared: dict, graphdef, stacked, k0, lo: int,
                 hi: int):
    """Model layers lo..hi-1, weights k0.. (traced or not) of `stacked`, as one lax.scan; fills new_cache[lo:hi]
    -> x. Dense caches are stacked into the scan and out again; paged ones (one group, consecutive layers in
    it) carry the group's pool array through it, the layer index traced."""
    ks = jnp.arange(hi - lo) + k0
    layer = lambda k: take_layer(graphdef, stacked, k)  # noqa: E731

    first = cache[lo]
    if isinstance(first, PagedKV):
        js = [cache[i].layer for i in range(lo, hi)]
        static = all(isinstance(j, int) for j in js)
        if any(cache[i].group != first.group for i in range(lo, hi)) or (
                static and js != list(range(js[0], js[0] + hi - lo))):
            raise ValueError(f"layers {lo}..{hi - 1} are not consecutive layers of one cache group")

        def paged(carry, kj):
            x, pool = carry
            x, c = layer(kj[0])(x, batch, replace(first, pool=pool, layer=kj[1]))
            return (x, c.pool), None
        pool = shared.get(first.group, first.pool)
        (x, pool), _ = jax.lax.scan(paged, (x, pool), (ks, jnp.stack([jnp.asarray(j, jnp.int32) for j in js])))
        shared[first.group] = pool
        for i, j in zip(range(lo, hi), js):
            new_cache[i] = replace(first, pool=pool, layer=j)
        return x

    def dense(x, kc):
        return layer(kc[0])(x, batch, kc[1])
    x, out = jax.lax.scan(dense, x, (ks, jax.tree.map(lambda *a: jnp.stack(a), *cache[lo:hi])))
    for n, i in enumerate(range(lo, hi)):
        new_cache[i] = jax.tree.map(lambda a, n=n: a[n], out)
    return x


def _entry_key(e):
    """What a layer's cache entry is to a scan: ("paged", group) or ("dense", structure, shapes)."""
    if isinstance(e, PagedKV):
        return "paged", e.group
    return "dense", jax.tree.structure(e), tuple((a.shape, a.dtype) for a in jax.tree.leaves(e))


def _period_layers(x, batch: Batch, cache: list, new_cache: list, shared: dict, sw: Switched, lo: int, hi: int):
    """Layers lo..hi-1, whole periods of a class-stacked model (`Switched.period`), as one lax.scan over the
    periods whose body runs the period's runs of one class in turn (a run of two or more layers as a scan of
    its own): each class compiles once, as in switch mode, and no conditional runs (switch mode's cost a
    decode step, bench.offline's gpt-oss-mini: ~6 of ~33 ms). Pools are carried, the layer indices and dense
    entries scanned; fills new_cache[lo:hi] -> x, or None where a class's layers do not share one kind of
    cache entry (switch mode then runs the span)."""
    P = sw.period
    n = (hi - lo) // P
    runs: list[list[int]] = []  # per run of one class in the period: [class, first position, end]
    for k in range(P):
        c = sw.where(lo + k)[0]
        if runs and runs[-1][0] == c:
            runs[-1][2] = k + 1
        else:
            runs.append([c, k, k + 1])
    layers = [[[lo + p * P + k for k in range(k0, k1)] for p in range(n)] for _, k0, k1 in runs]  # [run][p][k]
    for rows in layers:
        if len({_entry_key(cache[i]) for row in rows for i in row}) != 1:
            return None
    pools = {}
    for rows in layers:
        e = cache[rows[0][0]]
        if isinstance(e, PagedKV):
            pools.setdefault(e.group, shared.get(e.group, e.pool))
    xs = []  # per run: (stack indices [n, r], cache layers [n, r], dense entries [n, r, ...] or None)
    for rows in layers:
        first = cache[rows[0][0]]
        ms = jnp.asarray([[sw.where(i)[1] for i in row] for row in rows], jnp.int32)
        if isinstance(first, PagedKV):
            js = jnp.stack([jnp.stack([jnp.asarray(cache[i].layer, jnp.int32) for i in row]) for row in rows])
            xs.append((ms, js, None))
        else:
            xs.append((ms, jnp.zeros_like(ms), jax.tree.map(
                lambda *a: jnp.stack(a).reshape((n, len(rows[0])) + a[0].shape), *[cache[i] for r in rows for i in r])))

    def run_of(c, first):
        graphdef, stacked = sw.layers[c]

        def one(carry, mjd):
            (x, pools), (m, j, d) = carry, mjd
            layer = take_layer(graphdef, stacked, m)
            if isinstance(first, PagedKV):
                x, out = layer(x, batch, replace(first, pool=pools[first.group], layer=j))
                return (x, {**pools, first.group: out.pool}), None
            x, out = layer(x, batch, d)
            return (x, pools), jax.tree.map(lambda a, o: o.astype(a.dtype), d, out)
        return one

    def body(carry, xs):
        ys = []
        for (c, _, _), rows, run_xs in zip(runs, layers, xs):
            one = run_of(c, cache[rows[0][0]])
            if len(rows[0]) == 1:
                carry, y = one(carry, jax.tree.map(lambda a: a[0], run_xs))
                y = jax.tree.map(lambda a: a[None], y)
            else:
                carry, y = jax.lax.scan(one, carry, run_xs)
            ys.append(y)
        return carry, ys
    (x, pools), ys = jax.lax.scan(body, (x, pools), xs)
    shared.update(pools)
    for rows, y in zip(layers, ys):
        for p, row in enumerate(rows):
            for k, i in enumerate(row):
                e = cache[i]
                new_cache[i] = replace(e, pool=pools[e.group]) if isinstance(e, PagedKV) else jax.tree.map(
                    lambda a, p=p, k=k: a[p, k], y)
    return x


def _switch_layers(x, batch: Batch, cache: list, new_cache: list, shared: dict, sw: Switched, lo: int,
                   hi: int):
    """Layers lo..hi-1 as one lax.scan whose body switches on each layer's class (models/stack.py, switch
    mode), so each class's layer compiles once; fills new_cache[lo:hi] -> x. A paged group's pool is carried
    through the scan with the layer index traced, as `_scan_layers` does for a run. Dense cache entries are
    scanned, one stack per entry shape: a layer reads and writes its own row of its shape's stack, and passes
    the other shapes' rows (zeros where no layer of that shape is) through. Carrying the stacks instead, each
    layer updating its row, made the bundled Kimi Linear's decode steps a quarter slower."""
    where = [sw.where(i) for i in range(lo, hi)]
    present = sorted({c for c, _ in where})
    keys: list = []  # per view: ("paged", group) or ("dense", entry shape)
    key = {}  # layer -> its view's index
    for i in range(lo, hi):
        k = _entry_key(cache[i])
        if k not in keys:
            keys.append(k)
        key[i] = keys.index(k)
    view_of = {}  # class -> its view
    for i, (c, _) in zip(range(lo, hi), where):
        if view_of.setdefault(c, key[i]) != key[i]:
            raise ValueError(f"layers of class {c} lie in two cache groups")
    first = {key[i]: cache[i] for i in reversed(range(lo, hi))}
    views = [replace(first[v], pool=shared.get(first[v].group, first[v].pool)) if keys[v][0] == "paged" else
             jax.tree.map(lambda *a: jnp.stack(a), *[cache[i] if key[i] == v else
                                                     jax.tree.map(jnp.zeros_like, first[v]) for i in range(lo, hi)])
             for v in range(len(keys))]
    idx = jnp.asarray([[present.index(c), m, cache[i].layer if isinstance(cache[i], PagedKV) else 0]
                       for i, (c, m) in zip(range(lo, hi), where)], jnp.int32)  # [hi - lo, 3]
    x, views = _switch_scan(x, batch, sw, present, [view_of[c] for c in present], views, idx)
    for n, i in enumerate(range(lo, hi)):
        v = views[key[i]]
        if isinstance(v, PagedKV):
            shared[v.group] = v.pool
            new_cache[i] = replace(cache[i], pool=v.pool)
        else:
            new_cache[i] = jax.tree.map(lambda a, n=n: a[n], v)
    return x


def switch_span(x, batch: Batch, sw: Switched, views: list, place, at, n: int):
    """Layers at..at+n-1 of a class-stacked model, `at` traced: one program runs every span of n layers (a
    layer-wise prefill's groups, whatever classes they hold). views: per cache group of the pool, a `PagedKV`
    of its array (full groups) or its dense entries [n, ...] at the span's positions (cache/layout.py
    `gather_span`; a position whose layer is of another group reads any values and its row is not written
    back); place [L, 2] int32 (numpy): each layer's cache group and its index there. -> (x, views after the
    span, as `scatter_span` takes them)."""
    classes = sw.classes
    L = sum(len(c) for c in classes)
    table = jnp.asarray([[*sw.where(i), place[i][1]] for i in range(L)], jnp.int32)  # [L, 3]
    group_of = [int(place[c[0]][0]) for c in classes]
    for c, g in zip(classes, group_of):
        if any(int(place[i][0]) != g for i in c):
            raise ValueError(f"layers {list(c)} of one class lie in two cache groups")
    idx = jax.lax.dynamic_slice_in_dim(table, at, n)  # [n, 3]
    return _switch_scan(x, batch, sw, list(range(len(classes))), group_of, views, idx)


def _switch_scan(x, batch: Batch, sw: Switched, present: list[int], view_of: list[int], views: list, idx):
    """The scan of switch mode: position p runs a layer of class present[idx[p, 0]], weights idx[p, 1] of its
    stack, over its class's view (view_of, per present class): a PagedKV (pool carried, layer idx[p, 2]) or a
    dense stack [n, ...] (row p read and written; the other views' rows pass through). -> (x, views after)

    A pool that layers of two classes or more write is written outside the switch: XLA copies a buffer that
    branches of a conditional update in place (the whole pool, each layer of each step). So is every pool where
    the scan carries two or more (gpt-oss: full attention's blocks and the sliding layers' rings): XLA copies
    all but one of the buffers a conditional's branches update in place or pass through. A first switch runs
    the layer's class up to its write, captured (`PagedKV.deferred`; XLA drops the rest of that branch), the
    entries are written, and the layer then runs over the written pool, reading it only."""
    pools = {v: views[v].pool for v in set(view_of) if isinstance(views[v], PagedKV)}
    dense = {v: views[v] for v in set(view_of) if v not in pools}
    shared = sorted(v for v in pools if view_of.count(v) > 1 or len(pools) > 1)

    def layer_of(c, m):
        graphdef, stacked = sw.layers[c]
        return take_layer(graphdef, stacked, m)

    def branch(c, v):
        def run(x, pools, dense, m, j):
            layer = layer_of(c, m)
            if v in pools:
                x, out = layer(x, batch, replace(views[v], pool=pools[v], layer=j,
                                                 deferred="written" if v in shared else None))
                return x, {u: out.pool if u == v else p for u, p in pools.items() if u not in shared}, dense
            x, out = layer(x, batch, dense[v])
            return x, {u: p for u, p in pools.items() if u not in shared}, {
                **dense, v: jax.tree.map(lambda a, o: o.astype(a.dtype), dense[v], out)}
        return run

    def capture(c, v):  # -> the layer's write: (blocks, offsets, entries)
        def run(x, pools, dense, m, j):
            return layer_of(c, m)(x, batch, replace(views[v], pool=pools[v], layer=j, deferred="capture"))[1].pending
        return run

    branches = [branch(c, v) for c, v in zip(present, view_of)]

    def body(carry, xs):
        (x, pools), (ix, dense) = carry, xs
        args = (x, pools, dense, ix[1], ix[2])
        if shared:
            shapes = {v: jax.eval_shape(capture(c, v), *args) for c, v in zip(present, view_of) if v in shared}

            def captures(c, v):  # every shared pool's write: this class's own, nothing to the others
                def run(*a):
                    mine = capture(c, v)(*a) if v in shared else None
                    return {u: mine if u == v else _no_write(shapes[u], pools[u].shape[0]) for u in shared}
                return run
            pending = jax.lax.switch(ix[0], [captures(c, v) for c, v in zip(present, view_of)], *args)
            pools = {**pools, **{v: scatter(pools[v], ix[2], *pending[v]) for v in shared}}
            args = (x, pools, dense, ix[1], ix[2])
        x, own, dense = branches[0](*args) if len(branches) == 1 else jax.lax.switch(ix[0], branches, *args)
        return (x, {**pools, **own}), dense
    (x, pools), ys = jax.lax.scan(body, (x, pools), (idx, dense))
    return x, [replace(views[v], pool=pools[v]) if v in pools else ys.get(v, views[v]) for v in range(len(views))]


def _no_write(shapes, num_blocks: int):
    """A captured write (`PagedKV.pending`) of the given shapes that writes nothing: every block out of range."""
    blk, off, vals = shapes
    return (jnp.full(blk.shape, num_blocks, blk.dtype), jnp.zeros(off.shape, off.dtype),
            jnp.zeros(vals.shape, vals.dtype))


def abstract_model(cfg: ModelConfig, dtype, kernels: str = "reference") -> CausalLM:
    """The model with shape-only parameters (nothing allocated)."""
    return nnx.eval_shape(lambda: CausalLM(cfg, dtype, kernels))


def model_graphdef(cfg: ModelConfig, dtype, kernels: str):
    """The graph definition of the model with the given kernel mode: it pairs with any loaded state of `cfg`
    (the mode is static structure, the state is the same)."""
    return nnx.split(abstract_model(cfg, dtype, kernels))[0]


def kernel_cases(cfg: ModelConfig, dtype, block_size: int) -> list[Case]:
    """The kernels the model calls, each with the dims of its layers, for the self-test (pallas_kernels/check.py):
    attention over dense caches and over the paged pool (sliding layers' also over their rings, blocks of `window`
    tokens), MLA over the latent pool, the delta rule chunked (prefill) and recurrent (decode); the products of GQA
    layers' projections, dense and shared MLPs, the experts and the LM head."""
    hidden = cfg.hidden_size  # the LM head's product on part of the vocabulary: its lowering is the same
    cases = {Case.of("matmul", K=hidden, N=min(cfg.vocab_size, 4096), transposed=cfg.tie_word_embeddings, dtype=dtype)}
    for spec in (layer.mlp for layer in cfg.layers):
        if isinstance(spec, MoESpec):  # the experts' grouped products (gpt-oss: gate and up as one), a shared MLP
            E, I, S = min(spec.num_experts, 4), spec.intermediate_size, spec.shared_intermediate_size  # 4 suffice
            cases |= {Case.of("grouped_matmul", E=E, K=hidden, N=2 * I if spec.expert_style == "gpt_oss" else I,
                              dtype=dtype), Case.of("grouped_matmul", E=E, K=I, N=hidden, dtype=dtype)}
            if S:  # not fused: gate, up and down
                cases |= {Case.of("matmul", K=hidden, N=S, transposed=False, dtype=dtype),
                          Case.of("matmul", K=S, N=hidden, transposed=False, dtype=dtype)}
        elif isinstance(spec, MLPSpec):  # gate and up fused (models/fuse.py), and down
            cases |= {Case.of("matmul", K=hidden, N=2 * spec.intermediate_size, transposed=False, dtype=dtype),
                      Case.of("matmul", K=spec.intermediate_size, N=hidden, transposed=False, dtype=dtype)}
    for spec in (layer.mixer for layer in cfg.layers):
        if isinstance(spec, GQASpec):
            dims = dict(Hq=spec.num_heads, Hkv=spec.num_kv_heads, Dk=spec.head_dim, Dv=spec.v_head_dim, dtype=dtype,
                        window=spec.window, sinks=spec.sinks, scale=spec.scale)
            qkv = spec.num_heads * spec.head_dim * (2 if spec.output_gate else 1) + spec.num_kv_heads * (
                spec.head_dim + spec.v_head_dim)  # Q, K and V fused (models/fuse.py)
            if spec.window:  # decode over the rings in place: a ring is one block of `window` tokens (cache/layout.py)
                cases.add(Case.of("paged_attention", block_size=spec.window, **dims))
            cases |= {Case.of("batched_attention", **dims), Case.of("paged_attention", block_size=block_size, **dims),
                      Case.of("paged_prefill_attention", block_size=block_size, **dims),
                      Case.of("matmul", K=hidden, N=qkv, transposed=False, dtype=dtype)}
        elif isinstance(spec, MLASpec):
            L, R = spec.kv_lora_rank, spec.qk_rope_head_dim
            cases |= {Case.of("batched_attention", Hq=spec.num_heads, Hkv=1, Dk=L + R, Dv=L, dtype=dtype,
                              scale=spec.scale),
                      Case.of("paged_mla_attention", H=spec.num_heads, L=L, R=R, dtype=dtype, block_size=block_size,
                              scale=spec.scale),
                      Case.of("paged_mla_prefill_attention", H=spec.num_heads, L=L, R=R, dtype=dtype,
                              block_size=block_size, scale=spec.scale)}
        else:
            H, Dk, Dv = ((spec.num_v_heads, spec.head_k_dim, spec.head_v_dim) if isinstance(spec, GDNSpec)
                         else (spec.num_heads, spec.head_dim, spec.head_dim))
            dims = dict(H=H, Dk=Dk, Dv=Dv, dtype=dtype, per_channel=isinstance(spec, KDASpec))
            cases |= {Case.of("chunk_gated_delta_rule", **dims), Case.of("recurrent_gated_delta_rule", **dims)}
    return sorted(cases, key=str)


def make_forward(graphdef, stack: LayerStack | None = None):
    """Pure function (params, batch, cache, logits_idx) -> (logits, cache) over the split model: params the
    model's state, or with `stack` the (rest, stacks) it made (models/stack.py), its runs scanned."""
    def forward(params, batch: Batch, cache, logits_idx):
        if stack is None:
            return nnx.merge(graphdef, params)(batch, cache, logits_idx)
        model, stacks = stack.merge(graphdef, params)
        return model(batch, cache, logits_idx, stacks)
    return forward


def jit_forward(graphdef, stack: LayerStack | None = None):
    """The forward step, jitted with the cache donated (it is updated in place)."""
    return jax.jit(make_forward(graphdef, stack), donate_argnums=(2,))
