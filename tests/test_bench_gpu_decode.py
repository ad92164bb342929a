"""bench/gpu_decode.py's parts that run anywhere: the random checkpoint it writes (read by jaxserve and by
transformers alike) and the busy fraction it reads from a perfetto trace."""

import argparse
import gzip
import json
import os

import numpy as np

from bench import gpu_decode


def test_the_checkpoint_reads_the_same_in_jaxserve_and_transformers(tmp_path, hf_model):
    import torch
    from jaxserve import LLM
    ck = str(tmp_path / "ck")
    made = gpu_decode.part_make(argparse.Namespace(dir=ck, shape="tiny"))
    c = gpu_decode.config_of("tiny")
    assert made["weight_bytes"] == 2 * made["params"] == os.path.getsize(f"{ck}/model.safetensors") - 8 - int.from_bytes(
        open(f"{ck}/model.safetensors", "rb").read(8), "little")
    ids = [5, 9, 300, 17, 2, 44]
    ours = LLM(ck, progress=False).score(ids)  # float32 compute over the bf16 weights
    with torch.no_grad():
        theirs = hf_model(ck)(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == (len(ids), c["vocab_size"])
    np.testing.assert_allclose(ours, theirs, atol=2e-4)


def _trace(path, events):
    os.makedirs(path, exist_ok=True)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}}]
    with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_the_busy_fraction_is_the_union_of_the_gpus_kernels_over_their_span(tmp_path):
    gpu = [{"ph": "X", "pid": 1, "ts": ts, "dur": d} for ts, d in ((0, 10), (5, 10), (20, 10), (22, 3))]
    host = [{"ph": "X", "pid": 7, "ts": 0, "dur": 1000}]  # the host's events do not count
    _trace(str(tmp_path / "a" / "plugins"), gpu + host)
    got = gpu_decode.busy_fraction(str(tmp_path / "a"))
    assert got == {"busy_fraction": round(25 / 30, 3), "span_ms": 0.03, "kernels": 4}
    _trace(str(tmp_path / "b"), host)
    assert gpu_decode.busy_fraction(str(tmp_path / "b")) is None
