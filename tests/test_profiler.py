"""`jaxserve profile`: one instance of a config measured on its real programs, in the format `jaxserve plan`
reads; KV bytes against the cache layout computed by hand, the decode SLO choosing max_batch."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from jaxserve.router.cli import app

ENGINE = dict(block_size=4, num_blocks=96, chunk_size=16, max_num_batched_tokens=32, max_prefill_seqs=2,
              max_num_seqs=4, warmup=False, max_model_len=128)


def _profile(cfg_path, out, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", "profile", "--config", cfg_path, "--instance", "p0",
                           "--json", str(out), *extra], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_profile_measures_an_instance_in_the_planners_format(checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama")
    core = max(os.sched_getaffinity(0))  # the last core: under make test the soak holds the first (test_soak.py)
    cfg = {"model": {"path": path}, "engine": ENGINE,
           "clusters": [{"name": "pd", "instances": [{"name": "p0", "role": "both", "cpus": [core]}]}]}
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "p.json"
    r = _profile(str(cfg_path), out, "--lengths", "6,40", "--batches", "1,4", "--reps", "1", "--decode-steps", "3",
                 "--tpot-slo-ms", "10000")
    assert r.returncode == 0, r.stdout + r.stderr
    prof = json.loads(out.read_text())
    assert prof["prefill"]["tokens"] == [6, 40] and all(s > 0 for s in prof["prefill"]["seconds"])
    # tiny llama: 4 layers, 2 KV heads of 16, float32, K and V, whole blocks of 4 tokens
    per_token = 4 * 2 * 2 * 16 * 4
    assert prof["prefill"]["kv_bytes"] == [8 * per_token, 40 * per_token]
    # a cached prefix: of the listed lengths only 40 is whole blocks of 4; 32 new tokens behind it
    pf = prof["prefill"]["prefix"]
    assert pf["tokens"] == [40] and pf["new_tokens"] == 32 and pf["extra_seconds"][0] >= 0 < pf["fresh_seconds"]
    d = prof["decode"]
    assert d["batch"] == [1, 4] and all(s > 0 for s in d["batch_step_seconds"])
    assert d["max_batch"] == 4 and d["step_seconds"] == d["batch_step_seconds"][1]  # a 10 s SLO: every batch
    assert prof["cores"] == [core]
    # what it wrote is a profile `jaxserve plan` takes
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({"length": {"lognormal": {"mu": 3.0, "sigma": 0.5, "min": 4, "max": 64}},
                              "output_tokens": 8}))
    res = CliRunner().invoke(app, ["plan", "--prfaas", str(out), "--pd", str(out), "--workload", str(wl),
                                   "--n-prfaas", "1", "--n-pd", "2", "--egress-gbps", "1", "--t-step", "4"])
    assert res.exit_code == 0 and "lambda_max" in res.output, res.output
    # an SLO no step meets is refused, naming the measured step
    r = _profile(str(cfg_path), tmp_path / "q.json", "--lengths", "6", "--batches", "1", "--reps", "1",
                 "--decode-steps", "2", "--tpot-slo-ms", "0.001")
    assert r.returncode != 0 and "no batch size meets the TPOT SLO of 0.001 ms" in r.stderr


def test_profile_refuses_lengths_past_the_model(checkpoint_dir, tmp_path):
    cfg = {"model": {"path": checkpoint_dir("llama")}, "engine": ENGINE,
           "clusters": [{"name": "pd", "instances": [{"name": "p0", "role": "both"}]}]}
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    r = _profile(str(cfg_path), tmp_path / "p.json", "--lengths", "6,500")
    assert r.returncode == 2 and "--lengths [500]: must be 1 .. 127 (engine.max_model_len 128)" in r.stderr


def test_a_timing_is_the_median_of_enough_runs_to_fill_min_seconds():
    """_median_time: one untimed call first (its compilations), then at least `reps` timed calls, more while the
    calls have taken less than min_seconds of wall time (set-up included), never more than MAX_RUNS; the median
    of the timed calls' own seconds only."""
    from jaxserve.profiler import MAX_RUNS, _median_time
    now = [0.0]

    def calls(seconds, setup=0.0):
        made = []

        def once():
            made.append(seconds[min(len(made), len(seconds) - 1)])
            now[0] += made[-1] + setup  # the wall time the call takes
            return made[-1]
        return once, made
    clock = lambda: now[0]  # noqa: E731
    once, made = calls([9.0, 0.1, 0.3, 0.2])  # the untimed first call is the slow one
    assert _median_time(once, 3, 0.0, clock) == 0.2 and len(made) == 4
    once, made = calls([9.0] + [0.01] * 1000)  # short runs: as many as fill 0.25 s
    assert _median_time(once, 3, 0.25, clock) == 0.01 and 25 <= len(made) - 1 <= 26
    once, made = calls([9.0] + [0.01] * 1000, setup=0.04)  # a set-up of 40 ms a call counts too
    assert _median_time(once, 3, 0.25, clock) == 0.01 and 5 <= len(made) - 1 <= 6
    once, made = calls([9.0] + [1e-6] * 1000)
    _median_time(once, 3, 10.0, clock)
    assert len(made) - 1 == MAX_RUNS
