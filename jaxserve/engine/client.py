"""The engine-client protocol: what the HTTP app (server/app.py) asks of whatever serves its requests.

Two classes implement it: `AsyncEngine` (async_engine.py: one colocated `LLMEngine` on a thread of this
process) and `router.cluster.Router` (a cluster of worker processes behind the router). The app holds an
`EngineClient` and nothing else, so every route behaves the same over both. Like JetStream's `engine_api.Engine`
the contract is the protocol plus its value and error types, all here:

- `add` queues a request and returns the asyncio.Queue its `Update`s arrive on (cumulative snapshots; the last
  one has `finished` set, and an `error` when the request failed after it was accepted). It raises
  `RequestError` (the request is bad: HTTP 400), `QueueFull` (no room now: 429) or `EngineUnavailable`
  (nothing can serve it: 503) before anything is queued.
- `abort` is fire and forget, and a no-op for a finished or unknown request: it frees the request's slot and
  cache blocks.
- `health` answers `{"status": "ok" | "degraded", ...}`; `stats` the engine counters `/metrics` publishes
  (LLMEngine.stats keys: waiting, running, blocks_*, prefix_hit_rate, ...); `metrics_state` the cluster's
  instances and links (None when there is no cluster); `set_link` changes an emulated link's bandwidth at run
  time.

Concurrency: every method is called on the server's asyncio loop; implementations say how they reach their
engine (a thread, gRPC streams).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # the types only: this module imports nothing heavy (the scheduler and the router use it)
    from ..sampling import SamplingParams
    from ..tokenizer import Tokenizer


class RequestError(ValueError):
    """A request the engine cannot take (the server answers 400); param names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """No room for the request now (the server answers 429)."""


class EngineUnavailable(RuntimeError):
    """Nothing can take the request now (the server answers 503): e.g. no worker of a cluster is up."""


class Grown(Sequence):
    """The first n items of a list that only grows (a running request's output tokens and logprobs), read without
    copying it: what a running request's Update holds, so that publishing a step costs each request its new
    tokens, not its whole output again. Items before n never change; slices are lists."""
    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(self._n)
            return self._items[lo:hi] if step == 1 else [self._items[k] for k in range(lo, hi, step)]
        k = i + self._n if i < 0 else i
        if not 0 <= k < self._n:
            raise IndexError("Grown index out of range")
        return self._items[k]

    def __iter__(self):
        return iter(self._items[:self._n])

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, Grown)):
            return len(other) == self._n and self[:] == list(other)
        return NotImplemented

    def __add__(self, other) -> list:
        return self[:] + list(other)

    def __radd__(self, other) -> list:
        return list(other) + self[:]

    def __repr__(self) -> str:
        return f"Grown({self[:]!r})"

    def after(self, n: int, more) -> "Grown":
        """The first n of these items and then `more`, sharing the list where n is all of it and nothing was added
        since."""
        if n == self._n == len(self._items):
            self._items.extend(more)
            return Grown(self._items)
        return Grown(self[:n] + list(more))


@dataclass
class Update:
    """A snapshot of one sequence after a step, safe to read on the loop: its token_ids and logprobs are lists, or
    while it runs `Grown` views of lists its engine only appends to."""
    index: int  # choice index (0..n-1)
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list
    cached_tokens: int
    prompt_tokens: int
    error: str | None = None
    ttft_s: float | None = None  # arrival -> first token
    route: dict | None = None  # where it ran, set by the router on the final update (server/app.py: meta)
    migrations: list[dict] | None = None  # the final update's: the migrations it went through (kind, src, dst)


