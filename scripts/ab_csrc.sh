#!/usr/bin/env bash
# A/B of a kernel change on a GPU machine: this tree's csrc/ ("new") against another commit's
# ("base"), both built in place side by side, then the same bench_gemm points timed alternately
# (base then new, new then base, ...) so that both see the same GPU, clocks and power state, and
# `python -m benchmarks.ab_compare` prints new / base per kernel and M.
#
#   on the machine with git:  mkdir -p .ab && git archive -o .ab/base-csrc.tar <base-commit> csrc
#   on the GPU machine:       bash scripts/ab_csrc.sh .ab/base-csrc.tar OUTDIR [bench_gemm args...]
#
# (the device tool: carry [".ab"]; .ab/ is ignored). Without bench_gemm args: the nine benchmark
# layers at M = 1-16 with group 128, per column, groups of 32, zero points and bf16. Env: ROUNDS
# (2), MAX_JOBS (per build; half the cores), TESTS=1 to run the dense GPU suites on "new" after.
# Logs and JSON go to OUTDIR; the base tree is built in ${AB_BASE_DIR:-/tmp/marlin-ab-base}.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,13p' "$0"; exit 2; }
base_tar=$1 out=$2; shift 2
[ -f "$base_tar" ] || { echo "ab_csrc.sh: no base archive at $base_tar"; exit 2; }
bench_args=("$@")
[ ${#bench_args[@]} -gt 0 ] || bench_args=(--shapes 7B_qkv,7B_o,7B_gateup,7B_down,70B_qkv,70B_o,70B_gateup,70B_down,ideal
  --ms 1,2,4,8,16 --kernels marlin_g128,marlin_gcol,marlin_g32,marlin_zp_g128,marlin_bf16_g128)
PY=${PYTHON:-python3}
new=$PWD base=${AB_BASE_DIR:-/tmp/marlin-ab-base}
mkdir -p "$out"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

# the base tree: this tree without its build outputs, csrc/ from the archive
rm -rf "$base" && mkdir -p "$base"
tar --exclude=./build --exclude=./.ab --exclude=./.venv --exclude='./marlin/_C*.so' --exclude=./.build-stamp -cf - . |
  tar -xf - -C "$base"
rm -rf "$base/csrc" && tar -xf "$base_tar" -C "$base" || { echo "ab_csrc.sh: cannot unpack $base_tar"; exit 2; }
[ -d "$base/csrc" ] || { echo "ab_csrc.sh: $base_tar holds no csrc/ (git archive -o FILE COMMIT csrc)"; exit 2; }

jobs=${MAX_JOBS:-$(( ($(nproc) + 1) / 2 ))}
(cd "$base" && MAX_JOBS=$jobs bash scripts/setup_env.sh > "$out/build_base.log" 2>&1) & pid=$!
MAX_JOBS=$jobs bash scripts/setup_env.sh > "$out/build_new.log" 2>&1; rc_new=$?
wait $pid; rc_base=$?
say "built: new rc=$rc_new, base rc=$rc_base"
[ $rc_new = 0 ] && [ $rc_base = 0 ] || { tail -5 "$out"/build_*.log; exit 1; }

for r in $(seq 1 "${ROUNDS:-2}"); do
  order="base new"; [ $((r % 2)) = 0 ] && order="new base"
  for tree in $order; do
    dir=$new; [ $tree = base ] && dir=$base
    (cd "$dir" && "$PY" -m benchmarks.bench_gemm "${bench_args[@]}" --retime-spread 0 \
       --out "$out/ab_${tree}_$r.json" > "$out/ab_${tree}_$r.log" 2>&1)
    say "$tree, round $r: rc=$?"
  done
done
"$PY" -m benchmarks.ab_compare "$out" | tee "$out/ab.md"

if [ "${TESTS:-0}" = 1 ]; then
  bash scripts/remeasure.sh "$out" tests-gemm  # the dense GPU suites, as for a re-measurement (log in OUTDIR/logs)
fi
