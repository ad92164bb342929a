"""Incremental text of one request: constant work per token, whatever the output's length.

Each token decodes only a short window of ids: the text of ids[prefix:] against that of ids[prefix:read] (the
window's start decodes alike in both, so leading-space rules of the tokenizer's decoder cancel out); their
difference is the new text, committed once it no longer ends in an incomplete UTF-8 character, and the window
then moves up to the token (vLLM's incremental detokenization). Stop strings are looked for only where the new
text could complete one; the text is cut before the first found. Text that could still turn into a stop string
is held back from `text` until it cannot, and all of it is shown when the request ends.

Plain Python; one per request, driven by the engine loop.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.full = ""  # the committed text of the ids so far
        self.text = ""  # what may be shown now
        self.stopped = False
        self._prefix = self._read = 0  # the decode window: ids[_prefix:_read] decoded into full's tail
        self._hold = max((len(s) - 1 for s in stop), default=0)

    def add(self, tok: int) -> bool:
        """Append a token; True when a stop string was hit (the text is cut before it)."""
        if self.tok is None:
            return False
        self.ids.append(tok)
        before = self.tok.decode(self.ids[self._prefix:self._read])
        after = self.tok.decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # no new character yet (or one still incomplete): wait for the next token
        seen = len(self.full)
        self.full += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        for s in self.stop:  # only where the new text could complete it
            i = self.full.find(s, max(0, seen - len(s) + 1))
            if i >= 0:
                self.text, self.stopped = self.full[:i], True
                return True
        visible = self.full[:len(self.full) - self._hold] if self._hold else self.full
        if len(visible) > len(self.text):
            self.text = visible
        return False

    def finish(self) -> None:
        """The request ended: show everything held back (a stop token is never added, so no text of it)."""
        if self.tok is None or self.stopped:
            return
        self.text = self.tok.decode(self.ids)
