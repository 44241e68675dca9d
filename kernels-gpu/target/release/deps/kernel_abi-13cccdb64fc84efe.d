/work/main/kernels-gpu/target/release/deps/kernel_abi-13cccdb64fc84efe.d: /work/main/kernel-abi/src/lib.rs

/work/main/kernels-gpu/target/release/deps/libkernel_abi-13cccdb64fc84efe.rmeta: /work/main/kernel-abi/src/lib.rs

/work/main/kernel-abi/src/lib.rs:
