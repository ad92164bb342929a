"""Minimal safetensors reader: memory-maps each file and returns numpy views (bf16/fp8 via ml_dtypes).

Single-file and sharded (`model.safetensors.index.json`) checkpoints are both handled by `TensorIndex`.
"""

from __future__ import annotations

import glob
import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            try:
                self.header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: invalid safetensors header: {e}") from None
        self.header.pop("__metadata__", None)
        self.offset = 8 + n
        self._mm = None

    def keys(self):
        return self.header.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        meta = self.header[name]
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = meta["data_offsets"]
        raw = self._mm[self.offset + start:self.offset + end]
        return raw.view(_DTYPES[meta["dtype"]]).reshape(meta["shape"])


class TensorIndex:
    """All tensors of a checkpoint directory, by name."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            for fname in sorted(set(weight_map.values())):
                p = os.path.join(model_dir, fname)
                if not os.path.isfile(p):
                    raise CheckpointError(f"{index} names {fname}, which is missing from {model_dir}")
                self.files[fname] = SafetensorsFile(p)
            for name, fname in weight_map.items():
                self.where[name] = fname
        else:
            paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
            if not paths:
                raise CheckpointError(f"{model_dir}: no *.safetensors files (and no model.safetensors.index.json)")
            for p in paths:
                sf = SafetensorsFile(p)
                self.files[os.path.basename(p)] = sf
                for k in sf.keys():
                    self.where[k] = os.path.basename(p)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].get(name)
