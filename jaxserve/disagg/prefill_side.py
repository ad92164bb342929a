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
record. Concurrency: the engine thread builds and dispatches; one feeder thread per instance blocks on device
results and sockets.
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
    step fails."""
    link: object  # transfer backend link to the decode instance
    feeder: Feeder
    dst_blocks: list[int]
    skip: int  # leading blocks decode already holds
    kv_tokens: int  # tokens whose KV is sent (the prompt, or all but its last token)
    sample: bool = True  # send the first sampled token (False: decode computes the last prompt token)
    layers_per_group: int | None = None  # streaming granularity (None: one group, sent after the step)
    request_id: str | None = None  # the id decode knows the request by (default: the sequence's)
    shm_base: int | None = None  # link is a transfer.shm.ShmLink: the region's offset in decode's segment
    # the same KV (its first whole blocks) into other reservations too, group by group as it is computed: the
    # global KV store's write-back (BanaServe 4.2's third stage); sample False, the same layers_per_group
    copies: list["Handoff"] = field(default_factory=list)
    sender: KVSender | None = field(default=None, init=False)
    ends: bool = field(default=False, init=False)  # the first token ends the request (set by the engine)

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
        return self.sender is not None

    def send_cached(self, kv, blocks: list[int], row: int) -> None:
        """Send KV that is already in the pool (a cached prefix: `blocks` and the state in `row`,
        KVConnector.cached_prefix) with no step: plan, every group's export, and an empty first-token record."""
        self._start(kv, blocks, row, self.request_id)
        for k in range(len(self._groups)):
            self.export(k)
        self.feeder.put(self.sender, [], {"token": None})

    def _start(self, kv, blocks: list[int], row: int, request_id: str, span_rows: int | None = None) -> None:
        layout, dtype = kv.layout, kv.dtype_name
        self._groups = layer_groups(layout.num_layers, self.layers_per_group)
        plan = TransferPlan.build(layout, dtype, self.kv_tokens, blocks, self.dst_blocks, self.skip,
                                  self._groups, kv.head_parts, span_rows)
        plan.shm_base = self.shm_base  # the receiver refuses the plan unless that is its region's offset
        self._staging = plan.check(layout, dtype, self.dst_blocks, self.kv_tokens, self.skip)
        self.sender = KVSender(request_id, self.link, plan, self._staging, shm_base=self.shm_base)
        self.sender.start()
        self._kv, self._row = kv, row
        self._blocks = blocks[self.skip:self.skip + plan.nblocks]
        self._block_size = layout.block_size
        self._exported: set[int] = set()  # layer groups exported whole
        self._sent: set[tuple[int, int]] = set()  # (layer group, span) exported

    def follow(self, seq) -> None:
        """Before a step that runs a chunk of the request: its rows are read from where its blocks and state row are
        now (a request preempted after its hand-off began is recomputed in other blocks; what it sent stays)."""
        if self.sender is not None:
            self._blocks, self._row = seq.block_ids[self.skip:self.skip + self.sender.plan.nblocks], seq.slot
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
        if not isinstance(self.link, PullLink):  # sent from host memory: its copy there (pinned) starts now
            items = host_copies(items)
        self.feeder.put(self.sender, items, None)

    def export_all(self) -> None:
        """Every layer group's export not dispatched yet (a hand-off not streamed layer by layer: as the step's last
        programs are dispatched, before its first token is read)."""
        for k in range(len(self._groups)):
            self.export(k)

    def finish(self, prefix) -> None:
        self.export_all()
        record = ({"token": prefix.token, "logprob": prefix.logprob, "top": [list(t) for t in prefix.top]}
                  if self.sample else {"token": None})
        self.feeder.put(self.sender, [], record)
        for c in self.copies:
            c.finish(prefix)

    def abort(self, reason: str) -> None:
        if self.sender is not None:
            self.sender.abort(reason)
        for c in self.copies:
            c.abort(reason)
