"""Scheduler without JAX: budgets, chunk boundaries, admission, preemption by recompute, no leaks."""

import pytest

from jaxserve.cache.block_manager import BlockManager
from jaxserve.engine.client import QueueFull
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig
from jaxserve.engine.sequence import Sequence
from jaxserve.sampling import SamplingParams


# the settings these tests vary from (the engine builds its own from engine/settings.py)
BASE = dict(max_num_seqs=8, max_num_batched_tokens=512, chunk_size=256, max_prefill_seqs=4, max_waiting=256,
            block_size=16, mixed_batched_tokens=None, has_request_state=False, token_buckets=())


def config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{**BASE, **kw})


def make(num_blocks=64, bs=4, snapshots=0, **kw):
    cfg = config(block_size=bs, has_request_state=snapshots > 0, **kw)
    return Scheduler(cfg, BlockManager(num_blocks, bs, snapshots))


def run_step(s: Scheduler, plan, token=7):
    """What the engine does with a plan: complete chunks, append one token per finished prompt / decode."""
    for c in plan.prefills:
        s.complete_prefill(c)
        if c.last:
            c.seq.output.append(token)
            s.complete_decode(c.seq)
    for seq in plan.decodes:
        seq.output.append(token)
        s.complete_decode(seq)
    for seq in list(s.running):
        if len(seq.output) >= seq.params.max_tokens:
            s.finish(seq, "length")


def drain(s: Scheduler, limit=500):
    plans = []
    while s.has_work and len(plans) < limit:
        plan = s.schedule()
        plans.append(plan)
        run_step(s, plan)
    assert not s.has_work
    return plans


def seq(rid, n, max_tokens=4, start=0):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def test_a_step_that_decodes_takes_the_mixed_budget():
    """While requests decode, a step's prefill takes at most mixed_batched_tokens (block-aligned chunks, several
    prompts sharing it); a step with nothing to decode takes the whole budget; nothing leaks."""
    s = make(chunk_size=32, max_num_batched_tokens=32, mixed_batched_tokens=8)
    first = seq("first", 6, max_tokens=20)
    s.add(first)
    plan = s.schedule()
    assert [(c.start, c.length) for c in plan.prefills] == [(0, 6)] and not plan.decodes
    run_step(s, plan)
    s.add(seq("long", 30, start=100))  # no prefix shared with "first"
    s.add(seq("short", 3, start=200))
    lengths = []
    for _ in range(4):
        plan = s.schedule()
        assert [q.request_id for q in plan.decodes] == ["first"]
        lengths.append([(c.seq.request_id, c.length) for c in plan.prefills])
        run_step(s, plan)
    assert lengths[:4] == [[("long", 8)], [("long", 8)], [("long", 8)], [("long", 6), ("short", 2)]]
    assert all(sum(n for _, n in step) <= 8 for step in lengths)
    s2 = make(chunk_size=32, max_num_batched_tokens=32, mixed_batched_tokens=8)
    s2.add(seq("long", 30))
    assert [c.length for c in s2.schedule().prefills] == [30]  # nothing decodes: the whole budget
    drain(s)
    s.blocks.check()
    with pytest.raises(ValueError, match="mixed_batched_tokens"):
        config(mixed_batched_tokens=0)


def test_a_step_beside_decodes_keeps_its_tokens_in_the_bucket_they_just_pass():
    """Packed steps (token_buckets): where a step's prefill and decode tokens pass a bucket by a few, the last
    chunk leaves them to the next step (a block-aligned end); where moving them would save little padding, or
    nothing decodes, the chunk stays whole. Every prompt token is still computed once and nothing leaks."""
    buckets = (16, 32, 64, 96, 128, 192, 256, 384, 512)
    s = make(num_blocks=256, bs=16, chunk_size=512, max_num_batched_tokens=512, token_buckets=buckets)
    a, b = seq("a", 5, max_tokens=40), seq("b", 7, max_tokens=40, start=50)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # both prefilled alone: nothing decodes yet, nothing moved
    assert a.num_computed == 5 and b.num_computed == 7
    s.add(seq("long", 256, start=1000))
    plan = s.schedule()  # 256 + 2 decode tokens would pad to 384: 240 + 2 run in 256
    assert len(plan.decodes) == 2 and [(c.start, c.length) for c in plan.prefills] == [(0, 240)]
    run_step(s, plan)
    plan = s.schedule()
    assert [(c.start, c.length, c.last) for c in plan.prefills] == [(240, 16, True)]
    run_step(s, plan)
    s.add(seq("mid", 200, start=3000))  # 200 + 3 -> 256: moving 24 tokens to save 64 of padding is not worth it
    assert [c.length for c in s.schedule().prefills] == [200]
    s2 = make(num_blocks=256, bs=16, chunk_size=512, max_num_batched_tokens=512, token_buckets=buckets)
    s2.add(seq("alone", 258))
    assert [c.length for c in s2.schedule().prefills] == [258]  # nothing decodes: one step, no step added
    s3 = make(num_blocks=256, bs=16, chunk_size=512, max_num_batched_tokens=512)
    s3.add(seq("a", 5, max_tokens=40))
    run_step(s3, s3.schedule())
    s3.add(seq("long", 256, start=1000))
    assert [c.length for c in s3.schedule().prefills] == [256]  # steps not packed: chunks as the budget gives
    drain(s)
    s.blocks.check()
    assert s.blocks.num_free == 256


