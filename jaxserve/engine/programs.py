"""The engine's step programs: pure functions over pytrees, jitted once per runner (ModelRunner, runner.py, keeps
the state they read and write and dispatches them).

  prefill  layers lo..hi-1 of a prefill of B chunks of T tokens -> (pool, hidden states): the whole model in one
           program, or one layer group of a layer-wise prefill (its layers shifted by a traced offset, so one
           program serves the groups of a run)
  decode   the model over one token per row -> (pool, hidden states [B, 1, H]), with or without a migration
           helper running part of the step (engine/migration.py)
  step     a whole decode step: the model, the LM head and sampling in one program
  first    a prefill's first tokens, keyed by the rows only (every prefill shape shares it)
  sample   a mixed step's decode tokens
  forward, pick  a decode step in two programs (split_step.py)
  insert   slots that start decoding: their penalty state
Each takes the weights as one flat list (flattened once by the runner: `merge` rebuilds the model inside the
trace) and the pool, where it writes it, donated. A class-stacked model's model programs compile with their own
XLA options (models/stack.py). The programs that sample take the sampler's `mode` (sampler.py `sample`):
static, one program per mode, where the runner passes one (on an accelerator).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ..cache.layout import PoolLayout, gather, gather_span, layer_places, scatter, scatter_span
from ..models.model import switch_span
from ..models.paged import PagedKV
from ..models.stack import LayerStack, switch_compiler_options
from .migration import remote_hidden
from .sampler import sample
from .step_io import COLS, SLOT, pack_sampled, sampled_tokens, sampling_tensors, unpack_decode, with_device_tokens


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The jitted programs of one runner (see the module docstring)."""
    prefill: Callable
    decode: Callable
    step: Callable
    first: Callable
    sample: Callable
    insert: Callable
    forward: Callable
    pick: Callable


