//! Hopper's warpgroup MMA (`wgmma`, sm_90a), the one layer both `wgmma` GEMM families
//! use (`gemm::wgmma`'s `m64n128` tiles and `gemm::tma`'s `m64n256` ones): shared-memory
//! matrix descriptors, the wait for a warpgroup's MMAs, and one k-tile of MMAs per
//! operand arrangement — both operands from shared memory (`ss`) or `A` from registers
//! (`rs`), TF32, 3xTF32 (three MMAs per `k`-step, the small terms first) and bf16 — as
//! inline PTX.
//!
//! Each k-tile function issues its MMAs as one `asm!` statement with the accumulators
//! as its operands, fenced (`wgmma.fence`) and committed as one group; the functions
//! differ in how many groups they leave running (`wait_group`), which their callers'
//! pipelines are built around. Shared memory is addressed by 32-bit `.shared` offsets
//! (see `mma`); the descriptors' tiles must have been made visible to the
//! async proxy (`mma::fence_proxy_async_shared`, or written by TMA).

/// Runs a warpgroup-wide `wgmma` asm block with the 64 or 128 accumulators of `$acc`
/// (`m64n128` / `m64n256`, f32) as its first operands, positional `{0}`, `{1}`, ..
/// (the templates list them with `accumulators!`; the other operands are named). One
/// statement, so nothing touches the accumulators while the MMAs are in flight.
macro_rules! wgmma_asm {
    (64, $acc:ident; [$($tmpl:expr),* $(,)?]; $($ops:tt)*) => {
        wgmma_asm!(@ $acc; [$($tmpl),*]; [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63]; $($ops)*)
    };
    (128, $acc:ident; [$($tmpl:expr),* $(,)?]; $($ops:tt)*) => {
        wgmma_asm!(@ $acc; [$($tmpl),*]; [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95 96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127]; $($ops)*)
    };
    (@ $acc:ident; [$($tmpl:expr),*]; [$($i:literal)*]; $($ops:tt)*) => {
        core::arch::asm!($($tmpl),*, $(inout(reg32) $acc[$i],)* $($ops)* options(nostack))
    };
}

/// The `{{0}, .., {N-1}}` accumulator list of a `wgmma` template (`N` = 64 or 128).
macro_rules! accumulators {
    (64) => {
        "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}"
    };
    (128) => {
        "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}}}"
    };
}

/// A shared-memory matrix descriptor for a `k`-contiguous, 128-byte-swizzled operand
/// at `addr` (1024-byte aligned, or offset by a multiple of 32 bytes along `k` inside
/// the swizzle atom): start address, stride between 8-row groups (1024 bytes), mode
/// "128B swizzle" (1). The leading offset is unused for this layout (conventionally 1).
#[inline(always)]
pub fn descriptor_128b(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | (1 << 16) | ((1024u64 >> 4) << 32) | (1 << 62)
}

/// A descriptor for an MN-major 16-bit operand with the 128-byte swizzle at `addr`
/// (1024-byte aligned): boxes of 64 values along M (or N, one 128-byte row) x 64 of
/// `k`, 8 KB each, side by side. The leading offset is the stride between boxes (the
/// next 64 values of M or N, 8192 bytes); the stride offset between 8-row groups of `k`
/// (1024 bytes). A 16-deep `k`-step starts 2048 bytes further.
#[inline(always)]
pub fn descriptor_128b_mn(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | ((8192u64 >> 4) << 16) | ((1024u64 >> 4) << 32) | (1 << 62)
}

/// The same for 64-byte rows (16 floats) with the 64-byte swizzle: 512 bytes between
/// 8-row groups, swizzle mode 2.
#[inline(always)]
pub fn descriptor_64b(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | (1 << 16) | ((512u64 >> 4) << 32) | (2 << 62)
}

/// A warpgroup's f32 accumulators, as 32-bit words: 64 per thread (an `m64n128` tile)
/// or 128 (`m64n256`).
pub trait Accumulators {
    /// Waits for all of the warpgroup's `wgmma`s (the accumulators are operands, so
    /// nothing reads them before).
    ///
    /// # Safety
    /// Every thread of the warpgroup calls it.
    unsafe fn wait_all(&mut self);
}