def update_message(u: Update, sent: tuple[int, str]) -> tuple[dict, tuple[int, str]]:
    """An Update as a worker's stream sends it (JSON) -> (the message, `sent` for the next). Updates are
    cumulative; the message carries what the receiver does not hold yet: token_ids and logprobs from `offset`
    on, the text from character `text_from` on (from 0 where the text does not extend what was sent). So a step
    costs a stream its new tokens, not the whole output again (docs/08-worker-protocol.md). sent: (tokens, text)
    the receiver holds, (0, "") before the first; the finished update goes whole."""
    n, text = (0, "") if u.finished else sent
    if len(u.token_ids) < n or 0 < len(u.logprobs) < n:  # (no logprobs: the request asked for none)
        n = 0
    tf = len(text) if u.text.startswith(text) else 0
    msg = {"index": u.index, "token_ids": u.token_ids[n:], "offset": n, "text": u.text[tf:], "text_from": tf,
           "finished": u.finished, "finish_reason": u.finish_reason, "logprobs": u.logprobs[n:],
           "cached_tokens": u.cached_tokens, "prompt_tokens": u.prompt_tokens, "error": u.error, "ttft_s": u.ttft_s,
           "route": u.route, "migrations": u.migrations}
    return msg, (len(u.token_ids), u.text)


def update_of(msg: dict, held: Update | None) -> Update:
    """The cumulative Update of a stream message (`update_message`) after `held`, the stream's one before it
    (None: none yet). Raises ValueError for a message that does not follow what is held, TypeError for one that
    is no update."""
    msg = dict(msg)
    n, tf = msg.pop("offset", 0), msg.pop("text_from", 0)
    missing = {"token_ids", "logprobs", "text", "finished"} - set(msg)
    if missing:  # as Update(**msg) would say of any other field
        raise TypeError(f"an update without {', '.join(sorted(missing))}")
    have, lps, text = (held.token_ids, held.logprobs, held.text) if held is not None else ([], [], "")
    if n > len(have) or tf > len(text):
        raise ValueError(f"an update from token {n} (text {tf}) after {len(have)} tokens ({len(text)} characters)")
    for key, old in (("token_ids", have), ("logprobs", lps)):  # a running request's: views (`Grown`); else lists
        more = list(msg[key])
        if isinstance(old, Grown) and not msg["finished"]:
            msg[key] = old.after(n, more)
        else:  # old[:n]: a list, of a list or a Grown
            msg[key] = old[:n] + more if msg["finished"] else Grown(old[:n] + more)
    msg["text"] = text[:tf] + msg["text"]
    return Update(**msg)


def encode(tokenizer: Tokenizer | None, prompt) -> list[int]:
    """A text prompt (needs the tokenizer) or a token-id list -> token ids. Raises RequestError."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model has no tokenizer.json: send token ids", "prompt")
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Tokenizer | None

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt + output a request may have (None: not known yet, e.g. no worker registered)."""

    def encode(self, prompt) -> list[int]:
        """Text or token ids -> token ids (raises RequestError)."""

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  final_only: bool = False) -> asyncio.Queue:
        """Queue a request; its Updates arrive on the returned queue (final_only: each sequence's finished one
        alone, for a request that does not stream, as vLLM's FINAL_ONLY output kind). Raises RequestError,
        QueueFull, EngineUnavailable."""

    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds (no-op once finished)."""

    def health(self) -> dict:
        """{"status": "ok"} or {"status": "degraded", "error": ..., ...}."""

    def stats(self) -> dict:
        """Engine counters (LLMEngine.stats keys), summed over a cluster's instances."""

    def metrics_state(self) -> dict | None:
        """A cluster's instances, links and transfer counters for /metrics; None without a cluster."""

    async def set_link(self, src: str, dst: str, gbps: float) -> dict:
        """Change the emulated bandwidth of the link between two clusters (the admin endpoint); RequestError
        when there is no such link."""

    async def set_role(self, instance: str, role: str) -> dict:
        """Change an instance's role in place (the admin endpoint); RequestError when it cannot change,
        EngineUnavailable when it failed to."""

    async def migrate(self, kind: str, src: str, dst: str, heads=None, layers=None) -> dict:
        """Move part of the decode work running on src to dst (the admin endpoint); RequestError for an
        impossible move, EngineUnavailable when src failed to."""

    async def profile(self, seconds: float, base: str) -> dict:
        """A JAX trace of every process that runs the model, over `seconds`, into folders under `base`
        (jaxserve/trace.py) -> {"trace_dir", ...}; trace.Busy while a capture runs."""
