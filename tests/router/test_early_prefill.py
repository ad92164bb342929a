"""The router's early prefill against scripted fake workers (test_dispatch.py's): the Prefill call beside the
Decode call, bound to the reservation by a Bind call when it comes; cancelled with a reservation that fails; a
refused Bind placed again; the Prefill call after the reservation where decode holds a prefix of the prompt. The
real workers' side (a hand-off bound late, on TCP and the device backend) is in tests/disagg/test_workers.py and
tests/disagg/test_inprocess.py."""

from __future__ import annotations

import asyncio
import dataclasses

from jaxserve.router.requests import Sub

from .test_dispatch import GREEDY, D, P, cluster, result


def test_the_prefill_starts_while_decode_reserves():
    """router.early_prefill (the default): the Prefill call goes out beside the Decode call, naming the decode
    instance (pending_dst) before its reservation exists, and decode is asked to skip no block (max_skip 0); once
    the reservation comes a Bind call gives it to the prefill instance, and the request completes as before. Off,
    the Prefill call follows the reservation and carries it."""
    async def go():
        async with cluster({"p0": P, "d0": D}) as (ce, w):
            w["d0"].reserve_wait.add("r.1")
            add = asyncio.ensure_future(ce.add("r", [1, 2, 3], GREEDY))
            for _ in range(500):
                if w["p0"].prefills:
                    break
                await asyncio.sleep(0.01)
            assert w["p0"].prefills == ["r.1"] and w["d0"].opened == [] and not add.done()  # decode still reserving
            pre, = w["p0"].requests
            assert pre["pending_dst"] == "d0" and pre["dst"] is None and w["p0"].binds == []
            for _ in range(500):  # its first token is back at the router (held) before decode has reserved
                if ce.registry.workers["p0"].prefill.last_end:
                    break
                await asyncio.sleep(0.01)
            w["d0"].board.setdefault(("reserve", "r.1"), asyncio.Event()).set()
            u, = await result(await add)
            assert u.token_ids == [3, 0] and u.error is None and u.route["attempts"] == 1
            assert u.route["prefill_ttft_s"] == 0.01  # p0's own TTFT, kept though it came before the reservation
            assert w["p0"].binds == [("r.1", "d0")] and w["d0"].requests[0]["max_skip"] == 0
            assert 0 < u.route["placed_s"] <= u.ttft_s  # the first token is relayed once the reservation is in
        async with cluster({"p0": P, "d0": D}, early_prefill=False) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.token_ids == [3, 0] and u.error is None and w["p0"].binds == []
            pre, = w["p0"].requests
            assert pre["pending_dst"] is None and pre["dst"]["instance"] == "d0"
            assert w["d0"].requests[0]["max_skip"] is None
    asyncio.run(go())


def test_a_prefill_begun_early_follows_its_placement_through_failures():
    """A decode instance without room: the Prefill call begun beside its reservation is cancelled unbound and
    the request placed again (a fresh early prefill, bound to the other decode instance's reservation); a Bind the
    prefill instance refuses fails that prefill, and the request is placed again on another prefill instance."""
    async def go():
        async with cluster({"p0": P, "d0": ("decode", {"decode": "full_late"}), "d1": D}) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.error is None and u.token_ids == [3, 0] and u.route["decode_instance"] == "d1"
            assert w["p0"].prefills == ["r.1", "r.2"] and w["p0"].binds == [("r.2", "d1")]
            assert ce.registry.workers["p0"].inflight == 0
        async with cluster({"p0": ("prefill", {"bind": "refuse"}), "p1": P, "d0": D}) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.error is None and u.token_ids == [3, 0] and u.route["prefill_instance"] == "p1"
            assert u.route["attempts"] == 2 and w["p0"].binds == [("r.1", "d0")] and w["p1"].binds == [("r.2", "d0")]
            assert "r.1" in w["d0"].closed  # the first reservation was given back
    asyncio.run(go())


def test_decode_holding_a_prefix_of_the_prompt_gets_the_prefill_call_after_its_reservation():
    """Where the global KV index says the decode instance holds a whole block of the prompt, its reservation
    skips it and the Prefill call follows with it (an early prefill would send it again)."""
    async def go():
        async with cluster({"p0": P, "d0": D}) as (ce, w):
            s = Sub("r", 0, list(range(1, 40)), {}, 39)
            snap = ce._snapshot(s, set())
            pl = ce.policy.place(snap)
            assert ce._early(s, snap, pl) is ce.registry.get("p0")
            bs = ce.cfg.engine.block_size
            held = dataclasses.replace(snap, instances=tuple(
                dataclasses.replace(i, cached_tokens=bs if i.name == "d0" else 0) for i in snap.instances))
            assert ce._early(s, held, pl) is None
            partial = dataclasses.replace(snap, instances=tuple(
                dataclasses.replace(i, cached_tokens=bs - 1) for i in snap.instances))
            assert ce._early(s, partial, pl) is ce.registry.get("p0")
    asyncio.run(go())


def test_an_early_prefill_that_failed_before_the_reservation_came_is_placed_again_at_once():
    """The prefill instance refuses the early Prefill call while decode is still reserving: once the reservation
    comes, the request is placed again on the other prefill instance at once (decode, given no KV, would otherwise
    hold the request until its transfer deadline; this fake decode never gives up)."""
    async def go():
        async with cluster({"p0": ("prefill", {"prefill": "abort"}), "p1": P, "d0": D}) as (ce, w):
            w["d0"].reserve_wait.add("r.1")
            add = asyncio.ensure_future(ce.add("r", [1, 2, 3], GREEDY))
            for _ in range(500):
                if w["p0"].prefills and not ce.registry.workers["p0"].inflight:  # its call has failed
                    break
                await asyncio.sleep(0.01)
            assert w["p0"].prefills == ["r.1"] and not add.done()
            w["d0"].board.setdefault(("reserve", "r.1"), asyncio.Event()).set()
            u, = await result(await add)
            assert u.error is None and u.token_ids == [3, 0] and u.route["prefill_instance"] == "p1"
            assert u.route["attempts"] == 2 and "r.1" in w["d0"].closed and w["p1"].binds == [("r.2", "d0")]
    asyncio.run(go())