impl Accumulators for [u32; 64] {
    #[inline(always)]
    unsafe fn wait_all(&mut self) {
        let acc = self;
        // (The accumulators are named in a PTX comment: operands of the statement.)
        unsafe { wgmma_asm!(64, acc; [concat!("wgmma.wait_group.sync.aligned 0; // ", accumulators!(64))];) }
    }
}

impl Accumulators for [u32; 128] {
    #[inline(always)]
    unsafe fn wait_all(&mut self) {
        let acc = self;
        unsafe { wgmma_asm!(128, acc; [concat!("wgmma.wait_group.sync.aligned 0; // ", accumulators!(128))];) }
    }
}

/// Waits for all of the warpgroup's `wgmma`s into `acc`.
///
/// # Safety
/// Every thread of the warpgroup calls it.
#[inline(always)]
pub unsafe fn wgmma_wait_all<A: Accumulators>(acc: &mut A) {
    // SAFETY: as the caller promises.
    unsafe { acc.wait_all() }
}

// ---- `m64n128` k-tiles (`gemm::wgmma`): 64 accumulators per thread.

/// One k-tile (4 `k`-steps of 8) of a warpgroup: `acc += A B^T` with both operands
/// from shared memory, issued and committed; returns with at most `INFLIGHT` groups
/// (this one) still running.
///
/// # Safety
/// Descriptors of complete tiles made visible to the async proxy; every thread of
/// the warpgroup calls it.
#[inline(always)]
pub unsafe fn wgmma_n128_k_tile<const INFLIGHT: u32>(acc: &mut [u32; 64], da: [u64; 4], db: [u64; 4]) {
    unsafe {
        wgmma_asm!(64, acc; [
            "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {a0}, {b0}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {a1}, {b1}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {a2}, {b2}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {a3}, {b3}, p, 1, 1;"),
            "wgmma.commit_group.sync.aligned;",
            "wgmma.wait_group.sync.aligned {inflight}; }}",
        ];
            one = in(reg32) 1u32, inflight = const INFLIGHT,
            a0 = in(reg64) da[0], a1 = in(reg64) da[1], a2 = in(reg64) da[2], a3 = in(reg64) da[3],
            b0 = in(reg64) db[0], b1 = in(reg64) db[1], b2 = in(reg64) db[2], b3 = in(reg64) db[3],
        )
    }
}

/// One k-tile with `A` from registers (the warp's `m16k8` fragments of the 4 steps)
/// and `B` from shared memory.
///
/// # Safety
/// As [`wgmma_n128_k_tile`].
#[inline(always)]
pub unsafe fn wgmma_n128_rs_k_tile<const INFLIGHT: u32>(acc: &mut [u32; 64], a: [[u32; 4]; 4], db: [u64; 4]) {
    unsafe {
        wgmma_asm!(64, acc; [
            "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h00}, {h01}, {h02}, {h03}}}, {b0}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h10}, {h11}, {h12}, {h13}}}, {b1}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h20}, {h21}, {h22}, {h23}}}, {b2}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h30}, {h31}, {h32}, {h33}}}, {b3}, p, 1, 1;"),
            "wgmma.commit_group.sync.aligned;",
            "wgmma.wait_group.sync.aligned {inflight}; }}",
        ];
            one = in(reg32) 1u32, inflight = const INFLIGHT,
            h00 = in(reg32) a[0][0], h01 = in(reg32) a[0][1], h02 = in(reg32) a[0][2], h03 = in(reg32) a[0][3],
            h10 = in(reg32) a[1][0], h11 = in(reg32) a[1][1], h12 = in(reg32) a[1][2], h13 = in(reg32) a[1][3],
            h20 = in(reg32) a[2][0], h21 = in(reg32) a[2][1], h22 = in(reg32) a[2][2], h23 = in(reg32) a[2][3],
            h30 = in(reg32) a[3][0], h31 = in(reg32) a[3][1], h32 = in(reg32) a[3][2], h33 = in(reg32) a[3][3],
            b0 = in(reg64) db[0], b1 = in(reg64) db[1], b2 = in(reg64) db[2], b3 = in(reg64) db[3],
        )
    }
}

