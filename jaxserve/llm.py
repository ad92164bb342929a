"""Offline Python API: `LLM(path).score(ids)` and `LLM(path).generate(prompts, SamplingParams)`.

`generate` runs on the serving engine (engine/llm_engine.py: paged hybrid cache, prefix caching,
continuous batching, chunked prefill, on-device sampling): every prompt is queued and the engine steps
until all are done. `score` returns the logits of the plain prefill path over a dense cache.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .engine.client import RequestError
from .engine.llm_engine import EngineConfig, LLMEngine
from .models.batch import Batch
from .models.cache_spec import init_dense_cache
from .models.model import jit_forward
from .sampling import Output, SamplingParams


def bucket(n: int, minimum: int = 16) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


class LLM:
    def __init__(self, model: str, dtype: str = "auto", tp: int = 1, mesh: Mesh | None = None,
                 progress: bool = True, engine: EngineConfig | None = None):
        if mesh is None and tp > 1:
            devs = jax.devices()
            if len(devs) < tp:
                raise ValueError(f"tp={tp} needs {tp} devices, found {len(devs)}")
            mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devs[:tp])
        self.engine = LLMEngine(model, dtype, engine, mesh, progress)
        self.path, self.dtype, self.mesh = model, self.engine.dtype, mesh
        self.config, self.cache_spec = self.engine.model_config, self.engine.cache_spec
        self.graphdef, self.tokenizer = self.engine.graphdef, self.engine.tokenizer
        self._forward = None
        self._ids = itertools.count()

    def score(self, token_ids) -> np.ndarray:
        """Prefill-path logits at every position: np.ndarray [len, vocab] float32."""
        ids = self.engine.encode(token_ids)
        self.engine.validate(ids, SamplingParams(max_tokens=1))
        if self._forward is None:
            self._forward = jit_forward(self.graphdef, self.engine.runner.stack)
        T = bucket(len(ids))
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(ids)] = ids
        cache = init_dense_cache(self.config, 1, T, self.dtype)
        batch = Batch(jnp.asarray(tokens), jnp.zeros(1, jnp.int32), jnp.asarray([len(ids)], jnp.int32))
        logits, _ = self._forward(self.engine.runner.params, batch, cache, jnp.arange(T, dtype=jnp.int32)[None])
        return np.asarray(logits[0, :len(ids)])

    def generate(self, prompts, sampling_params: SamplingParams | None = None) -> list[Output]:
        """One Output per prompt (n per prompt, consecutive, when sampling_params.n > 1), in prompt order."""
        p = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        eng = self.engine
        seqs = []
        try:
            for x in prompts:
                seqs += eng.add_request(f"llm-{next(self._ids)}", x, p)
        except RequestError:
            for s in seqs:
                eng.abort(s.request_id)
            raise
        while eng.has_work:
            eng.step()
        outs = []
        for s in seqs:
            eng.release(s)
            text = s.detok.text if eng.tokenizer is not None else None
            outs.append(Output(prompt_token_ids=s.prompt, token_ids=list(s.output), text=text,
                               finish_reason=s.finish_reason, logprobs=s.logprobs if p.logprobs is not None else None,
                               cached_tokens=s.num_cached))
        return outs
