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
