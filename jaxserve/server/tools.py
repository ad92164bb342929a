"""Tool calling for chat completions: what `tool_choice` makes the output follow, and how an answer's text becomes
OpenAI `tool_calls`.

  none      the tools reach the chat template; the answer is text
  auto      the tools reach the chat template, the output is free, and a parser finds the model's own tool calls
            in it (PARSERS, `server.tool_call_parser`: "hermes", `<tool_call>{"name": ..., "arguments": ...}
            </tool_call>` blocks, the default; "llama3_json", the whole answer one {"name", "parameters"} object)
  required  the grammar engine makes the output a JSON array of one or more {"name", "arguments"} calls, each
            name one of the tools and its arguments valid against that tool's parameters schema (one call
            without parallel_tool_calls)
  named     {"type": "function", "function": {"name": N}}: the output is N's arguments, valid against its schema
Every tool's parameters schema is checked by the grammar engine when the request arrives (a 400 naming
`tools[i].function.parameters`); a function with `strict: true` has its objects closed (schema.closed), as OpenAI's
strict function calling does. Plain functions, no state; `ToolStream` holds one streamed answer's state.
"""

from __future__ import annotations

import json
import re
import uuid

from ..schema import SchemaError, closed
from ..structured import Guided, GuidedError

START, END = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parameters(tools: list, i: int) -> dict:
    """Tool i's arguments schema: its parameters (none: no arguments), closed when the function is strict
    (schema.closed; GuidedError naming tools[i].function.parameters when it cannot be)."""
    fn = tools[i].function
    schema = fn.parameters or {"type": "object", "properties": {}}
    if not fn.strict:
        return schema
    try:
        return closed(schema)
    except SchemaError as e:
        raise GuidedError(str(e), f"tools[{i}].function.parameters") from None


def constraint(tools: list, choice) -> Guided | None:
    """The output constraint of a request's tools and tool_choice (None: free)."""
    if not tools or choice in (None, "none", "auto"):
        return None
    if choice == "required":
        one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t.function.name}, "arguments": parameters(tools, i)}}
               for i, t in enumerate(tools)]
        return Guided("json", json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": one}}), "tool_choice")
    tool = named(tools, choice)
    return Guided("json", json.dumps(parameters(tools, tools.index(tool))), "tool_choice")


def named(tools: list, choice):
    """The tool a named tool_choice names (GuidedError naming tool_choice when none has that name)."""
    name = choice.function.name
    for t in tools:
        if t.function.name == name:
            return t
    raise GuidedError(f"tool_choice names {name!r}, which is not among the tools ({[t.function.name for t in tools]})",
                      "tool_choice")


def calls_of(text: str, tools: list, choice, parser: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """An answer's text -> (content, tool calls in OpenAI's shape). A constrained answer (required, named) is
    the calls themselves; an auto one goes through `parser` (calls naming no tool are left as text)."""
    if not tools or choice in (None, "none"):
        return text, []
    if choice == "required":
        return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
    if choice != "auto":
        return None, [_call(choice.function.name, text)]
    content, found = PARSERS[parser](text)
    names = {t.function.name for t in tools}
    calls = [_call(n, a) for n, a in found if n in names]
    if not parallel:
        calls = calls[:1]
    return (content if calls else text), calls


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, separators=(",", ":"))  # compact
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def hermes(text: str) -> tuple[str | None, list[tuple[str, object]]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen) -> (the text around them,
    [(name, arguments)]); a block that is not such JSON stays in the text."""
    calls, kept, pos = [], [], 0
    for m in re.finditer(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", text, re.S):
        try:
            obj = json.loads(m.group(1).strip())
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append((name, args))
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def llama3_json(text: str) -> tuple[str | None, list[tuple[str, object]]]:
    """The whole answer one JSON object {"name": ..., "parameters": {...}} (or several, separated by ';')."""
    calls = []
    for part in text.split(";"):
        try:
            obj = json.loads(part.strip())
            calls.append((obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
    return None, calls


PARSERS = {"hermes": hermes, "llama3_json": llama3_json}


class ToolStream:
    """One streamed chat answer with tools: which text may go out as content now, and the tool-call deltas.
    Named: the arguments stream as they come (the first delta carries the call's id and name). Required and
    auto: content streams until a tool call may be starting (auto: text from a `<tool_call>` on, or a prefix of
    it, is held back); the calls go out whole once the answer ends."""

    def __init__(self, tools: list, choice, parser: str, parallel: bool):
        self.tools, self.choice, self.parser, self.parallel = tools, choice, parser, parallel
        self.sent = 0  # characters of the text already sent (as content, or as a named call's arguments)
        self.id = call_id()

    @property
    def named(self) -> bool:
        return bool(self.tools) and self.choice not in (None, "none", "auto", "required")

    def delta(self, text: str) -> dict | None:
        """The delta for the text so far, before the end (None: nothing to send yet)."""
        if not self.tools or self.choice in (None, "none"):
            new, self.sent = text[self.sent:], len(text)
            return {"content": new} if new else None
        if self.named:
            new = text[self.sent:]
            first = self.sent == 0
            self.sent = len(text)
            if not new and not first:
                return None
            fn = {"name": self.choice.function.name, "arguments": new} if first else {"arguments": new}
            call = {"index": 0, "id": self.id, "type": "function", "function": fn} if first else \
                {"index": 0, "function": fn}
            return {"tool_calls": [call]}
        if self.choice == "required":
            return None
        safe = len(text)
        i = text.find(START)
        if i >= 0:
            safe = i
        else:
            for k in range(min(len(START) - 1, len(text)), 0, -1):
                if START.startswith(text[-k:]):
                    safe = len(text) - k
                    break
        new = text[self.sent:safe]
        if not new:
            return None
        self.sent = safe
        return {"content": new}

    def end(self, text: str) -> tuple[dict | None, bool]:
        """The last delta once the answer is complete -> (delta or None, whether it made tool calls)."""
        if self.named:
            return self.delta(text), True
        try:
            content, calls = calls_of(text, self.tools, self.choice, self.parser, self.parallel)
        except (ValueError, KeyError, TypeError):  # a required call cut short (max_tokens): its text
            content, calls = text, []
        if not calls:
            rest = text[self.sent:]
            return ({"content": rest} if rest else None), False
        out: dict = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        if content:  # auto: text after the part already sent (the calls removed)
            rest = content[self.sent:] if content.startswith(text[:self.sent]) else ""
            if rest:
                out["content"] = rest
        return out, True