def test_chunked_prefill_budget_and_alignment():
    s = make(chunk_size=8, max_num_batched_tokens=12)
    a, b = seq("a", 21), seq("b", 6)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefills] == [("a", 0, 8), ("b", 0, 4)]
    run_step(s, plan)
    plan = s.schedule()  # a continues first; chunk ends stay on block boundaries
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefills] == [("a", 8, 8), ("b", 4, 2)]
    assert all(c.end % 4 == 0 or c.last for c in plan.prefills)
    assert sum(c.length for c in plan.prefills) <= 12
    run_step(s, plan)
    drain(s)
    s.blocks.check()
    assert s.blocks.num_free == 64 and sorted(s.free_slots) == list(range(s.cfg.max_num_seqs))
    assert a.output == [7] * 4 and b.output == [7] * 4


def test_request_state_cuts_prompt_at_last_boundary_and_snapshots():
    s = make(snapshots=4, chunk_size=16, max_num_batched_tokens=64)
    a = seq("a", 11)
    s.add(a)
    plan = s.schedule()
    (c,) = plan.prefills
    assert (c.start, c.length) == (0, 8) and c.snapshot_row is not None  # cut at the last boundary (8)
    run_step(s, plan)
    (c,) = s.schedule().prefills
    assert (c.start, c.length) == (8, 3) and c.last
    drain(s)
    b = seq("b", 13)  # shares a's first 11 tokens: reuse up to the snapshot at 8
    s.add(b)
    plan = s.schedule()
    assert b.num_cached == 8 and b.state_src is not None and plan.prefills[0].start == 8
    drain(s)
    s.blocks.check()


@pytest.mark.parametrize("cap", [None, 2])
def test_decode_snapshots_at_boundaries_up_to_the_steps_cap(cap):
    """Requests whose decode token completes a block save their state there (one pool row each, pinned for the
    step); with a cap (sliding rings: cache/layout.py RING_SNAPSHOTS) a step takes that many, the rest keep their
    last snapshot and take one at a later boundary."""
    s = make(num_blocks=128, snapshots=8, chunk_size=16, max_num_batched_tokens=64, decode_snapshots=cap)
    seqs = [seq(r, 7, max_tokens=12, start=10 * i) for i, r in enumerate("abcd")]  # 7 tokens: boundaries at 8, 12
    for q in seqs:
        s.add(q)
    taken = []
    while s.has_work:
        plan = s.schedule()
        rows = [q.decode_snapshot for q in plan.decodes if q.decode_snapshot is not None]
        assert len(set(rows)) == len(rows) and (cap is None or len(rows) <= cap)
        taken.append(len(rows))
        run_step(s, plan)
    assert max(taken) == (4 if cap is None else cap) and sum(taken) > 0
    s.blocks.check()


def test_prefix_hit_without_request_state():
    s = make()
    s.add(seq("a", 10))
    drain(s)
    b = seq("b", 14)
    s.add(b)
    s.schedule()
    assert b.num_cached == 8
    drain(s)
    assert s.blocks.hit_rate == pytest.approx(8 / 24)
    s.blocks.check()


def test_preemption_recomputes_instead_of_crashing():
    s = make(num_blocks=6, bs=4, max_num_seqs=4)  # 24 token slots
    seqs = [seq(str(i), 7, max_tokens=8, start=100 * i) for i in range(3)]  # each needs 4 blocks eventually
    for x in seqs:
        s.add(x)
    plans = drain(s)
    assert s.num_preemptions > 0 and any(p.preempted for p in plans)
    assert all(len(x.output) == 8 for x in seqs)
    s.blocks.check()
    assert s.blocks.num_free == 6


def test_limits():
    s = make(num_blocks=4, max_waiting=1, max_num_seqs=2)
    with pytest.raises(ValueError, match="cache blocks"):
        s.add(seq("big", 20))
    for i in range(3):  # two take the free slots, one may queue
        s.add(seq(str(i), 4))
    with pytest.raises(QueueFull):
        s.add(seq("b", 4))
    with pytest.raises(ValueError, match="multiple of block_size"):
        config(chunk_size=10, block_size=4)


def test_abort_frees_everything():
    s = make()
    a, b = seq("a", 9), seq("b", 9, start=50)
    s.add(a)
    s.add(b)
    s.schedule()
    s.abort(a)
    s.abort(b)
    assert a.finish_reason == "abort" and not s.has_work
    s.blocks.check()
    assert s.blocks.num_free == 64 and len(s.free_slots) == s.cfg.max_num_seqs