/// One k-tile of the 3xTF32 split: per `k`-step, `A_lo B + A B_lo + A B` with `A`
/// (raw, and its residual) in registers and `B`, `B_lo` from shared memory.
///
/// # Safety
/// As [`wgmma_n128_k_tile`]; `a`, `a_lo` are the warp's `m16k8` fragments of the 4 steps.
#[inline(always)]
pub unsafe fn wgmma_n128_split_k_tile<const INFLIGHT: u32>(acc: &mut [u32; 64], a: [[u32; 4]; 4], a_lo: [[u32; 4]; 4], db: [u64; 4], db_lo: [u64; 4]) {
    unsafe {
        wgmma_asm!(64, acc; [
            "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{l00}, {l01}, {l02}, {l03}}}, {b0}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h00}, {h01}, {h02}, {h03}}}, {c0}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h00}, {h01}, {h02}, {h03}}}, {b0}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{l10}, {l11}, {l12}, {l13}}}, {b1}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h10}, {h11}, {h12}, {h13}}}, {c1}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h10}, {h11}, {h12}, {h13}}}, {b1}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{l20}, {l21}, {l22}, {l23}}}, {b2}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h20}, {h21}, {h22}, {h23}}}, {c2}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h20}, {h21}, {h22}, {h23}}}, {b2}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{l30}, {l31}, {l32}, {l33}}}, {b3}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h30}, {h31}, {h32}, {h33}}}, {c3}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 ", accumulators!(64), ", {{{h30}, {h31}, {h32}, {h33}}}, {b3}, p, 1, 1;"),
            "wgmma.commit_group.sync.aligned;",
            "wgmma.wait_group.sync.aligned {inflight}; }}",
        ];
            one = in(reg32) 1u32, inflight = const INFLIGHT,
            h00 = in(reg32) a[0][0], h01 = in(reg32) a[0][1], h02 = in(reg32) a[0][2], h03 = in(reg32) a[0][3],
            h10 = in(reg32) a[1][0], h11 = in(reg32) a[1][1], h12 = in(reg32) a[1][2], h13 = in(reg32) a[1][3],
            h20 = in(reg32) a[2][0], h21 = in(reg32) a[2][1], h22 = in(reg32) a[2][2], h23 = in(reg32) a[2][3],
            h30 = in(reg32) a[3][0], h31 = in(reg32) a[3][1], h32 = in(reg32) a[3][2], h33 = in(reg32) a[3][3],
            l00 = in(reg32) a_lo[0][0], l01 = in(reg32) a_lo[0][1], l02 = in(reg32) a_lo[0][2], l03 = in(reg32) a_lo[0][3],
            l10 = in(reg32) a_lo[1][0], l11 = in(reg32) a_lo[1][1], l12 = in(reg32) a_lo[1][2], l13 = in(reg32) a_lo[1][3],
            l20 = in(reg32) a_lo[2][0], l21 = in(reg32) a_lo[2][1], l22 = in(reg32) a_lo[2][2], l23 = in(reg32) a_lo[2][3],
            l30 = in(reg32) a_lo[3][0], l31 = in(reg32) a_lo[3][1], l32 = in(reg32) a_lo[3][2], l33 = in(reg32) a_lo[3][3],
            b0 = in(reg64) db[0], b1 = in(reg64) db[1], b2 = in(reg64) db[2], b3 = in(reg64) db[3],
            c0 = in(reg64) db_lo[0], c1 = in(reg64) db_lo[1], c2 = in(reg64) db_lo[2], c3 = in(reg64) db_lo[3],
        )
    }
}

// ---- `m64n256` k-tiles (`gemm::tma`): 128 accumulators per thread.

/// One 16-deep stage of the 3xTF32 split: per `k`-step `acc += A_lo B + A B_lo + A B` (the
/// small terms first), from the descriptors `[A, B, A_lo, B_lo]` of the k-tile's first
/// step (step `i` adds `2 i`: 32 bytes along the swizzled rows). Returns with this
/// group still running, the previous one finished.
///
/// # Safety
/// As [`wgmma_n256_k_tile`]; the residual tiles are complete and fenced.
#[inline(always)]
pub unsafe fn wgmma_n256_k_tile_split(acc: &mut [u32; 128], d: [u64; 4]) {
    macro_rules! step {
        ($i:literal) => {
            concat!(
                "add.s64 xa, {a}, ", $i, "; add.s64 xb, {b}, ", $i, "; add.s64 xl, {al}, ", $i, "; add.s64 xm, {bl}, ", $i, ";",
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", xl, xb, p, 1, 1;",
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", xa, xm, p, 1, 1;",
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", xa, xb, p, 1, 1;"
            )
        };
    }
    unsafe {
        wgmma_asm!(128, acc; [
            "{{ .reg .pred p; .reg .b64 xa, xb, xl, xm; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            step!(0),
            step!(2),
            "wgmma.commit_group.sync.aligned;",
            "wgmma.wait_group.sync.aligned 1; }}",
        ];
            one = in(reg32) 1u32,
            a = in(reg64) d[0], b = in(reg64) d[1], al = in(reg64) d[2], bl = in(reg64) d[3],
        )
    }
}

