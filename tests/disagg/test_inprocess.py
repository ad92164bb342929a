"""Two engines in one process, prefill -> TCP (loopback) -> decode, against the colocated engine (greedy).

Real transfer path end to end (plan, DLPack export, frames over sockets, receive region, import program) for
dense, MLA, sliding-window and hybrid models; the prefill and decode pools are set up so their block lists differ
and decode holds prefix blocks of an earlier request (those are not sent)."""

from __future__ import annotations

import collections
import queue

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.disagg.decode_side import KVIntake
from jaxserve.disagg.prefill_side import Feeder, Handoff
from jaxserve.engine.llm_engine import EngineConfig, LLMEngine
from jaxserve.transfer.plan import layer_groups
from jaxserve.transfer.pull import PullLink, PullServer
from jaxserve.transfer.shm import ShmLink
from jaxserve.transfer.state import KVPoll
from jaxserve.transfer.tcp import TcpLink

BASE = [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15, 6, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [BASE[:13], BASE[:3], BASE[:21], [30, 31] + BASE[:11], BASE[:17]]
CFG = EngineConfig(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
                   max_num_seqs=8, num_snapshots=8)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def compiled_transfer_programs(pre, dec) -> tuple[int, int]:
    """Executables compiled so far by the export programs of `pre` and the import programs of `dec`."""
    return (sum(f._cache_size() for f in pre.runner._io._export.values()),
            sum(f._cache_size() for f in dec.runner._io._import.values()))


def run_disagg(path, prompts, params, *, sample=True, layers_per_group=None, warm_decode=None, tp=(1, 1),
               shm=False, pull=False, warm_transfer=False, exported=None, failing_imports=0, seqs=None,
               resumed=None, cfg=CFG, after_step=None, bind_after=None):
    """tp: (prefill, decode) tensor parallelism, over the two fake CPU devices; shm: the local backend; pull:
    the device backend (each side its own JAX transfer server); warm_transfer: compile the export / import
    programs first, and check the transfers compile no more; exported: a list that collects every
    (staged array index, device array) prefill's exports hand the sender; failing_imports: decode's first
    that many imports raise; seqs: a list that collects decode's sequences; resumed: per prompt the output a
    failed first placement streamed, resumed as the router resumes it (router/cluster.py): prefill gets prompt +
    output and sends the KV of all but the last token, unsampled, and decode gets the output; cfg: both engines'
    settings; after_step: called with the prefill engine and the hand-offs after each prefill step; bind_after: the
    hand-offs are made before decode's reservation (the router's early prefill: no link, no blocks, decode asked to
    skip nothing) and bound to it after that many prefill steps (or once all ran)."""
    def mesh(n):
        return None if n == 1 else jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                                                 devices=jax.devices()[:n])
    pre = LLMEngine(path, "float32", cfg, mesh(tp[0]), progress=False)
    dec = LLMEngine(path, "float32", cfg, mesh(tp[1]), progress=False)
    posted: queue.Queue = queue.Queue()
    # the deadline is not under test here: long enough for a loaded machine to compile the prefill programs
    intake = KVIntake(dec.connector, "t0k", posted.put, deadline_s=600, shared=shm,
                      puller=PullServer(connections=2) if pull else None)
    link = (ShmLink(intake.address, "t0k", intake.pool.shm_name, connections=2, chunk_bytes=4096) if shm
            else PullLink(intake.address, "t0k", PullServer(connections=2), connections=2) if pull
            else TcpLink(intake.address, "t0k", connections=2, chunk_bytes=4096))
    feeder = Feeder()
    pre.blocks.allocate([], 5 * cfg.block_size)  # shift prefill's block ids so the two pools differ
    if exported is not None:
        export_kv = pre.runner.export_kv

        def record(*a):
            items = export_kv(*a)
            exported.extend(items)
            return items
        pre.runner.export_kv = record
    if failing_imports:
        import_kv, left = dec.runner.import_kv, [failing_imports]

        def broken(*a, **kw):
            left[0] -= 1
            if left[0] >= 0:
                raise RuntimeError("injected import failure")
            return import_kv(*a, **kw)
        dec.runner.import_kv = broken
    if warm_transfer:
        groups = layer_groups(pre.layout.num_layers, layers_per_group)
        pre.runner.warmup_transfer("float32", groups, export=True, receive=False, progress=False)
        dec.runner.warmup_transfer("float32", groups, export=False, receive=True, progress=False)
        compiled = compiled_transfer_programs(pre, dec)
    try:
        if warm_decode is not None:  # decode computes this prompt itself first: its blocks are prefix cache there
            dec.add_request("warm", warm_decode, params)
            while dec.has_work:
                dec.step()
        dseqs, handoffs, skips, unbound = [], [], [], []
        for i, p in enumerate(prompts):
            out = list(resumed[i]) if resumed else []
            kv = len(p) + len(out) - 1 if out else len(p) if sample else len(p) - 1
            seq, dst, skip = intake.reserve(f"r{i}", p, params, kv, max_skip=0 if bind_after is not None else None,
                                            **({"output": out} if out else {}))
            base = intake.shm_base(f"r{i}") if shm else None
            if bind_after is None:
                h = Handoff(link, feeder, dst, skip, kv, sample and not out, layers_per_group, shm_base=base)
            else:
                h = Handoff(None, feeder, None, 0, kv, sample and not out, layers_per_group, pull=pull)
                unbound.append((h, dst, base))
            (pseq,) = pre.add_request(f"r{i}", (p + out)[:kv], params)
            pseq.transfer.out = h
            dseqs.append(seq)
            if seqs is not None:
                seqs.append(seq)
            handoffs.append(h)
            skips.append(skip)
        steps = 0
        while pre.has_work:
            pre.step()
            steps += 1
            if after_step is not None:
                after_step(pre, handoffs)
            if steps == bind_after:
                for h, dst, base in unbound:
                    h.bind(link, dst, base)
        for h, dst, base in unbound if steps < (bind_after or 0) else ():
            h.bind(link, dst, base)
        for h in handoffs:
            assert h.sender.wait(30) is KVPoll.DONE, h.sender.state.reason
        while dec.has_work or intake.receivers:
            while True:
                try:
                    posted.get(timeout=0 if dec.has_work else 30)()
                except queue.Empty:
                    break
            if dec.has_work:
                dec.step()
        for eng in (pre, dec):
            eng.blocks.check()
        if warm_transfer:
            assert compiled_transfer_programs(pre, dec) == compiled
        assert dec.blocks.num_referenced() == 0 and intake.pool.free_bytes == intake.pool.capacity
        return [s.output for s in dseqs], handoffs, skips, dec
    finally:
        link.close()
        feeder.close()
        intake.close()


