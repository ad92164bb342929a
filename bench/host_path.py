"""The host's part of a decode step: the programs dispatched, the uploads, the reads and whether a read waits
with nothing queued behind it, per step, with the loop overlapped (engine/overlap.py) and, as the same-run
baseline, synchronous.

One engine per mode on the same checkpoint (SmolLM2-135M by default), B requests decoding steadily. Over N steps:
the runner's programs called (every jitted program of engine/runner.py), its uploads and reads (`_upload`,
`_read`), all under `jax.transfer_guard("disallow")` (so no implicit copy hides beside them); from a profiler
trace of the same steps, the executables the device client ran (every program, however it was dispatched); the
reads made while the next step's program was already dispatched (the device kept busy during the read); and
the host's time a step outside the device program (the engine's step timer: scheduling, input preparation,
output handling). Then both loops again with every request constrained (a regular expression no answer ends
before max_tokens), and the overlapped loop once more with its steps split as on an accelerator (engine/
split_step.py: the model dispatched before the read, the sampling after it, once the grammars have taken the
tokens read; on a CPU the whole step is dispatched after the read).

    python -m bench.host_path --json bench/results/host_path.json
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import tempfile
import time

from bench.stamp import arguments, write

PROGRAMS = ("_step", "_decode", "_sample", "_first", "_insert", "_prefill", "pick", "forward")


def executions(trace_dir: str) -> int:
    """Executables the device client ran in a perfetto trace."""
    f = glob.glob(f"{trace_dir}/**/*trace.json.gz", recursive=True)[0]
    with gzip.open(f) as fh:
        ev = json.load(fh)
    ev = ev.get("traceEvents", ev) if isinstance(ev, dict) else ev
    return sum(1 for e in ev if e.get("ph") == "X" and e.get("name") == "CommonPjRtLoadedExecutable::ExecutePrepare")


def measure(path: str, overlap: bool, batch: int, steps: int, guided: bool = False, split: bool = False) -> dict:
    import jax

    from jaxserve.engine.llm_engine import EngineConfig, LLMEngine
    from jaxserve.sampling import SamplingParams
    from jaxserve.structured import Guided
    eng = LLMEngine(path, config=EngineConfig(num_blocks=512, max_num_seqs=batch, overlap=overlap), progress=False)
    runner, log = eng.runner, []
    runner.split_steps = runner.split_steps or split
    runner.static_sampling = runner.static_sampling or split  # an accelerator specialises its samplers too
    for name in (*(p for p in PROGRAMS if p != "forward"), "_upload", "_read"):
        f = getattr(runner, name)
        setattr(runner, name, lambda *a, _f=f, _n=name, **k: (log.append(_n), _f(*a, **k))[1])
    forward = runner.forward

    def counted_forward(rows):  # counted where it dispatches (None: the whole step follows the read)
        out = forward(rows)
        if out is not None:
            log.append("forward")
        return out
    runner.forward = counted_forward
    params = SamplingParams(max_tokens=steps + 40, temperature=0, ignore_eos=True,
                            guided=Guided("regex", "[a-z ]+") if guided else None)

    def start(tag):
        seqs = [eng.add_request(f"{tag}{i}", list(range(100, 164)), params)[0] for i in range(batch)]
        while any(not s.output for s in seqs):
            eng.step()
        for _ in range(8):  # steady decoding (the overlapped loop in flight)
            eng.step()
        return seqs
    for s in start("warm"):  # compiles what the timed run runs
        eng.abort(s.request_id)
    while eng.has_work:
        eng.step()
    runner.split.wait()  # a constrained step's two programs, compiled behind the warm-up
    seqs = start("run")
    log.clear()
    in_flight = int(eng._ahead is not None)  # a step dispatched before the count began, read during it
    eng.timer.reset()
    trace = tempfile.mkdtemp(prefix="host_path_")
    jax.profiler.start_trace(trace, create_perfetto_trace=True)
    t0 = time.perf_counter()
    with jax.transfer_guard("disallow"):
        for _ in range(steps):
            eng.step()
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    count = collections.Counter(log)
    # a read made once the next step's program is dispatched: programs called before it outnumber reads so far
    ahead = reads = 0
    programs = in_flight
    for name in log:
        if name in PROGRAMS:
            programs += 1
        elif name == "_read":
            reads += 1
            ahead += programs > reads
    phases = eng.timer.summary().get("decode", {}).get("phases_ms", {})
    for s in seqs:
        eng.abort(s.request_id)
    return {"overlap": overlap, "guided": guided, "split": runner.split_steps, "steps": steps, "batch": batch,
            "programs_per_step": sum(count[p] for p in PROGRAMS) / steps,
            "uploads_per_step": count["_upload"] / steps, "reads_per_step": count["_read"] / steps,
            "executions_per_step": executions(trace) / steps,
            "reads_with_the_next_step_dispatched": ahead / max(reads, 1),
            "host_ms_per_step": round(sum(v for k, v in phases.items() if k != "decode.device"), 3),
            "wall_ms_per_step": round(1e3 * wall / steps, 3), "programs": dict(count)}


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--model", default="smollm2", help="checkpoint directory, .gguf file or 'smollm2'")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    a = ap.parse_args(argv)
    from jaxserve.bundled import resolve
    path = resolve(a.model, False)
    runs = [measure(path, overlap, a.batch, a.steps, guided, split)
            for guided, overlap, split in ((False, False, False), (False, True, False), (True, False, False),
                                           (True, True, False), (True, True, True))]
    write(a.json, {"model": path, "synchronous": runs[0], "overlapped": runs[1],
                   "constrained": {"synchronous": runs[2], "overlapped": runs[3], "split": runs[4]}})
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
