"""Structured outputs: a request's constraint (`Guided`) -> a grammar, one matcher per sequence (`Guide`), and each
step's next-token bitmask, which the sampler applies on device to the constrained rows.

The grammar engine is llguidance (Rust, on the package index as a wheel with no dependencies). xgrammar, the
other engine vLLM and SGLang use, requires torch, transformers and triton at run time, which a JAX server
should not carry; bench/structured.py measures llguidance's compile and mask times on SmolLM2. Every constraint
becomes an llguidance grammar: a JSON schema (`json_object`: any object), a regular expression, a choice among
strings, or an EBNF / Lark grammar; a JSON schema's numbers are bounded and its separators compact (schema.py,
which also closes the objects of a strict schema). `Grammars` checks a constraint when the request arrives
(GuidedError, naming the request field, for the 400) and compiles each grammar once: a matcher built for it is
kept (an LRU of MAX_GRAMMARS) and each sequence gets a copy of it (cheap).

A Guide follows its sequence's output tokens: `fill` writes the tokens allowed next into one row of a
[rows, ceil(V / 32)] int32 bitmask (bit t of word t // 32: token t), `advance` consumes the token sampled,
`done` says the grammar accepts nothing further (the sequence ends, "stop"). A sequence resumed elsewhere (the
decode instance of a disaggregated request, a request placed again) rebuilds its guide from the tokens so far.
Concurrency: guides on the engine thread only; `Grammars.check` also on the server's request threads (its cache
under a lock; the request path compiles no matcher).
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass

import numpy as np

from . import schema

KINDS = ("json", "regex", "choice", "grammar")
MAX_GRAMMARS = 256  # compiled grammars kept


class GuidedError(ValueError):
    """A constraint llguidance cannot take; `param` is the request field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Guided:
    """What a request's output must match."""
    kind: str  # one of KINDS
    spec: str  # json: the schema as JSON text; regex: the expression; choice: a JSON list of strings; grammar: EBNF
    param: str = "response_format"  # the request field it came from (errors name it)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GuidedError(f"a constraint is one of {', '.join(KINDS)}, got {self.kind!r}", self.param)
        if not isinstance(self.spec, str):
            raise GuidedError("a constraint's spec is a string", self.param)

    def grammar(self) -> str:
        """The llguidance grammar (raises GuidedError when the spec cannot be one). A JSON schema's numbers are
        bounded and its separators compact unless it says otherwise (schema.py)."""
        from llguidance import LLMatcher
        if self.kind == "json":
            try:
                spec = json.dumps(schema.bounded(json.loads(self.spec)))
            except json.JSONDecodeError as e:
                raise GuidedError(f"a JSON schema is JSON: {e}", self.param) from None
            return LLMatcher.grammar_from_json_schema(spec, defaults=schema.COMPACT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            try:
                options = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise GuidedError(f"a choice is a JSON list of strings: {e}", self.param) from None
            if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
                raise GuidedError("a choice is a non-empty list of strings", self.param)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        from llguidance import grammar_from
        return grammar_from("grammar", self.spec)


def json_object() -> Guided:
    """`response_format: {"type": "json_object"}`: any JSON object, its numbers bounded at any depth (schema.py)."""
    value = {"anyOf": [{"type": t} for t in ("null", "boolean", "number", "string")] + [
        {"type": "array", "items": {"$ref": "#/$defs/value"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}]}
    return Guided("json", json.dumps({"$defs": {"value": value}, "type": "object",
                                      "additionalProperties": {"$ref": "#/$defs/value"}}))


def words(vocab_size: int) -> int:
    """Words of one bitmask row for a vocabulary of vocab_size tokens."""
    return -(-vocab_size // 32)


class Guide:
    """One sequence's matcher."""

    def __init__(self, matcher):
        self.m = matcher

    def fill(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into `row` ([W] int32, C-contiguous)."""
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def advance(self, token: int) -> bool:
        """Consume the sampled token -> False when the grammar refused it (the matcher is then in error)."""
        return self.m.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar accepts nothing further (or the matcher failed: `error`)."""
        return self.m.is_stopped() or self.m.is_error()

    @property
    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None


class Grammars:
    """The grammar engine for one tokenizer and vocabulary: checks constraints, compiles each grammar once, makes
    guides."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self._json, self.V, self.eos = tokenizer_json, vocab_size, list(eos_ids)
        self._tok = None
        # constraint -> [its validated grammar, its compiled matcher once a guide needed one]; an LRU
        self._cache: collections.OrderedDict[Guided, list] = collections.OrderedDict()
        self._lock = threading.Lock()  # the server checks on its request threads
        self.compiled = 0  # grammars compiled (cache misses)

    @property
    def tokenizer(self):
        if self._tok is None:  # about 0.3 s for a 49k vocabulary: on first use
            from llguidance import LLTokenizer
            self._tok = LLTokenizer(self._json, n_vocab=self.V, eos_token=self.eos or None)
        return self._tok

    def _entry(self, g: Guided) -> list:
        """g's cache entry (validated on first use; at most MAX_GRAMMARS kept, the least recently used dropped)."""
        with self._lock:
            entry = self._cache.get(g)
            if entry is not None:
                self._cache.move_to_end(g)
                return entry
        entry = [self._validate(g), None]  # outside the lock: a slow check holds up no other request
        with self._lock:
            entry = self._cache.setdefault(g, entry)
            self._cache.move_to_end(g)
            if len(self._cache) > MAX_GRAMMARS:
                self._cache.popitem(last=False)
        return entry

    def _validate(self, g: Guided) -> str:
        from llguidance import LLMatcher
        try:
            grammar = g.grammar()
        except GuidedError:
            raise
        except Exception as e:  # noqa: BLE001 - llguidance's own parse errors
            raise GuidedError(f"invalid {g.kind}: {e}", g.param) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GuidedError(f"invalid {g.kind}: {messages[0] if messages else 'rejected'}", g.param)
        return grammar

    def check(self, g: Guided) -> str:
        """The constraint's grammar, validated -> the grammar; GuidedError naming g.param when it is none. A
        constraint that passed is remembered: repeated requests are not checked again."""
        return self._entry(g)[0]

    def guide(self, g: Guided, tokens: list[int] = ()) -> Guide:
        """A fresh guide for g, having consumed `tokens` (a resumed sequence's output so far)."""
        from llguidance import LLMatcher
        entry = self._entry(g)
        if entry[1] is None:
            template = LLMatcher(self.tokenizer, entry[0], log_level=0)
            if template.is_error():
                raise GuidedError(f"invalid {g.kind}: {template.get_error()}", g.param)
            self.compiled += 1
            entry[1] = template
        template = entry[1]
        guide = Guide(template.deep_copy())
        for t in tokens:
            guide.advance(t)
        return guide
