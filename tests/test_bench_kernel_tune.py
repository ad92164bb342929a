"""bench/kernel_tune.py's sweep, on a CPU: the candidate designs of paged decode interpreted on bench.kernels' CPU
shape, beside the defaults (the product kernel's design), a configuration that fails recorded with its error."""

import math

from bench import kernel_tune


def test_candidate_sweep_times_each_design_beside_the_defaults():
    designs = [c for c in kernel_tune.CANDIDATE_GRID if (c["pages_per_tile"], c["num_warps"]) == (2, 1)]
    designs += [c for c in kernel_tune.CANDIDATE_GRID if c.get("heads")][:2]
    assert len(designs) == 6  # prefetch, fused, both; the product's design in one partition; heads twice
    bad = dict(fused=True, pages_per_partition=2)  # one partition cannot cover the 16-block table
    emitted = []
    result = kernel_tune.sweep("candidates", designs + [bad], iters=1, deadline=math.inf, emit=emitted.append,
                               interpret=True)
    rows = result["configurations"]
    assert [r["params"] for r in rows] == [{}] + designs + [bad]
    assert len(emitted) == len(rows) and all(e is result for e in emitted)
    assert all(r["ok"] and r["max_abs_diff"] < 3e-2 and r["seconds"] > 0 for r in rows[:-1]), rows
    assert "must cover the table" in rows[-1]["error"]
    assert result["best"] in rows[:-1] and result["speedup_best_vs_defaults"] > 0
    assert result["shape"].startswith("B=8 ctx=256") and not result["cut_at_budget"]
