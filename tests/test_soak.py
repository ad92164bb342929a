"""The soak (bench/soak.py) on the tiny Llama: `jaxserve serve` with a prefill and a decode worker under locust's
Poisson load at 80% of the capacity measured in the same run. Nothing fails, the cache's free blocks return to
their baseline, and no process grows: threads and file descriptors after the load are back where they were
once the load had settled, resident memory grows by less than RSS_GROWTH_MB over the settled load. Ten minutes
here, the whole soak (router, workers, locust) on one core, so that the rest of the suite has the other, the
load backing off as latency grows (`--arrivals think`: the suite's share of that core changes under it);
`make soak` runs it for an hour on the bench-size model over two cores and reports the slopes."""

import json
import os

import pytest

from bench import soak

pytestmark = pytest.mark.slow
DURATION_S = 600  # the ten minutes; make test starts it first, beside the rest of the suite
RSS_GROWTH_MB = 16  # over the settled load (7.5 minutes): a compile of a new shape adds a step of a few MB


def test_soak_nothing_fails_nothing_grows(tmp_path, checkpoint_dir):
    core = min(os.sched_getaffinity(0))
    out = soak.main(["--json", str(tmp_path / "soak.json"), "--png", str(tmp_path / "soak.png"),
                     "--model", checkpoint_dir("llama"), "--duration", str(DURATION_S), "--calibrate-s", "10",
                     "--sample-s", "1", "--max-tokens", "8", "--prompt-max", "48", "--cores", str(core),
                     "--arrivals", "think"])
    assert json.loads((tmp_path / "soak.json").read_text())["locust"] == out["locust"]
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    s, b = out["locust"], out["blocks"]
    assert s["failures"] == 0 and s["requests"] >= 0.5 * out["rate_requests_per_s"] * DURATION_S, s
    assert b["end_used"] == 0 and b["end_free"] == b["baseline_free"] > 0, b
    assert set(out["slopes"]) == {"router", "prefill-0", "decode-0"}
    assert out["affinity"] == {"router": [core], "prefill-0": [core], "decode-0": [core]}, out["affinity"]
    for name, series in out["slopes"].items():
        assert series["threads"]["after"] <= series["threads"]["start"] + 2, (name, series["threads"])
        assert series["fds"]["after"] <= series["fds"]["start"] + 4, (name, series["fds"])
        assert series["rss_mb"]["end"] - series["rss_mb"]["start"] < RSS_GROWTH_MB, (name, series["rss_mb"])


def test_a_pinned_program_starts_on_its_cores():
    """bench.soak.pinned: the program runs with the affinity it is given (its threads inherit it), or as it is."""
    import subprocess
    import sys
    core = max(os.sched_getaffinity(0))
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    assert subprocess.run(soak.pinned(show, [core]), capture_output=True, text=True, check=True).stdout.strip() \
        == f"[{core}]"
    assert soak.pinned(show, None) == show
