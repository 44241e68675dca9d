#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, over device-carry/ built by
# scripts/device-prepare.sh: checks first, then timings, then PyTorch's numbers in the
# same call. Logs under $OUT; a short table last.
#   STEPS="ptxas tests check forward bench pytorch" (default: all)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=device-carry
STEPS=${STEPS:-"ptxas tests check forward bench pytorch"}
has() { [[ " $STEPS " == *" $1 "* ]]; }
summary=()

# cuBLAS for `host bench`: cudarc looks for libcublas.so; point it at CUDA's or PyTorch's copy.
mkdir -p /tmp/cublas
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null); do
  lib=$(ls "$d"/libcublas.so* 2>/dev/null | head -1)
  if [ -n "$lib" ]; then
    ln -sf "$lib" /tmp/cublas/libcublas.so
    lt=$(ls "$d"/libcublasLt.so* 2>/dev/null | head -1); [ -n "$lt" ] && ln -sf "$lt" /tmp/cublas/libcublasLt.so
    export LD_LIBRARY_PATH="/tmp/cublas:$d:${LD_LIBRARY_PATH:-}"
    break
  fi
done

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"

if has ptxas; then
  echo "== ptxas resources (sm_90)"
  ptxas -arch=sm_90 -v "$C/kernels_sm90.ptx" -o /dev/null 2>&1 | tee "$OUT/ptxas.txt" | grep -E "Function properties|spill|Used" | grep -v panicking
  spills=$(grep -c "[1-9][0-9]* bytes spill" "$OUT/ptxas.txt")
  summary+=("ptxas: $(grep -c 'Compiling entry' "$OUT/ptxas.txt") entries, lines with spills: $spills")
fi

if has tests; then
  echo "== GPU tests (--include-ignored)"
  timeout 300 "$C/test-gpu" --include-ignored --nocapture --test-threads 1 2>&1 | tee "$OUT/test-gpu.txt"
  summary+=("GPU tests: exit ${PIPESTATUS[0]}, $(grep -E '^test result' "$OUT/test-gpu.txt")")
fi

if has check; then
  echo "== host check"
  timeout 240 $C/host check --random 32 2>&1 | tee "$OUT/check.txt"
  summary+=("host check: exit ${PIPESTATUS[0]}, $(tail -1 "$OUT/check.txt")")
fi

if has forward; then
  echo "== host forward at seed sizes (64 rows checked against f64)"
  for m in M1 M2 M3 M4 M5; do
    timeout 120 $C/host forward --device gpu --model $m --repeat 10 --check-rows 64 >"$OUT/forward-$m.txt" 2>&1
    summary+=("forward $m: exit $? | $(grep -o 'rel err [^,]*' "$OUT/forward-$m.txt") | $(grep -o '[0-9.]* ms, [0-9.]* TFLOP/s' "$OUT/forward-$m.txt")")
  done
  cat "$OUT/forward-M1.txt"
fi

if has bench; then
  echo "== host bench (strict FP32, vs cuBLAS SGEMM in the same process)"
  timeout 240 $C/host bench --repeat 20 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
fi

if has pytorch; then
  echo "== PyTorch baselines (same call)"
  PYTHONUNBUFFERED=1 timeout 300 python3 $C/pytorch_baselines.py --json "$OUT/torch-fp32.json" 2>&1 | tee "$OUT/torch.txt"
fi

echo
echo "== summary"
for s in "${summary[@]}"; do echo "$s"; done | tee "$OUT/summary.txt"
[ -f "$OUT/bench.txt" ] && grep -A8 "^model" "$OUT/bench.txt"
[ -f "$OUT/torch.txt" ] && grep -E "^M[1-5] " "$OUT/torch.txt"
