//! Recomputing the listed values of `z` in f64: `refine_values` one by one, `refine_z` by
//! chunks (in the order `refine_order` gives).

use super::*;

/// `z[row, c] = bias[c] + sum_k x[row, k] w[c, k]` in f64 (the products of two f32
/// are exact there), rounded once to f32, for the `count` (row, column) pairs that
/// [`kink_scan_tiles`] left in `values`.
///
/// # Safety
/// Device pointers: `x` `(rows, k)`, `w` `(n, k)`, `bias` `(n,)`, `z` `(rows, n)`;
/// `values` holds `*count` pairs inside `z`. Launch: any grid of `ROW_THREADS`-thread
/// blocks, no shared memory.
///
/// # Thread mapping
/// A warp per value, the grid's warps striding over the list: each lane takes every
/// 32nd 4 of `k`, with 4 16-byte loads each of `x` and `w` in flight, so that the
/// grid streams the listed weight rows at once (a row's values stand together in the
/// list, so the warps of a block mostly share `x`'s row, from L1).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn refine_values(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    z: *mut f32,
    values: *const u32,
    count: *const u32,
    n: u32,
    k: u32,
) {
    const UNROLL: usize = 4;
    let (n, k) = (n as usize, k as usize);
    let lane = lane_id() as usize;
    let warps = grid_dim_x() as usize * WARPS;
    let quads = k / 4;
    // SAFETY (whole body): pairs below *count are inside z (the scan's contract); reads
    // below k of the row of x and of the weight row (16-byte aligned when k is
    // divisible by 4: the allocations are, and rows are k floats).
    unsafe {
        let total = *count as usize;
        let mut v = block_idx_x() as usize * WARPS + warp_id() as usize;
        while v < total {
            let (row, c) = (*values.add(2 * v) as usize, *values.add(2 * v + 1) as usize);
            let (xr, wr) = (x.add(row * k), w.add(c * k));
            let mut acc = [0.0f64; 4];
            if k.is_multiple_of(4) {
                let mut q = lane;
                while q + WARP * (UNROLL - 1) < quads {
                    let mut xv = [[0.0f32; 4]; UNROLL];
                    let mut wv = [[0.0f32; 4]; UNROLL];
                    unroll!(u in 0..4 => {
                        xv[u] = load_v4_nc(xr.add(4 * (q + WARP * u)));
                        wv[u] = load_v4_nc(wr.add(4 * (q + WARP * u)));
                    });
                    unroll!(u in 0..4 => {
                        unroll!(e in 0..4 => { acc[e] += xv[u][e] as f64 * wv[u][e] as f64; });
                    });
                    q += WARP * UNROLL;
                }
                while q < quads {
                    let (xv, wv) = (load_v4_nc(xr.add(4 * q)), load_v4_nc(wr.add(4 * q)));
                    unroll!(e in 0..4 => { acc[e] += xv[e] as f64 * wv[e] as f64; });
                    q += WARP;
                }
            } else {
                let mut kk = lane;
                while kk < k {
                    acc[0] += *xr.add(kk) as f64 * *wr.add(kk) as f64;
                    kk += WARP;
                }
            }
            let s = warp_sum_f64((acc[0] + acc[1]) + (acc[2] + acc[3]));
            if lane == 0 {
                *z.add(row * n + c) = (*bias.add(c) as f64 + s) as f32;
            }
            v += warps;
        }
    }
}

/// The order in which [`refine_z`]'s blocks take the chunks: most listed rows first
/// (counts of `ORDER_BUCKETS - 1` or more together), so that the last blocks to start
/// are the shortest and the SMs finish together (longest-first list scheduling).
/// A counting sort in one block: a histogram of the counts, its prefix sums, a scatter.
///
/// # Safety
/// `counts` holds `chunks` entries, `order` room for as many. Launch: grid `(1, 1, 1)`,
/// `ROW_THREADS` threads, `ORDER_BUCKETS` u32 of dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn refine_order(counts: *const u32, chunks: u32, order: *mut u32) {
    let t = thread_idx_x() as usize;
    let chunks = chunks as usize;
    let bucket = |c: usize| ORDER_BUCKETS - 1 - (unsafe { *counts.add(c) } as usize).min(ORDER_BUCKETS - 1);
    // SAFETY (whole body): the dynamic shared memory holds ORDER_BUCKETS slots, indexed
    // below that; c < chunks; every position is written once (the slots' prefix sums
    // partition 0..chunks); the barriers are reached by the whole block.
    unsafe {
        let slots = dynamic_shared::<u32>();
        let mut b = t;
        while b < ORDER_BUCKETS {
            *slots.add(b) = 0;
            b += ROW_THREADS;
        }
        sync_threads();
        let mut c = t;
        while c < chunks {
            atomic_add_shared(slots.add(bucket(c)), 1);
            c += ROW_THREADS;
        }
        sync_threads();
        if t == 0 {
            let mut sum = 0;
            for b in 0..ORDER_BUCKETS {
                let h = *slots.add(b);
                *slots.add(b) = sum;
                sum += h;
            }
        }
        sync_threads();
        let mut c = t;
        while c < chunks {
            let at = atomic_add_shared(slots.add(bucket(c)), 1);
            *order.add(at as usize) = c as u32;
            c += ROW_THREADS;
        }
    }
}

