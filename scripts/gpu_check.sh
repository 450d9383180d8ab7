#!/usr/bin/env bash
# One device-machine run: build, GPU tests, compute-sanitizer, SASS check, optional benchmark.
# Logs go to $OUT (or ./out). Usage: bash scripts/gpu_check.sh [tests|sanitize|sass|bench|quick]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
steps=${*:-tests sanitize sass}
rc=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
( time bash scripts/setup_env.sh ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"
# ptxas C7518 (and C7514, C7515): it serialized a kernel's wgmma (correct but a third slower; .ci/run fails on
# it for the nvcc there, this catches the nvcc of this machine when this run built the extension)
if grep -qE "C751[458]" "$OUT/build.log"; then grep -E "C751[458]" "$OUT/build.log" | head -3; echo "error: ptxas serialized wgmma (C7514/C7515/C7518)"; rc=1; fi
for step in $steps; do
  case $step in
    tests)
      python3 -m pytest tests -q -x -ra -p no:cacheprovider > "$OUT/tests.log" 2>&1; r=$?
      tail -15 "$OUT/tests.log"; [ $r -eq 0 ] || rc=1 ;;
    gputests)
      python3 -m pytest tests/test_gemm_cuda.py -q -x -ra -p no:cacheprovider > "$OUT/gputests.log" 2>&1; r=$?
      tail -15 "$OUT/gputests.log"; [ $r -eq 0 ] || rc=1 ;;
    sanitize)
      # the base cases, the other formats' instances, the prefill kernel's and the 128-column tile's
      # (scripts/sanitize.py)
      for mode in base formats prefill prefill-split narrow; do
        flag=$([ $mode = base ] || echo "--$mode")
        for tool in memcheck racecheck synccheck initcheck; do
          log="$OUT/sanitize-$mode-$tool.log"
          compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize.py $flag > "$log" 2>&1; r=$?
          echo "compute-sanitizer $tool ($mode): exit $r ($(grep -c 'ERROR SUMMARY: 0 errors\|RACECHECK SUMMARY: 0 hazards' "$log") clean summaries)"
          grep -E 'SUMMARY' "$log" | head -2
          [ $r -eq 0 ] || rc=1
        done
      done ;;
    sass)
      python3 scripts/check_sass.py > "$OUT/sass.log" 2>&1; r=$?; tail -8 "$OUT/sass.log"; [ $r -eq 0 ] || rc=1 ;;
    bench)
      python3 -m benchmarks.bench_gemm > "$OUT/bench.log" 2>&1; r=$?; tail -60 "$OUT/bench.log"; [ $r -eq 0 ] || rc=1
      cp benchmarks/results/*.json "$OUT/" 2>/dev/null ;;
    quick)
      python3 -m benchmarks.bench_gemm --quick --out "$OUT/quick.json" > "$OUT/quick.log" 2>&1; r=$?; tail -45 "$OUT/quick.log"; [ $r -eq 0 ] || rc=1 ;;
  esac
done
exit $rc
