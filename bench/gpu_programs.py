"""The engine's programs as XLA compiles them for a GPU, on a machine without one: the kernels a step launches,
the copies it makes, the arrays it updates in place.

XLA compiles for a GPU it is only described: a compile-only device made from the GPU's target description
(bench/gpu_targets/h200.txtpb, OpenXLA's spec of an H200) by JAX's CUDA plugin, with NVIDIA's compilers as
wheels and no driver or card. The programs are those a lent GPU compiles (the same passes, fusions and Triton
kernels, to machine code), except where XLA would autotune on the card: here each gemm keeps its default
configuration. Nothing runs: no time is measured, only what each program is made of.

Workload: random bf16 checkpoints of Llama-3.1-8B's shape (bench/gpu_decode.py) with 1 and with 2 layers, each
served on this CPU by an engine with the Pallas kernels interpreted while every program call's argument shapes
are recorded: 1 prompt of 16 tokens (4 greedy tokens), then 64 (32 tokens each: all 64 decode together at the
end). An engine of the same checkpoint with a GPU's settings (Pallas kernels compiled, layers unrolled,
samplers specialised to their rows) then compiles each recorded call for the GPU. Per program: the kernels it
launches by kind (gemms, Pallas kernels, other fusions, copies), the arguments aliased to outputs (updated in
place), how the kernels that write those arrays write them (in place: a kernel over the update only; whole),
any copy, the matrix products XLA left to loop kernels instead of gemms, and XLA's compile seconds on this
host. Per layer: the 2-layer program's kernels less the 1-layer one's, and from them a 32-layer program's. Then
the same for the bench-size checkpoint of every family (bench/families.py; `--families`), serving 1 prompt and
then 8 (8 tokens each): that every program of each, its Pallas kernels included, compiles for the GPU, and what
it copies. Runs in its own environment
(`--venv`, created on first use): the lent GPU machines' JAX (0.11.2) with its CUDA 13 plugin and the image's
Flax, beside this checkout's other dependencies.

    python -m bench.gpu_programs --json bench/results/gpu_programs_h200.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_JAX = ["jax[cuda13]==0.11.2", "flax==0.12.10"]  # the lent machines' JAX and Flax (../shared/gpu/README.md)
PROGRAMS = ("_prefill", "_decode", "_step", "_first", "_sample", "_insert")
POOLED = ("_prefill", "_decode", "_step")  # programs whose second argument is the KV pool (its size: the layers')
# (prompts, tokens each) served while the calls are recorded: 32 tokens, so that all 64 decode together at the end
BATCHES_8B = "[[1, 4], [64, 32]]"
BATCHES_FAMILY = "[[1, 4], [8, 8]]"  # fewer shapes: each compiles the interpreted Pallas kernels on this CPU again
# (array, axis) of a call's arrays after the weights and pool: where its rows are counted (a prefill's
# sequences, a decode step's requests)
BATCH = {"_prefill": (0, 0), "_decode": (0, 0), "_step": (3, 0), "_first": (0, 0), "_sample": (0, 0), "_insert": (1, 1)}
LAYERS = 32  # Llama-3.1-8B's
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
               "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\([^()]*\)|\S+) ([a-z][\w-]*)\((.*)$")


# ---- reading XLA's optimized HLO text (plain Python: tests/test_bench_gpu_programs.py) ----

def _computations(text: str) -> dict[str, list[str]]:
    """name -> its instruction lines; the entry computation under "ENTRY"."""
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            name = "ENTRY" if head.group(1) else head.group(2)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps


def _kind(op: str, rest: str) -> str:
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else ""
        return "pallas" if "triton" in target else "gemm" if ("cublas" in target or "gemm" in target) else target
    if op == "fusion":
        calls = re.search(r"calls=%(\S+?)[,\s]", rest + " ")
        return "gemm" if calls and calls.group(1).startswith(("gemm_fusion", "cublas")) else "fusion"
    return "copy" if op in ("copy", "copy-start") else op


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES.get(dtype, 4)
    return total


def kernels(text: str) -> dict:
    """XLA's optimized HLO text of one program -> the kernels one run launches, by kind ("gemm", "pallas",
    "fusion", "copy", any other op by name; a loop's body counted once per trip), the copies ([shape, bytes]),
    the entry parameters aliased to outputs (their shapes), how the kernels writing those arrays write them
    (writes()), and the kernels that compute a product outside a gemm."""
    comps = _computations(text)
    counts: dict[str, int] = {}
    copies: list = []
    loop_dots = 0

    def walk(name: str, times: int) -> None:
        nonlocal loop_dots
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            shape, op, rest = m.group(2), m.group(3), m.group(4)
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                walk(re.search(r"body=%(\S+?)[,\s]", rest + " ").group(1), times * int(trips.group(1) if trips else 1))
                continue
            if op in ("call", "conditional"):
                for callee in re.findall(r"(?:to_apply|branch_computations=\{|true_computation|false_computation)"
                                         r"=?%(\S+?)[,}\s]", rest + " "):
                    walk(callee, times)
                continue
            if op in NOT_KERNELS or op.endswith("-done"):
                continue
            kind = _kind(op, rest)
            counts[kind] = counts.get(kind, 0) + times
            callee = re.search(r"calls=%(\S+?)[,\s]", rest + " ") if kind == "fusion" else None
            if callee and _weight_product(comps.get(callee.group(1), [])):
                loop_dots += times
            if kind == "copy":
                copies.append([shape, _bytes(shape)])

    walk("ENTRY", 1)
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", text)
    params = re.findall(r"\w+\[[\d,]*\]", layout.group(1)) if layout else []
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry", text)
    aliased = [params[int(i)] for i in re.findall(r": \((\d+),", alias.group(1) if alias else "")]
    return {"kernels": sum(counts.values()), "by_kind": dict(sorted(counts.items())), "copies": copies,
            "aliased": aliased, "writes": writes(comps, aliased), "dots_in_loop_kernels": loop_dots}


def _weight_product(lines: list[str]) -> bool:
    """Whether a fused computation (not a gemm) holds a matrix product: a dot, or a reduce of a product over a
    contracting dimension of 256 or more (XLA rewrites a product with one row so, and fused into the KV write a
    K projection took the H200 75 us a layer at batch 1, ../shared/gpu/README.md); a gemm's split-K partial
    sums (a reduce over its few splits) are not one."""
    shapes = {}
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            continue
        shapes[m.group(1)] = m.group(2)
        if m.group(3) == "dot":
            return True
        if m.group(3) == "reduce" and "dot_general" in line:
            first = re.match(r"%(\S+?)[,)]", m.group(4))
            dims = re.search(r"\[([\d,]*)\]", shapes.get(first.group(1), "") if first else "")
            axes = re.search(r"dimensions=\{([\d,]*)\}", m.group(4))
            if dims and axes:
                size = [int(d) for d in dims.group(1).split(",") if d]
                n = 1
                for a in filter(None, axes.group(1).split(",")):
                    n *= size[int(a)]
                if n >= 256:
                    return True
    return False


def writes(comps: dict[str, list[str]], aliased: list[str]) -> dict:
    """How the kernels that produce an array of an aliased argument's shape write it: "in_place" (the fused
    computation's root a dynamic-update-slice or scatter into its parameter: a kernel over the update only) or
    "whole" (any other kernel: every element of the array written)."""
    out = {"in_place": 0, "whole": 0}
    big = {s for s in aliased if _bytes(s) >= 1 << 20}
    for line in comps.get("ENTRY", []):
        m = _INSTR.match(line)
        if not m or m.group(3) not in ("fusion", "scatter", "dynamic-update-slice"):
            continue
        shape = re.sub(r"\{[^}]*\}", "", m.group(2))
        if shape not in big:
            continue
        if m.group(3) != "fusion":
            out["in_place"] += 1
            continue
        callee = re.search(r"calls=%(\S+?)[,\s]", m.group(4) + " ").group(1)
        root = next((_INSTR.match(x) for x in comps.get(callee, []) if x.lstrip().startswith("ROOT")), None)
        into_param = root and root.group(3) in ("dynamic-update-slice", "scatter") and re.match(
            r"%param_\S+[,)]", root.group(4))
        out["in_place" if into_param else "whole"] += 1
    return out


def per_layer(one: dict, two: dict, layers: int = LAYERS) -> dict:
    """The same program compiled for 1 and 2 layers (kernels()' results) -> kernels a layer adds, by kind, and
    the program's kernels at `layers` layers."""
    kinds = sorted(set(one["by_kind"]) | set(two["by_kind"]))
    layer = {k: two["by_kind"].get(k, 0) - one["by_kind"].get(k, 0) for k in kinds}
    layer = {k: v for k, v in layer.items() if v}
    return {"per_layer": sum(layer.values()), "per_layer_by_kind": layer,
            f"at_{layers}_layers": one["kernels"] + (layers - 1) * sum(layer.values())}


# ---- in the GPU environment ----

def ensure_venv(venv: str) -> str:
    """The Python of `venv`: the lent GPU machines' JAX with its CUDA plugin, and this checkout's other
    dependencies (pyproject.toml), installed on first use (JAX 0.11 needs Python 3.12 or later: `python3.12` or
    `python3.13`, or pyenv's); a stamp file marks it complete."""
    import tomllib
    py, stamp = os.path.join(venv, "bin", "python"), os.path.join(venv, ".jaxserve-gpu-xla")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = [d for d in tomllib.load(f)["project"]["dependencies"] if not re.match(r"(jax|jaxlib|flax)\W", d)]
    want = "\n".join(GPU_JAX + deps) + "\n"
    if os.path.exists(stamp) and open(stamp).read() == want:
        return py
    print(f"installing {' '.join(GPU_JAX)} into {venv} (once: about 4 GB with NVIDIA's wheels)", flush=True)
    found = [shutil.which(n) for n in ("python3.12", "python3.13")] + sorted(
        glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[23]*/bin/python")))
    works = lambda py: subprocess.run([py, "-c", "import sys; assert sys.version_info >= (3, 12)"],  # noqa: E731
                                      capture_output=True).returncode == 0
    base = next((py for py in found if py and works(py)), None)
    if base is None:
        raise SystemExit("gpu_programs: JAX 0.11.2 needs Python 3.12 or later, and no python3.12 or python3.13 "
                         "here runs")
    subprocess.run([base, "-m", "venv", "--clear", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", *GPU_JAX, *deps], check=True)
    with open(stamp, "w") as f:
        f.write(want)
    return py


def _engine(path: str, gpu: bool, packed: bool | None = None):
    from jaxserve.engine import llm_engine
    from jaxserve.engine.llm_engine import EngineConfig, default_chunk_size
    from jaxserve.llm import LLM
    # the chunk a GPU's engine takes (its prefill kernels compiled), for the interpreted engine that serves too
    cfg = EngineConfig(block_size=16, num_blocks=160, max_num_seqs=64, max_num_batched_tokens=1024,
                       chunk_size=default_chunk_size(False, 1024, 16, compiled_prefill=True),
                       prefix_caching=False, kernels="interpret", scan_layers=False, compilation_cache=None,
                       packed_prefill=packed)
    plan = llm_engine.check.plan
    if gpu:  # a GPU's choice of kernels, taken without the self-test (which would run them here)
        llm_engine.check.plan = lambda requested, cases, progress=False, store=None: ("pallas", {})
    try:
        llm = LLM(path, dtype="bfloat16", engine=cfg, progress=False)
    finally:
        llm_engine.check.plan = plan
    llm.engine.runner.static_sampling = True  # as on a GPU (engine/runner.py)
    return llm


def part_compile(path: str, target: str, batches, hlo: str | None = None, prompt_tokens: int = 16,
                 packed: bool | None = None) -> list[dict]:
    """Serve batches ((prompts, tokens each), ...) of `prompt_tokens`-token prompts on the checkpoint at `path`
    recording each program call, then compile every distinct call for the GPU of `target` -> a row per program
    (each program's optimized HLO text into the folder `hlo`, when given)."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, SingleDeviceSharding, use_abstract_mesh
    from jaxserve.sampling import SamplingParams
    with open(target) as f:
        topo = topologies.get_topology_desc(platform="cuda", target_config=f.read(), topology="1x1x1")
    device = topo.devices[0]
    on_gpu = SingleDeviceSharding(device)
    shaped = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_gpu) if hasattr(a, "shape") else a  # noqa
    calls: list = []
    served = _engine(path, gpu=False, packed=packed)
    runner = served.engine.runner
    for name in PROGRAMS:
        def record(*args, _fn=getattr(runner, name), _name=name, **static):
            calls.append((_name, jax.tree.map(shaped, args), static))
            return _fn(*args, **static)
        setattr(runner, name, record)
    rng = np.random.default_rng(0)
    vocab, layers = served.engine.model_config.vocab_size, served.engine.model_config.num_layers
    for batch, new in batches:
        served.generate([rng.integers(3, vocab, prompt_tokens).tolist() for _ in range(batch)],
                        SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    del served, runner
    gpu = _engine(path, gpu=True, packed=packed).engine.runner
    # Pallas' Triton lowering asks which GPU it targets: the abstract one named as the device is (Hopper)
    mesh = AbstractMesh((1,), ("gpu",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice("NVIDIA H100", None, "gpu"))
    rows, seen = [], set()
    for name, args, static in calls:
        varying = args[2:] if name in POOLED else args[1:]
        shapes = [list(a.shape) for a in jax.tree.leaves(varying) if hasattr(a, "shape")]
        whole = {**static, "hi": "all"} if static.get("hi") == layers else static  # every layer, whatever their number
        key = json.dumps([name, sorted(whole.items()), shapes], default=str)
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        with use_abstract_mesh(mesh):
            lowered = getattr(gpu, name).trace(*args, **static).lower(lowering_platforms=("cuda",))
        text = lowered.compile().as_text()
        if hlo:
            os.makedirs(hlo, exist_ok=True)
            with open(os.path.join(hlo, f"{len(rows):02d}{name}.txt"), "w") as f:
                f.write(text)
        rows.append({"program": name, "rows": shapes[BATCH[name][0]][BATCH[name][1]],
                     "static": {k: str(v) for k, v in static.items()}, "shapes": shapes,
                     "key": key, "compile_s": round(time.perf_counter() - t0, 2), **kernels(text)})
        print(f"{name} {static}: {rows[-1]['kernels']} kernels {rows[-1]['by_kind']}", flush=True)
    return rows


def main(argv=None) -> int:
    from bench.gpu_decode import config_of
    from bench.stamp import arguments, write
    ap = arguments(__doc__)
    ap.add_argument("--target", default=os.path.join(ROOT, "bench", "gpu_targets", "h200.txtpb"))
    ap.add_argument("--venv", default=os.path.join(ROOT, "bench", ".gpu-xla-venv"))
    ap.add_argument("--families", default="all", help="comma-separated bench-size checkpoints (bench/families.py) "
                    "compiled too: 'all' (default) or 'none'")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "jaxserve-bench"),
                    help="where the families' checkpoints are built (once)")
    ap.add_argument("--hlo", help="a folder for each program's optimized HLO text (<checkpoint>/<n><program>.txt)")
    ap.add_argument("--batches", default=BATCHES_8B, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-tokens", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--part", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--packed-prefill", action="store_true", help=argparse.SUPPRESS)  # engine.packed_prefill
    a = ap.parse_args(argv)
    if a.part:  # in the GPU environment
        with open(a.part[1], "w") as f:
            json.dump(part_compile(a.part[0], a.target, json.loads(a.batches), a.hlo, a.prompt_tokens,
                                   a.packed_prefill or None), f)
        return 0
    from bench.families import NAMES, checkpoint
    families = {"none": [], "all": NAMES}.get(a.families) or a.families.split(",")
    unknown = sorted(set(families) - set(NAMES))
    if unknown:
        raise SystemExit(f"gpu_programs: unknown families {unknown}; have {NAMES}")
    py = ensure_venv(a.venv)
    work = tempfile.mkdtemp(prefix="gpu_programs_")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}

    def compile_all(checkpoint: str, name: str, batches: str) -> list[dict]:
        print(f"gpu_programs: {name}: serving {batches} (prompts, tokens) on this CPU, then compiling each program "
              "for the GPU", flush=True)
        out = os.path.join(work, f"{name}.json")
        hlo = ["--hlo", os.path.join(os.path.abspath(a.hlo), name)] if a.hlo else []
        subprocess.run([py, "-m", "bench.gpu_programs", "--json", a.json, "--target", a.target, *hlo,
                        "--batches", batches, "--part", checkpoint, out], check=True, env=env, cwd=ROOT)
        return json.load(open(out))

    target = open(a.target).read()
    result = {"target": re.search(r'device_description_str: "([^"]+)"', target).group(1), "gpu_jax": GPU_JAX,
              "model": {**config_of("8b"), "num_hidden_layers": [1, 2]}, "programs": [], "families": {}}
    try:
        by_layers = {}
        for layers in (1, 2):
            ck = os.path.join(work, f"llama-8b-{layers}")
            make = [py, "-c", "import sys; from bench.gpu_decode import config_of, make_checkpoint; "
                    f"c = config_of('8b'); c['num_hidden_layers'] = {layers}; make_checkpoint(sys.argv[1], c)", ck]
            subprocess.run(make, check=True, env=env, cwd=ROOT)
            by_layers[layers] = {r["key"]: r for r in compile_all(ck, f"llama-8b-{layers}", BATCHES_8B)}
            shutil.rmtree(ck)
        for key, two in by_layers[2].items():
            one = by_layers[1].get(key)
            row = {k: v for k, v in two.items() if k != "key"}
            result["programs"].append({**row, "layers": 2, **(per_layer(one, two) if one else {})})
        write(a.json, result)
        for name in families:  # each on its own: a family that fails is recorded, the next still compiles
            try:
                rows = compile_all(checkpoint(name, a.root), name, BATCHES_FAMILY)
                result["families"][name] = [{k: v for k, v in r.items() if k != "key"} for r in rows]
            except subprocess.CalledProcessError as e:
                result["families"][name] = {"error": f"rc {e.returncode}"}
            write(a.json, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
