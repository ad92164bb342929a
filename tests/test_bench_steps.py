"""The paired step benchmark runs end to end: two trees (this one and a commit in a temporary worktree), each in
its own worker process, timed case by case; the worktree is removed afterwards."""

import json
import subprocess

from bench import steps


def test_step_benchmark_compares_two_trees(checkpoint_dir, tmp_path):
    out = tmp_path / "steps.json"
    before = subprocess.run(["git", "-C", steps.ROOT, "worktree", "list"], capture_output=True, text=True).stdout
    steps.main(["--baseline", "HEAD", "--json", str(out), "--model", checkpoint_dir("llama"), "--reps", "3",
                "--cases", "decode:3x9,prefill:2x8,prefill:1x5@9", "--scan-layers", "false"])
    data = json.loads(out.read_text())
    assert set(data["cases"]) == {"decode:3x9", "prefill:2x8", "prefill:1x5@9"} and data["reps"] == 3
    assert data["scan_layers"] == "false"
    for c in data["cases"].values():
        assert c["this_ms"] > 0 and c["baseline_ms"] > 0
        assert c["ratio"]["min"] <= c["ratio"]["median"] <= c["ratio"]["max"]
    assert data["stamp"]["command"]
    after = subprocess.run(["git", "-C", steps.ROOT, "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before
