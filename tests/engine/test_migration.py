"""Migration of running decode requests' work to a helper engine (engine/migration.py), in one process: the
source engine's step programs call the helper's `Guests` through the message format the workers' control port
carries (pack / unpack), with no network in between (the live test over gRPC is tests/router/test_balance.py).

Greedy answers with attention-level and with layer-level migration triggered mid-generation equal those
without, for a dense, an MLA and a hybrid model, and the helper's part is what makes them equal (a helper with
its held KV spoiled changes them). A helper that fails mid-generation loses nothing. Impossible moves are
refused naming the field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.migration import MigrationError, pack, unpack

from .test_engine import ENGINE

PROMPTS = [[5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12], [30, 31, 5, 7, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
MOVES = {"llama": (("heads", [1]), ("layers", [1, 3])),  # dense GQA, 2 KV heads, 4 layers
         "deepseek_v3": (("heads", [0, 2]), ("layers", [0, 2])),  # MLA: query heads over the latent
         "qwen3_next": (("heads", [0]), ("layers", [1, 4]))}  # Gated DeltaNet + gated attention (layer 3)


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    made = {}

    def get(family):
        if family not in made:
            cfg = dataclasses.replace(ENGINE, num_blocks=96)
            made[family] = tuple(LLM(checkpoint_dir(family), progress=False, engine=cfg).engine for _ in range(2))
        return made[family]
    return get


def run(src, move=None, at=5, link=None, tag=""):
    """Generate PROMPTS on src, moving their work after `at` steps -> (outputs, migrations per request)."""
    for i, p in enumerate(PROMPTS):
        src.add_request(f"{tag}{i}", p, PARAMS)
    done, n = {}, 0
    while src.has_work:
        for s in src.step():
            if s.finished:
                done[s.request_id] = (list(s.output), s.migrations)
                src.release(s)
        n += 1
        if move is not None and n == at:
            kind, arg = move
            ans = src.migrate(kind, arg if kind == "heads" else None, arg if kind == "layers" else None, "src",
                              "dst", link)
            assert ans["requests"] and ans["bytes"] > 0
    src.blocks.check()
    assert src.blocks.num_referenced() == 0 and not src.outbound
    return [done[f"{tag}{i}"][0] for i in range(len(PROMPTS))], [done[f"{tag}{i}"][1] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("family", sorted(MOVES))
def test_greedy_answers_are_unchanged_by_either_migration(pair, family):
    src, dst = pair(family)
    base, _ = run(src, tag="base")
    for kind, arg in MOVES[family]:
        before = dict(src.moves)
        got, moves = run(src, (kind, arg), link=dst.guests.handle, tag=kind)
        assert got == base, (family, kind)
        assert all(m == [{"kind": kind, "src": "src", "dst": "dst"}] for m in moves), moves
        # the helper answered every step after the move, nothing failed, and it forgot the move at the end
        assert src.moves["started"] == before["started"] + 1 and src.moves["failed"] == before["failed"]
        assert src.moves["calls"] > before["calls"] + 3
        assert dst.guests.count() == 0


@pytest.mark.parametrize("kind", ["heads", "layers"])
def test_the_helpers_part_is_what_the_answer_depends_on(pair, kind):
    """A helper whose held KV is spoiled at the move gives other answers: its part is really used."""
    src, dst = pair("llama")
    base, _ = run(src, tag="spoil-base")

    def spoiling(payload):
        header, arrays = unpack(payload)
        if header["op"] == "accept":
            arrays = {k: (v if k == "since" else np.asarray(v) * 0 + 0.5) for k, v in arrays.items()}
            payload = pack(header, arrays)
        return dst.guests.handle(payload)
    got, _ = run(src, (kind, dict(MOVES["llama"])[kind]), link=spoiling,
                 tag=f"spoil-{kind}")
    assert got != base


@pytest.mark.parametrize("family,kind", [("llama", "heads"), ("qwen3_next", "heads"), ("qwen3_next", "layers")])
def test_a_helper_that_fails_mid_generation_loses_nothing(pair, family, kind):
    """The helper stops answering after a few steps: heads-migrated requests of a model without request-level
    state redo the step here (their pool is whole), the others are recomputed; every answer is the one without
    migration."""
    src, dst = pair(family)
    base, _ = run(src, tag="fail-base")
    calls = {"n": 0}

    def dying(payload):
        calls["n"] += 1
        if calls["n"] > 3:
            raise ConnectionError("helper gone")
        return dst.guests.handle(payload)
    before = dict(src.moves)
    preempted = src.scheduler.num_preemptions
    got, _ = run(src, (kind, dict(MOVES[family])[kind]), link=dying, tag=f"fail-{family}-{kind}")
    assert got == base
    assert src.moves["failed"] == before["failed"] + 1
    # redone here (llama, heads) or recomputed
    assert (src.scheduler.num_preemptions > preempted) == (family != "llama")


def test_impossible_moves_are_refused_naming_the_field(pair):
    src, dst = pair("llama")
    with pytest.raises(MigrationError, match="nothing is decoding") as e:
        src.migrate("heads", [0], None, "src", "dst", dst.guests.handle)
    assert e.value.param == "src"
    src.add_request("bad", PROMPTS[0], PARAMS)
    for _ in range(3):
        src.step()
    cases = [("heads", [2], None, "heads"), ("heads", [0, 0], None, "heads"), ("heads", None, [0, 1], "layers"),
             ("layers", None, [2, 2], "layers"), ("layers", None, [0, 5], "layers"), ("rows", [0], None, "kind")]
    for kind, heads, layers, param in cases:
        with pytest.raises(MigrationError) as e:
            src.migrate(kind, heads, layers, "src", "dst", dst.guests.handle)
        assert e.value.param == param, (kind, heads, layers, str(e.value))

    def other_model(payload):  # the helper serves another model: it refuses, nothing moves
        header, arrays = unpack(payload)
        header["model"] = {**header["model"], "hidden": 1}
        return dst.guests.handle(pack(header, arrays))
    with pytest.raises(MigrationError, match="did not take the move") as e:
        src.migrate("layers", None, [1, 2], "src", "dst", other_model)
    assert e.value.param == "dst" and not src.outbound
    room, dst.guests.capacity = dst.guests.capacity, 1000  # the helper holds at most this much moved state
    try:
        with pytest.raises(MigrationError, match="no room"):
            src.migrate("layers", None, [1, 2], "src", "dst", dst.guests.handle)
    finally:
        dst.guests.capacity = room
    src.abort("bad")
    src.blocks.check()


def test_messages_carry_arrays_exactly():
    import ml_dtypes
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.asarray([1, -1], np.int32),
              "c": np.linspace(0, 1, 6).astype(ml_dtypes.bfloat16)}
    header, got = unpack(pack({"op": "x", "n": 3}, arrays))
    assert header == {"op": "x", "n": 3}
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v)
    with pytest.raises(ValueError, match="cut short"):
        unpack(pack({}, arrays)[:-3])
