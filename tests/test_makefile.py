"""The install path `make serve` / `make test` take per accelerator (ACCEL), read from `make -n` (nothing runs)."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dry_run(target: str, *args: str) -> subprocess.CompletedProcess:
    # a venv path that does not exist, so make lists every install step
    return subprocess.run(["make", "-n", target, "VENV=/nonexistent/venv", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("target,accel,extras", [("install", "cpu", '".[test]"'), ("install", "cuda", '".[test,cuda]"'),
                                                 ("serve", "cpu", '"."'), ("serve", "cuda", '".[cuda]"')])
def test_install_takes_the_cuda_extra_and_checks_the_gpu_only_for_cuda(target, accel, extras):
    out = dry_run(target, f"ACCEL={accel}")
    assert out.returncode == 0, out.stderr
    assert f"pip install -q -e {extras}" in out.stdout
    assert ("default_backend() == 'gpu'" in out.stdout) == (accel == "cuda")
    assert f"/nonexistent/venv/.installed-{'serve-' if target == 'serve' else ''}{accel}" in out.stdout


def test_an_unknown_accelerator_is_refused_by_name():
    out = dry_run("install", "ACCEL=rocm")
    assert out.returncode != 0 and "ACCEL must be cpu or cuda, got 'rocm'" in out.stderr
