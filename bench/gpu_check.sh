#!/bin/bash
# The GPU checks in one run, for a lent GPU machine that reaches no package index: the Pallas kernels compiled
# and timed against their references (bench.kernels: decode attention's share of HBM bandwidth, prefill
# attention's of bf16 peak), the kernel tests compiled for the GPU (tests/pallas_kernels), the engine's decode
# step against the memory floor on an 8B-shaped checkpoint with transformers beside it, a 2K-token prefill's
# kernels by time, the same engine with its layers scanned and with packed prefill (engine.packed_prefill: prefill
# and mixed steps as one program over the pool; decode and prefill against the default's, a layer-wise prefill
# instance's programs, warm-up seconds and prefill: bench.gpu_decode),
# CUDA IPC between two processes on the GPU (tests/transfer/test_ipc.py: arrays copied out of another process's
# memory, staged through driver memory where JAX's cannot be shared), `jaxserve serve` disaggregated (a prefill
# and a decode worker sharing the GPU, KV through CUDA IPC, or through JAX's transfer server where the IPC test
# failed) and the PrfaaS deployment (a prefill cluster over an emulated link) against colocated, SmolLM2-shaped
# (bench.gpu_disagg: answers, TTFT and where it goes, the wait for the second token (the KV's transfer; a
# 4,000-token prompt's first chunk sent while its second computes), TPOT, TPOT under a batch of 16, and TTFT with
# 12 requests decoding: the decode reservation the router's early prefill does not wait for), tiny
# Llama, Kimi Linear and gpt-oss checkpoints answering the same disaggregated as colocated there
# (tests/router/test_cluster_http.py), and with the time left
# the device transfer backend's tests and its bytes/s (transfer server and CUDA IPC) beside raw sockets and the
# device's own copy (tests/transfer/test_pull.py, bench.transfer part a). The
# launch-parameter sweep (bench.kernel_tune) runs when TUNE_SWEEPS names sweeps (candidates, hopper, paged: swept
# on the H100 and H200, bench/results/kernel_tune_*).
#
# Here, once: bash bench/gpu_wheels.sh (the packages the machine's image lacks, as wheels in .whl/). Then the
# device tool's run, with carry [".whl"] and timeout_s 600:
#     bash bench/gpu_check.sh
# It uses the machine's own python3, JAX (CUDA) and Flax, the wheels installed beside them in /tmp/site;
# TUNE_SWEEPS picks bench.kernel_tune's sweeps (default none), its JSON named after them
# (kernel_tune_candidates_h200.json, ...).
# Every step has its share of BUDGET_S (default 560 s; the shares scale with it) and is cut at it; what each
# wrote, a summary and its log (in logs.tgz) go to $OUT (results named after the GPU: kernels_h100.json,
# kernels_h200.json, ...), to be copied into bench/results/ (make bench does).
# A run that spends its GPU on part of the check: ONLY names the steps to run (comma-separated; the rest are
# skipped and take no time), SHARE_<step> sets a step's share in seconds, GPU_DISAGG_ARGS replaces
# bench.gpu_disagg's arguments (default "--reps 2 --busy 12": SmolLM2's shape), e.g. the 8B shape at 256 to 8K
# tokens:
#     ONLY=ipc_test,gpu_disagg,transfer SHARE_gpu_disagg=460 \
#         GPU_DISAGG_ARGS="--shape 8b --lengths 256,2048,8000 --reps 2" bash bench/gpu_check.sh
# The whole check outgrows one call: on the H200 (2026-11-29) the machine started in about 35 s, bench.gpu_decode's
# checkpoint took 34 s and its unrolled part 203 s, bench.gpu_disagg 110 s, the three families' disaggregated tests
# and the attention tests over 60 s each. A lent machine's 15 minutes (its start included) hold two calls, the
# engine's and the serving's, the second sized from what the device tool's status says is left (budget_left_s, B)
# and sent at once, while the machine is still warm:
#     ONLY=kernels,gpu_decode,ipc_test,transfer SHARE_gpu_decode=440 bash bench/gpu_check.sh        # timeout_s 600
#     ONLY=gpu_disagg,disagg_tests,attention_tests,pallas_tests BUDGET_S=$((B - 40)) SHARE_gpu_disagg=280 \
#         SHARE_disagg_tests=200 SHARE_attention_tests=150 bash bench/gpu_check.sh              # timeout_s B - 20
# (the shares are of the default budget and scale with BUDGET_S; a cut step still leaves what it wrote in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
DEFAULT_BUDGET_S=560  # the step shares below are of this budget
BUDGET_S=${BUDGET_S:-$DEFAULT_BUDGET_S}
START=$(date +%s)
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # several processes share the GPU
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: the wheels in .whl/ did not install" >&2; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
[ -n "$GPU" ] || { echo "gpu_check: nvidia-smi finds no GPU" >&2; exit 1; }
TAG=$(echo "$GPU" | grep -o -i -E 'H100|H200|A100|L40S|B200' | head -1 | tr 'A-Z' 'a-z')
TAG=${TAG:-gpu}
{
    echo "gpu: $GPU (tag $TAG)"
    nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader
    $PY -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__); print(jax.devices())"
} 2>&1 | tee "$OUT/summary.txt"