# dense and sliding-window here; MLA (deepseek_v3) runs over TCP in the sharded test below and the hybrid
# kimi_linear through the shared-memory and device backends below, all three end to end over HTTP with real
# worker processes in tests/router/test_cluster_http.py
def test_a_failed_import_fails_its_request_and_frees_its_blocks(checkpoint_dir):
    """The import raising on decode (a device error) ends that request with the error, for the router to place
    it again, instead of leaving it waiting; the others are served and every block and region is freed
    (run_disagg checks)."""
    path = checkpoint_dir("llama")
    want = LLM(path, progress=False, engine=CFG).generate(PROMPTS[:2], GREEDY)
    seqs: list = []
    got, *_ = run_disagg(path, PROMPTS[:2], GREEDY, failing_imports=1, seqs=seqs)
    failed = [i for i, s in enumerate(seqs) if s.finish_reason == "error"]  # the first transfer to arrive
    assert len(failed) == 1 and "injected import failure" in seqs[failed[0]].error
    (ok,) = {0, 1} - set(failed)
    assert seqs[ok].error is None and got[ok] == want[ok].token_ids


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_disaggregated_tokens_equal_colocated(checkpoint_dir, family):
    path = checkpoint_dir(family)
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS, GREEDY)]
    got, handoffs, skips, dec = run_disagg(path, PROMPTS, GREEDY, layers_per_group=2, warm_decode=BASE[:9])
    assert got == want, family
    assert any(s > 0 for s in skips)  # decode already held a prefix: those blocks were not sent
    spec, bs = dec.cache_spec, CFG.block_size
    for p, h, skip in zip(PROMPTS, handoffs, skips):
        # bytes on the wire == what the cache groups say decode needs for this prompt (block granular)
        nb = -(-len(p) // bs)
        assert h.sender.bytes_acked == spec.transfer_bytes(len(p), bs, 4, skip), (p, skip)
        assert nb - skip >= 1


def test_shared_memory_backend_matches_colocated(checkpoint_dir):
    """The local backend (sender writes into decode's shared-memory receive pool) on a hybrid model; with the
    transfer programs warmed up first, no request compiles another."""
    path = checkpoint_dir("kimi_linear")
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS, GREEDY)]
    got, handoffs, skips, dec = run_disagg(path, PROMPTS, GREEDY, layers_per_group=2, shm=True, warm_transfer=True)
    assert got == want
    for p, h, skip in zip(PROMPTS, handoffs, skips):
        assert h.sender.shm_base is not None
        assert h.sender.bytes_acked == dec.cache_spec.transfer_bytes(len(p), CFG.block_size, 4, skip)


