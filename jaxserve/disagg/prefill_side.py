"""Prefill instance: after a request's last prompt chunk, hand its KV to a `KVSender` instead of decoding it.

A `Handoff` is attached to the sequence (`Sequence.transfer.out`) when the request is queued, with where decode
reserved the KV (its block ids, the prefix blocks it already holds) and the link to it. Before the step that runs
the request's last prompt chunk, the engine thread calls `begin` with the engine's KVConnector (engine/connector.py,
all of the engine this module uses): it builds the plan (FlowKV runs of sender vs receiver blocks) and starts the
sender (the plan frame goes out). A prompt longer than a chunk begins at its first chunk instead, its rows in
spans of a chunk's blocks (transfer/plan.py): after each earlier chunk, `export_computed` dispatches the export
of the spans that chunk completed, so they travel while the later chunks compute (SGLang sends a chunked
prefill's KV chunk by chunk the same way). With `layers_per_group` the last chunk's step then runs as
one program per layer group and, as each is dispatched, `export(k)` dispatches that group's export program: the
device arrays go to the `Feeder` thread, which waits for each (JAX dispatch is asynchronous: group k's KV is sent
while groups k+1.. still compute; on an accelerator the group's copy to host memory is started as it is
dispatched, into pinned host memory), wraps it with DLPack and queues its sends (on the device backend it offers
the group's arrays for decode to pull instead: transfer/pull.py). `finish` sends what is left and the first-token
record. A prefill that starts while decode still reserves (the router's Prefill call beside its Decode call, as
SGLang's router sends a request to both servers at once) has no reservation yet: its exports wait in the hand-off
until `bind` brings it (from the worker's Bind call), then the plan goes out and they follow.
Concurrency: the engine thread builds and dispatches; one feeder thread per instance blocks on device
results and sockets; `bind` runs on the worker's loop (a lock per hand-off).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from jax.profiler import TraceAnnotation

from jaxserve.transfer.device import host_copies, to_host, whole
from jaxserve.transfer.plan import TransferPlan, layer_groups
from jaxserve.transfer.pull import PullLink
from jaxserve.transfer.sender import KVSender

log = logging.getLogger("jaxserve.prefill")


class Feeder:
    """Moves exported device arrays into their senders, in order, off the engine thread."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._run, name="kv-feeder", daemon=True)
        self._t.start()

    def put(self, sender: KVSender, items: list, record: dict | None) -> None:
        self._q.put((sender, items, record))

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            sender, items, record = job
            try:
                with TraceAnnotation("kv.send", request=sender.request_id, arrays=len(items)):
                    self._feed(sender, items, record)
            except Exception as e:  # noqa: BLE001 - the transfer fails, the worker keeps serving
                log.exception("feeding %s failed", sender.request_id)
                sender.abort(f"prefill side error: {type(e).__name__}: {e}")

    @staticmethod
    def _feed(sender: KVSender, items: list, record: dict | None) -> None:
        if isinstance(sender.link, PullLink):  # the receiver pulls the group's arrays device to device
            if not sender.state.final:
                sender.offer_arrays([(index, whole(x)) for index, x in items])
        else:
            for index, x in items:
                if sender.state.final:
                    break
                sender.send_array(index, to_host(x))
        if record is not None:
            sender.finish(record)


