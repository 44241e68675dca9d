#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, over device-carry/ built by
# scripts/device-prepare.sh. Checks, then times; logs under $OUT; a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=device-carry
log() { echo "$@" | tee -a "$OUT/summary.txt"; }

nvidia-smi -L | tee "$OUT/gpu.txt"

echo "== ptxas resources (sm_90)"
ptxas -arch=sm_90 -v "$C/kernels_sm90.ptx" -o /dev/null 2>&1 | tee "$OUT/ptxas.txt" | grep -E "Function properties|spill|Used"

echo "== GPU tests"
"$C/test-gpu" --include-ignored --nocapture --test-threads 1 2>&1 | tee "$OUT/test-gpu.txt"
gpu_tests=${PIPESTATUS[0]}

echo "== forward on the GPU at small odd shapes and at seed sizes"
status=()
for m in M1 M2 M3 M4 M5; do
  groups=4; [ "$m" = M4 ] && groups=""
  $C/host forward --device gpu --model $m --shape 33,77,96 ${groups:+--groups $groups} --check-rows 33 >"$OUT/fwd-small-$m.txt" 2>&1
  status+=("$m small: exit $? $(grep -o 'rel err [^,]*' "$OUT/fwd-small-$m.txt")")
done
for m in M1 M2 M3 M4 M5; do
  $C/host forward --device gpu --model $m --repeat 10 >"$OUT/fwd-seed-$m.txt" 2>&1
  status+=("$m seed: exit $? $(grep -o 'rel err [^,]*' "$OUT/fwd-seed-$m.txt") | $(grep -o 'time .*TFLOP/s' "$OUT/fwd-seed-$m.txt")")
done

echo
log "== summary"
log "GPU tests exit code: $gpu_tests ($(grep -c '^test .* ok$' "$OUT/test-gpu.txt") ok, $(grep -c 'FAILED' "$OUT/test-gpu.txt") FAILED lines)"
grep -E "gemm_bias_tiled m=|rel .* max abs" "$OUT/test-gpu.txt" | tee -a "$OUT/summary.txt"
for s in "${status[@]}"; do log "$s"; done
