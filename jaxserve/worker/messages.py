"""Schemas of the control-plane requests (rpc.py validates every request against its method's schema).

Unknown fields are refused, types are strict (a string is not an integer), every list and string is bounded.
What the engine checks itself (token ids inside the vocabulary, lengths against the context, sampling ranges)
is left to it; it answers INVALID_ARGUMENT as well. No address, shared-memory segment name or offset outside a
reservation comes from a caller: a Prefill call names its decode instance, and the worker looks it up in the
router's registry of instances (the peer table that Register answers with).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr, model_validator

from ..cache.events import KINDS
from ..sampling import SamplingParams

MAX_TOKENS = 1 << 22  # token ids in one prompt (+ output): far beyond any context, far below MAX_MESSAGE
MAX_BLOCKS = 1 << 22

Name = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Ids = Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]], Field(max_length=MAX_TOKENS)]
TopLogprob = tuple[StrictInt, FiniteFloat]
Logprobs = Annotated[list[tuple[FiniteFloat, Annotated[list[TopLogprob], Field(max_length=64)]]],
                     Field(max_length=MAX_TOKENS)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GuidedMsg(_Msg):
    """structured.Guided as JSON."""
    kind: Literal["json", "regex", "choice", "grammar"]
    spec: Annotated[StrictStr, Field(max_length=1 << 20)]
    param: Annotated[StrictStr, Field(max_length=64)] = "response_format"


class Params(_Msg):
    """SamplingParams as JSON (dataclasses.asdict of one); `sampling()` checks the ranges."""
    max_tokens: StrictInt = Field(16, ge=1, le=MAX_TOKENS)
    temperature: FiniteFloat = 1.0
    top_p: FiniteFloat = 1.0
    top_k: StrictInt = Field(0, ge=0, lt=1 << 31)
    min_p: FiniteFloat = 0.0
    repetition_penalty: FiniteFloat = 1.0
    presence_penalty: FiniteFloat = 0.0
    frequency_penalty: FiniteFloat = 0.0
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    stop: Annotated[list[Annotated[StrictStr, Field(max_length=1024)]], Field(max_length=16)] = []
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]], Field(max_length=1024)] = []
    ignore_eos: StrictBool = False
    n: StrictInt = Field(1, ge=1, le=64)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    guided: GuidedMsg | None = None

    def sampling(self) -> SamplingParams:
        """-> SamplingParams; raises ValueError on an out-of-range value."""
        return SamplingParams(**self.model_dump())


class _Request(_Msg):
    request_id: Name
    prompt: Annotated[Ids, Field(min_length=1)]
    params: Params = Params()


class _Resumable(_Request):
    output: Ids = []  # a resumed request's output so far (worker/main.py)
    logprobs: Logprobs | None = None
    updates: Name | None = None  # the Updates stream its running updates leave on (worker/fanout.py)

    def resume(self) -> dict:
        """LLMEngine's resume arguments (output=, logprobs=), empty for a fresh request."""
        return {"output": list(self.output), "logprobs": self.logprobs} if self.output else {}


class Health(_Msg):
    pass


class Generate(_Resumable):
    pass


class SetRole(_Msg):
    """This worker's new role, taken in place once what it has in flight is done (the router's role flips)."""
    role: Literal["prefill", "decode", "both"]


class SetLink(_Msg):
    """The emulated bandwidth of this worker's links to cluster `dst` (the router's admin endpoint)."""
    dst: Name
    bandwidth_gbps: FiniteFloat = Field(gt=0, le=1e4)


class Decode(_Resumable):
    kv_tokens: StrictInt = Field(ge=1, le=MAX_TOKENS)
    deadline_s: FiniteFloat | None = Field(None, gt=0, le=3600)
    # reuse at most this many leading blocks of this instance's prefix cache (a prefill already under way sends
    # the KV from that block on); None: as many as it holds
    max_skip: StrictInt | None = Field(None, ge=0, le=MAX_BLOCKS)


