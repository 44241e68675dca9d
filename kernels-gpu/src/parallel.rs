//! Several GPUs: the row max of a tensor-parallel block, reduced across ranks as one
//! 64-bit word per row (`host::parallel::RowMaxKey` writes and reads the same words).
//! The word's unsigned order is the order the ranks' maxima combine in (larger value,
//! then lower rank; NaN above all), so one all-reduce `max` gives every rank the row's
//! maximum and the rank that holds it.

use crate::elementwise::global_index;

/// `keys[i]` = this rank's row maximum `local[i]` and its rank, ordered.
///
/// # Safety
/// `local` and `keys` hold `len` values; `rank < ranks`. Launch: 1-D over `len`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn row_max_keys(local: *const f32, keys: *mut u64, rank: u32, ranks: u32, len: u32) {
    let i = global_index();
    if i < len as usize {
        // SAFETY: i < len.
        let v = unsafe { *local.add(i) };
        let bits = if v.is_nan() { 0x7fc0_0000 } else { v.to_bits() };
        let ordered = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
        // SAFETY: i < len.
        unsafe { *keys.add(i) = ((ordered as u64) << 32) | (ranks - 1 - rank) as u64 };
    }
}

/// `y[i]` = the maximum a reduced key holds.
///
/// # Safety
/// `keys` and `y` hold `len` values. Launch: 1-D over `len`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn row_max_values(keys: *const u64, y: *mut f32, len: u32) {
    let i = global_index();
    if i < len as usize {
        // SAFETY: i < len.
        let ordered = unsafe { (*keys.add(i) >> 32) as u32 };
        let bits = if ordered >> 31 == 1 { ordered & 0x7fff_ffff } else { !ordered };
        // SAFETY: i < len.
        unsafe { *y.add(i) = f32::from_bits(bits) };
    }
}

/// `dy_rank[i]` = `dy[i]` where this rank holds row `i`'s maximum, else 0: the
/// gradient the rank's own backward routes to its local maximum.
///
/// # Safety
/// `keys`, `dy` and `dy_rank` hold `len` values. Launch: 1-D over `len`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn row_max_grad(
    keys: *const u64,
    dy: *const f32,
    dy_rank: *mut f32,
    rank: u32,
    ranks: u32,
    len: u32,
) {
    let i = global_index();
    if i < len as usize {
        // SAFETY: i < len.
        unsafe {
            let owner = ranks - 1 - (*keys.add(i) & 0xffff_ffff) as u32;
            *dy_rank.add(i) = if owner == rank { *dy.add(i) } else { 0.0 };
        }
    }
}
