"""FlowKV's bidirectional segment alignment: pair a sender's and a receiver's block lists into runs.

Block i of a request sits at `src[i]` in the sender's pool and `dst[i]` in the receiver's. A run is a maximal
stretch of consecutive i where both sides are contiguous (src[i+1] == src[i] + 1 and dst[i+1] == dst[i] + 1):
in the block-major pool layout every run is one contiguous byte range on each side, so it moves as one send.
A per-block, per-layer transfer needs blocks * layers sends; aligned, a request whose blocks are contiguous
on both sides (what the segment allocator aims for) needs one. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    index: int  # first position in the request's block list
    src: int  # first sender block id
    dst: int  # first receiver block id
    length: int


def align(src: list[int], dst: list[int]) -> list[Run]:
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} sender blocks, {len(dst)} receiver blocks")
    runs: list[Run] = []
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append(Run(i, src[i], dst[i], j - i))
        i = j
    return runs


def contiguous_runs(blocks: list[int]) -> int:
    """Runs one side alone would need (its own contiguity only)."""
    return sum(1 for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1] + 1)