@pytest.mark.parametrize("family,tp", [("kimi_linear", (1, 1)), ("llama", (2, 1))])
def test_device_backend_matches_colocated(checkpoint_dir, family, tp):
    """The device backend: decode pulls each layer group's staged arrays through JAX's transfer server (one
    PULL frame per group for the last chunk, and one per group for the spans an earlier chunk completed; no
    bytes on the KV connections), for a hybrid model and from a sharded (TP=2) pool; the transfers compile
    nothing beyond the warmed programs; the counted bytes are the plan's."""
    path = checkpoint_dir(family)
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS, GREEDY)]
    got, handoffs, skips, dec = run_disagg(path, PROMPTS, GREEDY, layers_per_group=2, pull=True, tp=tp,
                                           warm_transfer=True)
    assert got == want
    groups = len(layer_groups(dec.layout.num_layers, 2))
    for p, h, skip in zip(PROMPTS, handoffs, skips):
        assert h.sender.frames == h.sender.sends + 2  # plan + the PULLs + record
        # the last chunk's export one PULL per group; each earlier chunk's that completed a span one per group
        # holding attention blocks (the spans of a linear-attention group's state all go with the last)
        early, with_blocks = len(h.sender.staging.spans) - 1, len({a.layer_group for a in h.sender.staging.arrays
                                                                   if a.kind == "blocks"})
        assert (h.sender.sends - groups) % with_blocks == 0 and 0 <= (h.sender.sends - groups) // with_blocks <= early
        assert h.sender.bytes_acked == dec.cache_spec.transfer_bytes(len(p), CFG.block_size, 4, skip)
    assert any(h.sender.sends > groups for h in handoffs)  # a longer prompt's spans left before its last chunk


def test_kv_sent_over_tcp_from_pinned_host_copies_matches_colocated(checkpoint_dir, monkeypatch):
    """The TCP backend's path on an accelerator, with this CPU's arrays: each layer group's exported arrays copied
    once into pinned host memory as they are dispatched (transfer/device.py `host_copies`), the sender writing the
    socket from views of those copies; the answers are colocated's."""
    from jaxserve.disagg import prefill_side
    from jaxserve.transfer import device
    copied = []

    def pinned(items):
        out = device.host_copies(items, pinned=True)
        copied.extend(x for _, x in out)
        return out
    monkeypatch.setattr(prefill_side, "host_copies", pinned)
    path = checkpoint_dir("llama")
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS[:2], GREEDY)]
    got, handoffs, _, _ = run_disagg(path, PROMPTS[:2], GREEDY, layers_per_group=2)
    assert got == want
    assert copied and all(x.sharding.memory_kind == "pinned_host" for x in copied)
    assert sum(h.sender.sends for h in handoffs) >= len(copied)  # every staged array went out from its copy


