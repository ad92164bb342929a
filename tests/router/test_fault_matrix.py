"""A slice of the fault matrix (bench/faults.py) in the suite: the router and four real worker processes with
the tiny Llama; while requests are mid-stream, the decode victim SIGKILLed, and the prefill victim partitioned
(its network namespace's link down; without root, where no namespace can be made, SIGKILLed instead); then a
cancellation storm. Every request ends token-exact or with a clean error, none hangs, nothing is held after.
32 tokens a request keep each request's stream phase long enough for the injector to catch (with 8, a cell's
requests could all finish in a fraction of a second, before it saw one on the victim). The workers run
unpinned, as the suite's others do (bench/clusters.py `unpinned`)."""

import json

import pytest

from bench import faults, netns

pytestmark = pytest.mark.slow


def test_fault_matrix_slice_nothing_hangs_nothing_leaks(tmp_path, checkpoint_dir):
    prefill_fault = "partition" if netns.available() is None else "sigkill"
    out = faults.main(["--json", str(tmp_path / "faults.json"), "--model", checkpoint_dir("llama"),
                       "--cells", f"decode:sigkill:stream,prefill:{prefill_fault}:stream", "--requests", "12",
                       "--warm", "4", "--storm", "12", "--max-tokens", "32", "--prompt-len", "16,48",
                       "--hang-s", "60", "--deadline-s", "10", "--no-warmup", "--unpinned"])
    assert json.loads((tmp_path / "faults.json").read_text())["totals"] == out["totals"]
    assert [(c["role"], c["fault"]) for c in out["cells"]] == [("decode", "sigkill"), ("prefill", prefill_fault)]
    # every worker's compiles reach the matrix (JAX's compile log, one line per program), so a program compiled
    # during a cell is named: each surviving instance that compiled one lists what
    assert set(out["compiles_logged"]) == {"p0", "p1", "d0", "d1"}, out["compiles_logged"]
    assert all(n > 0 for n in out["compiles_logged"].values()), out["compiles_logged"]
    for c in out["cells"]:
        assert "skipped" not in c and c["fault_injected"], c
        for name, n in c["compiled_during_cell"].items():
            assert n == 0 or any("_fn" in w for w in c["compiled_during_cell_names"].get(name, [])), c
        # a near tie (bench/faults.py Reference) is rounding, not a fault-handling error; a wrong token is
        assert c["hung"] == 0 and c["wrong_tokens"] == 0, c
        assert c["token_exact"] + c["near_ties"] + c["failed"] == c["requests"], c
        assert c["leaked_blocks"] == 0 and c["leaked_pool_bytes"] == 0, c
    storm = out["cancellation_storm"]
    assert storm["requests"] == 12 and not any(storm["leaked"].values()), storm
    assert storm["longest_reservation_s"] <= storm["deadline_s"] + 1, storm
