#!/usr/bin/env bash
# Builds here (the GPU machine has no Rust) what scripts/device-run.sh needs there,
# into device-carry/ (git-ignored; name it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf device-carry && mkdir -p device-carry
# The binaries carry the kernels as a cubin only where the build found ptxas (else the GPU
# machine compiles 16 MB of PTX at each first start): PTXAS, or CI's pip-installed one.
if [ -z "${PTXAS:-}" ] && ! command -v ptxas > /dev/null; then
  PTXAS="$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "bin", "ptxas"))' 2>/dev/null || true)"
  if [ -x "$PTXAS" ]; then export PTXAS; else unset PTXAS; echo "note: no ptxas found; the kernels go as PTX" >&2; fi
fi
cargo build --release -p host
cp target/release/host device-carry/
# An older build to compare against in the same device call (STEPS=ab).
if [ -n "${OLD_HOST:-}" ]; then cp "$OLD_HOST" device-carry/host-old; fi
# Test executables that hold GPU tests (run there with --include-ignored).
cargo test --release --no-run --message-format=json -p host 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        if m["target"]["name"] in ("gpu", "gpu_parallel"):
            shutil.copy(m["executable"], "device-carry/test-" + m["target"]["name"])
            print("test binary:", m["target"]["name"])
'
cp "$(ls -t $(find target/release/build -name kernels_sm90.ptx) | head -1)" device-carry/
# The bf16 model's dev timing (host/examples/bf16_timing.rs).
cargo build --release -p host --example bf16_timing && cp target/release/examples/bf16_timing device-carry/
if [ -n "${OLD_TIMING:-}" ]; then cp "$OLD_TIMING" device-carry/bf16_timing-old; fi
# The Python package (abi3 wheel: any CPython >= 3.9) and pytest for its GPU tests (the
# GPU machine has PyTorch but no network).
PY=${PYTHON:-python3}
"$PY" -m maturin build --release -m python/Cargo.toml -i "$PY" --out device-carry/wheels >/dev/null
"$PY" -m pip download --quiet --only-binary :all: -d device-carry/wheels pytest
ls device-carry/wheels
# torchao, the fp8 configuration's peers (STEPS=fp8), kept apart from the wheels installed
# by default. TORCHAO= picks the version (empty: none).
TORCHAO=${TORCHAO-0.18.0}
if [ -n "$TORCHAO" ]; then
  "$PY" -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 -d device-carry/torchao \
    "torchao==$TORCHAO"
fi
# Symbols are not needed there; stripped, everything fits the device tool's 64 MiB.
for f in device-carry/*; do [ -x "$f" ] && [ -f "$f" ] && strip "$f"; done
ls -la device-carry
du -sh device-carry