@pytest.mark.parametrize("pull", [False, True])
def test_a_longer_prompts_kv_leaves_chunk_by_chunk(checkpoint_dir, pull):
    """A 21-token prompt prefilled in chunks of 8 (blocks of 4: spans of 2 rows): the rows its first chunk
    computed are at decode before its second chunk runs, the first two chunks' before its last, every layer
    group's (TCP, and pulled device to device); the answer is colocated's."""
    import time
    path = checkpoint_dir("llama")
    prompt = BASE[:21]
    want = LLM(path, progress=False, engine=CFG).generate([prompt], GREEDY)[0].token_ids
    arrived = []

    def landed(pre, handoffs):
        (h,) = handoffs
        st = h.sender.staging
        if len(arrived) < 2:  # after chunk k (k = 1, 2): spans 0..k-1, all groups, and nothing else
            spans = range(len(arrived) + 1)
            want_bytes = sum(a.sent_bytes for a in st.arrays if a.span in spans)
            end = time.monotonic() + 30
            while h.sender.bytes_acked < want_bytes and time.monotonic() < end:
                time.sleep(0.002)
            time.sleep(0.05)  # nothing more is on its way
        arrived.append(h.sender.bytes_acked)
    got, handoffs, _, _ = run_disagg(path, [prompt], GREEDY, layers_per_group=2, pull=pull, after_step=landed)
    assert got == [want]
    st = handoffs[0].sender.staging
    assert st.spans == [(0, 2), (2, 2), (4, 2)] and len(arrived) == 3
    assert arrived[:2] == [sum(a.sent_bytes for a in st.arrays if a.span < k) for k in (1, 2)]
    assert arrived[1] < st.sent_bytes


@pytest.mark.parametrize("pull", [False, True])
@pytest.mark.parametrize("bind_after", [1, 9])
def test_a_hand_off_bound_after_its_prefill_began_sends_what_waited(checkpoint_dir, pull, bind_after):
    """The router's early prefill: hand-offs made before decode reserved compute at once; what they export
    waits in them, in order, until decode's reservation is bound (after the first prefill step: an earlier chunk's
    spans waited; or after the last: every group and the first-token record waited), then it all goes. The
    answers are colocated's, over TCP and pulled device to device; a binding of the wrong kind of link fails."""
    path = checkpoint_dir("llama")
    prompts = [BASE[:21], BASE[:6]]
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(prompts, GREEDY)]
    seen = []

    def waited(pre, handoffs):
        seen.append([(h.bound, h.sender is None, len(h._parked)) for h in handoffs])
    got, handoffs, skips, _ = run_disagg(path, prompts, GREEDY, layers_per_group=2, pull=pull, after_step=waited,
                                         bind_after=bind_after)
    assert got == want and skips == [0, 0]
    # after the first step, before any binding: both computed (the short prompt whole, the long one's first
    # chunk), their exports waiting in them with no sender
    assert [(bound, unsent, parked > 0) for bound, unsent, parked in seen[0]] == [(False, True, True)] * 2
    assert len(seen) == 3 and all(h.bound and not h._parked for h in handoffs)  # 21 tokens: three chunks
    h = Handoff(None, None, None, 0, 8, pull=not pull)  # its exports made for the other kind of link
    with pytest.raises(ValueError, match="destination refused: the link to decode"):
        h.bind(PullLink.__new__(PullLink) if pull else object(), [0, 1], None)
    assert "the link to decode" in h.failed and h.sender is None and not h.bound


def test_a_hand_off_preempted_between_its_chunks_reads_its_rows_where_they_are_then(checkpoint_dir):
    """The prefill instance preempts a request after its first chunk's rows left (recomputed in other blocks):
    what it sent stays, the rest is read from its new blocks, and the answer is colocated's."""
    path = checkpoint_dir("llama")
    prompt = BASE[:21]
    want = LLM(path, progress=False, engine=CFG).generate([prompt], GREEDY)[0].token_ids
    moved = []

    def preempt(pre, handoffs):
        if not moved:
            (seq,) = pre.scheduler.running
            old = list(seq.block_ids)
            pre.scheduler.requeue(seq)
            moved.append((old, pre.blocks.allocate([], len(old) * CFG.block_size)))  # its blocks taken meanwhile
        elif len(moved) == 1:
            (seq,) = pre.scheduler.running
            # recomputed elsewhere in the pool (the first chunk's two blocks are its prefix cache hit)
            assert seq.block_ids[:2] == moved[0][0][:2] and not set(seq.block_ids[2:]) & set(moved[0][0])
            moved.append(seq)
    got, handoffs, _, _ = run_disagg(path, [prompt], GREEDY, layers_per_group=2, after_step=preempt)
    assert got == [want] and len(moved) == 2 and moved[1].num_preemptions == 1
    assert handoffs[0].sender.bytes_acked == handoffs[0].sender.staging.sent_bytes