/// One k-tile of a warpgroup with `A` from registers (`a[i]`: step `i`'s fragment),
/// `B` from shared memory: issued and committed, not waited for.
///
/// # Safety
/// A complete `B` tile; every thread of the warpgroup calls it; nothing writes `a`'s
/// registers until the group is waited for (the caller waits before its next loads).
#[inline(always)]
pub unsafe fn wgmma_n256_rs_k_tile(acc: &mut [u32; 128], a: [[u32; 4]; 4], db: [u64; 4]) {
    unsafe {
        wgmma_asm!(128, acc; [
            "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a00}, {a01}, {a02}, {a03}}}, {b0}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a10}, {a11}, {a12}, {a13}}}, {b1}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a20}, {a21}, {a22}, {a23}}}, {b2}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a30}, {a31}, {a32}, {a33}}}, {b3}, p, 1, 1;"),
            "wgmma.commit_group.sync.aligned; }}",
        ];
            one = in(reg32) 1u32,
            a00 = in(reg32) a[0][0], a01 = in(reg32) a[0][1], a02 = in(reg32) a[0][2], a03 = in(reg32) a[0][3],
            a10 = in(reg32) a[1][0], a11 = in(reg32) a[1][1], a12 = in(reg32) a[1][2], a13 = in(reg32) a[1][3],
            a20 = in(reg32) a[2][0], a21 = in(reg32) a[2][1], a22 = in(reg32) a[2][2], a23 = in(reg32) a[2][3],
            a30 = in(reg32) a[3][0], a31 = in(reg32) a[3][1], a32 = in(reg32) a[3][2], a33 = in(reg32) a[3][3],
            b0 = in(reg64) db[0], b1 = in(reg64) db[1], b2 = in(reg64) db[2], b3 = in(reg64) db[3],
        )
    }
}

/// One 16-deep stage of the 3xTF32 split with `A` from registers: per `k`-step `i`,
/// `acc += A_lo B + A B_lo + A B` (`a[i]`, `a_lo[i]`; descriptors `db[i]`, `dbl[i]`):
/// issued and committed, not waited for.
///
/// # Safety
/// As [`wgmma_n256_rs_k_tile`]; the residual tile is complete and fenced.
#[inline(always)]
pub unsafe fn wgmma_n256_rs_split_k_tile(acc: &mut [u32; 128], a: [[u32; 4]; 2], a_lo: [[u32; 4]; 2], db: [u64; 2], dbl: [u64; 2]) {
    macro_rules! mma {
        ($a:literal, $b:literal) => {
            concat!(
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128),
                ", {{{", $a, "0}, {", $a, "1}, {", $a, "2}, {", $a, "3}}}, {", $b, "}, p, 1, 1;"
            )
        };
    }
    unsafe {
        wgmma_asm!(128, acc; [
            "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            mma!("l0", "b0"), mma!("h0", "c0"), mma!("h0", "b0"),
            mma!("l1", "b1"), mma!("h1", "c1"), mma!("h1", "b1"),
            "wgmma.commit_group.sync.aligned; }}",
        ];
            one = in(reg32) 1u32,
            h00 = in(reg32) a[0][0], h01 = in(reg32) a[0][1], h02 = in(reg32) a[0][2], h03 = in(reg32) a[0][3],
            h10 = in(reg32) a[1][0], h11 = in(reg32) a[1][1], h12 = in(reg32) a[1][2], h13 = in(reg32) a[1][3],
            l00 = in(reg32) a_lo[0][0], l01 = in(reg32) a_lo[0][1], l02 = in(reg32) a_lo[0][2], l03 = in(reg32) a_lo[0][3],
            l10 = in(reg32) a_lo[1][0], l11 = in(reg32) a_lo[1][1], l12 = in(reg32) a_lo[1][2], l13 = in(reg32) a_lo[1][3],
            b0 = in(reg64) db[0], b1 = in(reg64) db[1], c0 = in(reg64) dbl[0], c1 = in(reg64) dbl[1],
        )
    }
}

/// Declares a function running one k-tile (four `k`-steps, 32 bytes of each 128-byte
/// row apiece) of a warpgroup, `acc += A B^T` with both operands in shared memory, each
/// step `$mma acc, a, b, p, 1, 1$tail;`: issued, committed, and returned from with this
/// group still running (the previous one finished).
macro_rules! wgmma_n256_k_tile_fn {
    ($(#[$doc:meta])* $name:ident, $mma:literal, $tail:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// Descriptors of complete tiles written by the async proxy (TMA); every thread
        /// of the warpgroup calls it.
        #[inline(always)]
        pub unsafe fn $name(acc: &mut [u32; 128], da: [u64; 4], db: [u64; 4]) {
            unsafe {
                wgmma_asm!(128, acc; [
                    "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
                    "wgmma.fence.sync.aligned;",
                    concat!($mma, " ", accumulators!(128), ", {a0}, {b0}, p, 1, 1", $tail, ";"),
                    concat!($mma, " ", accumulators!(128), ", {a1}, {b1}, p, 1, 1", $tail, ";"),
                    concat!($mma, " ", accumulators!(128), ", {a2}, {b2}, p, 1, 1", $tail, ";"),
                    concat!($mma, " ", accumulators!(128), ", {a3}, {b3}, p, 1, 1", $tail, ";"),
                    "wgmma.commit_group.sync.aligned;",
                    "wgmma.wait_group.sync.aligned 1; }}",
                ];
                    one = in(reg32) 1u32,
                    a0 = in(reg64) da[0], a1 = in(reg64) da[1], a2 = in(reg64) da[2], a3 = in(reg64) da[3],
                    b0 = in(reg64) db[0], b1 = in(reg64) db[1], b2 = in(reg64) db[2], b3 = in(reg64) db[3],
                )
            }
        }
    };
}

wgmma_n256_k_tile_fn!(
    /// A 32-deep TF32 k-tile: four `m64n256k8` steps.
    wgmma_n256_k_tile, "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32", ""
);
wgmma_n256_k_tile_fn!(
    /// A 64-deep bf16 k-tile: four `m64n256k16` steps, both operands `k`-major (no
    /// transpose: the last two immediates).
    wgmma_n256_k_tile_bf16, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ", 0, 0"
);
wgmma_n256_k_tile_fn!(
    /// A 64-deep bf16 k-tile with `A` `k`-major and `B` N-major (`dX = dZ W` with `W`
    /// as stored): the last immediate transposes `B`.
    wgmma_n256_k_tile_bf16_nn, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ", 0, 1"
);
wgmma_n256_k_tile_fn!(
    /// A 64-deep bf16 k-tile with both operands MN-major (`dW = dZ^T X` with `dZ` and
    /// `X` as stored).
    wgmma_n256_k_tile_bf16_tn, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ", 1, 1"
);
wgmma_n256_k_tile_fn!(
    /// [`wgmma_n256_k_tile_bf16`] in fp16.
    wgmma_n256_k_tile_f16, "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", ", 0, 0"
);
wgmma_n256_k_tile_fn!(
    /// [`wgmma_n256_k_tile_bf16_nn`] in fp16.
    wgmma_n256_k_tile_f16_nn, "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", ", 0, 1"
);
wgmma_n256_k_tile_fn!(
    /// [`wgmma_n256_k_tile_bf16_tn`] in fp16.
    wgmma_n256_k_tile_f16_tn, "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", ", 1, 1"
);
wgmma_n256_k_tile_fn!(
    /// A 128-deep e4m3 k-tile: four `m64n256k32` steps over the same 128-byte rows as
    /// bf16's, both operands `k`-major (FP8 `wgmma` takes no transpose immediates).
    wgmma_n256_k_tile_e4m3, "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3", ""
);
