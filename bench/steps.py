"""Engine step times of this tree against an earlier commit, paired: what a change did to a decode or prefill step.

Each tree (this one, and `--baseline` checked out into a temporary git worktree) gets a worker process that loads
the same checkpoint with the same engine config and prepares every case: `decode:RxC` (one decode step of R
requests with C tokens cached each), `prefill:RxT` (one step of R first chunks of T tokens), `prefill:RxT@C` (one
step of R chunks of T tokens after C cached tokens each: a long prompt's later chunk). The driver then
times the cases one step at a time, alternating the trees (the order reversed every round), so a noisy
machine's slow moments fall on both: per case each tree's median and the median of the paired ratios
(this tree / baseline) with their range. The baseline's code runs from its worktree (the worker imports it
first on its path); the worker itself is this file.

    python -m bench.steps --baseline 0ab36c4 --json bench/results/steps.json   (before the native CPU kernel)
    python -m bench.steps --baseline b49a0f5 --json bench/results/steps_prefill.json   (before paged prefill)

`--family` runs a bench-size checkpoint of a model family (bench/families.py) instead of `--model`, and
`--scan-layers` sets engine.scan_layers (default: the engine's choice; false: every layer unrolled, as a GPU's
decode instance runs them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("decode:4x16,decode:4x300,decode:16x300,decode:48x150,prefill:4x128,prefill:3x100,prefill:1x256,"
         "prefill:1x256@768,prefill:2x132@508")


def _worker(model: str, cases: list[str], scan_layers: bool | None) -> None:
    """Prepare every case on an engine of the tree first on sys.path, say "ready", then run a case per line of
    stdin and answer with its seconds."""
    here = os.path.dirname(os.path.abspath(__file__))  # run as a script: bench/ is on the path, and its
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # transfer.py is not the package
    import numpy as np

    from jaxserve.bundled import resolve
    from jaxserve.engine import runner as R
    from jaxserve.engine.llm_engine import EngineConfig, LLMEngine
    from jaxserve.sampling import SamplingParams
    idle = SamplingParams(temperature=0.0, seed=0)  # greedy: the rows' sampling costs what warm-up's does
    eng = LLMEngine(resolve(model, False), "float32", EngineConfig(compilation_cache=None, max_model_len=2048,
                                                                   num_blocks=2048, max_num_seqs=48,
                                                                   scan_layers=scan_layers), None, False)
    r, bs, rng = eng.runner, eng.runner.layout.block_size, np.random.default_rng(0)
    run = {}
    for case in cases:
        kind, shape = case.split(":")
        shape, _, cached = shape.partition("@")
        n, m = map(int, shape.split("x"))
        c = int(cached or 0)
        if kind == "decode":
            nb = -(-(m + 1) // bs)
            rows = [R.DecodeRow(i, 1, m, list(range(1 + nb * i, 1 + nb * (i + 1))), idle, 0) for i in range(n)]
            run[case] = lambda rows=rows: r.generate(rows)
        else:
            nb, scratch = -(-(c + m) // bs), r.layout.scratch_row
            rows = [R.PrefillRow(f"r{i}", rng.integers(3, 1000, m).tolist(), c,
                                 list(range(1 + nb * i, 1 + nb * i + nb)), scratch, scratch, None, True, idle, 0,
                                 [1, 2, 3]) for i in range(n)]
            run[case] = lambda rows=rows: r.prefill(rows)
        run[case]()  # compile
        run[case]()
    import jaxserve
    print("ready", os.path.dirname(os.path.dirname(os.path.abspath(jaxserve.__file__))), flush=True)
    for line in sys.stdin:
        t = time.perf_counter()
        run[line.strip()]()
        print(f"{time.perf_counter() - t:.6f}", flush=True)


def _start(tree: str, model: str, cases: str, scan_layers: str) -> subprocess.Popen:
    """A worker on `tree`'s code; raises unless it is ready and its jaxserve is the tree's own."""
    env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--cases", cases,
                          "--scan-layers", scan_layers],
                         cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    while (line := p.stdout.readline()) and not line.startswith("ready"):
        pass
    if p.poll() is not None or not line:
        raise RuntimeError(f"the worker for {tree} exited ({p.returncode}) before it was ready")
    if os.path.realpath(line.split(maxsplit=1)[1].strip()) != os.path.realpath(tree):
        raise RuntimeError(f"the worker for {tree} imported jaxserve from {line.split(maxsplit=1)[1].strip()}")
    return p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="the git revision to compare with (required unless --worker)")
    ap.add_argument("--json", help="where to write the result (required unless --worker)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--family", help="a bench-size checkpoint of this model family (bench/families.py) as the model")
    ap.add_argument("--models", default="bench/.models", help="where bench-size checkpoints are built")
    ap.add_argument("--scan-layers", default="auto", choices=("auto", "true", "false"),
                    help="engine.scan_layers (auto: the engine's choice)")
    ap.add_argument("--cases", default=CASES, help="comma-separated decode:RxC / prefill:RxT / prefill:RxT@C")
    ap.add_argument("--reps", type=int, default=20, help="timed steps of each case per tree")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    scan = {"auto": None, "true": True, "false": False}[a.scan_layers]
    if a.worker:
        return _worker(a.model, a.cases.split(","), scan)
    if not a.baseline or not a.json:
        ap.error("--baseline and --json are required")
    if a.family:
        sys.path.insert(0, ROOT)
        from bench.families import checkpoint
        a.model = checkpoint(a.family, a.models)
    from tqdm import tqdm
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", a.baseline], capture_output=True, text=True,
                         check=True).stdout.strip()
    base = tempfile.mkdtemp(prefix="jaxserve-steps-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, rev], check=True, capture_output=True)
    cases = a.cases.split(",")
    procs = []
    try:
        model = os.path.abspath(a.model) if os.path.exists(a.model) else a.model  # the workers run in their trees
        procs = [_start(tree, model, a.cases, a.scan_layers) for tree in (ROOT, base)]
        times = {c: ([], []) for c in cases}
        for i in tqdm(range(a.reps), desc="steps", unit="round"):
            for c in cases:
                for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                    procs[k].stdin.write(c + "\n")
                    procs[k].stdin.flush()
                    times[c][k].append(float(procs[k].stdout.readline()))
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], capture_output=True)
    out = {}
    for c, (new, old) in times.items():
        ratios = [x / y for x, y in zip(new, old)]
        out[c] = {"this_ms": 1e3 * statistics.median(new), "baseline_ms": 1e3 * statistics.median(old),
                  "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
        print(f"{c:16s} this {out[c]['this_ms']:8.1f} ms  {rev} {out[c]['baseline_ms']:8.1f} ms  "
              f"ratio {out[c]['ratio']['median']:.3f} ({out[c]['ratio']['min']:.2f}-{out[c]['ratio']['max']:.2f})")
    res = {"what": "engine step times, this tree against a baseline commit, one step at a time alternating the "
                   "trees (order reversed every round); ratio: this / baseline per paired step",
           "model": a.model, "scan_layers": a.scan_layers, "baseline": rev, "reps": a.reps, "cases": out}
    sys.path.insert(0, ROOT)
    from bench.stamp import write
    write(a.json, res, indent=1)
    return res


if __name__ == "__main__":
    main()