/// `z[row, c] = bias[c] + sum_k x[row, k] w[c, k]` in f64, rounded once to f32, for the
/// rows and chunks [`kink_scan`] listed.
///
/// # Safety
/// Device pointers: `x` `(rows, k)`, `w` `(n, k)`, `bias` `(n,)`, `z` `(rows, n)`,
/// `counts` and `lists` as `kink_scan` wrote them, `order` as [`refine_order`] wrote
/// it (block `b` takes chunk `order[b]`) or null (block `b` takes chunk `b`). Launch:
/// grid `(n.div_ceil(CHUNK), 1, 1)`, `REFINE_THREADS` threads, `REFINE_SMEM_BYTES`.
///
/// # Thread mapping
/// One block per chunk of `CHUNK` columns, the most listed first (a fifth faster on
/// M3 than in column order: the SMs were idle 30% of the time at the grid's end), its
/// listed rows `REFINE_ROWS` at a time.
/// The products run on the f64 tensor cores (`mma.m16n8k16.f64`, Hopper's full-rate
/// shape: 12% faster here than `m8n8k4`; the products of two f32 are exact in f64)
/// with the chunk's 16 weight rows as `A` and four 8-row tiles of `x` as `B`, every
/// warp a 16-deep slice of `k` in turn, so the block's warps split `k` and add their
/// sums in shared memory at the end. Each lane loads 4 consecutive `k` of its weight
/// rows and `x` rows (one 16-byte `cp.async` each) and feeds them as the `k` slots
/// `4e + q` of both operands: the sum's order within a slice is the same permutation
/// for `x` and `w`. Rows past the batch are zero-filled, not loaded. The weights are
/// read once and marked first to leave L2, the rows of `x` (read again by other
/// chunks) last. No barrier in the loop.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn refine_z(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    z: *mut f32,
    counts: *const u32,
    lists: *const u32,
    order: *const u32,
    rows: u32,
    n: u32,
    k: u32,
) {
    const WARPS_R: usize = REFINE_THREADS / WARP;
    const TILES: usize = REFINE_ROWS / 8;
    const _: () = assert!(TILES == 4, "the unrolled loops below");
    // SAFETY: order, unless null, holds gridDim.x chunk indices (refine_order).
    let chunk = if order.is_null() {
        block_idx_x() as usize
    } else {
        unsafe { *order.add(block_idx_x() as usize) as usize }
    };
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let (g, q) = (lane / 4, lane % 4);
    let (rows, n, k) = (rows as usize, n as usize, k as usize);
    let vec = k.is_multiple_of(4);
    let c0 = chunk * CHUNK;
    let cols = CHUNK.min(n - c0);
    // SAFETY (whole body): REFINE_SMEM_BYTES holds every warp's ring, which after the
    // loop holds its REFINE_ROWS x CHUNK partial sums; the list holds counts[chunk]
    // rows < rows; rows and columns are clamped to live ones before any load (dead
    // ones copy 0 bytes); the barriers are reached by the whole block.
    unsafe {
        let ring_bytes = REFINE_STAGES * REFINE_LOADS * WARP * 16;
        let ring = shared_address(dynamic_shared::<u8>()) + (warp * ring_bytes) as u32;
        let count = *counts.add(chunk) as usize;
        let list = lists.add(chunk * rows);
        let mut first = 0;
        while first < count {
            let batch = REFINE_ROWS.min(count - first);
            let tiles = batch.div_ceil(8);
            let mut x_row = [x; TILES];
            let mut x_live = [false; TILES];
            unroll!(m in 0..4 => {
                let r = m * 8 + g;
                x_live[m] = r < batch;
                x_row[m] = x.add(*list.add(first + r.min(batch - 1)) as usize * k);
            });
            let mut w_row = [w; 2];
            let mut w_live = [false; 2];
            unroll!(h in 0..2 => {
                w_live[h] = h * 8 + g < cols;
                w_row[h] = w.add((c0 + (h * 8 + g).min(cols - 1)) * k);
            });
            // acc[m]: weight rows g, g + 8 (d[0..2], d[2..4]) by x rows 8m + 2q, + 1.
            let mut acc = [[0.0f64; 4]; TILES];
            // Each lane copies its own 16 bytes of every row of a slice (`cp.async`,
            // zero past `k` and for dead rows) into its warp's ring of `REFINE_STAGES`
            // slots, `REFINE_STAGES - 1` slices ahead of the MMAs, and reads back only
            // what it copied itself (so its own wait suffices, no barrier).
            let step = 16 * WARPS_R;
            let (x_policy, w_policy) = (l2_policy(false), l2_policy(true));
            let slot_of = |i: usize, p: usize| ring + ((((i % REFINE_STAGES) * REFINE_LOADS + p) * WARP + lane) * 16) as u32;
            let issue = |i: usize| {
                let kk = warp * 16 + i * step + 4 * q;
                let copy = |dst: u32, src: *const f32, live: bool, is_w: bool| {
                    if vec {
                        let bytes = if live && kk < k { (4 * (k - kk)).min(16) as u32 } else { 0 };
                        let src = if bytes > 0 { src.add(kk) } else { src };
                        cp_async_16_hint(dst, src, bytes, if is_w { w_policy } else { x_policy });
                    } else {
                        unroll!(e in 0..4 => {
                            let inside = live && kk + e < k;
                            cp_async_4(dst + 4 * e as u32, if inside { src.add(kk + e) } else { src }, 4 * u32::from(inside));
                        });
                    }
                };
                unroll!(m in 0..4 => {
                    if m < tiles {
                        copy(slot_of(i, m), x_row[m], x_live[m], false);
                    }
                });
                unroll!(h in 0..2 => { copy(slot_of(i, TILES + h), w_row[h], w_live[h], true); });
                cp_async_commit();
            };
            let steps = (k - (warp * 16).min(k)).div_ceil(step);
            for i in 0..REFINE_STAGES - 1 {
                issue(i);
            }
            for i in 0..steps {
                issue(i + REFINE_STAGES - 1);
                cp_async_wait::<{ REFINE_STAGES as u32 - 1 }>();
                let (w_lo, w_hi) = (ld_shared_v4(slot_of(i, TILES)), ld_shared_v4(slot_of(i, TILES + 1)));
                let mut a = [0.0f64; 8];
                unroll!(e in 0..4 => {
                    a[2 * e] = f32::from_bits(w_lo[e]) as f64;
                    a[2 * e + 1] = f32::from_bits(w_hi[e]) as f64;
                });
                unroll!(m in 0..4 => {
                    if m < tiles {
                        let b = ld_shared_v4(slot_of(i, m)).map(|v| f32::from_bits(v) as f64);
                        mma_f64_m16n8k16(&mut acc[m], a, b);
                    }
                });
            }
            cp_async_wait_all();
            // The warp's ring, drained, takes its partial sums (every lane past its
            // last read of the ring first).
            sync_warp();
            let red = dynamic_shared::<u8>().add(warp * ring_bytes) as *mut f64;
            unroll!(m in 0..4 => {
                unroll!(j in 0..4 => {
                    let (col, row) = (g + 8 * (j / 2), 8 * m + 2 * q + j % 2);
                    *red.add(row * CHUNK + col) = acc[m][j];
                });
            });
            sync_threads();
            let mut o = t;
            while o < REFINE_ROWS * CHUNK {
                let (r, d) = (o / CHUNK, o % CHUNK);
                if r < batch && d < cols {
                    let mut s = *bias.add(c0 + d) as f64;
                    for wi in 0..WARPS_R {
                        s += *(dynamic_shared::<u8>().add(wi * ring_bytes) as *const f64).add(o);
                    }
                    *z.add(*list.add(first + r) as usize * n + c0 + d) = s as f32;
                }
                o += REFINE_THREADS;
            }
            sync_threads();
            first += REFINE_ROWS;
        }
    }
}

