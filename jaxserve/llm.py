"""Offline Python API: `LLM(path).score(ids)` and `LLM(path).generate(prompts, SamplingParams)`.

This version runs a simple loop: one prefill of the (right-padded) batch into a dense per-request
cache, then one jitted decode step per token for the whole batch, sampling on the host. Prompt lengths
and cache capacities are rounded up to powers of two so a workload compiles a bounded number of
programs. The serving-engine issue replaces the insides with the paged engine behind the same API.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .checkpoint import load_any
from .models.batch import Batch
from .models.cache_spec import cache_spec, init_dense_cache
from .models.config import load_config
from .models.model import jit_forward
from .sampling import Output, SamplingParams, sample
from .tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def bucket(n: int, minimum: int = 16) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


class LLM:
    def __init__(self, model: str, dtype: str = "float32", tp: int = 1, mesh: Mesh | None = None,
                 progress: bool = True):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if not os.path.isdir(model):
            raise FileNotFoundError(f"{model}: not a model directory")
        if mesh is None and tp > 1:
            devs = jax.devices()
            if len(devs) < tp:
                raise ValueError(f"tp={tp} needs {tp} devices, found {len(devs)}")
            mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devs[:tp])
        self.path, self.dtype, self.mesh = model, DTYPES[dtype], mesh
        self.config = load_config(model)
        self.cache_spec = cache_spec(self.config)
        self.graphdef, self.state = load_any(model, self.config, dtype, mesh, progress)
        self.tokenizer = Tokenizer.maybe_load(model)
        self._forward = jit_forward(self.graphdef)

    # ---- helpers
    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                Tokenizer(self.path)  # raises, naming the missing tokenizer.json
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        return ids

    def _run(self, tokens: np.ndarray, start: np.ndarray, lengths: np.ndarray, cache, logits_idx: np.ndarray):
        batch = Batch(jnp.asarray(tokens, jnp.int32), jnp.asarray(start, jnp.int32), jnp.asarray(lengths, jnp.int32))
        return self._forward(self.state, batch, cache, jnp.asarray(logits_idx, jnp.int32))

    # ---- public API
    def score(self, token_ids) -> np.ndarray:
        """Prefill-path logits at every position: np.ndarray [len, vocab] float32."""
        ids = self._ids(token_ids)
        T = bucket(len(ids))
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(ids)] = ids
        cache = init_dense_cache(self.config, 1, T, self.dtype)
        logits, _ = self._run(tokens, np.zeros(1), np.array([len(ids)]), cache, np.arange(T)[None])
        return np.asarray(logits[0, :len(ids)])

    def generate(self, prompts, sampling_params: SamplingParams | None = None) -> list[Output]:
        p = sampling_params or SamplingParams()
        if isinstance(prompts, (str,)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self._ids(x) for x in prompts]
        B = len(ids)
        lens = np.array([len(x) for x in ids])
        if lens.max() + p.max_tokens > self.config.max_position_embeddings:
            raise ValueError(f"prompt ({lens.max()}) + max_tokens ({p.max_tokens}) exceeds the model's context "
                             f"({self.config.max_position_embeddings})")
        T = bucket(int(lens.max()))
        cap = bucket(int(lens.max()) + p.max_tokens)
        tokens = np.zeros((B, T), np.int32)
        for i, x in enumerate(ids):
            tokens[i, :len(x)] = x
        cache = init_dense_cache(self.config, B, cap, self.dtype)
        logits, cache = self._run(tokens, np.zeros(B), lens, cache, (lens - 1)[:, None])
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.config.eos_token_ids))
        rng = np.random.default_rng(p.seed)
        outs = [Output(prompt_token_ids=x) for x in ids]
        active = np.ones(B, bool)
        cur = lens.copy()
        while True:
            nxt = sample(np.asarray(logits[:, -1]), p, rng)
            for i in np.flatnonzero(active):
                outs[i].token_ids.append(int(nxt[i]))
                if int(nxt[i]) in stops:
                    active[i], outs[i].finish_reason = False, "stop"
                elif len(outs[i].token_ids) >= p.max_tokens:
                    active[i], outs[i].finish_reason = False, "length"
            if not active.any():
                break
            logits, cache = self._run(nxt[:, None], cur, active.astype(np.int32), cache, np.zeros((B, 1)))
            cur = cur + active
        if self.tokenizer is not None:
            for o in outs:
                o.text = self.tokenizer.decode(o.token_ids)
        return outs
