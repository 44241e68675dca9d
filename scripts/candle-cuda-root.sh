#!/usr/bin/env bash
# A CUDA 13.0 build root for the feature `candle-cuda` on a machine without CUDA
# (docs/RUST.md): candle links CUDA at build time and compiles its kernels with nvcc.
#
#   scripts/candle-cuda-root.sh [DIR]      (default target/cuda-root)
#   eval "$(scripts/candle-cuda-root.sh)"  exports CUDA_ROOT, PATH and CUDA_COMPUTE_CAP
#   cargo build --release -p host --no-default-features --features candle-cuda
#
# nvcc, its headers, libcudart and libNVVM come from NVIDIA's CUDA 13.0 pip wheels, one
# version throughout (a newer libNVVM emits PTX the 13.0 ptxas refuses). The libraries
# the program loads at run time from the driver and the GPU machine's CUDA install
# (libcuda, libcublas, libcublasLt, libcurand, libnvrtc, libnccl) are link-time stand-ins
# here: shared objects with their real sonames that define every function cudarc declares
# for them, so that the link resolves and the loader then finds the real libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-target/cuda-root}
mkdir -p "$DIR/wheels" "$DIR/lib64"
DIR=$(cd "$DIR" && pwd)
PY=${PYTHON:-python3}
for w in nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88; do
  "$PY" -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 -d "$DIR/wheels" "$w" >&2
done
"$PY" - "$DIR" <<'EOF'
import glob, os, sys, zipfile
root = sys.argv[1]
for w in glob.glob(os.path.join(root, "wheels", "*.whl")):
    zipfile.ZipFile(w).extractall(os.path.join(root, "unpacked"))
EOF
cu="$DIR/unpacked/nvidia/cu13"
chmod +x "$cu"/bin/* "$cu"/nvvm/bin/*
for d in bin include nvvm; do ln -sfn "$cu/$d" "$DIR/$d"; done
ln -sf "$cu/lib/libcudart.so.13" "$DIR/lib64/libcudart.so"

# The stand-ins: every `fn name(` cudarc's bindings for the library declare.
cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* | sort -V | tail -1)
stub() {  # stub LIB SONAME MODULE
  local c="$DIR/stub-$1.c"
  grep -ohE '^\s+fn [A-Za-z_][A-Za-z0-9_]*\(' "$cudarc/src/$3/sys/mod.rs" | sed -E 's/^\s+fn ([A-Za-z0-9_]+)\(/\1/' \
    | sort -u | sed 's/.*/void &(void) {}/' > "$c"
  cc -shared -fPIC -Wl,-soname,"$2" -o "$DIR/lib64/lib$1.so" "$c"
}
stub cuda libcuda.so.1 driver
stub cublas libcublas.so.13 cublas
stub cublasLt libcublasLt.so.13 cublaslt
stub curand libcurand.so.10 curand
stub nvrtc libnvrtc.so.13 nvrtc
stub nccl libnccl.so.2 nccl
echo "export CUDA_ROOT=$DIR CUDA_PATH=$DIR PATH=$DIR/bin:\$PATH CUDA_COMPUTE_CAP=90"
