"""bench/gpu_check.sh's plumbing, without a GPU: a stand-in `nvidia-smi` names one, a stand-in python records each
step's command and succeeds. The steps run in order, each within its share of the budget, with the result files
named after the GPU; a lent GPU machine's few minutes are not the place to find a broken line of the script."""

import os
import re
import shlex
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["kernels", "gpu_decode", "ipc_test", "gpu_disagg", "disagg_tests", "pull_tests", "transfer",
         "attention_tests", "pallas_tests"]


def _executable(path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _run(tmp_path, **env) -> tuple[list[list[str]], str, object]:
    """Run the script with the stand-ins (and `env` over the defaults) -> (the python command lines it ran, its
    summary.txt, its output folder)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(exist_ok=True)
    _executable(bin_dir / "nvidia-smi", '#!/bin/sh\necho "NVIDIA H100 80GB HBM3"\n')
    calls = tmp_path / "calls.txt"
    _executable(bin_dir / "fakepy", f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(calls))}\necho "ran $*"\n')
    base = {k: v for k, v in os.environ.items() if k not in ("TUNE_SWEEPS", "BUDGET_S")}
    env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "PY": str(bin_dir / "fakepy"), **env}
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln.split() for ln in calls.read_text().splitlines()] if calls.exists() else []
    return lines, (out / "summary.txt").read_text(), out


def test_every_step_runs_in_order_with_the_results_named_after_the_gpu(tmp_path):
    calls, summary, out_dir = _run(tmp_path)
    out = str(out_dir)
    assert "gpu: NVIDIA H100 80GB HBM3 (tag h100)" in summary
    steps = [c for c in calls if c[0] == "-m" and c[1] != "pip"]  # the version print (-c), a wheel install aside
    assert [c[1] for c in steps] == ["bench.kernels", "bench.gpu_decode", "pytest", "bench.gpu_disagg", "pytest",
                                     "pytest", "bench.transfer", "pytest", "pytest"]  # no sweep without TUNE_SWEEPS
    assert steps[0][-1] == f"{out}/kernels_h100.json" and steps[1][-1] == f"{out}/gpu_decode_h100.json"
    assert "tests/transfer/test_ipc.py" in steps[2]
    disagg = steps[3]
    assert disagg[-1] == f"{out}/gpu_disagg_h100.json" and disagg[disagg.index("--cuda-ipc") + 1] == "on"
    assert disagg[disagg.index("--busy") + 1] == "12"  # TTFT with decode busy (a slot of 16 left), by default
    assert "tests/router/test_cluster_http.py" in steps[4]
    assert "tests/transfer/test_pull.py" in steps[5] and steps[6][-1] == f"{out}/transfer_h100.json"
    attention, others = steps[7], steps[8]
    assert "tests/pallas_kernels/test_paged_candidates.py" in attention
    ignored = {others[i + 1] for i, a in enumerate(others) if a == "--ignore"}
    assert {a for a in attention if a.startswith("tests/")} | {"tests/pallas_kernels/test_gpu_lowering.py"} == ignored
    for name in STEPS:
        assert f"{name}: rc 0" in summary, summary
    with tarfile.open(out_dir / "logs.tgz") as tar:
        assert sorted(os.path.basename(n) for n in tar.getnames() if n.endswith(".log")) == sorted(
            f"{s}.log" for s in STEPS)


@pytest.mark.parametrize("sweeps,name", [("hopper,paged", "kernel_tune_hopper_paged_h100.json")])
def test_the_sweeps_chosen_name_the_sweep_file(tmp_path, sweeps, name):
    calls, _, out_dir = _run(tmp_path, TUNE_SWEEPS=sweeps)
    steps = [c[1] for c in calls if c[0] == "-m" and c[1] != "pip"]
    assert steps[:6] == ["bench.kernels", "bench.gpu_decode", "pytest", "bench.gpu_disagg", "pytest",
                         "bench.kernel_tune"]
    tune = next(c for c in calls if c[:2] == ["-m", "bench.kernel_tune"])
    assert tune[tune.index("--sweeps") + 1] == sweeps and tune[-1] == f"{out_dir}/{name}"
    assert float(tune[tune.index("--budget-s") + 1]) < 150  # the sweep stops starting configurations in its share


def test_a_small_budget_skips_the_steps_it_cannot_fit_and_says_so(tmp_path):
    calls, summary, _ = _run(tmp_path, BUDGET_S="100")
    assert "kernels: skipped, under 20 s for it (its share 7 s" in summary
    assert "gpu_decode: rc 0" in summary  # its share, 39 s, still fits
    assert not any(c[:2] == ["-m", "bench.kernels"] for c in calls)


def test_the_disaggregated_deployment_keeps_the_transfer_server_when_the_ipc_test_fails(tmp_path):
    """The stand-in python fails the IPC test's pytest: bench.gpu_disagg then runs with --cuda-ipc off."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    _executable(bin_dir / "ipcfails", f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(calls))}\n'
                '[ "$2" = pytest ] && echo "$*" | grep -q test_ipc.py && exit 1\nexit 0\n')
    _, summary, _ = _run(tmp_path, PY=str(bin_dir / "ipcfails"))
    disagg = next(ln.split() for ln in calls.read_text().splitlines() if "bench.gpu_disagg" in ln)
    assert disagg[disagg.index("--cuda-ipc") + 1] == "off" and "ipc_test: rc 1" in summary


def test_a_run_can_spend_its_gpu_on_the_disaggregated_steps(tmp_path):
    """ONLY picks the steps, SHARE_<step> widens one's share, GPU_DISAGG_ARGS reaches bench.gpu_disagg."""
    calls, summary, out_dir = _run(tmp_path, ONLY="ipc_test,gpu_disagg", SHARE_gpu_disagg="460",
                                   GPU_DISAGG_ARGS="--shape 8b --lengths 256,2048,8000 --reps 2")
    steps = [c for c in calls if c[0] == "-m" and c[1] != "pip"]
    assert [c[1] for c in steps] == ["pytest", "bench.gpu_disagg"]
    assert steps[1][2:8] == ["--shape", "8b", "--lengths", "256,2048,8000", "--reps", "2"]
    assert steps[1][steps[1].index("--cuda-ipc") + 1] == "on"
    assert re.search(r"gpu_disagg: rc 0 in \d+ s \(limit 460 s\)", summary) and "gpu_decode: not chosen" in summary


def test_a_run_that_leaves_the_ipc_test_out_keeps_the_transfer_server(tmp_path):
    """CUDA IPC only where the test just passed: without it bench.gpu_disagg runs with --cuda-ipc off."""
    calls, summary, _ = _run(tmp_path, ONLY="gpu_disagg")
    steps = [c for c in calls if c[0] == "-m" and c[1] != "pip"]
    assert [c[1] for c in steps] == ["bench.gpu_disagg"] and "ipc_test: not chosen" in summary
    assert steps[0][steps[0].index("--cuda-ipc") + 1] == "off"
