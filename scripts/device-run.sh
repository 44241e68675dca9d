#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, over device-carry/ built by
# scripts/device-prepare.sh: checks first, then timings, then PyTorch's numbers in the
# same call. Everything goes to $OUT/log.txt (and the JSON tables beside it: the
# device tool returns at most 8 files); a short summary is printed last.
#   STEPS="ptxas sass tests check forward backward bench train pytorch tensor parity compile"
#   Python package: STEPS="python kernelbench kbfuse pybench pytrain" (pytest, the KernelBench
#   ModelNews, fuse(Model) of all 36 KernelBench problems, the op against `host bench`,
#   examples/train.py)
#   (default: all; `pytorch` runs python -m fused_linear.bench at the seed sizes, `compile` the same
#   with max-autotune; STEPS=sweep its batch sweep, BENCH_CONFIGS= picks configurations)
#   STEPS=ab: this build against device-carry/host-old (OLD_HOST= in device-prepare.sh), same call
#   STEPS=seedparity: scripts/parity.py at the presets' seed sizes, every precision, against
#   PyTorch's float64 on the GPU (~5 minutes: a call of its own, not in the default)
#   STEPS=bf16ab: the bf16 model's dev timing (and M2's phases), this build against
#   device-carry/bf16_timing-old
#   STEPS=bf16: a bf16 model's blocks, ours and PyTorch's bf16 model (eager, compiled)
#   STEPS=fp8: the FP8 GPU tests, examples/train.py in fp8, scripts/fp8-errors.py and the
#   benchmark's fp8 configuration at the seed sizes (torchao's recipes as peers where
#   device-carry/torchao holds its wheel) (not in the default)
#   STEPS=parallel: several ranks (NCCL over every GPU present, ranks sharing GPU 0), tensor
#   and data parallel through the CLI, the DDP example (not in the default)
#   STEPS=sanitize: compute-sanitizer's memcheck over every Rust GPU test, one test per
#   process (a test fails where the tool reports any access outside an allocation;
#   SANITIZE_TESTS= a space-separated subset of test names; not in the default: ~10x slower)
set -uo pipefail
# NVLink multicast stays off in everything started here: on a shared host a program that
# uses it can put every GPU out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=device-carry
STEPS=${STEPS:-"ptxas sass tests check forward backward bench train pytorch tensor parity compile"}
LOG="$OUT/log.txt"
has() { [[ " $STEPS " == *" $1 "* ]]; }
summary=()
# run LABEL TIMEOUT CMD...: runs CMD with its output in the log; records the exit code.
run() {
  local label=$1 limit=$2; shift 2
  echo "== $label: $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  summary+=("$label: exit $rc")
  return "$rc"
}

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

# NCCL for the several-GPU paths: cudarc looks for libnccl.so; PyTorch's wheel carries libnccl.so.2.
nccl=$(python3 -c 'import nvidia, glob, os; print(next(iter(sorted(glob.glob(os.path.join(nvidia.__path__[0], "*", "lib", "libnccl.so*")))), ""))' 2>/dev/null)
if [ -n "$nccl" ]; then
  mkdir -p /tmp/nccl && ln -sf "$nccl" /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH="/tmp/nccl:${LD_LIBRARY_PATH:-}"
fi

