"""A request's Prefill call, the router's side of the worker's (worker/prefill_calls.py).

The call runs the prompt on the prefill instance into decode's reservation: named in the call, or, called beside
the Decode call before decode reserved (the router's early prefill, cluster.py), sent to it by a Bind call once
decode made it. The first token is handed on as soon as it is sampled; the call's answer (once decode acknowledged
every KV byte) settles the prefix move and store write-back the placement named and the router's measured KV bytes
per token. Runs on the router's asyncio loop.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from jaxserve.engine.client import Update

from .calls import message
from .registry import WorkerInfo
from .requests import Retry, Silent, Sub, raise_failure, settle


class Prefills:
    def __init__(self, router):
        """router: the Router (cluster.py) whose requests these calls serve."""
        self.r = router
        self.cfg, self.workers = router.cfg, router.workers

    async def run(self, s: Sub, p: WorkerInfo, on_first, bound: asyncio.Future | None = None,
                  decode: str | None = None) -> None:
        """Run the prompt on prefill instance p into the reservation (after moving a cached prefix to p when
        the placement says so); on_first(Update) gets the first token as soon as it is sampled; returns once
        decode acknowledged every KV byte. Raises Retry. bound: called before decode reserved (early), the
        reservation on instance `decode` to come, sent to p by a Bind call when it does."""
        r = self.r
        load = await r.prefixes.move_prefix(s, p) if s.placement.move_prefix is not None else None
        tokens = s.prompt + s.output  # resuming: the output so far is prompt to this prefill
        params = {**s.params, "max_tokens": s.params["max_tokens"] - len(s.output)}
        p.inflight += 1
        s.prefilling = p.name
        n, t0, computed = max(1, s.placement.uncached_tokens or len(tokens)), time.monotonic(), False
        p.prefill.start(n)
        store = r.prefixes.name_put(s)
        dst = {"dst": s.reserved} if bound is None else {"pending_dst": decode}
        msg = message("Prefill", request_id=s.xid, prompt=tokens, params=params, kv_tokens=s.kv(),
                      sample=s.kv() == len(tokens), **dst, **({"prefix_from": load} if load else {}),
                      **({"store": store} if store else {}))
        call = self.workers.client(p).stream("Prefill", msg, timeout=self.cfg.server.request_timeout_s)
        binding = None if bound is None else asyncio.ensure_future(self._bind(p, s.xid, bound))
        try:
            it = call.__aiter__()
            while True:
                try:
                    res = await self._answer(p, it, binding)
                except StopAsyncIteration:
                    raise Retry(f"{p.name} ended its Prefill call without an answer") from None
                if "first" not in res:
                    break
                if not computed:  # the prompt is computed: its tokens leave p's queue and time its rate
                    computed = True
                    p.prefill.end(n, t0, time.monotonic(), True)
                s.prefill_ttft_s = res["first"].get("ttft_s")
                on_first(Update(**res["first"]))
        except grpc.aio.AioRpcError as e:
            self.workers.down(p, e)
            s.avoid_prefill.add(p.name)
            raise Retry(f"prefill on {p.name} failed: {e.code().name}: {e.details()}") from None
        except Silent as e:
            s.avoid_prefill.add(p.name)
            raise Retry(f"prefill on {e}") from None
        finally:
            call.cancel()  # nothing once it has ended
            settle(binding)
            p.inflight -= 1
            s.prefilling = None
            if not computed:
                p.prefill.end(n, t0, time.monotonic(), False)
        missed = await r.prefixes.settle_load(s, p, res) if load else False
        p.served += 1
        s.prefill, s.kv_bytes, s.kv_backend = p.name, int(res["kv_bytes"]), res.get("backend")
        r.kv_bytes_transferred += s.kv_bytes
        sent = s.kv() - int(s.reserved.get("skip", 0)) * self.cfg.engine.block_size  # tokens beyond decode's own
        if sent > 0 and s.kv_bytes > 0:  # the policies' bytes per token (a moving average over transfers)
            x, old = s.kv_bytes / sent, r.kv_bytes_per_token
            r.kv_bytes_per_token = x if old is None else 0.8 * old + 0.2 * x
        r.prefixes.settle_put(s, p, tokens, store, res, missed)

    async def _bind(self, p: WorkerInfo, xid: str, bound: asyncio.Future) -> None:
        """An early Prefill call's reservation, sent to p once decode made it."""
        dst = await asyncio.shield(bound)  # (cancelling this call leaves the reservation's future to its owner)
        await self.workers.watch(p, self.workers.client(p).call("Bind", message("Bind", request_id=xid, dst=dst)))

    async def _answer(self, p: WorkerInfo, it, binding: asyncio.Future | None) -> dict:
        """A Prefill call's next message; a failure of its Bind call (binding) raises as soon as it is known."""
        if binding is None or binding.done():
            raise_failure(binding)
            return await self.workers.watch(p, it.__anext__())
        nxt = asyncio.ensure_future(self.workers.watch(p, it.__anext__()))
        try:
            await asyncio.wait({nxt, binding}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                raise_failure(binding)
            return await nxt
        finally:
            nxt.cancel()
