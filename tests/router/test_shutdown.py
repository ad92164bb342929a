"""A clean stop: `jaxserve serve` of a disaggregated config (its router process never loading JAX), stopped as
Ctrl-C stops it (SIGINT to the whole process group: the router and its workers) after it served a request, exits
with no traceback in any process's output (the workers' lines reach the router's stderr), gRPC's `Event loop is
closed` included, and leaves no worker behind; a worker whose router is unreachable, stopped by SIGTERM or SIGINT
while its heartbeat retries, stops as cleanly (its heartbeat task ends, closing its channel, before its loop closes:
worker/rpc.py `LoopThread.stop`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from bench.clusters import unpinned
from jaxserve.router.launcher import free_ports

pytestmark = pytest.mark.slow
UNCLEAN = ("Traceback", "Event loop is closed", "Task was destroyed", " ERROR ")


def _config(tmp_path, ckpt: str) -> str:
    cfg = unpinned({"model": {"path": ckpt, "name": "m"},
                    "engine": {"block_size": 4, "num_blocks": 64, "max_num_seqs": 4, "max_model_len": 64,
                               "chunk_size": 8, "max_num_batched_tokens": 16, "warmup": False},
                    "clusters": [{"name": "c", "instances": [{"name": "p0", "role": "prefill"},
                                                             {"name": "d0", "role": "decode"}]}],
                    "transfer": {"token": "tok"}, "router": {"heartbeat_s": 0.2, "down_after_s": 3.0}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_worker_whose_router_is_gone_stops_cleanly(checkpoint_dir, tmp_path, sig):
    path = _config(tmp_path, checkpoint_dir("llama"))
    nobody = f"127.0.0.1:{free_ports('127.0.0.1')}"  # no router listens there
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "worker", "--config", path, "--instance", "d0",
                             "--router", nobody], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("JAXSERVE_WORKER_READY"):
                break
        time.sleep(1.5)  # several heartbeats fail and retry meanwhile
        proc.send_signal(sig)
        out = "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "unreachable" in out and proc.returncode == 0, out[-3000:]
    assert not any(u in out for u in UNCLEAN), out[-3000:]


def test_ctrl_c_stops_every_process_without_a_traceback(checkpoint_dir, tmp_path):
    path = _config(tmp_path, checkpoint_dir("llama"))
    port = free_ports("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.router.cli", "serve", "--config", path,
                             "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not become ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        body = json.dumps({"model": "m", "prompt": [5, 7, 9, 11, 13], "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.load(r)["jaxserve"]["decode_instance"] == "d0"
        # the router runs no model: it has not loaded JAX (its import would delay the workers' start by seconds)
        with open(f"/proc/{proc.pid}/maps") as f:
            assert not [line for line in f if "jaxlib" in line], "the router process loaded jaxlib"
        time.sleep(1.5)  # a few heartbeats in flight when the signal comes
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert not any(u in out for u in UNCLEAN), out[-4000:]
    assert proc.returncode in (0, -signal.SIGINT), (proc.returncode, out[-2000:])
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the session still running: {left}"
