"""bench/faults.py's reference check: an answer is token-exact, parts from the colocated engine's only at a near
tie (float32 rounding of another batch deciding a greedy step the reference itself nearly split), or is wrong."""

import types

from bench.faults import Reference, wrong_tokens


def output(steps):
    """steps: per position (chosen token, its logprob, [(another token, its logprob)])."""
    return types.SimpleNamespace(token_ids=[t for t, _, _ in steps],
                                 logprobs=[(lp, [(t, lp)] + alt) for t, lp, alt in steps])


def test_a_reference_tells_a_near_tie_from_a_wrong_token():
    ref = Reference([output([(5, -0.1, [(6, -3.0)]), (7, -0.69310, [(8, -0.69315)]), (9, -0.2, [(1, -2.0)])])])
    assert ref[0] == [5, 7, 9] and len(ref) == 1
    assert ref.parting(0, [5, 7, 9]) is None and not ref.near_tie(0, [5, 7, 9], 1e-4)
    # parts at position 1, where the reference's top two were 5e-5 apart: a near tie; whatever follows differs
    k, gap = ref.parting(0, [5, 8, 3])
    assert k == 1 and abs(gap - 5e-5) < 1e-9
    assert ref.near_tie(0, [5, 8, 3], 1e-4) and not ref.near_tie(0, [5, 8, 3], 1e-5)
    # parts where the reference preferred its token by 2.9: wrong; a token not among its top ones: wrong
    assert ref.parting(0, [6, 7, 9])[0] == 0 and not ref.near_tie(0, [6, 7, 9], 1e-4)
    assert ref.parting(0, [5, 7, 4]) == (2, None) and not ref.near_tie(0, [5, 7, 4], 1e-4)
    # a shorter answer parts where it ends
    assert ref.parting(0, [5, 7]) == (2, None)
    w = wrong_tokens({"rid": "r", "tokens": [6, 7, 9]}, ref, 0)
    assert (w["first_difference"], w["got"], w["want"]) == (0, [6, 7, 9], [5, 7, 9])
    assert abs(w["logprob_gap"] - 2.9) < 1e-9


def test_compile_log_keeps_what_each_worker_compiled_and_when(monkeypatch):
    from bench import faults
    clock = iter([10.0, 20.0, 30.0, 40.0])
    monkeypatch.setattr(faults.time, "monotonic", lambda: next(clock))
    log = faults.CompileLog()
    # lines as router/launcher.py echoes a worker's output, JAX's compile log among them
    line = ("[{}] 2026-11-28 00:31:06,427 {} WARNING jax._src.interpreters.pxla: Compiling jit({}) with global "
            "shapes and types (ShapedArray(int32[{}]),). Argument mapping: (UnspecifiedValue,).")
    log.echo(line.format("d1", "d1", "prefill_fn", 384))  # at 10
    log.echo("[d1] 2026-11-28 00:31:06,500 d1 INFO jaxserve.worker: serving")  # not a compile: not kept
    log.echo("Compiling jit(x) with global shapes and types ()")  # not a worker's line: not kept
    log.echo(line.format("d0", "d0", "decode_fn", 8))  # at 20
    log.echo(line.format("d1", "d1", "sample_fn", 8))  # at 30
    assert log.counts() == {"d1": 2, "d0": 1}
    assert log.since(0, exclude="d0") == {"d1": ["jit(prefill_fn) (int32[384],)", "jit(sample_fn) (int32[8],)"]}
    assert log.since(15, exclude="p0") == {"d0": ["jit(decode_fn) (int32[8],)"], "d1": ["jit(sample_fn) (int32[8],)"]}
    # a long argument list keeps its end (a step program's weights come first, its batch last)
    log.echo(line.format("d1", "d1", "decode_fn", ",".join(["7"] * 100)).replace("int32", "float32[9], int32"))
    got = log.since(35, exclude="p0")["d1"][0]
    assert got.startswith("jit(decode_fn) ...") and got.endswith(",7,7,7],)") and len(got) < 200
    assert "ShapedArray" not in got
