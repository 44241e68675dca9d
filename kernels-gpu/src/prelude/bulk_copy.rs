//! Hopper's tensor memory accelerator (TMA, `cp.async.bulk.tensor`) and the shared-memory
//! barriers (`mbarrier`) that tell a consumer its tile has landed — the pieces of a
//! warp-specialised pipeline, where one thread copies whole tiles and the other warps
//! only compute. (`cp.async`, the per-thread copies, is in `async_copy`.)
//!
//! Barriers and tiles are addressed by 32-bit `.shared` offsets
//! ([`super::async_copy::shared_address`]). A barrier is one 8-byte word: it completes
//! a *phase* when its expected arrivals (and, for TMA, its expected bytes) are in, and a
//! waiter names the phase by its parity.

use core::arch::asm;

/// Initialises the barrier at `bar` to expect `count` arrivals per phase.
///
/// # Safety
/// `bar` is an 8-byte aligned shared address no one uses yet; one thread initialises
/// it, then [`fence_barrier_init`] and a block barrier publish it.
#[inline(always)]
pub unsafe fn mbarrier_init(bar: u32, count: u32) {
    unsafe { asm!("mbarrier.init.shared::cta.b64 [{b}], {c};", b = in(reg32) bar, c = in(reg32) count, options(nostack)) }
}

/// Makes barrier initialisations visible to the other threads and to the TMA unit
/// (followed by a block barrier).
#[inline(always)]
pub fn fence_barrier_init() {
    // SAFETY: a fence.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) }
}

/// One arrival on `bar`.
///
/// # Safety
/// `bar` is an initialised barrier; the phase's arrivals are not exceeded.
#[inline(always)]
pub unsafe fn mbarrier_arrive(bar: u32) {
    unsafe {
        asm!("{{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [{b}]; }}", b = in(reg32) bar, options(nostack))
    }
}

/// One arrival on `bar` that also announces `bytes` more of asynchronous copies
/// (`complete_tx`) before the phase may complete: the producer's call before it
/// starts a stage's TMA copies.
///
/// # Safety
/// As [`mbarrier_arrive`].
#[inline(always)]
pub unsafe fn mbarrier_arrive_expect_tx(bar: u32, bytes: u32) {
    unsafe {
        asm!("{{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [{b}], {n}; }}",
             b = in(reg32) bar, n = in(reg32) bytes, options(nostack))
    }
}

/// Waits until the phase of `bar` with parity `parity` has completed. (A fresh
/// barrier counts the phase before its first, parity 1, as complete: producers
/// waiting for "stage free" start there.)
///
/// # Safety
/// `bar` is an initialised barrier.
#[inline(always)]
pub unsafe fn mbarrier_wait(bar: u32, parity: u32) {
    loop {
        let done: u32;
        unsafe {
            asm!("{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {q}; selp.u32 {d}, 1, 0, p; }}",
                 b = in(reg32) bar, q = in(reg32) parity, d = out(reg32) done, options(nostack));
        }
        if done != 0 {
            break;
        }
    }
}

/// Makes the tensor map at `map` (128 bytes of global memory), as the generic proxy wrote
/// it (the `store_words` kernel, earlier on the stream), the one this thread's later TMA
/// operations read: the TMA unit reads maps through the tensormap proxy and caches them,
/// and a map a kernel wrote — rather than a host copy — needs this acquire (PTX ISA 8.3;
/// without it a CUDA graph's replays, which reuse addresses for other maps, read stale
/// maps and the pipeline waits forever for bytes that never come).
///
/// # Safety
/// `map` points at a valid `CUtensorMap`.
#[inline(always)]
pub unsafe fn acquire_tensor_map(map: *const u8) {
    unsafe {
        asm!(
            "fence.proxy.tensormap::generic.acquire.gpu [{m}], 128;",
            m = in(reg64) map as u64,
            options(nostack, readonly)
        )
    }
}

/// Asks the TMA unit to fetch the tensor map at `map` (global memory) into its cache.
///
/// # Safety
/// `map` points at a valid `CUtensorMap`.
#[inline(always)]
pub unsafe fn prefetch_tensor_map(map: *const u8) {
    unsafe { asm!("prefetch.tensormap [{m}];", m = in(reg64) map as u64, options(nostack, readonly)) }
}