def test_a_hand_off_in_one_group_is_exported_before_the_first_token_is_read(checkpoint_dir, monkeypatch):
    """A prompt sent in one layer group, prefilled in two chunks: each step's export (the span its first chunk
    completed, then the rest) is dispatched with the step's programs, before the step reads its tokens back (the
    device runs it right after the prefill; neither the first token nor the next step waits for its dispatch);
    the answer is colocated's."""
    from jaxserve.engine.runner import ModelRunner
    path = checkpoint_dir("llama")
    prompt = BASE[:13]  # chunks of 8 and 5 tokens
    want = LLM(path, progress=False, engine=CFG).generate([prompt], GREEDY)[0].token_ids
    order = []
    export_kv, read = ModelRunner.export_kv, ModelRunner._read

    def exporting(self, *a, **kw):
        order.append("export")
        return export_kv(self, *a, **kw)

    def reading(x):
        order.append("read")
        return read(x)
    monkeypatch.setattr(ModelRunner, "export_kv", exporting)
    monkeypatch.setattr(ModelRunner, "_read", staticmethod(reading))
    got, handoffs, _, _ = run_disagg(path, [prompt], GREEDY)
    assert got == [want] and handoffs[0].sender.bytes_acked == handoffs[0].sender.staging.sent_bytes
    assert handoffs[0].sender.staging.spans == [(0, 2), (2, 2)]
    assert order[:4] == ["export", "read", "export", "read"], order  # the two prefill steps': then decode's reads


def test_last_prompt_token_left_to_decode(checkpoint_dir):
    path = checkpoint_dir("qwen3_next")
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS, GREEDY)]
    got, handoffs, _, _ = run_disagg(path, PROMPTS, GREEDY, sample=False)
    assert got == want
    assert all(h.sender.plan.num_tokens == len(p) - 1 for p, h in zip(PROMPTS, handoffs))


def test_a_request_resumed_after_its_first_tokens_ends_as_colocated(checkpoint_dir):
    """The router's resume of a request whose placement failed after streaming k tokens: prefill computes the
    prompt and all but the last of those tokens, decode computes the last and goes on: the answer is the
    colocated engine's, whatever k."""
    path = checkpoint_dir("llama")
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS, GREEDY)]
    got, handoffs, _, _ = run_disagg(path, PROMPTS, GREEDY, resumed=[w[:k] for w, k in zip(want, (1, 2, 5, 1, 3))])
    assert got == want
    assert [h.sender.plan.num_tokens for h in handoffs] == [len(p) + k - 1 for p, k in zip(PROMPTS, (1, 2, 5, 1, 3))]


def test_seeded_sampling_matches_colocated(checkpoint_dir):
    path = checkpoint_dir("llama")
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS[:3], params)]
    got, _, _, _ = run_disagg(path, PROMPTS[:3], params)
    assert got == want
    assert np.unique([len(g) for g in got]).tolist() == [6]


def test_layer_groups_of_one_structure_share_an_export_program(checkpoint_dir):
    """Llama's four layers in four groups: one export program per row bucket serves every group (the group's
    first layer an argument), and group k's export holds exactly layer k of the sent blocks."""
    import jax.numpy as jnp

    from jaxserve.transfer.plan import bucket, staging
    pre = LLMEngine(checkpoint_dir("llama"), "float32", CFG, progress=False)
    runner = pre.runner
    groups = layer_groups(pre.layout.num_layers, 1)
    assert len(groups) == 4
    runner.warmup_transfer("float32", groups, export=True, receive=False, progress=False)
    assert len(runner._io._export) == len({bucket(n) for n in range(1, runner.max_blocks_per_seq + 1)})
    pool = np.random.default_rng(0).standard_normal(runner.pool[0].shape).astype(np.float32)
    runner.pool = [jnp.asarray(pool)]
    blocks = [9, 3, 7]
    st = staging(pre.layout, "float32", bucket(len(blocks)), groups, runner.head_parts)
    for k, (lo, hi) in enumerate(groups):
        (_, x), = runner.export_kv(st, k, blocks, 0)
        np.testing.assert_array_equal(np.asarray(x)[:len(blocks)], pool[blocks, lo:hi])