class Reservation(_Msg):
    """Where an instance reserved KV (the first answer of its Decode or Import stream), as the router passes it on."""
    instance: Name  # the receiving instance; its KV address and segment come from the peer table
    blocks: Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]], Field(max_length=MAX_BLOCKS)]
    skip: StrictInt = Field(ge=0, le=MAX_BLOCKS)
    shm_base: StrictInt | None = Field(None, ge=0, lt=1 << 48)  # the region's offset in decode's segment
    pull: StrictBool = False


class PrefixFrom(_Msg):
    """A cached prefix (the prompt's first `tokens`, whole blocks) arriving into this instance through the Import
    stream `import_id` (the router's load from the global KV store) while the prefill runs over it, or copied
    from the store's shared pool by the Load call `import_id` before the prefill runs."""
    import_id: Name
    tokens: StrictInt = Field(ge=1, le=MAX_TOKENS)


class StoreCopy(_Msg):
    """The prompt's first `tokens` (whole blocks) go into this Import reservation on the global KV store too,
    layer group by layer group as the prefill computes them (`import_id`: that Import's request id)."""
    import_id: Name
    tokens: StrictInt = Field(ge=1, le=MAX_TOKENS)
    dst: Reservation


class Prefill(_Request):
    """dst: where decode reserved the KV; or, the prefill starting while decode reserves, `pending_dst` names the
    decode instance and a Bind call brings its reservation (whose skip is then 0)."""
    kv_tokens: StrictInt = Field(ge=1, le=MAX_TOKENS)
    sample: StrictBool = True
    dst: Reservation | None = None
    pending_dst: Name | None = None
    prefix_from: PrefixFrom | None = None
    store: StoreCopy | None = None

    @model_validator(mode="after")
    def _one_dst(self):
        if (self.dst is None) == (self.pending_dst is None):
            raise ValueError("a Prefill names its destination once: dst (the reservation) or pending_dst (the "
                             "decode instance whose reservation a Bind call brings)")
        if self.pending_dst is not None and (self.prefix_from is not None or self.store is not None):
            raise ValueError("pending_dst: a Prefill over a prefix_from or with a store copy takes its dst at once")
        return self


class Bind(_Msg):
    """The reservation a Prefill called with `pending_dst` sends its KV into (its skip 0: that prefill sends every
    block)."""
    request_id: Name
    dst: Reservation


class Import(_Msg):
    """A cached prefix (whole blocks) to receive into this instance's prefix cache."""
    request_id: Name
    prompt: Annotated[Ids, Field(min_length=1)]
    deadline_s: FiniteFloat | None = Field(None, gt=0, le=3600)


class Export(_Msg):
    """A prefix of this instance's prefix cache to send into the reservation Import made on `dst.instance`."""
    request_id: Name
    prompt: Annotated[Ids, Field(min_length=1)]
    dst: Reservation


class Load(_Msg):
    """A cached prefix (whole blocks) to copy from the shared pool of the global KV store `store` on this host into
    this instance's prefix cache."""
    request_id: Name
    prompt: Annotated[Ids, Field(min_length=1)]
    store: Name


class PoolLeaf(_Msg):
    offset: StrictInt = Field(ge=0, lt=1 << 48)
    shape: Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]], Field(max_length=8)]
    dtype: Literal["float32", "uint16"]


class PoolTable(_Msg):
    """Where the pool's seqlock table lies: one entry per block, then one per state row."""
    offset: StrictInt = Field(ge=0, lt=1 << 48)
    blocks: StrictInt = Field(ge=0, lt=1 << 31)
    rows: StrictInt = Field(ge=0, lt=1 << 31)