@dataclass
class Handoff:
    """Where one request's KV goes, and its transfer. The engine thread calls `begin` before the step that
    runs the request's first prompt chunk (a prompt in one chunk: its last), `follow` before each later one,
    `export_computed` after each chunk but the last, `export(k)` as the last chunk's layer group k's program is
    dispatched (layer-wise streaming), and `finish` after that step with the sampled first token; `abort` if a
    step fails.

    A hand-off made before decode reserved (link and dst_blocks None, `pull` saying which kind of link it will
    be, skip 0: the prefill started while decode reserves) is `bind`-ed to the reservation from the worker's loop
    when it comes: its exports and first-token record are dispatched as ever and wait in the hand-off, in order,
    until then; the plan goes out and they follow at `bind` (one lock: the engine thread and the binding
    thread)."""
    link: object  # transfer backend link to the decode instance (None until `bind`)
    feeder: Feeder
    dst_blocks: list[int] | None  # decode's reservation (None until `bind`)
    skip: int  # leading blocks decode already holds
    kv_tokens: int  # tokens whose KV is sent (the prompt, or all but its last token)
    sample: bool = True  # send the first sampled token (False: decode computes the last prompt token)
    layers_per_group: int | None = None  # streaming granularity (None: one group, sent after the step)
    request_id: str | None = None  # the id decode knows the request by (default: the sequence's)
    shm_base: int | None = None  # link is a transfer.shm.ShmLink: the region's offset in decode's segment
    # the same KV (its first whole blocks) into other reservations too, group by group as it is computed: the
    # global KV store's write-back (BanaServe 4.2's third stage); sample False, the same layers_per_group
    copies: list["Handoff"] = field(default_factory=list)
    pull: bool | None = None  # the link is a pull.PullLink (set from link; given for a hand-off bound later)
    sender: KVSender | None = field(default=None, init=False)
    ends: bool = field(default=False, init=False)  # the first token ends the request (set by the engine)

    def __post_init__(self):
        if self.link is not None:
            self.pull = isinstance(self.link, PullLink)
        elif self.pull is None or self.skip:
            raise ValueError("a hand-off bound later says whether its link pulls (pull) and skips nothing")
        self._lock = threading.Lock()
        self._begun = False
        self._parked: list = []  # (items, record) made before `bind`, in order
        self._failed: str | None = None  # aborted before a sender existed

    def groups(self, kv) -> list[tuple[int, int]] | None:
        """The layer groups the step is to run as (None: one program, everything exported after it)."""
        groups = layer_groups(kv.layout.num_layers, self.layers_per_group)
        return groups if len(groups) > 1 else None

    def begin(self, kv, seq) -> None:
        """Plan the transfer and send the plan (kv: the engine's KVConnector), before the request's first chunk
        that computes any of its KV (or its last)."""
        self._start(kv, seq.block_ids, seq.slot, self.request_id or seq.request_id, kv.span_rows)
        for c in self.copies:
            c.begin(kv, seq)

    @property
    def begun(self) -> bool:
        return self._begun

    @property
    def bound(self) -> bool:
        return self.dst_blocks is not None

    def send_cached(self, kv, blocks: list[int], row: int) -> None:
        """Send KV that is already in the pool (a cached prefix: `blocks` and the state in `row`,
        KVConnector.cached_prefix) with no step: plan, every group's export, and an empty first-token record."""
        self._start(kv, blocks, row, self.request_id)
        for k in range(len(self._groups)):
            self.export(k)
        self._put([], {"token": None})

    def _start(self, kv, blocks: list[int], row: int, request_id: str, span_rows: int | None = None) -> None:
        layout, dtype = kv.layout, kv.dtype_name
        self._groups = layer_groups(layout.num_layers, self.layers_per_group)
        # what the plan needs beside decode's blocks; the staging (what each export holds) does not depend on them
        self._planned = (layout, dtype, list(blocks), kv.head_parts, span_rows, request_id)
        dst = self.dst_blocks if self.bound else blocks  # unbound: a plan onto its own blocks gives the staging
        plan = self._plan(dst)
        staging = plan.check(layout, dtype, dst, self.kv_tokens, self.skip)
        self._kv, self._row = kv, row
        self._nblocks = -(-self.kv_tokens // layout.block_size) - self.skip
        self._blocks = blocks[self.skip:self.skip + self._nblocks]
        self._block_size = layout.block_size
        self._exported: set[int] = set()  # layer groups exported whole
        self._sent: set[tuple[int, int]] = set()  # (layer group, span) exported
        with self._lock:
            self._staging, self._begun = staging, True
            if self.bound and self._failed is None:
                self._open(plan)

    def _plan(self, dst_blocks: list[int]) -> TransferPlan:
        layout, dtype, blocks, head_parts, span_rows, _ = self._planned
        plan = TransferPlan.build(layout, dtype, self.kv_tokens, blocks, dst_blocks, self.skip, self._groups,
                                  head_parts, span_rows)
        plan.shm_base = self.shm_base  # the receiver refuses the plan unless that is its region's offset
        return plan

    def _open(self, plan: TransferPlan) -> None:
        """(Under the lock, begun and bound.) The sender of `plan` (checked against the reservation), its plan
        sent, and what waited for it queued."""
        self.sender = KVSender(self._planned[-1], self.link, plan, self._staging, shm_base=self.shm_base)
        self.sender.start()
        for items, record in self._parked:
            self.feeder.put(self.sender, items, record)
        self._parked.clear()

    def bind(self, link, dst_blocks: list[int], shm_base: int | None) -> None:
        """Decode's reservation for a hand-off made before it (the worker's loop): the plan goes out once begun,
        with what was exported so far. Raises ValueError: bound already; another kind of link, or blocks that do
        not hold the KV (the hand-off then fails: `failed` says why)."""
        with self._lock:
            if self._failed is not None:
                return
            if self.bound:
                raise ValueError("the hand-off has its reservation already")
            try:
                if isinstance(link, PullLink) != self.pull:
                    raise ValueError(f"the link to decode {'does not pull' if self.pull else 'pulls'} device "
                                     "arrays as the exports made for it expect")
                self.link, self.dst_blocks, self.shm_base = link, list(dst_blocks), shm_base
                if self._begun:  # (the staging exported is the one the plan checks: both are of the same rows)
                    plan = self._plan(self.dst_blocks)
                    layout, dtype = self._planned[:2]
                    plan.check(layout, dtype, self.dst_blocks, self.kv_tokens, self.skip)
                    self._open(plan)
            except Exception as e:
                self._failed = f"destination refused: {e}"
                self._parked.clear()
                raise ValueError(self._failed) from None

    @property
    def failed(self) -> str | None:
        """Why a hand-off failed before it had a sender (its destination refused, or aborted unbound)."""
        return self._failed

    def _put(self, items: list, record: dict | None) -> None:
        with self._lock:
            if self.sender is not None:
                self.feeder.put(self.sender, items, record)
            elif self._failed is None:
                self._parked.append((items, record))

    def follow(self, seq) -> None:
        """Before a step that runs a chunk of the request: its rows are read from where its blocks and state row are
        now (a request preempted after its hand-off began is recomputed in other blocks; what it sent stays)."""
        if self._begun:
            self._blocks, self._row = seq.block_ids[self.skip:self.skip + self._nblocks], seq.slot
        for c in self.copies:
            c.follow(seq)

    def export(self, k: int) -> None:
        """Dispatch layer group k's export (its program reads the pool as the step's group k left it: the spans
        of its rows not exported yet, with its rings and state) and queue the arrays to the feeder, which sends
        each as soon as it is computed."""
        if k in self._exported:
            return
        self._exported.add(k)
        self._send(k, range(len(self._staging.spans)))
        for c in self.copies:
            c.export(k)

    def export_computed(self, tokens: int) -> None:
        """After a chunk before the last, whose end is token `tokens`: every layer group's spans whose rows that
        chunk or an earlier one computed, exported now (the last span, which holds the rings and state, waits for
        the last chunk)."""
        rows = tokens // self._block_size - self.skip
        spans = [s for s, (r0, n) in enumerate(self._staging.spans[:-1]) if r0 + n <= rows]
        for k in range(len(self._groups)) if spans else ():
            self._send(k, spans)
        for c in self.copies:
            c.export_computed(tokens)

    def _send(self, k: int, spans) -> None:
        spans = [s for s in spans if (k, s) not in self._sent]
        if not spans:
            return
        self._sent.update((k, s) for s in spans)
        items = self._kv.export(self._staging, k, self._blocks, self._row, spans)
        if not self.pull:  # sent from host memory: its copy there (pinned) starts now
            items = host_copies(items)
        self._put(items, None)

    def export_all(self) -> None:
        """Every layer group's export not dispatched yet (a hand-off not streamed layer by layer: as the step's last
        programs are dispatched, before its first token is read)."""
        for k in range(len(self._groups)):
            self.export(k)

    def finish(self, prefix) -> None:
        self.export_all()
        record = ({"token": prefix.token, "logprob": prefix.logprob, "top": [list(t) for t in prefix.top]}
                  if self.sample else {"token": None})
        self._put([], record)
        for c in self.copies:
            c.finish(prefix)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.sender is not None:
                self.sender.abort(reason)
            elif self._failed is None:
                self._failed = reason
                self._parked.clear()
        for c in self.copies:
            c.abort(reason)