@pytest.mark.parametrize("family", ["kimi_linear", "gpt_oss"])
def test_layerwise_prefill_equals_one_program_and_exports_early(checkpoint_dir, family):
    """Prefill run as one program per layer (layer-wise streaming) leaves the same pool and samples the same
    token as the one-program prefill; each layer group's export is dispatched right after its own program,
    before any later group runs (so its KV can travel while they compute)."""
    import jax

    from jaxserve.engine.rows import PrefillRow
    path = checkpoint_dir(family)
    one, staged = (LLMEngine(path, "float32", CFG, progress=False) for _ in range(2))
    prompt = BASE[:13]
    blocks = list(range(1, 5))
    row = PrefillRow("r", prompt, 0, blocks, 0, 0, None, True, GREEDY, 0, prompt)
    want, = one.runner.prefill([row])
    groups = layer_groups(staged.layout.num_layers, 1)
    assert len(groups) == staged.layout.num_layers > 1
    order = []
    run_stage = staged.runner._prefill

    def stage(*a, **kw):  # a[3]: the shift of a middle group of a run (runner._stage)
        order.append(("stage", kw["lo"] + (0 if a[3] is None else int(a[3]))))
        return run_stage(*a, **kw)
    staged.runner._prefill = stage
    got = staged.runner.prefill([row], groups, lambda k: order.append(("export", groups[k][0])))
    assert got[0].token == want.token and abs(got[0].logprob - want.logprob) < 1e-5
    for a, b in zip(jax.tree.leaves(one.runner.pool), jax.tree.leaves(staged.runner.pool)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert order == [(kind, lo) for lo, _ in groups for kind in ("stage", "export")]


@pytest.mark.parametrize("family,tp", [("llama", (2, 1)), ("llama", (1, 2)), ("llama", (2, 2)),
                                       ("deepseek_v3", (2, 1))])
def test_sharded_transfer_between_different_tensor_parallelism(checkpoint_dir, family, tp):
    """Prefill and decode shard KV heads differently (TP=2 -> TP=1, the reverse, and TP=2 on both; MLA's
    latent is replicated, so one device's copy is sent) and the tokens equal the colocated engine's. A sharded
    prefill sends each rank's heads as they are (HND head parts, no gather): every exported array lives on one
    device or is replicated, and the parts of each attention array come from both devices. The bytes are what
    a TP=1 transfer carries."""
    path = checkpoint_dir(family)
    want = [o.token_ids for o in LLM(path, progress=False, engine=CFG).generate(PROMPTS[:3], GREEDY)]
    exported: list = []
    got, handoffs, skips, dec = run_disagg(path, PROMPTS[:3], GREEDY, layers_per_group=2, tp=tp, exported=exported)
    assert got == want, (family, tp)
    if tp[1] == 2:  # the decode pool really is split over both devices after the import
        assert any(len(x.sharding.device_set) == 2 for x in jax.tree.leaves(dec.runner.pool))
    split = tp[0] == 2 and family == "llama"
    for h in handoffs:
        assert h.sender.plan.head_parts == ([2] if split else None)
    # nothing to gather: one device's array, or a replicated one (read from any one device)
    assert all(len(x.sharding.device_set) == 1 or x.is_fully_replicated for _, x in exported)
    if split:  # each array's head parts: one from each device (llama has only attention arrays, all split)
        per_device = collections.Counter(d for _, x in exported for d in x.sharding.device_set)
        assert len(per_device) == 2 and len(set(per_device.values())) == 1, per_device
    for p, h, skip in zip(PROMPTS[:3], handoffs, skips):
        assert h.sender.bytes_acked == dec.cache_spec.transfer_bytes(len(p), CFG.block_size, 4, skip)