class PoolInfo(_Msg):
    """The global KV store's shared pool (cache/shared_pool.py SharedPool.describe, and the host's boot id)."""
    name: Annotated[StrictStr, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+$")]
    boot: Annotated[StrictStr, Field(max_length=255)]
    bytes: StrictInt = Field(ge=0)
    signature: Annotated[StrictStr, Field(max_length=64)]
    leaves: Annotated[list[PoolLeaf], Field(max_length=256)]
    table: PoolTable


class ShmInfo(_Msg):
    name: Annotated[StrictStr, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+$")]
    boot: Annotated[StrictStr, Field(max_length=255)]
    bytes: StrictInt = Field(ge=0)


Scalar = StrictInt | FiniteFloat | StrictStr | StrictBool | None


Hash = Annotated[StrictStr, Field(min_length=32, max_length=32, pattern="^[0-9a-f]{32}$")]
Hashes = Annotated[list[Hash], Field(max_length=MAX_BLOCKS)]
EventKind = Annotated[StrictStr, Field(pattern=f"^({'|'.join(KINDS)})$")]


class CacheState(_Msg):
    blocks: Hashes = []
    snaps: Hashes = []


class CacheBatch(_Msg):
    """Prefix-cache events (jaxserve/cache/events.py): those numbered from `from_` on, or the full state."""
    epoch: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    from_: StrictInt | None = Field(None, ge=0, alias="from")
    events: Annotated[list[tuple[EventKind, Hashes]], Field(max_length=4096)] = []
    full: CacheState | None = None
    next: StrictInt = Field(ge=0)


class StepTotals(_Msg):
    """One kind of engine step's time since the worker started (engine/steptimer.py StepTimer.totals)."""
    count: StrictInt = Field(ge=0)
    ms: FiniteFloat = Field(ge=0)
    phases_ms: Annotated[dict[Annotated[str, Field(max_length=64)], FiniteFloat], Field(max_length=64)] = {}


class Register(_Msg):
    """A worker's registration / heartbeat (its Health answer); `kv`: its prefix-cache events since the number
    the router's last answer asked for (`kv_want`), or its full cache state when that was None; `kv_epoch`:
    its events' epoch, on every heartbeat (a restarted worker is a new epoch at once)."""
    name: Name
    role: Name
    address: Annotated[StrictStr, Field(min_length=1, max_length=512)]
    kv_address: tuple[Annotated[StrictStr, Field(max_length=255)], StrictInt] | None = None
    max_model_len: StrictInt = Field(ge=1)
    pid: StrictInt | None = None
    stats: Annotated[dict[Annotated[str, Field(max_length=64)], Scalar], Field(max_length=64)] = {}
    steps: Annotated[dict[Annotated[str, Field(max_length=64)], StepTotals], Field(max_length=16)] = {}
    links: Annotated[dict[Annotated[str, Field(max_length=600)],
                          Annotated[dict[Annotated[str, Field(max_length=64)], Scalar], Field(max_length=64)]],
                     Field(max_length=256)] = {}
    shm: ShmInfo | None = None  # its shared-memory receive pool
    pool: PoolInfo | None = None  # a store's shared KV pool
    reads_pool: StrictBool = False  # copies prefixes out of a store's shared pool on its host (one device)
    pull: StrictBool = False  # takes device pulls
    pull_address: Annotated[StrictStr, Field(max_length=512)] | None = None  # prefill: its JAX transfer server
    ipc: Annotated[StrictStr, Field(max_length=127)] | None = None  # the GPU it shares KV on (transfer/ipc.py)
    request_state: StrictBool = False  # the model has request-level state (prefixes reusable at snapshots only)
    kv: CacheBatch | None = None
    kv_epoch: Annotated[StrictStr, Field(min_length=1, max_length=64)] | None = None  # its cache events' epoch


class Migrate(_Msg):
    """Move part of the decode work of the requests decoding here to instance `dst` (engine/migration.py)."""
    kind: Literal["heads", "layers"]
    dst: Name
    heads: Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 16)]], Field(max_length=4096)] | None = None
    layers: Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 16)]], Field(min_length=2,
                                                                                 max_length=2)] | None = None


class Updates(_Msg):
    """Open the Updates stream `stream` (worker/fanout.py): the running updates of the requests that name it."""
    stream: Name


class Profile(_Msg):
    """Trace this worker's process for `seconds` into `<server.profile_dir>/<stamp>/<instance>` (trace.py)."""
    seconds: FiniteFloat = Field(gt=0, le=300)
    stamp: Annotated[StrictStr, Field(pattern=r"^[0-9A-Za-z_.-]{1,64}$")]


WORKER = {"Health": Health, "Decode": Decode, "Prefill": Prefill, "Bind": Bind, "Generate": Generate,
          "SetLink": SetLink, "SetRole": SetRole, "Import": Import, "Export": Export, "Migrate": Migrate, "Load": Load,
          "Profile": Profile, "Updates": Updates}
ROUTER = {"Register": Register}
