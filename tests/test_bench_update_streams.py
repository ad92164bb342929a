"""bench/update_streams.py end to end: a worker process serving Generate and the Updates stream (worker/fanout.py)
and a router process rebuilding each request's updates (router/updates.py, update_of), both ways, over real gRPC;
the report renders the rounds."""

import json

from bench import update_streams
from bench.report_cluster import update_streams as render


def test_both_ways_deliver_every_token_and_are_timed(tmp_path):
    out = tmp_path / "update_streams.json"
    assert update_streams.main(["--requests", "3", "--steps", "6", "--step-ms", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())  # (measure raises unless every request rebuilt its 7 tokens)
    (row,) = r["rounds"]
    assert row["requests"] == 3 and r["steps"] == 6
    for way in ("per_request", "one_stream"):
        assert row[way]["worker_cpu_ms_per_step"] > 0 and row[way]["router_cpu_ms_per_step"] > 0
        assert row[way]["worker_wall_ms_per_step"] >= 2, row  # the engine thread's step time at least
    assert row["worker_cpu_ratio"] > 0 and r["stamp"]["command"]
    text = "\n".join(render({"update_streams.json": r}))
    assert "| 3 |" in text and "a stream per request / one Updates stream per worker" in text
