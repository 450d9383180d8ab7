#!/usr/bin/env bash
# Re-measures committed results on a GPU machine, with the arguments the committed files were made
# with, so that a csrc change can re-measure what it moves in one or two device calls:
#
#   MARLIN_GIT_REV=<commit> MARLIN_CSRC_TREE=<git rev-parse <commit>:csrc> \
#     bash scripts/remeasure.sh OUTDIR STEP [STEP ...]
#
# Steps, run in the order given (each logs to OUTDIR/logs/STEP.log and prints one line):
#   build      the extension in place (scripts/setup_env.sh; MAX_JOBS defaults to the cores)
#   tests-2_4  the 2:4 GPU suites (mma.sync, wgmma, prefill) with 12 workers
#   tests-gemm the dense GPU suites (small-batch, prefill, formats) with 12 workers
#   full       bench_gemm's full run          -> OUTDIR/<gpu>.json
#   formats    the formats run                -> OUTDIR/<gpu>-formats.json
#   layers     the real-model layers at M=16  -> OUTDIR/<gpu>-layers.json
#   e2e        bench_e2e, 7B shape, compiled  -> OUTDIR/<gpu>-e2e.json
#   serving    bench_e2e_serving, 2 rates     -> OUTDIR/<gpu>-serving.json
#   tp         bench_tp at TP=2 and TP=1, then tests/tp_torchrun.py (needs 2 GPUs)
#                                             -> OUTDIR/<gpu>x2-tp.json, <gpu>x1-tp.json
# The commit and csrc tree are taken from MARLIN_GIT_REV / MARLIN_CSRC_TREE (a copy of the tree
# without .git cannot say them itself; benchmarks/provenance.py). Then, on the machine with git:
# copy the files into benchmarks/results/, `python -m benchmarks.report FILES`, and
# `python -m benchmarks.readme_tables --check` for the README tables to update.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,22p' "$0"; exit 2; }
out=$1; shift
mkdir -p "$out/logs"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# the results files' GPU name (h200, h100-80gb-hbm3), asked again after `build` (torch may not import before)
gpu_slug() { "$PY" -c "import torch; from benchmarks.bench_math import sanitize_gpu_name as s; print(s(torch.cuda.get_device_name(0)))" 2>/dev/null || echo gpu; }
gpu=$(gpu_slug)

run() {  # step name, timeout in seconds, command...
  local step=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/logs/$step.log" 2>&1
  local rc=$?
  say "$step: rc=$rc $(grep -vE 'Warning|warn\(' "$out/logs/$step.log" | tail -1 | cut -c1-200)"
  return $rc
}

bench_kernels="fp16,fp16_kn,marlin_g128,marlin_direct,marlin_gcol,marlin_24_g128,torch_int4"
format_kernels="fp16,fp16_kn,marlin_g128,marlin_direct,marlin_gcol,marlin_24_g128,marlin_bf16_g128,marlin_zp_g128,marlin_g64,marlin_g32,marlin_u8_g128,marlin_24_bf16_g128,marlin_24_g64,marlin_24_g32,marlin_24_zp_g128,torch_int4"

for step in "$@"; do
  case $step in
    build) run build 600 bash scripts/setup_env.sh && gpu=$(gpu_slug) ;;
    tests-2_4) run tests-2_4 400 "$PY" -m pytest -q -n 12 -p no:cacheprovider tests/test_gemm_2_4_cuda.py \
                 tests/test_gemm_2_4_wgmma_cuda.py tests/test_gemm_2_4_prefill_cuda.py ;;
    tests-gemm) run tests-gemm 500 "$PY" -m pytest -q -n 12 -p no:cacheprovider tests/test_gemm_cuda.py \
                  tests/test_gemm_cuda_prefill.py tests/test_gemm_cuda_formats.py ;;
    full) run full 300 "$PY" -m benchmarks.bench_gemm --kernels "$bench_kernels" --out "$out/$gpu.json" ;;
    formats) run formats 300 "$PY" -m benchmarks.bench_gemm --kernels "$format_kernels" --out "$out/$gpu-formats.json" ;;
    layers) run layers 200 "$PY" -m benchmarks.bench_gemm --layers --kernels fp16,fp16_kn,marlin_g128,marlin_gcol \
              --out "$out/$gpu-layers.json" ;;
    e2e) run e2e 480 "$PY" -m benchmarks.bench_e2e --kernels fp16,fp16_kn,fp16_fused,fp16_fused_kn,marlin,marlin_24 \
           --cache slots --modes compiled --samples 3 --profile --profile-batches 1,16 --out "$out/$gpu-e2e.json" ;;
    serving) run serving 300 "$PY" -m benchmarks.bench_e2e_serving --kernels fp16,fp16_fused,marlin,marlin_24 --slots 16 \
               --rates 2,8 --num-requests 12 --timeout 25 --out "$out/$gpu-serving.json" ;;
    tp) run tp2 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.bench_tp \
          --kinds fp16,marlin,marlin_24 --profile-batches 1,16 --out "$out/${gpu}x2-tp.json"
        run tp1 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m benchmarks.bench_tp \
          --kinds marlin,marlin_24 --out "$out/${gpu}x1-tp.json"
        run tp-tests 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_torchrun.py ;;
    *) echo "remeasure.sh: unknown step '$step' (build, tests-2_4, tests-gemm, full, formats, layers, e2e, serving, tp)"; exit 2 ;;
  esac
done
