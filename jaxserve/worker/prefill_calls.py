"""A worker's Prefill and Bind calls: run a prompt here and hand its KV to decode's reservation.

A Prefill names decode's reservation (`dst`), or, sent while decode still reserves (the router's Prefill call beside
its Decode call), the decode instance alone (`pending_dst`): the prefill starts at once, its exports wait in the
request's hand-off (disagg/prefill_side.py), and the Bind call the router makes when the reservation comes binds
them to it. The first token goes back as soon as it is sampled either way; the KV's numbers once decode acknowledged
every byte.

Concurrency: the handlers run on the worker's asyncio loop and hand the engine work as commands (its engine
thread); they read the worker's role, engine, intake, feeder, peers and prefix calls (main.py), which a role change
may replace between calls. `pending` (request id -> its unbound hand-off) is the loop's alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from . import peers

BIND_WAIT_S = 10.0  # a Bind that comes before its Prefill call (two calls, either may be handled first) waits this long


@dataclass
class _Pending:
    """A Prefill's hand-off waiting for its reservation: the decode instance, its peer-table entry, and an event set
    once bound (or refused)."""
    handoff: object
    instance: str
    peer: dict
    bound: asyncio.Event


class PrefillCalls:
    def __init__(self, worker):
        """worker: the Worker (main.py) whose calls these are."""
        self.w = worker
        self.cfg = worker.cfg
        self.pending: dict[str, _Pending] = {}
        self._waiting: dict[str, asyncio.Event] = {}  # set when the Prefill call a waiting Bind names comes

    async def prefill(self, req, ctx):
        import grpc
        from ..disagg.prefill_side import Handoff
        from ..engine.client import RequestError
        w = self.w
        if w.role in ("decode", "store"):
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{w.inst.name} is a {w.role} instance")
        rid, kv, dst = req.request_id, req.kv_tokens, req.dst
        t = self.cfg.transfer
        name = dst.instance if dst is not None else req.pending_dst
        peer = await w.peers.get(name, decode=True)
        if dst is not None:
            why = w.peers.check_dst(peer, dst, kv, w.llm.layout, w.llm.dtype_name)
        else:
            why = w.peers.check_peer(peer, name, "pending_dst")
        if why is None and rid in self.pending:
            why = f"request_id: {rid!r} is prefilling here already"
        pf = req.prefix_from
        if why is None and pf is not None:
            why = self._check_prefix_from(pf, kv)
        sc, store_peer = req.store, None
        if why is None and sc is not None:
            store_peer = await w.peers.get(sc.dst.instance)
            why = self._check_store_copy(store_peer, sc, kv)
        if why is not None:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        prompt = list(req.prompt)[:kv]
        over = []  # the IncomingPrefix the prefill runs over (none when that Import has ended)
        # or a Load here from the store's shared pool, under way: its copy is queued on the engine thread already
        # (Load queues it before it first awaits), so the prefill, queued after it, finds the prefix cached
        loading = w.prefixes.loads.get(pf.import_id) if pf is not None else None
        pending = None
        try:
            params = req.params.sampling()
            copies, per_group = [], t.groups_of(kv)
            # the store's copy leaves group by group beside decode's; a model with request-level state would
            # need the state at the copy's end, a snapshot the step does not export: the router puts it after
            if sc is not None and not w.llm.layout.has_request_state:
                store_link, store_base = w.peers.link_to(store_peer, sc.dst)
                copies.append(Handoff(store_link, w.feeder, list(sc.dst.blocks), sc.dst.skip, sc.tokens, False,
                                      per_group, request_id=sc.import_id, shm_base=store_base))
            if dst is not None:
                link, shm_base = w.peers.link_to(peer, dst)
                handoff = Handoff(link, w.feeder, list(dst.blocks), dst.skip, kv, req.sample, per_group,
                                  request_id=rid, shm_base=shm_base, copies=copies)
            else:  # bound when the reservation comes (bind), every block sent
                handoff = Handoff(None, w.feeder, None, 0, kv, req.sample, per_group, request_id=rid,
                                  pull=w.peers.pulls(peer, name))
                pending = self.pending[rid] = _Pending(handoff, name, peer, asyncio.Event())
                if rid in self._waiting:
                    self._waiting.pop(rid).set()

            def add(eng):
                inc = w.intake.prefixes.get(pf.import_id) if pf is not None else None
                if inc is not None and inc.tokens != prompt[:pf.tokens]:
                    raise RequestError(f"prefix_from.import_id: {pf.import_id!r} carries another prefix than the "
                                       f"prompt's first {pf.tokens} tokens")
                seqs = eng.add_request(rid, prompt, params)
                seqs[0].transfer.out = handoff
                if inc is not None and inc.pending:
                    seqs[0].transfer.into = inc
                    over.append(inc)
                return seqs, None
            q, _ = await w.engine.attach(rid, add)
        except (RequestError, ValueError) as e:
            self._drop(rid, pending)
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            try:
                while True:
                    u = await q.get()
                    if u.finished:
                        break
            finally:
                w.engine.abort(rid)
            if u.error or u.finish_reason != "handoff":
                await ctx.abort(grpc.StatusCode.ABORTED, f"prefill failed: {u.error or u.finish_reason}")
            if handoff.sample and not handoff.ends:  # the client may see the first token while its KV travels
                yield {"first": dataclasses.asdict(dataclasses.replace(u, finished=False, finish_reason=None))}
            if pending is not None:
                try:
                    await asyncio.wait_for(pending.bound.wait(), t.deadline_s)
                except asyncio.TimeoutError:
                    handoff.abort(f"no reservation came within {t.deadline_s}s")
                if handoff.sender is None:
                    await ctx.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {handoff.failed}")
        finally:
            self._drop(rid, pending)
        sent = await peers.sent(handoff.sender, ctx, t.deadline_s)
        prefix = None
        if loading is not None:
            prefix = {"tokens": pf.tokens, "streamed_groups": 0, "error": await asyncio.shield(loading),
                      "via": "shared"}
        elif pf is not None:  # what arrived while the prefill ran (none: the Import had ended before it began)
            prefix = {"tokens": pf.tokens, "streamed_groups": len(over[0].imported) if over else 0,
                      "error": over[0].error if over else None, "via": "transfer"}
        store = None if sc is None else {"streamed": bool(copies)}  # False: the router puts it after the prefill
        yield {**sent, "token": u.token_ids[0] if u.token_ids and handoff.sample else None, "ttft_s": u.ttft_s,
               **({"prefix": prefix} if prefix is not None else {}), **({"store": store} if store else {})}

    def _drop(self, rid: str, pending: _Pending | None) -> None:
        """The Prefill call is over: its hand-off no longer waits for a Bind (one still unbound fails)."""
        if pending is not None and self.pending.get(rid) is pending:
            del self.pending[rid]
            if not pending.handoff.bound:
                pending.handoff.abort("the prefill ended before its reservation came")

    async def bind(self, req, ctx):
        """Bind: decode's reservation for a Prefill called with pending_dst -> {"bound": true}. NOT_FOUND when no
        such prefill waits here (it ended, or failed; or its call did not come within BIND_WAIT_S), INVALID_ARGUMENT
        for a reservation it cannot send into (the prefill then fails: ABORTED on its own call)."""
        import grpc
        w, dst, rid = self.w, req.dst, req.request_id
        p = self.pending.get(rid)
        if p is None:  # its Prefill call may not have been handled yet
            came = self._waiting.setdefault(rid, asyncio.Event())
            try:
                await asyncio.wait_for(came.wait(), BIND_WAIT_S)
            except asyncio.TimeoutError:
                if self._waiting.get(rid) is came:
                    del self._waiting[rid]
            p = self.pending.get(rid)
        if p is None:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"no prefill of {req.request_id!r} waits for its reservation "
                                                       "here")
        why = (f"dst.instance: {dst.instance!r}, the Prefill named {p.instance!r}" if dst.instance != p.instance
               else f"dst.skip: {dst.skip}: a prefill bound later sends every block (skip 0)" if dst.skip
               else w.peers.check_dst(p.peer, dst, p.handoff.kv_tokens, w.llm.layout, w.llm.dtype_name))
        try:
            if why is not None:
                p.handoff.abort(f"destination refused: {why}")
            else:
                link, shm_base = w.peers.link_to(p.peer, dst)
                p.handoff.bind(link, list(dst.blocks), shm_base)
        except ValueError as e:
            why = str(e)
        finally:
            p.bound.set()
        if why is not None:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        return {"bound": True}

    def _check_store_copy(self, peer: dict | None, sc, kv: int) -> str | None:
        """Why the prompt's KV cannot also go to the store's reservation `sc` (None: it can)."""
        llm = self.w.llm
        bs = llm.layout.block_size
        if sc.tokens % bs or sc.tokens > kv:
            return f"store.tokens: {sc.tokens} is not whole blocks of {bs} tokens within the {kv} tokens prefilled"
        if peer is not None and peer.get("role") != "store":
            return f"store.dst.instance: {sc.dst.instance!r} is a {peer.get('role')} instance, not the store"
        why = self.w.peers.check_dst(peer, sc.dst, sc.tokens, llm.layout, llm.dtype_name, decode=False)
        return None if why is None else "store." + why

    def _check_prefix_from(self, pf, kv: int) -> str | None:
        """Why the prompt cannot run over the prefix pf names (None: it can)."""
        bs = self.w.llm.layout.block_size
        if pf.tokens % bs or pf.tokens >= kv:
            return (f"prefix_from.tokens: {pf.tokens} is not whole blocks of {bs} tokens shorter than the "
                    f"{kv} tokens prefilled")
        return None
