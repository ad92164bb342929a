"""Prefill instance: after a request's last prompt chunk, hand its KV to a `KVSender` instead of decoding it.

A `Handoff` is attached to the sequence (`Sequence.handoff`) when the request is queued, with where decode
reserved the KV (its block ids, the prefix blocks it already holds) and the link to it. The engine thread
calls it when prefill finishes: it builds the plan (FlowKV runs of sender vs receiver blocks), starts the
sender (the plan frame goes out), and dispatches one export program per layer group. The device arrays go to
the `Feeder` thread, which waits for each (JAX dispatch is asynchronous, so the engine thread moves on to the
next step at once), wraps it with DLPack and queues its sends, then the first-token record. Concurrency: the
engine thread builds and dispatches; one feeder thread per instance blocks on device results and sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from transfer.device import to_host
from transfer.plan import TransferPlan, layer_groups
from transfer.sender import KVSender

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
                for index, x in items:
                    if sender.state.final:
                        break
                    sender.send_array(index, to_host(x))
                if record is not None:
                    sender.finish(record)
            except Exception as e:  # noqa: BLE001 - the transfer fails, the worker keeps serving
                log.exception("feeding %s failed", sender.request_id)
                sender.abort(f"prefill side error: {type(e).__name__}: {e}")


@dataclass
class Handoff:
    """Where one request's KV goes; called by the engine thread when its prefill completes."""
    link: object  # transfer backend link to the decode instance
    feeder: Feeder
    dst_blocks: list[int]
    skip: int  # leading blocks decode already holds
    kv_tokens: int  # tokens whose KV is sent (the prompt, or all but its last token)
    sample: bool = True  # send the first sampled token (False: decode computes the last prompt token)
    layers_per_group: int | None = None  # streaming granularity (None: one group)
    request_id: str | None = None  # the id decode knows the request by (default: the sequence's)
    sender: KVSender | None = field(default=None, init=False)

    def __call__(self, llm, seq, prefix) -> None:
        eng = llm.engine
        layout = eng.layout
        dtype = llm.dtype_name
        groups = layer_groups(layout.num_layers, self.layers_per_group)
        plan = TransferPlan.build(layout, dtype, self.kv_tokens, seq.block_ids, self.dst_blocks, self.skip, groups)
        st = plan.check(layout, dtype, self.dst_blocks, self.kv_tokens, self.skip)
        sender = KVSender(self.request_id or seq.request_id, self.link, plan, st)
        self.sender = sender
        sender.start()
        n = self.skip + plan.nblocks
        items = []
        for k in range(len(groups)):
            items.extend(eng.export_kv(st, k, seq.block_ids[self.skip:n], seq.slot))
        record = ({"token": prefix.token, "logprob": prefix.logprob, "top": [list(t) for t in prefix.top]}
                  if self.sample else {"token": None})
        self.feeder.put(sender, items, record)