# step NAME SHARE_S COMMAND...: runs COMMAND for at most SHARE_S seconds (SHARE_NAME if set) and what is left of
# BUDGET_S -> COMMAND's status (1 when skipped for time, 0 when ONLY leaves it out)
chosen() { [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$1,"* ]]; }  # chosen NAME: whether ONLY leaves the step in
step() {
    local name=$1 override="SHARE_$1"
    if ! chosen "$name"; then
        echo "$name: not chosen (ONLY=$ONLY)" >> "$OUT/summary.txt"
        return 0
    fi
    local share=$(( ${!override:-$2} * BUDGET_S / DEFAULT_BUDGET_S )); shift 2  # shares scale with the budget
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    local limit=$(( share < left ? share : left ))
    if [ "$limit" -lt 20 ]; then
        echo "$name: skipped, under 20 s for it (its share $share s, $left s of the budget left)" | tee -a "$OUT/summary.txt"
        return 1
    fi
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc $rc in $(( $(date +%s) - t0 )) s (limit $limit s)$([ $rc = 124 ] && echo ', cut at its limit')" \
        | tee -a "$OUT/summary.txt"
    tail -n 4 "$OUT/$name.log" | awk '{print "    " $0}' | tee -a "$OUT/summary.txt"  # awk ends every line
    return $rc
}

# in order of what a cut-short run must not lose: the kernels' rates, the engine against the memory floor,
# disaggregated serving on the GPU and its answers, the device transfer backends, the attention kernels' tests, the other kernel tests
step kernels 40 $PY -m bench.kernels --iters 20 --json "$OUT/kernels_$TAG.json"
step gpu_decode 230 $PY -m bench.gpu_decode --json "$OUT/gpu_decode_$TAG.json"
# the disaggregated deployment moves KV through CUDA IPC only where two processes just did so correctly (a run
# that leaves the test out keeps JAX's transfer server)
IPC=off
step ipc_test 20 $PY -m pytest -v -p no:cacheprovider tests/transfer/test_ipc.py && chosen ipc_test && IPC=on
step gpu_disagg 90 $PY -m bench.gpu_disagg ${GPU_DISAGG_ARGS:---reps 2 --busy 12} --cuda-ipc $IPC --json "$OUT/gpu_disagg_$TAG.json"
step disagg_tests 50 env JAXSERVE_DISAGG_FAMILIES=llama,kimi_linear,gpt_oss $PY -m pytest -v -p no:cacheprovider \
    tests/router/test_cluster_http.py -k equals_colocated
if [ -n "${TUNE_SWEEPS:-}" ]; then
    step kernel_tune 150 $PY -m bench.kernel_tune --iters 10 --budget-s $(( 120 * BUDGET_S / DEFAULT_BUDGET_S )) \
        --sweeps "$TUNE_SWEEPS" --json "$OUT/kernel_tune_$(echo "$TUNE_SWEEPS" | tr , _)_$TAG.json"
fi
# the device transfer backends' rates (CUDA IPC, the transfer server) before the kernel tests, which ran on the H100 and H200
step pull_tests 20 $PY -m pytest -q -p no:cacheprovider tests/transfer/test_pull.py
step transfer 20 $PY -m bench.transfer --parts a --reps 3 --json "$OUT/transfer_$TAG.json"
K=tests/pallas_kernels
ATTENTION="$K/test_flash_attention_hopper.py $K/test_paged_attention.py $K/test_paged_prefill.py $K/test_paged_candidates.py"
step attention_tests 50 $PY -m pytest -v -p no:cacheprovider $ATTENTION
step pallas_tests 30 $PY -m pytest -v -p no:cacheprovider $K $(for f in $ATTENTION; do echo --ignore $f; done) \
    --ignore $K/test_gpu_lowering.py  # the engine on each model family first
# (tests/conftest.py's order); test_gpu_lowering.py checks on a CPU what the GPU's own compiles show here
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
(cd "$OUT" && tar -czf logs.tgz ./*.log && rm -f ./*.log)  # the logs in one file, beside the summary and results
