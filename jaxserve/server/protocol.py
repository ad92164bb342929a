"""OpenAI request bodies (validated by pydantic; unknown fields rejected; every list and name bounded, the body
itself by the gate) and the OpenAI error shape."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from ..sampling import INT32_MAX, MAX_REPETITION_PENALTY, SamplingParams
from ..schema import SchemaError, closed, flexible
from ..structured import Guided, GuidedError, json_object


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
MAX_CHOICES = 1024


class JsonSchema(_Body):
    """response_format.json_schema (OpenAI): the schema the answer must validate against."""
    name: StrictStr = Field("response", max_length=256)
    description: StrictStr | None = Field(None, max_length=65536)
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text (free), json_object (any JSON object), json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: one of a JSON schema, a regular expression, a choice, an EBNF grammar."""
    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: StrictStr | None = None


def _schema_text(schema, param: str, strict: bool = False) -> str:
    """A request's JSON schema as text; under strict, its objects closed (schema.closed)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GuidedError(f"{param}: not JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise GuidedError(f"{param}: a JSON schema is an object", param)
    if strict:
        try:
            schema = closed(schema)
        except SchemaError as e:
            raise GuidedError(f"{param}: {e}", param) from None
    return json.dumps(schema)


class _Sampling(_Body):
    model: StrictStr = Field(max_length=256)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: StrictInt | None = Field(None, ge=0, le=2**64 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]] = Field(default_factory=list,
                                                                                 max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(None, max_length=256)
    return_token_ids: StrictBool = Field(False, description="vLLM's extension: the answer adds prompt_token_ids "
                                         "and choices[].token_ids (a stream: each chunk's new token ids)")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's structured outputs")
    guided_json: dict | StrictStr | None = Field(None, description="vLLM's (older) JSON schema constraint")
    guided_regex: StrictStr | None = Field(None, description="vLLM's (older) regular expression constraint")
    guided_choice: list[StrictStr] | None = Field(None, min_length=1, max_length=MAX_CHOICES,
                                                  description="vLLM's (older) choice constraint")
    guided_grammar: StrictStr | None = Field(None, description="vLLM's (older) EBNF grammar constraint")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    def guided(self, flexible_json: bool = False) -> Guided | None:
        """The request's output constraint (one at most; GuidedError naming the field otherwise); flexible_json: a
        JSON schema's whitespace as JSON allows it rather than compact (server.json_whitespace)."""
        g = self._guided()
        if flexible_json and g is not None and g.kind == "json":
            g = Guided("json", flexible(g.spec), g.param)
        return g

    def _guided(self) -> Guided | None:
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(json_object())
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise GuidedError("response_format: json_schema needs json_schema.schema", "response_format")
            found.append(Guided("json", _schema_text(rf.json_schema.schema_, "response_format",
                                                     bool(rf.json_schema.strict)), "response_format"))
        so = self.structured_outputs
        for name, kind, value in (
                ("structured_outputs", "json", so.json_ if so else None),
                ("structured_outputs", "regex", so.regex if so else None),
                ("structured_outputs", "choice", so.choice if so else None),
                ("structured_outputs", "grammar", so.grammar if so else None),
                ("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
                ("guided_choice", "choice", self.guided_choice), ("guided_grammar", "grammar", self.guided_grammar)):
            if value is None:
                continue
            if kind == "json":
                value = _schema_text(value, name)
            elif kind == "choice":
                value = json.dumps(value)
            found.append(Guided(kind, value, name))
        if len(found) > 1:
            raise GuidedError(f"give one output constraint, got {len(found)} ({', '.join(g.param for g in found)})",
                              found[1].param)
        return found[0] if found else None

    def params(self, max_tokens: int, logprobs: int | None, flexible_json: bool = False) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, n=self.n, logprobs=logprobs,
                              guided=self.guided(flexible_json))


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None


MAX_TOOLS = 128
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class ToolCallFunction(_Body):
    name: StrictStr = Field(pattern=TOOL_NAME)
    arguments: StrictStr = Field(max_length=1 << 20)


class ToolCall(_Body):
    """An assistant message's call of a tool (an earlier answer, sent back in the conversation)."""
    id: StrictStr = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: StrictStr | None = Field(None, max_length=256, description="role tool: the call it answers")

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    def template_dict(self) -> dict:
        """The message as chat templates take it: text parts joined, tool-call arguments as objects."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        d.setdefault("content", "")  # an assistant's tool calls without text: templates read content anyway
        for call in d.get("tool_calls", ()):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                pass
        return d


class FunctionDef(_Body):
    name: StrictStr = Field(pattern=TOOL_NAME)
    description: StrictStr | None = Field(None, max_length=65536)
    parameters: dict | None = Field(None, description="a JSON schema of the arguments (none: no arguments)")
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: StrictStr = Field(max_length=256)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools: the model's own calls, parsed), required (one or "
        "more calls, enforced by the grammar engine) or a named function (its arguments, enforced)")
    parallel_tool_calls: StrictBool = True

    @property
    def choice(self):
        """tool_choice in effect: as given, else auto with tools, else none."""
        return self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")

    def _guided(self) -> Guided | None:
        from .tools import constraint
        own = super()._guided()
        if self.tool_choice not in (None, "none") and not self.tools:
            raise GuidedError("tool_choice needs tools", "tool_choice")
        calls = constraint(self.tools or [], self.choice)
        if calls is not None and own is not None:
            raise GuidedError(f"tool_choice {self.choice if isinstance(self.choice, str) else 'named'} constrains "
                              f"the output already: drop {own.param}", own.param)
        if calls is not None and self.choice == "required" and not self.parallel_tool_calls:
            spec = json.loads(calls.spec)
            calls = Guided("json", json.dumps({**spec, "maxItems": 1}), calls.param)
        return calls or own


class RoleUpdate(_Body):
    """POST /admin/roles: change an instance's role in place (it drains first)."""
    instance: StrictStr = Field(min_length=1, max_length=256)
    role: Literal["prefill", "decode", "both"]


class MigrateRequest(_Body):
    """POST /admin/migrate: move part of the decode work of the requests running on src to dst."""
    kind: Literal["heads", "layers"]
    src: StrictStr = Field(min_length=1, max_length=256)
    dst: StrictStr = Field(min_length=1, max_length=256)
    heads: list[StrictInt] | None = Field(None, min_length=1, max_length=4096)
    layers: list[StrictInt] | None = Field(None, min_length=2, max_length=2)


class LinkUpdate(_Body):
    """POST /admin/links: the emulated bandwidth of the link from cluster src to cluster dst."""
    src: StrictStr = Field(min_length=1, max_length=256)
    dst: StrictStr = Field(min_length=1, max_length=256)
    bandwidth_gbps: float = Field(gt=0, le=1e4, allow_inf_nan=False)
