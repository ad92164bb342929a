"""The wheel claims one top-level name: `jaxserve` (router/, transfer/ and pallas_kernels/ inside it, as
jaxserve.router, ...; bench/ and tests/ left out), and a built wheel installed into a clean environment serves: its
console script starts a disaggregated cluster whose workers import jaxserve from that environment alone."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile

import pytest
import yaml

from bench.clusters import unpinned
from jaxserve.router.launcher import free_ports

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("pyproject.toml", "README.md", "jaxserve", "router", "transfer", "pallas_kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel built from a copy of the sources (jaxserve/'s links kept as links), without build isolation."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = os.listdir(dist)
    return str(dist / built)


def test_the_wheel_holds_jaxserve_alone(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"jaxserve", "jaxserve-0.1.0.dist-info"}, tops
    for path in ("jaxserve/router/cli.py", "jaxserve/router/policies/flowkv.py", "jaxserve/transfer/tcp.py",
                 "jaxserve/pallas_kernels/paged_attention.py", "jaxserve/pallas_kernels/native/matmul.cc",
                 "jaxserve/pallas_kernels/native/run_items.h", "jaxserve/configs/local.yaml",
                 "jaxserve/worker/main.py"):
        assert path in names, path
    assert not any("/tests/" in n or n.startswith("jaxserve/bench/") for n in names)
    assert "jaxserve = jaxserve.router.cli:app" in entry


def _clean_env(tmp_path, wheel: str) -> str:
    """A new virtual environment holding the wheel; its dependencies come from this environment's site-packages,
    listed in a .pth (whose own .pth files, this checkout's editable install among them, are not run)."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    (purelib,) = (env / "lib").glob("python*/site-packages")
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q",
                          "--no-deps", "--no-index", wheel], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return str(env)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{e.code}: {e.read().decode()}") from None


def test_a_built_wheel_installs_into_a_clean_environment_and_serves(wheel, tmp_path, checkpoint_dir):
    env = _clean_env(tmp_path, wheel)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([f"{env}/bin/python", "-c", "import jaxserve.router.cli, jaxserve.transfer.tcp, sys; "
                            "print(jaxserve.__file__); import router"],
                           cwd=tmp_path, capture_output=True, text=True, env=clean, timeout=120)
    assert where.stdout.startswith(env) and "No module named 'router'" in where.stderr, where.stdout + where.stderr
    bench = subprocess.run([f"{env}/bin/jaxserve", "bench", "serving", "--json", "x.json"], cwd=tmp_path,
                           capture_output=True, text=True, env=clean, timeout=120)
    assert bench.returncode == 2 and "run benchmarks from a checkout" in bench.stderr, bench.stderr[-2000:]

    cfg = unpinned({"model": {"path": checkpoint_dir("llama"), "name": "m"},
                    "engine": {"block_size": 4, "num_blocks": 64, "max_num_seqs": 4, "max_model_len": 64,
                               "chunk_size": 8, "max_num_batched_tokens": 16, "warmup": False},
                    "clusters": [{"name": "c", "instances": [{"name": "p0", "role": "prefill"},
                                                             {"name": "d0", "role": "decode"}]}],
                    "transfer": {"token": "tok"}})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    port = free_ports("127.0.0.1")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([f"{env}/bin/jaxserve", "serve", "--config", "c.yaml", "--port", str(port)],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=clean, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.5)
        out = _post(url + "/v1/completions", {"model": "m", "prompt": [5, 9, 14, 3, 7, 21], "max_tokens": 5,
                                              "temperature": 0, "ignore_eos": True})
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length", out
    finally:
        os.killpg(proc.pid, 2)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
