"""The global KV index against the workers' own block managers (plain Python): after every heartbeat its
answer for a prompt equals what the instance's block manager itself would reuse; lost events, a restarted
worker and a dead one make it resync, and it never reports a prefix the instance no longer holds."""

import random

from jaxserve.cache.block_manager import BlockManager
from jaxserve.cache.events import CacheEvents
from jaxserve.worker.messages import CacheBatch
from jaxserve.router.kv_index import KVIndex

BS = 4


class Worker:
    """A block manager with its events log, and the heartbeat protocol of jaxserve/worker/main.py."""

    def __init__(self, name, num_blocks=64, snapshots=0, capacity=4096):
        self.name = name
        self.bm = BlockManager(num_blocks, BS, snapshots, events=CacheEvents(capacity))
        self.want = None
        self.seqs = []

    def serve(self, tokens, snapshot=False):
        """Prefill `tokens` as the scheduler does: reuse the cached prefix, register the computed blocks
        (and a state snapshot at the last boundary), then finish (blocks stay cached, evictable)."""
        hits, cached, _ = self.bm.match(tokens, snapshot)
        ids = self.bm.allocate(hits, len(tokens))
        self.bm.register(ids, tokens, len(tokens))
        if snapshot and len(tokens) >= BS:
            self.bm.snapshots.acquire(self.bm.register(ids, tokens, len(tokens) // BS * BS)[-1])
        self.bm.free(ids)

    def beat(self, index, lose=False):
        batch = self.bm.events.since(self.want)
        if batch is None:
            batch = self.bm.full_state()
        # what crosses the wire: the Register schema, as the router's control port validates it
        batch = CacheBatch.model_validate(batch).model_dump(by_alias=True, exclude_none=True)
        if lose:
            return
        self.want = index.apply(self.name, batch)

    def truth(self, tokens, snapshot=False):
        return self.bm.match(tokens, snapshot)[1]


def prompt(rng, shared, n):
    return shared + [rng.randrange(1000) for _ in range(n)]


def check(index, workers, prompts, snapshot=False):
    for p in prompts:
        got = index.match(p)
        for w in workers:
            assert got.get(w.name, 0) == w.truth(p, snapshot), (w.name, p)


def test_index_follows_stores_and_evictions_exactly():
    rng = random.Random(0)
    index = KVIndex(BS)
    a, b = Worker("a", num_blocks=24), Worker("b", num_blocks=24)
    base = [rng.randrange(1000) for _ in range(10)]
    prompts = []
    for step in range(40):
        w = a if rng.random() < 0.5 else b
        p = prompt(rng, base if rng.random() < 0.5 else [], rng.randrange(1, 20))
        w.serve(p)
        prompts.append(p)
        for x in (a, b):
            x.beat(index)
        check(index, [a, b], prompts[-12:] + [base + [1, 2, 3, 4, 5]])
    assert a.bm.events.next_seq > 0 and index.stats()["resyncs"] == 0
    kinds = {k for w in (a, b) for k, _ in w.bm.events.since(0, limit=10**6)["events"]}
    assert kinds == {"stored", "removed"}  # the small pools evicted, and the index followed


def test_request_state_prefixes_count_only_at_a_snapshot():
    index = KVIndex(BS, request_state=True)
    w = Worker("h", snapshots=4)
    p = list(range(1, 15))  # 14 tokens: blocks at 4, 8, 12; snapshot at 12
    w.serve(p, snapshot=True)
    w.beat(index)
    assert index.match(p + [99]) == {"h": 12} == {"h": w.truth(p + [99], True)}
    assert index.match(p[:11] + [77, 78]) == {}  # blocks at 4 and 8 are there, but no state snapshot there
    for i in range(5):  # four more snapshots push the first one out of the pool (LRU)
        w.serve([500 + i] * 9, snapshot=True)
    w.beat(index)
    assert index.match(p + [99]) == {} and w.truth(p + [99], True) == 0


def test_lost_events_resync_and_never_report_a_dropped_prefix():
    index = KVIndex(BS)
    w = Worker("a", num_blocks=8)
    old = list(range(100, 117))
    w.serve(old)
    w.beat(index)
    assert index.match(old + [1]) == {"a": 16}
    w.serve(list(range(200, 229)))  # evicts `old`'s blocks
    w.beat(index, lose=True)  # a heartbeat lost: the worker sends the same events again next time
    w.beat(index)
    assert index.match(old + [1]) == {} and index.stats()["resyncs"] == 0
    check(index, [w], [old + [1], list(range(200, 229)) + [1]])
    # events skipped (numbers that never arrive): everything of the instance is dropped until its full state
    w.serve([7, 7, 7, 7, 7])
    w.serve([8, 8, 8, 8, 8])
    skipped = w.bm.events.since(w.want + 1)
    assert index.apply("a", skipped) is None and index.match(list(range(200, 229)) + [1]) == {}
    assert index.stats()["resyncs"] == 1
    w.want = None  # the router's answer
    w.beat(index)  # the full state
    assert w.want == w.bm.events.next_seq
    check(index, [w], [old + [1], list(range(200, 229)) + [1], [7, 7, 7, 7, 7, 1], [8, 8, 8, 8, 8, 1]])


def served(p) -> tuple[KVIndex, Worker]:
    """An index that heard of worker "a" serving the 20-token prompt p."""
    index, w = KVIndex(BS), Worker("a")
    w.serve(p)
    w.beat(index)
    assert index.match(p + [1]) == {"a": 20}
    return index, w


def test_a_restarted_worker_starts_from_nothing():
    p = list(range(50, 70))
    index, w = served(p)
    fresh = Worker("a")  # the same instance name, a new process: a new epoch and an empty cache
    fresh.want = w.want  # it answers the router's last question, with events of its own epoch
    fresh.serve([1, 2, 3, 4, 5])
    fresh.beat(index)
    assert index.match(p + [1]) == {} and fresh.want is None
    fresh.beat(index)
    check(index, [fresh], [p + [1], [1, 2, 3, 4, 5, 6]])


def test_a_restarted_worker_heard_without_events_already_counts_for_nothing():
    """A restarted worker's first heartbeats carry no batch (its full state is still being taken on the engine
    thread) but do carry its epoch: the old process's entries go with the first of them, not a beat later."""
    p = list(range(80, 100))
    index, w = served(p)
    assert index.apply("a", None, w.bm.events.epoch) == w.want  # the same process, nothing to send: no change
    assert index.match(p + [1]) == {"a": 20}
    fresh = Worker("a")
    assert index.apply("a", None, fresh.bm.events.epoch) is None  # it asks for the new process's full state
    assert index.match(p + [1]) == {} and index.stats()["resyncs"] == 1
    fresh.beat(index)
    check(index, [fresh], [p + [1]])


def test_a_dead_worker_counts_for_nothing_until_it_resyncs():
    index = KVIndex(BS)
    a, b = Worker("a"), Worker("b")
    p = list(range(300, 320))
    a.serve(p)
    b.serve(p[:8])
    for w in (a, b):
        w.beat(index)
    assert index.match(p + [1]) == {"a": 20, "b": 8}
    assert index.match(p + [1], instances={"b"}) == {"b": 8}
    index.drop("a")  # marked down (its call failed)
    assert index.match(p + [1]) == {"b": 8}
    a.beat(index)  # back: its events no longer line up with anything the index holds
    assert a.want is None and index.match(p + [1]) == {"b": 8}
    a.beat(index)
    assert index.match(p + [1]) == {"a": 20, "b": 8}
    assert index.stats() == {"instances": 2, "blocks": len(a.bm.hash_block) + len(b.bm.hash_block),
                             "snapshots": 0, "resyncs": 1}


def test_an_overflowing_log_sends_the_full_state():
    index = KVIndex(BS)
    w = Worker("a", capacity=3)
    w.beat(index)  # first contact: the full (empty) state
    for i in range(6):
        w.serve([i * 10 + k for k in range(9)])
    assert w.bm.events.since(w.want) is None  # the log kept only the newest 3 events
    w.beat(index)
    check(index, [w], [[i * 10 + k for k in range(9)] + [0] for i in range(6)])


def test_a_cleared_cache_empties_the_instance():
    index = KVIndex(BS)
    w = Worker("a")
    w.serve(list(range(40, 60)))
    w.beat(index)
    assert index.match(list(range(40, 61))) == {"a": 20}
    w.bm.events.emit("cleared")
    w.beat(index)
    assert index.match(list(range(40, 61))) == {} and index.stats()["resyncs"] == 0


def test_a_whole_prefix_matches_in_full_and_a_prompt_leaves_its_last_token():
    index = KVIndex(BS)
    a = Worker("a", num_blocks=24)
    p = list(range(1, 3 * BS + 1))  # three whole blocks
    a.serve(p + [99])
    a.beat(index)
    assert index.match(p)["a"] == 2 * BS  # a prompt of exactly those blocks computes its last one
    assert index.match(p, whole=True)["a"] == 3 * BS  # the prefix itself is held in full
    assert index.match(p + [5], whole=True)["a"] == 3 * BS
