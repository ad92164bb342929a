"""A step's inputs in one upload and its sampled tokens in one read: the packed arrays of the hot path.

A decode step's per-row inputs (token, position, state rows, penalty slot, output index, sampling parameters)
and its block table travel to the device as one int32 array [B, COLS + W], the float parameters bit-cast into
int32 columns; `pack_decode` builds it on the host and `unpack_decode`, inside the program, takes it apart. A
sampler's results come back as one float32 array [B, 2 + 2K] (token ids bit-cast): `pack_sampled` inside the
program, `read_sampled` on the host. So a decode step makes one host-to-device copy and one device-to-host copy
whatever its batch (vLLM's persistent input batch and its single sampled-token copy play this part).

Pure functions: numpy on the host side, jnp inside jitted programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..models.batch import Batch
from .sampler import MAX_LOGPROBS, SamplingTensors

# int32 columns of a packed row
TOKEN, POSITION, LENGTH, STATE_ROW, SNAP_ROW, SLOT, STEP, TOP_K, SEED, TOP = range(10)
# float32 columns, bit-cast
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(10, 16)
FROM_DEVICE = 16  # 1: the row's input token is the one its slot sampled last on the device (engine/overlap.py)
COLS = 17  # then the block table's W columns
_FLOAT_PADDING = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)  # a padding row samples greedily, no penalties


def _seed(p) -> int:
    s = (p.seed or 0) & 0xFFFFFFFF
    return s - (1 << 32) if s >= 1 << 31 else s  # the uint32 seed's bits as int32


def pack_rows(rows: list, B: int, W: int, *, scratch: int, spare: int, tables: list | None = None) -> np.ndarray:
    """[B, COLS + W] int32 for rows with .token, .position, .slot, .params, .step, .snap_row (None: none) and
    .from_device: row i of the first len(rows); the rest padding (state rows `scratch`, penalty slot `spare`,
    length 0).
    tables: each row's block ids (at most W of them), written after the COLS columns."""
    out = np.zeros((B, COLS + W), np.int32)
    out[:, STATE_ROW:SLOT + 1] = (scratch, scratch, spare)
    floats = out[:, TEMPERATURE:FREQUENCY + 1].view(np.float32)
    floats[:] = _FLOAT_PADDING
    n = len(rows)
    if n:
        out[:n, FROM_DEVICE] = [r.from_device for r in rows]
        out[:n, :TOP + 1] = [(r.token, r.position, 1, r.slot, scratch if r.snap_row is None else r.snap_row, r.slot,
                               r.step, r.params.top_k, _seed(r.params), r.params.logprobs or 0) for r in rows]
        floats[:n] = [(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                       p.frequency_penalty) for p in (r.params for r in rows)]
    for i, blocks in enumerate(tables or ()):
        out[i, COLS:COLS + len(blocks)] = blocks
    return out


def pack_sampling(params: list, steps: list[int], B: int, *, spare: int) -> np.ndarray:
    """[B, COLS] int32 carrying only the sampling columns (and the penalty slot `spare`) of B rows: the first
    len(params) sample with those parameters at output index steps[i], the rest are greedy padding."""
    out = np.zeros((B, COLS), np.int32)
    out[:, SLOT] = spare
    floats = out[:, TEMPERATURE:FREQUENCY + 1].view(np.float32)
    floats[:] = _FLOAT_PADDING
    n = len(params)
    if n:
        out[:n, STEP:TOP + 1] = [(s, p.top_k, _seed(p), p.logprobs or 0) for p, s in zip(params, steps)]
        floats[:n] = [(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                       p.frequency_penalty) for p in params]
    return out


def sampling_tensors(x: jax.Array) -> SamplingTensors:
    """The sampler's tensors from a packed [B, >= COLS] int32 array (inside a program)."""
    f = jax.lax.bitcast_convert_type(x[:, TEMPERATURE:FREQUENCY + 1], jnp.float32)
    return SamplingTensors(f[:, 0], f[:, 1], x[:, TOP_K], f[:, 2], f[:, 3], f[:, 4], f[:, 5],
                           jax.lax.bitcast_convert_type(x[:, SEED], jnp.uint32), x[:, STEP], x[:, TOP])


def with_device_tokens(x: jax.Array, last: jax.Array) -> jax.Array:
    """x [B, COLS + W] with the TOKEN of each FROM_DEVICE row taken from last [slots + 1], the token its slot
    sampled last (inside a program)."""
    return x.at[:, TOKEN].set(jnp.where(x[:, FROM_DEVICE] > 0, last[x[:, SLOT]], x[:, TOKEN]))


def sampled_tokens(out: jax.Array) -> jax.Array:
    """The tokens [B] int32 of `pack_sampled`'s array (inside a program)."""
    return jax.lax.bitcast_convert_type(out[:, 0], jnp.int32)


def unpack_decode(x: jax.Array):
    """A packed decode step [B, COLS + W] -> (Batch of one token a row, table [B, W], state rows [B], snapshot
    rows [B]) (inside a program)."""
    return (Batch(x[:, TOKEN:TOKEN + 1], x[:, POSITION], x[:, LENGTH]), x[:, COLS:], x[:, STATE_ROW],
            x[:, SNAP_ROW])


def pack_sampled(tok, lp, ids, tlp) -> jax.Array:
    """The sampler's (tokens [B], logprobs [B], top ids [B, K], top logprobs [B, K]) as one [B, 2 + 2K] float32
    array (inside a program)."""
    bits = lambda a: jax.lax.bitcast_convert_type(a.astype(jnp.int32), jnp.float32)  # noqa: E731
    return jnp.concatenate([bits(tok)[:, None], lp[:, None].astype(jnp.float32), bits(ids),
                            tlp.astype(jnp.float32)], axis=1)


def read_sampled(out: np.ndarray):
    """`pack_sampled`'s array on the host -> (tokens [B] int32, logprobs [B], top ids [B, K], top logprobs)."""
    K = MAX_LOGPROBS
    ints = out.view(np.int32)
    return ints[:, 0], out[:, 1], ints[:, 2:2 + K], out[:, 2 + K:]
