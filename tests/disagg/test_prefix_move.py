"""A cached prefix copied from one instance's prefix cache into another's (the router's cross-cluster prefix
move): two engines in one process, the sender's Export path (Handoff.send_cached from LLMEngine.cached_prefix,
no compute) over TCP (loopback) into the receiver's Import reservation (KVIntake.reserve_prefix). The receiver
then serves a longer prompt from the moved blocks (and, for the hybrid model, the moved linear state at the
prefix's end), and its greedy tokens equal the colocated engine's; or it computes that prompt over the prefix as
it arrives, layer group by layer group (the global KV store's pipelined load)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from jaxserve import LLM
from jaxserve.disagg.decode_side import KVIntake
from jaxserve.disagg.prefill_side import Feeder, Handoff
from jaxserve.engine.client import RequestError
from jaxserve.engine.llm_engine import LLMEngine
from tests.disagg.test_inprocess import BASE, CFG, GREEDY
from jaxserve.transfer.plan import layer_groups
from jaxserve.transfer.state import KVPoll
from jaxserve.transfer.tcp import TcpLink

PROMPT = BASE[:13]  # cached on the sender up to its last block boundary (12 tokens, block_size 4)
PREFIX = PROMPT[:12]
FOLLOWUP = PROMPT + [40, 41, 42, 43, 44]


def run(eng: LLMEngine, rid: str, prompt):
    (seq,) = eng.add_request(rid, prompt, GREEDY)
    while eng.has_work:
        eng.step()
    return seq


class Mover:
    """The receiving engine's KV intake and a TCP link to it from the sending side's feeder."""

    def __init__(self, dst: LLMEngine):
        self.posted: queue.Queue = queue.Queue()
        self.intake = KVIntake(dst.connector, "t0k", self.posted.put, deadline_s=600)  # the deadline is not under test
        self.link = TcpLink(self.intake.address, "t0k", connections=2, chunk_bytes=4096)
        self.feeder = Feeder()

    def move(self, src: LLMEngine, rid: str, tokens) -> tuple[list, int, Handoff]:
        """-> (the arrival outcomes (None: cached), skip, handoff)"""
        outcomes = []
        blocks, skip = self.intake.reserve_prefix(rid, tokens, outcomes.append)
        found = src.connector.cached_prefix(tokens)
        assert found is not None
        h = Handoff(self.link, self.feeder, blocks, skip, len(tokens), False, 2, request_id=rid)
        h.send_cached(src.connector, *found)
        assert h.sender.wait(30) is KVPoll.DONE, h.sender.state.reason
        self.arrive(outcomes)
        return outcomes, skip, h

    def arrive(self, outcomes: list) -> None:
        """Run what the intake posted to "the engine thread" until the transfer's arrival has run (it posts a
        wake-up when the first layer group lands, too)."""
        n = len(outcomes)
        while len(outcomes) == n:
            self.posted.get(timeout=30)()

    def close(self):
        self.link.close()
        self.feeder.close()
        self.intake.close()


@pytest.mark.parametrize("family", ["llama", "kimi_linear"])
def test_moved_prefix_serves_the_next_request(checkpoint_dir, family):
    path = checkpoint_dir(family)
    want = LLM(path, progress=False, engine=CFG).generate([FOLLOWUP], GREEDY)[0].token_ids
    src = LLMEngine(path, "float32", CFG, progress=False)
    dst = LLMEngine(path, "float32", CFG, progress=False)
    dst.blocks.allocate([], 3 * CFG.block_size)  # the two pools' block ids differ
    run(src, "a", PROMPT)
    assert src.connector.cached_prefix(PROMPT[:8] + [60, 61, 62, 63]) is None  # not held: nothing to send
    mover = Mover(dst)
    try:
        events = dst.cache_events.since(0)["next"]
        outcomes, skip, h = mover.move(src, "m", PREFIX)
        assert outcomes == [None] and skip == 0 and h.sender.bytes_acked > 0
        assert dst.blocks.num_referenced() == 3  # only the blocks allocated above: the move's are cache now
        stored = [e for e in dst.cache_events.since(events)["events"] if e[0] in ("stored", "snap")]
        assert sum(len(hs) for kind, hs in stored if kind == "stored") == 3
        assert any(kind == "snap" for kind, _ in stored) == dst.layout.has_request_state

        seq = run(dst, "b", FOLLOWUP)
        assert seq.num_cached == len(PREFIX)  # served from the moved blocks (and snapshot), not recomputed
        assert seq.output == want, family

        # moved again: the blocks it holds are skipped (all but the last, which comes with the state)
        outcomes, skip, _ = mover.move(src, "m2", PREFIX)
        assert outcomes == [None] and skip == len(PREFIX) // CFG.block_size - 1
        for eng in (src, dst):
            eng.blocks.check()
        assert mover.intake.pool.free_bytes == mover.intake.pool.capacity and not mover.intake.receivers
    finally:
        mover.close()


def test_a_move_that_never_arrives_releases_its_blocks(checkpoint_dir):
    dst = LLMEngine(checkpoint_dir("llama"), "float32", CFG, progress=False)
    mover = Mover(dst)
    try:
        outcomes = []
        mover.intake.reserve_prefix("m", PREFIX, outcomes.append)
        assert dst.blocks.num_referenced() == 3
        mover.intake.cancel("m")  # the router closed the Import stream (the sender failed)
        mover.arrive(outcomes)
        assert outcomes == ["request aborted"]
        assert dst.blocks.num_referenced() == 0 and not dst.blocks.hash_block  # nothing cached from it
        assert mover.intake.pool.free_bytes == mover.intake.pool.capacity
        with pytest.raises(RequestError, match="whole blocks"):
            mover.intake.reserve_prefix("x", PREFIX[:6], outcomes.append)
        dst.blocks.check()
    finally:
        mover.close()


def test_a_prefix_without_room_waits_for_it_in_arrival_order(checkpoint_dir):
    """An Import that finds no free blocks waits (not refused: its prefill would compute the prefix, more work on
    an instance already short of room), is reserved once blocks are freed, oldest first, and its transfer then
    lands; one withdrawn while waiting is gone; one whose wait ran out is refused; one bigger than the whole
    cache is refused at once."""
    src = LLMEngine(checkpoint_dir("llama"), "float32", CFG, progress=False)
    dst = LLMEngine(checkpoint_dir("llama"), "float32", CFG, progress=False)
    run(src, "a", PROMPT)
    mover = Mover(dst)
    try:
        held = dst.blocks.allocate([], (CFG.num_blocks - 1) * CFG.block_size)  # 1 block left: a prefix needs 3
        got: dict[str, object] = {}
        outcomes = []

        def when_room(rid, tokens, wait_s=600.0):
            mover.intake.reserve_prefix_when_room(rid, tokens, outcomes.append,
                                                  lambda r, rid=rid: got.setdefault(rid, r), wait_s)
        when_room("first", PREFIX)
        when_room("second", PREFIX)
        when_room("gone", PREFIX)
        when_room("late", PREFIX, wait_s=0.0)  # it runs out before it is tried (it waits behind the others)
        when_room("huge", [1] * (CFG.num_blocks + 1) * CFG.block_size)
        assert list(got) == ["huge"] and "in all" in str(got["huge"])
        assert mover.intake.stats()["prefixes_waiting"] == 4
        mover.intake.retry_waiting()
        assert list(got) == ["huge"]  # still no room: nothing reserved, nothing overtook
        mover.intake.withdraw("gone")
        dst.blocks.free(held[:4])  # room for one prefix (3 blocks) and not two
        mover.intake.retry_waiting()
        assert list(got) == ["huge", "first"] and got["first"][1] == 0 and len(got["first"][0]) == 3
        found = src.connector.cached_prefix(PREFIX)
        h = Handoff(mover.link, mover.feeder, got["first"][0], 0, len(PREFIX), False, 2, request_id="first")
        h.send_cached(src.connector, *found)
        assert h.sender.wait(30) is KVPoll.DONE, h.sender.state.reason
        mover.arrive(outcomes)
        assert outcomes == [None]  # cached: its blocks are evictable now, room for the next
        mover.intake.retry_waiting()
        assert list(got) == ["huge", "first", "second", "late"]
        assert got["second"][1] == len(PREFIX) // CFG.block_size - 1  # the blocks just cached are skipped
        assert "before its deadline" in str(got["late"]) and mover.intake.stats()["prefixes_waiting"] == 0
        mover.intake.withdraw("second")  # the caller gave up after its reservation: released
        mover.arrive(outcomes)
        assert outcomes == [None, "request aborted"] and "gone" not in got
        dst.blocks.free(held[4:])
        assert dst.blocks.num_referenced() == 0 and mover.intake.pool.free_bytes == mover.intake.pool.capacity
        dst.blocks.check()
    finally:
        mover.close()


class Stepper:
    """One `dst.step()` on a thread of its own (the engine thread), which the test feeds the prefix to."""

    def __init__(self, eng: LLMEngine):
        self.error = None

        def go():
            try:
                eng.step()
            except BaseException as e:  # noqa: BLE001 - re-raised by join
                self.error = e
        self.t = threading.Thread(target=go, daemon=True)
        self.t.start()

    def join(self):
        self.t.join(120)
        assert not self.t.is_alive(), "the step did not end"
        if self.error is not None:
            raise self.error


def until(cond, what: str, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.005)


def start_prefix(mover: Mover, src: LLMEngine, dst: LLMEngine, rid: str, tokens):
    """Reserve a prefix on dst, arriving in one-layer groups, and a sender from src's cache that has sent
    nothing yet -> (the IncomingPrefix, the handoff, the arrival outcomes)."""
    outcomes = []
    groups = layer_groups(dst.layout.num_layers, 1)
    blocks, skip = mover.intake.reserve_prefix(rid, tokens, outcomes.append, groups=groups)
    h = Handoff(mover.link, mover.feeder, blocks, skip, len(tokens), False, 1, request_id=rid)
    h._start(src.connector, *src.connector.cached_prefix(tokens), rid)
    return mover.intake.prefixes[rid], h, outcomes


def fetching(path: str):
    """src computes PROMPT; dst queues FOLLOWUP over PREFIX reserved as arriving from src; the request is not
    admitted before the prefix's first layer group lands (another request goes first); src sends group 0 and a
    step runs the request on its own thread -> (the colocated answer, dst, the mover, (the IncomingPrefix, the
    handoff, the arrival outcomes, the request, the step)) once group 0 is imported."""
    want = LLM(path, progress=False, engine=CFG).generate([FOLLOWUP], GREEDY)[0].token_ids
    src = LLMEngine(path, "float32", CFG, progress=False)
    dst = LLMEngine(path, "float32", CFG, progress=False)
    run(src, "a", PROMPT)
    mover = Mover(dst)
    inc, h, outcomes = start_prefix(mover, src, dst, "m", PREFIX)
    (seq,) = dst.add_request("b", FOLLOWUP, GREEDY)
    seq.transfer.into = inc
    assert not dst.has_work  # nothing to do until the prefix starts arriving: the engine thread may sleep
    other = run(dst, "c", [60, 61, 62])  # a request behind it is served meanwhile
    assert other.finished and seq.num_computed == 0 and seq in dst.scheduler.waiting
    h.export(0)
    until(lambda: inc.started, "layer group 0 did not land")
    assert dst.has_work
    step = Stepper(dst)
    until(lambda: inc.imported == {0}, "layer group 0 was not imported")
    return want, dst, mover, (inc, h, outcomes, seq, step)


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "kimi_linear"])
def test_a_prefill_computes_over_a_prefix_as_it_lands(checkpoint_dir, family):
    """BanaServe's pipelined load: the prefill of a request whose prefix is still arriving runs each layer group
    as soon as that group's part is in, waiting for the next meanwhile; its greedy tokens equal the colocated
    engine's (dense, sliding window, and MLA + linear attention with request-level state)."""
    want, dst, mover, (inc, h, outcomes, seq, step) = fetching(checkpoint_dir(family))
    try:
        time.sleep(0.2)  # more time than a group's import takes: the step waits for the next group
        assert step.t.is_alive() and inc.imported == {0}
        for k in range(1, dst.layout.num_layers):
            h.export(k)
        mover.feeder.put(h.sender, [], {"token": None})
        step.join()
        assert inc.imported == set(range(dst.layout.num_layers)) and seq.num_cached == len(PREFIX)
        assert seq.num_computed > len(PREFIX)  # its first chunk ran over the prefix
        mover.arrive(outcomes)  # the prefix is cached, the reservation's references dropped
        assert outcomes == [None] and not mover.intake.prefixes
        while dst.has_work:
            dst.step()
        assert seq.output == want, family
        assert seq.num_preemptions == 0
        assert dst.blocks.cached(dst.connector._prefix_hashes(PREFIX), False)[0]  # the moved blocks are prefix cache
        dst.blocks.check()
        assert dst.blocks.num_referenced() == 0 and mover.intake.pool.free_bytes == mover.intake.pool.capacity
    finally:
        mover.close()


