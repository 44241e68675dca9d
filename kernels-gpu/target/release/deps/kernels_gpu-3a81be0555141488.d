/work/main/kernels-gpu/target/release/deps/kernels_gpu-3a81be0555141488.d: src/lib.rs src/elementwise.rs src/epilogue/mod.rs src/epilogue/lanes.rs src/epilogue/pointwise.rs src/epilogue/rows.rs src/gemm/mod.rs src/gemm/simt.rs src/gemm/staged.rs src/gemm/tensor_core.rs src/gemm/tiled.rs src/optim.rs src/prelude/mod.rs src/prelude/index.rs src/prelude/math.rs src/prelude/shared.rs src/prelude/sync.rs src/prelude/tensor_core.rs src/prelude/warp.rs Cargo.toml

/work/main/kernels-gpu/target/release/deps/libkernels_gpu-3a81be0555141488.rmeta: src/lib.rs src/elementwise.rs src/epilogue/mod.rs src/epilogue/lanes.rs src/epilogue/pointwise.rs src/epilogue/rows.rs src/gemm/mod.rs src/gemm/simt.rs src/gemm/staged.rs src/gemm/tensor_core.rs src/gemm/tiled.rs src/optim.rs src/prelude/mod.rs src/prelude/index.rs src/prelude/math.rs src/prelude/shared.rs src/prelude/sync.rs src/prelude/tensor_core.rs src/prelude/warp.rs Cargo.toml

src/lib.rs:
src/elementwise.rs:
src/epilogue/mod.rs:
src/epilogue/lanes.rs:
src/epilogue/pointwise.rs:
src/epilogue/rows.rs:
src/gemm/mod.rs:
src/gemm/simt.rs:
src/gemm/staged.rs:
src/gemm/tensor_core.rs:
src/gemm/tiled.rs:
src/optim.rs:
src/prelude/mod.rs:
src/prelude/index.rs:
src/prelude/math.rs:
src/prelude/shared.rs:
src/prelude/sync.rs:
src/prelude/tensor_core.rs:
src/prelude/warp.rs:
Cargo.toml:

# env-dep:CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
# env-dep:CLIPPY_CONF_DIR