/// Starts a TMA copy of the box at element coordinates `(x, y)` (`x` the contiguous
/// dimension) of the 2-D tensor described by `map` into shared memory at `dst`; its
/// bytes count towards `bar`'s expected transaction. Elements outside the tensor
/// arrive as zeros (and still count).
///
/// # Safety
/// `map` is a valid tensor map in global memory whose box fits at `dst` (aligned as
/// its swizzle mode requires); `bar` expects the bytes.
#[inline(always)]
pub unsafe fn tma_load_2d(dst: u32, map: *const u8, x: u32, y: u32, bar: u32) {
    unsafe {
        asm!("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{m}, {{{x}, {y}}}], [{b}];",
             d = in(reg32) dst, m = in(reg64) map as u64, x = in(reg32) x, y = in(reg32) y, b = in(reg32) bar,
             options(nostack))
    }
}

// The bulk stores below are issued by one thread of a warpgroup, as predicated
// instructions (`issue`) rather than under a branch: a branch around them, inside the
// chain's epilogue loop, cost the chain spills.

/// Where `issue` holds, starts TMA stores of the two boxes at `src` and `src + next` (shared
/// memory, laid out as the map's swizzle says) to element coordinates `(x, y)` and
/// `(x + dx, y)` of the 2-D tensor described by `map`, and closes them as one bulk group
/// of this thread. Elements outside the tensor are not written.
///
/// # Safety
/// `map` is a valid tensor map in global memory (acquired by this thread); the boxes are
/// written and made visible to the async proxy ([`super::mma::fence_proxy_async_shared`])
/// and stay untouched until [`bulk_wait_group_read_if`] says they have been read.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tma_store_2d_pair_if(issue: bool, src: u32, next: u32, map: *const u8, x: u32, dx: u32, y: u32) {
    unsafe {
        asm!("{{ .reg .pred p; .reg .b32 s2, x2;",
             "setp.ne.u32 p, {i}, 0; add.u32 s2, {s}, {n}; add.u32 x2, {x}, {dx};",
             "@p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [{m}, {{{x}, {y}}}], [{s}];",
             "@p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [{m}, {{x2, {y}}}], [s2];",
             "@p cp.async.bulk.commit_group; }}",
             i = in(reg32) issue as u32, s = in(reg32) src, n = in(reg32) next, m = in(reg64) map as u64,
             x = in(reg32) x, dx = in(reg32) dx, y = in(reg32) y, options(nostack))
    }
}

/// Where `issue` holds, waits until no bulk group of this thread still reads its shared
/// memory (the global writes may still be under way): the boxes can be written again.
#[inline(always)]
pub fn bulk_wait_group_read_if(issue: bool) {
    // SAFETY: a wait.
    unsafe {
        asm!("{{ .reg .pred p; setp.ne.u32 p, {i}, 0; @p cp.async.bulk.wait_group.read 0; }}",
             i = in(reg32) issue as u32, options(nostack))
    }
}

/// Where `issue` holds, waits until every bulk group of this thread is complete (its
/// global writes done): before the block exits.
#[inline(always)]
pub fn bulk_wait_group_if(issue: bool) {
    // SAFETY: a wait.
    unsafe {
        asm!("{{ .reg .pred p; setp.ne.u32 p, {i}, 0; @p cp.async.bulk.wait_group 0; }}",
             i = in(reg32) issue as u32, options(nostack))
    }
}

/// `bar.sync id, threads`: a barrier for a subset of the block (named barrier `id`,
/// 1..15; 0 is `__syncthreads`), so consumer warps can meet without the producer.
///
/// # Safety
/// Exactly `threads` threads (a multiple of 32, whole warps) reach it.
#[inline(always)]
pub unsafe fn named_barrier(id: u32, threads: u32) {
    unsafe { asm!("bar.sync {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack)) }
}

/// `setmaxnreg`: moves this warpgroup's per-thread register allowance to `N` (a
/// multiple of 8 in 24..=256), `INC` raising it (waits until the registers are free),
/// else lowering it (returns them to the block's pool). A warp-specialised kernel's
/// producer gives registers to its consumers this way.
///
/// # Safety
/// Every thread of the warpgroup executes it; the block's total stays within the
/// register file.
#[inline(always)]
pub unsafe fn set_max_registers<const INC: bool, const N: u32>() {
    unsafe {
        if INC {
            asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack));
        } else {
            asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack));
        }
    }
}
