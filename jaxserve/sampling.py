"""Sampling parameters and generation outputs (the offline API's value types) and host-side sampling.

`sample` is the host reference; the engine samples on device (engine/sampler.py) with the same rules."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .structured import Guided

INT32_MAX = 2**31 - 1  # the engine samples with int32 token ids and top-k
MAX_REPETITION_PENALTY = 1e6  # and float32 penalties (a value this large already means "never repeat")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top log-probabilities per output token (0: only the sampled token's)
    guided: Guided | None = None  # structured outputs: what the output must match (structured.py)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"SamplingParams.top_k must be in [0, {INT32_MAX}], got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"SamplingParams.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                             f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"SamplingParams.logprobs must be in [0, 20], got {self.logprobs}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("SamplingParams.stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)
        ids = tuple(int(t) for t in self.stop_token_ids)
        if any(not 0 <= t <= INT32_MAX for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {INT32_MAX}]")
        object.__setattr__(self, "stop_token_ids", ids)
        if isinstance(self.guided, dict):  # as dataclasses.asdict wrote it (a worker's request)
            object.__setattr__(self, "guided", Guided(**self.guided))
        if self.guided is not None and not isinstance(self.guided, Guided):
            raise ValueError(f"SamplingParams.guided must be a structured.Guided, got {type(self.guided).__name__}")


@dataclass
class Output:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list | None = None  # per token: (logprob, [(token id, logprob), ...])
    cached_tokens: int = 0


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> np.ndarray:
    """logits [B, V] float32 -> token ids [B]."""
    if params.temperature == 0.0:
        return logits.argmax(-1)
    z = logits / params.temperature
    if params.top_k:
        kth = np.partition(z, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sp = np.take_along_axis(p, order, -1)
        keep = np.cumsum(sp, -1) - sp < params.top_p
        sp = np.where(keep, sp, 0.0)
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sp, -1)
        p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])