def test_a_prefix_landed_whole_before_its_prefill_runs_unstaged(checkpoint_dir):
    """A prefix that has landed whole by the time its request's prefill step runs is imported at once, and the
    step runs the whole model in one program instead of layer group by layer group; same greedy answer."""
    path = checkpoint_dir("llama")
    want = LLM(path, progress=False, engine=CFG).generate([FOLLOWUP], GREEDY)[0].token_ids
    src = LLMEngine(path, "float32", CFG, progress=False)
    dst = LLMEngine(path, "float32", CFG, progress=False)
    run(src, "a", PROMPT)
    mover = Mover(dst)
    try:
        inc, h, outcomes = start_prefix(mover, src, dst, "m", PREFIX)
        (seq,) = dst.add_request("b", FOLLOWUP, GREEDY)
        seq.transfer.into = inc
        L = dst.layout.num_layers
        for k in range(L):
            h.export(k)
        mover.feeder.put(h.sender, [], {"token": None})
        until(lambda: inc.landed, "the prefix did not land")
        stages, prefill = [], dst.runner.prefill
        dst.runner.prefill = lambda rows, st=None, *a, **kw: (stages.append(st), prefill(rows, st, *a, **kw))[1]
        dst.step()  # the arrival is not run yet: the prefix is still the request's IncomingPrefix
        assert stages == [None] and inc.imported == set(range(L)) and seq.num_cached == len(PREFIX)
        mover.arrive(outcomes)
        assert outcomes == [None]
        while dst.has_work:
            dst.step()
        assert seq.output == want
        dst.blocks.check()
        assert dst.blocks.num_referenced() == 0 and mover.intake.pool.free_bytes == mover.intake.pool.capacity
    finally:
        mover.close()


def test_a_prefix_that_stops_arriving_is_computed_instead(checkpoint_dir):
    """The holder fails after sending the first layer group: the prefill waiting for the second gives up on
    the prefix, the request is computed from its tokens instead (same answer), nothing is cached from the
    failed move and no block leaks."""
    want, dst, mover, (inc, h, outcomes, seq, step) = fetching(checkpoint_dir("llama"))
    try:
        h.abort("the holder died")
        mover.intake.cancel("m")  # the router closes the Import stream
        step.join()
        assert inc.error and seq.num_computed == 0 and seq.num_preemptions == 1  # back in the queue
        mover.arrive(outcomes)
        assert outcomes == ["request aborted"]
        while dst.has_work:
            dst.step()
        assert seq.output == want
        assert seq.num_cached == 0  # nothing of the failed move was cached
        dst.blocks.check()
        assert dst.blocks.num_referenced() == 0 and mover.intake.pool.free_bytes == mover.intake.pool.capacity
    finally:
        mover.close()
