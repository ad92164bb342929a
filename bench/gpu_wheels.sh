#!/bin/bash
# The Python packages jaxserve needs that the lent GPU machines' image lacks (or holds at another version), as
# x86-64 CPython 3.12 wheels in .whl/ (ignored by git), for bench/gpu_check.sh to install there (it can fetch
# nothing). Versions are this checkout's .venv's, so the GPU run uses the library versions the suite tests here,
# but for JAX and Flax, which are the image's.
# Run here, in the repository root: bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# Not flax: the image's Flax matches its JAX (this checkout's Flax needs a JAX API the image's JAX lacks).
# The second line: what `jaxserve serve` (typer's CLI, /metrics, prefix hashes) and the HTTP tests (httpx) need,
# for bench.gpu_disagg and tests/router/test_cluster_http.py there.
PKGS="pydantic pydantic_core annotated-types typing-inspection gguf fastapi starlette uvicorn llguidance
      cryptography cffi pycparser typer click rich shellingham markdown-it-py mdurl pygments prometheus_client
      xxhash httpx httpcore h11 anyio sniffio certifi idna pyyaml tqdm filelock opentelemetry-api annotated-doc
      typing_extensions"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
for p in $PKGS; do
    v=$($PY -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$v" ] || { echo "gpu_wheels: $p is not installed in $PY's environment (make install first)" >&2; exit 1; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        -d .whl "$p==$v"
done
du -sh .whl && ls .whl
