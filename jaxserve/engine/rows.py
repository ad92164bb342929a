"""The rows a ModelRunner step takes and gives (PrefillRow, DecodeRow, Prefix) and its shape buckets: what
runner.py, warmup.py and the engine share. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..sampling import SamplingParams

IDLE = SamplingParams(temperature=0.0, seed=0)  # sampling parameters of the warm-up's requests
DRAWN = SamplingParams(temperature=1.0, seed=0)  # and of its drawing ones, where samplers are specialised
SMALL_DECODE_ROWS = 4  # without full tables, the smallest decode batch bucket: up to this many running requests
# with full tables, the decode table's narrowest width: max_blocks_per_seq up to this many blocks (32K tokens of
# 16), wider contexts in power-of-two widths above it, so a step uploads [rows, at most this] where its contexts
# are shorter (256 rows: 2 MiB, not the 8 MiB of a 128K-token model's whole table)
FULL_TABLE_BLOCKS = 2048


def next_bucket(b: int, fine_from: int) -> int:
    """The bucket after b: double below fine_from, then the powers of two and the midpoints between them (from 64:
    96, 128, 192, 256, ...; from 2: 3, 4, 6, 8, 12, ...), so at most a third of a bucket is padding."""
    return b * 2 if b < fine_from else (b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3)


def token_buckets(lo: int, hi: int) -> list[int]:
    """The packed-token buckets up to hi: lo doubling to 64, then the powers of two and the midpoints between them
    (96, 128, 192, 256, 384, ...), hi itself last."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b = next_bucket(b, 64)
    return out + [hi]


def pow2_bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi] (hi itself when n exceeds the powers below it)."""
    b = lo
    while b < n and b < hi:
        b *= 2
    return min(b, hi) if n <= hi else n


@dataclass
class Prefix:
    """What prefill hands to decode for one request: where its cache is and the first sampled token."""
    request_id: str
    slot: int
    block_ids: list[int]
    num_tokens: int  # tokens in the cache
    token: int  # first sampled token
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    prompt_mask: np.ndarray | None = None  # [V] bool tokens of the prompt (repetition penalty)


@dataclass
class PrefillRow:
    request_id: str
    tokens: list[int]  # the chunk's tokens
    start: int  # tokens already cached
    block_ids: list[int]
    src_row: int  # state row to read request-level state from
    dst_row: int  # state row to write it to (the slot)
    snap_row: int | None  # also save the state here
    sample: bool  # the chunk completes the prompt: sample the first token
    params: object = None  # SamplingParams
    step: int = 0  # output index of the token sampled
    prompt: list[int] | None = None  # whole prompt (for the prompt mask), when sampling


@dataclass
class DecodeRow:
    slot: int
    token: int  # input token
    position: int  # its position (= tokens already cached)
    block_ids: list[int]
    params: object
    step: int
    snap_row: int | None = None  # also save the request-level state here (a block boundary during decode)
    request_id: str = ""
    from_device: bool = False  # the input token is the one this slot's last decode step sampled, not yet read