def step_programs(layout: PoolLayout, stack: LayerStack, merge: Callable, num_slots: int, *, paged_prefill: bool,
                  inplace_prefill: bool, inplace_first: bool, chunk: int) -> StepPrograms:
    """The programs over `layout`'s pool: merge(leaves) -> (the model, its stacked runs); num_slots the decode
    slots (the penalty state has one more row, the padding rows'); paged_prefill, inplace_prefill, inplace_first
    as the runner's (runner.py); chunk: a paged prefill's row width T (its tokens come packed: Batch.spread)."""
    places = layer_places(layout)

    def prefill_fn(params, pool, x, shift, batch, table, src, dst, snap, *, lo, hi, last):
        # layers lo..hi-1 of a prefill (embedding first; last: the hidden state of each row's last token
        # [B, 1, H] out, for `first_fn`): the whole model in one program, or one layer group of a layer-wise
        # prefill (its layers shifted by `shift`: one program for the groups of a run, `_stage`)
        m, stacks = merge(params)
        batch = batch.spread(chunk)
        inplace = inplace_prefill and (inplace_first or not batch.fresh)  # first chunks: their own keys, or in place
        if stack.classes and shift is not None:
            # layers shift..shift+hi-1 of a class-stacked model (`_stage`): one program for every group of
            # hi layers; the embedding where shift is 0, out both the hidden states and each row's last
            views = gather_span(layout, pool, table, src, batch.start, shift, hi, dense=not paged_prefill,
                                inplace=inplace)
            x = jnp.where(shift == 0, m.embed(batch), x)
            x, views = switch_span(x, batch, stacks, views, places, shift, hi)
            return scatter_span(layout, pool, views, dst, snap, shift, hi), (x, batch.last_tokens(x))
        # shifted from layer 0 (every layer in one run, `_stage`): any group of hi layers, as the class-stacked
        # program above (the embedding where shift is 0, out both the hidden states and each row's last)
        anywhere = shift is not None and lo == 0
        shift = 0 if shift is None else shift
        cache = gather(layout, pool, table, src, batch.start, span=(lo, hi), dense=not paged_prefill, shift=shift,
                       inplace=inplace)
        if lo == 0:
            x = jnp.where(shift == 0, m.embed(batch), x) if anywhere else m.embed(batch)
        x, cache = m.run_layers(x, batch, cache, lo, hi, stacks, shift)
        pool = scatter(layout, pool, cache, dst, snap, span=(lo, hi), shift=shift)
        if anywhere:
            return pool, (x, batch.last_tokens(x))
        if last:
            x = batch.last_tokens(x)
        return pool, x

    def decode_fn(params, pool, x, mig, *, total_blocks, remote):
        # the model over one token per row (x [B, COLS + W]: step_io.pack_rows) -> (pool, hidden states
        # [B, 1, H]) for `sample_fn`. remote: part of the step runs on a helper instance (engine/migration.py),
        # mig its per-row arrays
        batch, table, rows, snap = unpack_decode(x)
        cache = gather(layout, pool, table, rows, batch.start, total_blocks=total_blocks)
        m, stacks = merge(params)
        L = layout.num_layers
        if remote is None:
            x, cache = m.run_layers(m.embed(batch), batch, cache, 0, L, stacks)
        elif remote.kind == "heads":
            cache = [dataclasses.replace(c, split=remote.split, since=mig["since"], mid=mig["mid"],
                                         gidx=mig["gidx"]) if isinstance(c, PagedKV) and
                     layout.groups[c.group].kind == "full" else c for c in cache]  # sliding rings stay whole
            x, cache = m.run_layers(m.embed(batch), batch, cache, 0, L, stacks)
        else:  # layers lo..hi-1 run on the helper, the hidden states crossing there and back
            lo, hi = remote.span
            x, cache = m.run_layers(m.embed(batch), batch, cache, 0, lo, stacks)
            cache = _latest_pools(cache, range(lo))
            x = remote_hidden(x, mig, batch.start)
            x, cache = m.run_layers(x, batch, cache, hi, L, stacks)
            cache = _latest_pools(cache, [*range(lo), *range(hi, L)])
        return scatter(layout, pool, cache, rows, snap, after=x), x

    # a prefill's LM head and sampling are a program of its own, keyed by the rows only: every prefill shape
    # shares it (compiled once, not once per shape); a decode step runs the model and sampling as one program
    def logits_of(params, h):  # h [B, 1, H] -> [B, V] float32
        return merge(params)[0].head(h, jnp.zeros((h.shape[0], 1), jnp.int32))[:, 0]

    def first_fn(params, h, x, pmask, allowed, *, mode=None):
        # a prefill's first tokens -> step_io.pack_sampled: x [B, COLS] the rows' sampling (pack_sampling),
        # pmask [B, V] the prompts' tokens, no outputs yet (h: its first B rows); allowed [B, W] the rows'
        # next-token bitmasks (structured outputs); mode: the sampler's (sampler.py `sample`)
        B = x.shape[0]
        return pack_sampled(*sample(logits_of(params, h[:B]), sampling_tensors(x), pmask,
                                    jnp.zeros(pmask.shape, jnp.int32), allowed, mode))

    def sample_fn(params, h, prompt_mask, out_counts, x, allowed, *, at=0, mode=None):
        # a decode step's tokens with each slot's penalty state (x [B, >= COLS]: the rows' slots and sampling;
        # h: rows at.. of it) -> (counts of the tokens drawn, step_io.pack_sampled)
        slots = x[:, SLOT]
        tok, lp, ids, tlp = sample(logits_of(params, h[at:at + x.shape[0]]), sampling_tensors(x),
                                   prompt_mask[slots], out_counts[slots], allowed, mode)
        return out_counts.at[slots, tok].add((slots < num_slots).astype(jnp.int32)), pack_sampled(tok, lp, ids,
                                                                                                 tlp)

    def pick_fn(params, h, prompt_mask, out_counts, last, x, allowed, *, mode=None):
        # a decode step's sampling -> (counts, each slot's last sampled token [slots + 1], pack_sampled)
        out_counts, out = sample_fn(params, h, prompt_mask, out_counts, x, allowed, mode=mode)
        return out_counts, last.at[x[:, SLOT]].set(sampled_tokens(out)), out

    def forward_fn(params, pool, last, x, *, total_blocks):
        # a decode step's model alone -> (pool, hidden states [B, 1, H], the rows' sampling columns [B, COLS])
        # for `pick_fn` (split_step.py); rows marked FROM_DEVICE take their input token from `last`
        pool, h = decode_fn(params, pool, with_device_tokens(x, last), None, total_blocks=total_blocks,
                            remote=None)
        return pool, h, x[:, :COLS]

    def step_fn(params, pool, prompt_mask, out_counts, last, x, allowed, *, total_blocks, mode=None):
        # a whole decode step: the model and sampling in one program -> (pool, what pick_fn returns)
        x = with_device_tokens(x, last)
        pool, h = decode_fn(params, pool, x, None, total_blocks=total_blocks, remote=None)
        return (pool, *pick_fn(params, h, prompt_mask, out_counts, last, x, allowed, mode=mode))

    def insert_fn(prompt_mask, out_counts, ids, masks):
        # slots ids[0] [k] start decoding after their first tokens ids[1] [k]; masks [k, V] their prompts'
        # tokens (None: no repetition penalty reads them). Padding rows name the spare row
        slots, tokens = ids[0], ids[1]
        pm = prompt_mask.at[slots].set(False if masks is None else masks)
        return pm, out_counts.at[slots].set(0).at[slots, tokens].set(1)

    # a class-stacked model's step programs compile with their own XLA options (models/stack.py)
    opts = switch_compiler_options() if stack.classes else None
    return StepPrograms(
        prefill=jax.jit(prefill_fn, donate_argnums=(1,), static_argnames=("lo", "hi", "last"), compiler_options=opts),
        decode=jax.jit(decode_fn, donate_argnums=(1,), static_argnames=("total_blocks", "remote"),
                       compiler_options=opts),
        step=jax.jit(step_fn, donate_argnums=(1, 3, 4), static_argnames=("total_blocks", "mode"),
                     compiler_options=opts),
        first=jax.jit(first_fn, static_argnames=("mode",)),
        sample=jax.jit(sample_fn, donate_argnums=(3,), static_argnames=("at", "mode")),
        insert=jax.jit(insert_fn, donate_argnums=(0, 1)),
        forward=jax.jit(forward_fn, donate_argnums=(1,), static_argnames=("total_blocks",), compiler_options=opts),
        pick=jax.jit(pick_fn, donate_argnums=(3, 4), static_argnames=("mode",)))


def _latest_pools(cache: list, ran) -> list:
    """Every full-attention layer's view with its group's pool as the last of the layers `ran` (in the order they
    ran) left it: a step whose layers run in separate parts, each part writing into what the one before wrote."""
    latest = {}
    for i in ran:
        if isinstance(cache[i], PagedKV):
            latest[cache[i].group] = cache[i].pool
    return [dataclasses.replace(c, pool=latest.get(c.group, c.pool)) if isinstance(c, PagedKV) else c
            for c in cache]
