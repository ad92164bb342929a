"""On-device sampling, inside the jitted prefill / decode steps.

Per row: repetition penalty (over prompt and output tokens, vLLM semantics: positive logits divided,
negative multiplied), presence and frequency penalties (over output tokens), then greedy (temperature 0)
or temperature + top-k + top-p + min-p and a draw from a key derived from (seed, output index), so a seeded
request gives the same tokens whatever it is batched with. Log-probabilities are those of the model's
distribution (before penalties and temperature): the sampled token's and the `max_logprobs` best.
Structured outputs (jaxserve/structured.py): `allowed` is each row's next-token bitmask ([B, ceil(V / 32)] int32,
bit t % 32 of word t // 32 for token t, every bit set for a free row); a token outside it is never drawn.
A batch with no sampled row skips the sort and the draws, and one where no row asks for top logprobs skips
the top-k, so greedy decoding pays for an argmax only: decided on the device (`lax.cond`: the other branch is
not run), or, with `mode` (`sampling_mode` of the rows' parameters, which the host knows), by the program
itself, compiled for it. On a GPU the engine passes the mode: XLA's GPU runtime reads a conditional's
predicate on the host, which holds the thread dispatching the program until the device reaches the
conditional, after the model; a step left in flight would no longer be dispatched ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    temperature: jax.Array  # [B] float32
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32, 0: off
    min_p: jax.Array  # [B] float32
    repetition_penalty: jax.Array  # [B] float32
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32: index of the token being sampled among the outputs
    top: jax.Array  # [B] int32: top logprobs asked for (0: none)

    @staticmethod
    def from_params(params: list, steps: list[int], size: int) -> "SamplingTensors":
        """Host-built tensors for `size` rows; rows beyond len(params) are greedy padding."""
        def col(name, dtype, default):
            v = np.full(size, default, dtype)
            for i, p in enumerate(params):
                v[i] = getattr(p, name)
            return v
        seeds = np.zeros(size, np.uint32)
        for i, p in enumerate(params):
            seeds[i] = (p.seed or 0) & 0xFFFFFFFF
        st = np.zeros(size, np.int32)
        st[:len(steps)] = steps
        top = np.zeros(size, np.int32)
        for i, p in enumerate(params):
            top[i] = p.logprobs or 0
        return SamplingTensors(col("temperature", np.float32, 0.0), col("top_p", np.float32, 1.0),
                               col("top_k", np.int32, 0), col("min_p", np.float32, 0.0),
                               col("repetition_penalty", np.float32, 1.0), col("presence_penalty", np.float32, 0.0),
                               col("frequency_penalty", np.float32, 0.0), seeds, st, top)


def apply_penalties(logits, st: SamplingTensors, prompt_mask, out_counts):
    """logits [B, V] float32; prompt_mask [B, V] bool; out_counts [B, V] int32 -> penalised logits."""
    seen = prompt_mask | (out_counts > 0)
    rep = st.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - st.frequency_penalty[:, None] * out_counts.astype(jnp.float32)
    return logits - st.presence_penalty[:, None] * (out_counts > 0).astype(jnp.float32)


def _filtered(logits, st: SamplingTensors):
    """Temperature-scaled logits with top-k / top-p / min-p applied (masked entries -inf)."""
    V = logits.shape[-1]
    z = logits / jnp.maximum(st.temperature, 1e-6)[:, None]
    srt = -jnp.sort(-z, axis=-1)  # descending
    k = jnp.where(st.top_k > 0, jnp.minimum(st.top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    p = jax.nn.softmax(srt, axis=-1)
    keep = (jnp.cumsum(p, -1) - p) < st.top_p[:, None]
    keep = keep & (jnp.arange(V)[None, :] < k[:, None])
    pth = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    thresh = jnp.maximum(kth, pth)
    probs = jax.nn.softmax(z, axis=-1)
    minp = st.min_p[:, None] * probs.max(-1, keepdims=True)
    return jnp.where((z >= thresh) & (probs >= minp), z, -jnp.inf)


def unpack(allowed, V: int):
    """Bitmask rows [B, W] int32 -> [B, V] bool (token t: bit t % 32 of word t // 32)."""
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(allowed.shape[0], -1)[:, :V].astype(bool)


def sampling_mode(params) -> tuple[bool, bool]:
    """(whether any of these rows' SamplingParams draws, whether any asks for top logprobs): `sample`'s mode."""
    return any(p.temperature > 0 for p in params), any(p.logprobs for p in params)


def sample(logits, st: SamplingTensors, prompt_mask, out_counts, allowed=None, mode: tuple[bool, bool] | None = None):
    """logits [B, V] float32; allowed [B, ceil(V / 32)] int32 or None (no constraint); mode: the rows'
    `sampling_mode` (static), or None to decide on the device -> (tokens [B] int32, logprob [B], top_ids [B, K]
    int32, top_logprobs [B, K])."""
    B = logits.shape[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    x = apply_penalties(logits, st, prompt_mask, out_counts)
    if allowed is not None:
        x = jnp.where(unpack(allowed, x.shape[-1]), x, -jnp.inf)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)

    def drawn(x):
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(st.seed, st.step)
        d = jax.vmap(jax.random.categorical)(keys, _filtered(x, st)).astype(jnp.int32)
        return jnp.where(st.temperature > 0, d, greedy)

    def top(logp):
        top_lp, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
        return top_ids.astype(jnp.int32), top_lp

    none = (jnp.zeros((B, MAX_LOGPROBS), jnp.int32), jnp.zeros((B, MAX_LOGPROBS), logp.dtype))
    if mode is None:
        tok = jax.lax.cond(jnp.any(st.temperature > 0), drawn, lambda x: greedy, x)
        top_ids, top_lp = jax.lax.cond(jnp.any(st.top > 0), top, lambda logp: none, logp)
    else:
        tok = drawn(x) if mode[0] else greedy
        top_ids, top_lp = top(logp) if mode[1] else none
    return tok, jnp.take_along_axis(logp, tok[:, None], -1)[:, 0], top_ids, top_lp