# The Python package: installed from the carried wheels into a folder of its own.
if [ -d "$C/wheels" ]; then
  python3 -m pip install --quiet --no-index --no-deps --target /tmp/pylib "$C"/wheels/*.whl 2>&1 | tail -2
  export PYTHONPATH="/tmp/pylib:${PYTHONPATH:-}"
fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a "$LOG"

if has ptxas; then
  echo "== ptxas resources (sm_90a)" | tee -a "$LOG"
  ptxas -arch=sm_90a -v "$C/kernels_sm90.ptx" -o /dev/null 2>&1 | grep -v panicking >> "$LOG"
  summary+=("ptxas: $(grep -c 'Compiling entry' "$LOG") entries, $(grep -cE '[1-9][0-9]* bytes spill' "$LOG") with spills")
fi
if has sass; then
  # The tensor-core instructions the fastest GEMMs compile to (HGMMA: wgmma; HMMA: mma.sync).
  ptxas -arch=sm_90a "$C/kernels_sm90.ptx" -o /tmp/kernels.cubin 2>/dev/null
  for f in gemm_tma_tf32_nt gemm_tma_tf32x3_nt gemm_tma_bf16_nt gemm_tma_bf16_nt_to_bf16 gemm_tma_bf16_nn_to_bf16 gemm_tma_bf16_tn_to_bf16 gemm_tma_bf16_tn gemm_tma_tf32_tk gemm_tma_tf32x3_tk_t gemm_wgmma_tf32_nt_vec4 gemm_wgmma_tf32x3_nt_vec4 gemm_mma_tf32x3_nn_vec4; do
    echo "$f: $(cuobjdump -sass -fun $f /tmp/kernels.cubin | grep -oE '(HGMMA|HMMA)[.A-Z0-9x]*' | sort | uniq -c | tr '\n' ' ')" | tee -a "$LOG"
  done
fi
has tests && run "GPU tests" 400 "$C/test-gpu" --include-ignored --nocapture --test-threads 1
if has sanitize; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  tests=${SANITIZE_TESTS:-$("$C/test-gpu" --include-ignored --list 2>/dev/null | sed -n 's/: test$//p')}
  for t in $tests; do
    run "memcheck $t" 300 "$cs" --tool memcheck --error-exitcode 9 "$C/test-gpu" --include-ignored --exact "$t"
  done
fi
has check && run "check forward" 300 "$C/host" check --random 32
has check && run "check backward" 300 "$C/host" check --backward --random 32 --seed 1
if has forward; then
  for m in M1 M2 M3 M4 M5; do
    run "forward $m" 120 "$C/host" forward --device gpu --model $m --repeat 10 --check-rows 64
  done
fi
if has backward; then
  for m in M1 M2 M3 M4 M5; do
    run "backward $m" 180 "$C/host" backward --device gpu --model $m --repeat 5 --check-rows 16
  done
fi
has bench && run "bench forward" 300 "$C/host" bench --repeat 20 --json "$OUT/bench.json"
has bench && run "bench backward" 400 "$C/host" bench --backward --repeat 10 --json "$OUT/bench-bwd.json"
if has tensor; then
  for p in tf32x3 tf32; do
    run "check $p" 300 "$C/host" check --precision $p --random 24 --seed 2
    run "check backward $p" 300 "$C/host" check --backward --precision $p --random 24 --seed 3
    run "bench $p" 300 "$C/host" bench --precision $p --repeat 20 --json "$OUT/bench-$p.json"
  done
  run "check bf16" 300 "$C/host" check --precision bf16 --random 24 --seed 2
  run "check backward bf16" 300 "$C/host" check --backward --precision bf16 --random 24 --seed 3
  run "bench bf16" 300 "$C/host" bench --precision bf16 --fp32-tensors --repeat 20
  run "bench backward tf32x3" 300 "$C/host" bench --backward --precision tf32x3 --repeat 10 --json "$OUT/bench-tf32x3-bwd.json"
  run "bench backward tf32" 300 "$C/host" bench --backward --precision tf32 --repeat 10
fi
# Same-call A/B of this build against an older one (device-carry/host-old, see
# device-prepare.sh): every precision, forward and forward+backward, the two builds
# alternating so that clock drift touches both alike.
if has ab && [ -x "$C/host-old" ]; then
  for p in fp32 tf32x3 tf32 bf16; do
    for dir in "" "--backward"; do
      for b in old new; do
        # (bf16 on FP32 tensors in both builds: the old one has no bf16 model.)
        bin="$C/host"; [ "$b" = old ] && bin="$C/host-old"
        extra=""; [ "$b" = new ] && [ "$p" = bf16 ] && extra="--fp32-tensors"
        run "bench $b $p $dir" 200 "$bin" bench --precision $p $dir $extra --repeat 10 \
          --json "$OUT/ab-$b-$p${dir:+-bwd}.json" >/dev/null
      done
    done
  done
  python3 scripts/ab-table.py "$OUT" | tee -a "$LOG"
fi
# The bf16 model's dev timing of this build against an older one
# (device-carry/bf16_timing-old, OLD_TIMING= in device-prepare.sh), alternating twice:
# every preset, the backward's GEMMs alone, M2's chain op by op.
if has bf16ab && [ -x "$C/bf16_timing-old" ]; then
  for round in 1 2; do
    for b in old new; do
      bin="$C/bf16_timing"; [ "$b" = old ] && bin="$C/bf16_timing-old"
      run "bf16 timing $b ($round)" 200 "$bin" "" --gemms --chains
      run "bf16 phases M2 $b ($round)" 200 "$bin" M2 --phases
    done
  done
fi
# A bf16 model's blocks (bf16 tensors in and out): the GPU test, `host check` and
# `host bench` of the bf16-native path, the dev timing with M2's chain op by op, the
# op's bf16 tests, and PyTorch's bf16 model eager and compiled, all in one call.
if has bf16; then
  run "GPU test, bf16 model" 200 "$C/test-gpu" --include-ignored --nocapture bf16_model
  run "bench bf16 model" 300 "$C/host" bench --precision bf16 --repeat 20 --json "$OUT/bench-bf16-model.json"
  run "bench backward bf16 model" 300 "$C/host" bench --backward --precision bf16 --repeat 10 \
    --json "$OUT/bench-bf16-model-bwd.json"
  [ -x "$C/bf16_timing" ] && run "bf16 timing (dev)" 200 "$C/bf16_timing" M2 --gemms --chains --phases
  PYTHONUNBUFFERED=1 run "benchmark bf16, seed sizes" 560 python3 -m fused_linear.bench --shapes seed \
    --configs bf16 --no-progress --json "$OUT/bench-seed-bf16.json" --markdown "$OUT/bench-seed-bf16.md"
fi
has train && run "train" 200 "$C/host" train --device gpu --steps 60
# Several ranks: the collectives and split blocks (GPU tests), the CLI's tensor parallel over
# every GPU (M1 at seed size and 4x wider: the one-GPU side of the scaling table), data-parallel
# training against one rank (ranks sharing GPU 0, and one per GPU), the DDP example.
if has parallel; then
  ngpu=$(nvidia-smi -L | wc -l)
  echo "== $ngpu GPU(s); NCCL library: ${nccl:-not found}" | tee -a "$LOG"
  run "GPU tests, parallel" 300 "$C/test-gpu_parallel" --include-ignored --nocapture --test-threads 1
  for m in M1 M2 M3 M4 M5; do
    run "forward $m" 120 "$C/host" forward --device gpu --model $m --repeat 10 --check-rows 16
    run "forward $m tp$ngpu" 120 "$C/host" forward --device gpu --model $m --repeat 10 --check-rows 16 \
      --tensor-parallel $ngpu
    run "backward $m" 120 "$C/host" backward --device gpu --model $m --repeat 5 --check-rows 8
    run "backward $m tp$ngpu" 120 "$C/host" backward --device gpu --model $m --repeat 5 --check-rows 8 \
      --tensor-parallel $ngpu
  done
  wide="--model M1 --shape 1024,8192,32768 --check-rows 4"
  run "backward wide M1" 200 "$C/host" backward --device gpu $wide --repeat 5
  run "backward wide M1 tp$ngpu" 200 "$C/host" backward --device gpu $wide --repeat 5 --tensor-parallel $ngpu
  run "train dp1" 200 "$C/host" train --device gpu --steps 30 > "$OUT/train-dp1.txt"
  run "train dp2 sharing GPU 0" 200 "$C/host" train --device gpu --steps 30 --data-parallel 2 --ranks-share-gpu \
    > "$OUT/train-dp2-shared.txt"
  [ "$ngpu" -gt 1 ] && run "train dp$ngpu" 200 "$C/host" train --device gpu --steps 30 --data-parallel $ngpu \
    > "$OUT/train-dp$ngpu.txt"
  # Throughput: a block pair whose steps are ~0.1 s on one GPU (teacher on the CPU backend).
  big="--dims 4096,8192,4096 --batch 8192 --batches 2 --steps 12 --groups 256"
  run "train big dp1" 300 "$C/host" train --device gpu $big
  [ "$ngpu" -gt 1 ] && run "train big dp$ngpu" 300 "$C/host" train --device gpu $big --data-parallel $ngpu
  python3 - "$OUT" <<'PY' | tee -a "$LOG"
import glob, sys
def losses(path):
    return [float(l.split("loss ")[1].split()[0]) for l in open(path) if l.startswith("step")]
one = losses(f"{sys.argv[1]}/train-dp1.txt")
for path in sorted(glob.glob(f"{sys.argv[1]}/train-dp*.txt")):
    other = losses(path)
    worst = max(abs(a - b) / a for a, b in zip(one, other)) if other else float("nan")
    print(f"{path.split('/')[-1]}: {len(other)} steps, loss {other[0]:.6f} -> {other[-1]:.6f}, "
          f"worst step rel diff vs one rank {worst:.2e}")
PY
  PYTHONUNBUFFERED=1 run "DDP example + pytest" 300 python3 -m pytest -q -p no:cacheprovider python/tests/test_ddp.py
  PYTHONUNBUFFERED=1 run "DDP example on $ngpu GPU(s)" 200 python3 -m torch.distributed.run --standalone \
    --nproc-per-node=$ngpu examples/ddp.py --steps 20
fi
has parity && PYTHONUNBUFFERED=1 run "parity with PyTorch" 400 python3 scripts/parity.py --host "$C/host"
if has seedparity; then
  for p in fp32 tf32x3 tf32 bf16; do
    PYTHONUNBUFFERED=1 run "parity at seed size, $p" 200 python3 scripts/parity.py --host "$C/host" --seed-sizes \
      --precision $p --json "$OUT/parity-seed-$p.json"
  done
fi
has python && PYTHONUNBUFFERED=1 run "pytest (CPU and GPU)" 500 python3 -m pytest -q -p no:cacheprovider python/tests
has kernelbench && PYTHONUNBUFFERED=1 run "KernelBench ModelNew" 560 python3 examples/kernelbench/run.py \
  --problems hand --precision fp32,tf32x3 --trials 5 --backward --json "$OUT/kernelbench.json"
has kbfuse && PYTHONUNBUFFERED=1 run "KernelBench fuse(Model), 36 problems" 560 python3 \
  examples/kernelbench/run.py --fuse --precision fp32,tf32x3 --trials 5 --backward --f64 --no-compile \
  --json "$OUT/kernelbench-fuse.json"
has pybench && PYTHONUNBUFFERED=1 run "op vs host bench" 560 python3 scripts/py-bench.py --host "$C/host" \
  --json "$OUT/py-bench.json"
has pytrain && PYTHONUNBUFFERED=1 run "train.py" 200 python3 examples/train.py --steps 50 --device cuda --precision fp32
# Ours against eager PyTorch and torch.compile of the same blocks, in one process, every protocol
# (python -m fused_linear.bench): the presets at their seed sizes (pytorch: TF32 and bf16; compile:
# with --compile-mode max-autotune-no-cudagraphs too), and the batch sweep (sweep: ~4 minutes a
# configuration on an H100).
if has pytorch; then
  PYTHONUNBUFFERED=1 run "benchmark, seed sizes" 560 python3 -m fused_linear.bench --shapes seed \
    --configs ${BENCH_CONFIGS:-tf32,bf16} --no-progress --json "$OUT/bench-seed.json" --markdown "$OUT/bench-seed.md"
  has tensor && PYTHONUNBUFFERED=1 run "benchmark, strict FP32 peers" 300 python3 -m fused_linear.bench \
    --shapes seed --configs fp32,tf32x3 --modes fwd --protocols flushed --no-compile --no-progress \
    --json "$OUT/bench-seed-fp32.json" --markdown "$OUT/bench-seed-fp32.md"
fi
if has compile; then
  PYTHONUNBUFFERED=1 run "benchmark, max-autotune" 560 python3 -m fused_linear.bench --shapes seed \
    --configs ${BENCH_CONFIGS:-tf32,bf16} --compile-mode max-autotune-no-cudagraphs --no-progress \
    --json "$OUT/bench-seed-autotune.json" --markdown "$OUT/bench-seed-autotune.md"
fi
if has fp8; then
  if [ -d "$C/torchao" ]; then
    python3 -m pip install --quiet --no-index --no-deps --target /tmp/aolib "$C"/torchao/*.whl 2>&1 | tail -2
  fi
  run "FP8 GPU tests" 200 "$C/test-gpu" --ignored --nocapture --test-threads 1 fp8
  PYTHONUNBUFFERED=1 run "train.py fp8" 200 python3 examples/train.py --steps 50 --device cuda --precision fp8
  PYTHONPATH="/tmp/pylib:/tmp/aolib" PYTHONUNBUFFERED=1 run "fp8 errors" 300 python3 scripts/fp8-errors.py
  PYTHONPATH="/tmp/pylib:/tmp/aolib" PYTHONUNBUFFERED=1 run "benchmark fp8" 560 python3 -m fused_linear.bench \
    --shapes seed --models M1,M3,M5 --configs fp8 --protocols graph,flushed,stream --no-progress \
    --json "$OUT/bench-seed-fp8.json" --markdown "$OUT/bench-seed-fp8.md"
fi
if has sweep; then
  for cfg in ${BENCH_CONFIGS:-bf16 tf32}; do
    PYTHONUNBUFFERED=1 run "benchmark sweep $cfg" 560 python3 -m fused_linear.bench --shapes sweep --configs "$cfg" \
      --no-progress --json "$OUT/bench-sweep-$cfg.json" --markdown "$OUT/bench-sweep-$cfg.md"
  done
fi

echo
echo "== summary" | tee -a "$LOG"
for s in "${summary[@]}"; do echo "$s"; done | tee -a "$LOG"
grep -E "^(test result|all cases|worst relative|done in)|FAILED" "$LOG" | head -20
grep -E "^== (forward|backward) M|^  (check|time)" "$LOG" | sed 's/(median.*//' | head -60
grep -B1 -A7 "^model " "$LOG"
grep -E "^M[1-5] \{" "$LOG"
