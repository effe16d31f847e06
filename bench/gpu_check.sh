#!/usr/bin/env bash
# The GPU check for streamer's Triton kernels: one command on a lent GPU (H200), under 8 minutes, table last.
#
#   bench/gpu_check.sh                 # on the GPU machine, from anywhere in the repo
#   bench/gpu_check.sh --tests-only    # step 1 alone
#   bench/gpu_check.sh --cpu-dry-run   # CPU smoke test of the same script (tiny shapes, Triton interpreter)
#
# Steps, each under its own time limit so one hang cannot eat the budget, and all of them under 7.75 min (TOTAL);
# on the H200 of 2026-12-04 the whole check took 3.5 min, and step 1 alone 2 min on 8 workers:
#   1. kernel tests on CUDA (tests/test_kernels_*.py, compiled, no interpreter) and the CUDA-graph
#      decode test (tests/test_cuda_graphs.py: captured graphs vs plain steps, same tokens), and the
#      draft model's device path (tests/test_draft_model.py, the target as its own draft), Gemma 3's
#      images on the device (tests/test_multimodal.py, against transformers), 4-bit weights
#      (tests/test_int4.py), DeepSeek-V3's 24-wide heads (tests/test_deepseek.py)                  <= 160 s
#      then, only when the Gemma 3 image test fails, bench/gpu_gemma3_diag.py: which part of the engine
#      the difference follows                                                                     <= 150 s
#   2. bench/gpu_kernels.py: ceilings, unified_attention decode/prefill vs SDPA, MoE (graphed too), sweeps <= 160 s
#   3. bench/gpu_e2e.py: Llama-3-8B-shaped dummy model, decode at batch 1 / 32 / 256, and 1 / 32
#      again without CUDA graphs and without async scheduling, then 256 sampling top-k/top-p on
#      the torch and on the Triton sampler, the step-time model's prediction error per step (stall-free
#      scheduling sizes prefill chunks with it), then eager: bf16 vs int4 weights at batch 1, int4 at 32,
#      bf16 vs FP8 weights at 32; last, if the budget leaves ~100 s, an FP8 engine as served
#      (compiled, CUDA graphs) at batch 1 and 32                                                  <= 285 s
#   4. bench/gpu_report.py: the summary table
# Raw logs and JSON land in $OUT/gpu_check (or a temp dir), so they come back with the run.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
RES="${OUT:-$(mktemp -d)}/gpu_check"
mkdir -p "$RES"
DRY=""
if [ "${1:-}" = "--cpu-dry-run" ]; then DRY="--cpu-dry-run"; fi
TESTS_ONLY=""
if [ "${1:-}" = "--tests-only" ]; then TESTS_ONLY=1; fi  # step 1 alone (a rerun after a fix)
PY=${PYTHON:-python}
T0=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }
# The whole check stays inside TOTAL seconds (issue 7: under 8 minutes): each step gets its own cap or what is left
# of the total, whichever is less (at least 30 s, so a late step still reports).
TOTAL=${GPU_CHECK_TOTAL:-465}
limit() { local left=$(( TOTAL - ($(date +%s) - T0) )); [ "$left" -lt 30 ] && left=30; echo $(( $1 < left ? $1 : left )); }

stamp "preflight"
$PY - <<'EOF' 2>&1 | tee "$RES/preflight.log"
import importlib, sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "| cuda", torch.version.cuda, "| device",
          torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
except Exception as e:
    print("torch import failed:", e)
for mod in ("triton", "pytest", "hypothesis", "tokenizers", "safetensors", "numpy", "transformers"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"MISSING {mod}: {type(e).__name__}")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv

# 1. Kernel tests. On the GPU they run compiled (TRITON_INTERPRET unset); the dry run takes a quick subset.
# SIGINT at the limit lets pytest print its summary of what did run. Hypothesis budgets are smaller on CUDA
# (each new specialisation costs a compile); STREAMER_KERNEL_MAX_EXAMPLES lowers them further.
stamp "kernel tests"
if [ -z "$DRY" ]; then
    env -u TRITON_INTERPRET timeout -s INT -k 10 ${GPU_TESTS_LIMIT:-160} $PY -m pytest -q -rfE -n ${GPU_TESTS_WORKERS:-8} -p no:cacheprovider -W ignore::DeprecationWarning \
        tests/test_kernels_attention.py tests/test_kernels_cache.py tests/test_kernels_fused.py \
        tests/test_kernels_backend.py tests/test_kernels_sampling.py tests/test_kernels_lora.py \
        tests/test_kernels_moe.py tests/test_cuda_graphs.py "tests/test_draft_model.py::test_the_target_as_its_own_draft_is_always_right" \
        tests/test_fp8_kv_cache.py "tests/test_multimodal.py::test_gemma3_images_attend_both_ways_as_in_transformers" \
        "tests/test_structured_output.py::test_bitmask_unpacking_paths_agree" \
        "tests/test_int4.py::test_int4_kernel_on_cuda" "tests/test_int4.py::test_int8_is_refused_on_cuda" "tests/test_deepseek.py::test_matches_transformers[v3-True]" \
        >"$RES/tests.log" 2>&1
else
    TRITON_INTERPRET=1 STREAMER_KERNEL_MAX_EXAMPLES=2 timeout -k 10 300 $PY -m pytest -q -p no:cacheprovider \
        -W ignore::DeprecationWarning tests/test_kernels_cache.py tests/test_kernels_fused.py \
        "tests/test_kernels_attention.py::test_unified_attention_random" \
        "tests/test_kernels_backend.py::test_backend_matches_reference_and_torch_backend" \
        "tests/test_kernels_sampling.py::test_sampler_matches_reference" tests/test_kernels_lora.py \
        tests/test_kernels_moe.py \
        "tests/test_fp8_kv_cache.py::test_unified_attention_reads_fp8_caches" \
        tests/test_cuda_graphs.py \
        "tests/test_structured_output.py::test_bitmask_unpacking_paths_agree" >"$RES/tests.log" 2>&1
fi
TESTS_RC=$?
tail -n 15 "$RES/tests.log"
# Gemma 3's image prompts were off transformers' on the H200 of 2026-12-04 (not on CPU): when they still are, find
# which part of the engine the difference follows (one table, <= 150 s).
if [ -z "$DRY" ] && grep -q "FAILED tests/test_multimodal.py::test_gemma3" "$RES/tests.log"; then
    stamp "gemma 3 diagnosis"
    timeout -k 10 "$(limit 150)" $PY bench/gpu_gemma3_diag.py 2>&1 | grep -v "it/s\]" | tee "$RES/gemma3_diag.log" | tail -n 12
fi
if [ -n "$TESTS_ONLY" ]; then exit $TESTS_RC; fi

# 2. Kernel benchmarks.
stamp "kernel benchmarks"
timeout -k 10 "$(limit 160)" $PY bench/gpu_kernels.py $DRY --out "$RES/kernels.json" 2>&1 | tee "$RES/kernels.log"

# 3. End to end, with the measured copy bandwidth and matmul rate for the roofline column.
stamp "end-to-end decode"
COPY=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['copy_gbps'])" "$RES/kernels.json" 2>/dev/null)
MATMUL=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['matmul_tflops'])" "$RES/kernels.json" 2>/dev/null)
E2E=$(limit 285)
timeout -k 10 "$E2E" $PY bench/gpu_e2e.py $DRY ${COPY:+--copy-gbps "$COPY"} ${MATMUL:+--matmul-tflops "$MATMUL"} --budget-s $(( E2E - 15 )) --out "$RES/e2e.json" \
    2>&1 | tee "$RES/e2e.log"

# 4. The table, last.
stamp "done"
$PY bench/gpu_report.py --tests-log "$RES/tests.log" --tests-rc "$TESTS_RC" "$RES/kernels.json" "$RES/e2e.json"
