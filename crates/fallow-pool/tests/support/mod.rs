//! Page contents shared by the tests and the benches of this crate (the benches include this
//! file by path), so that both fill pools with the same kind of bytes.

// Each test or bench binary uses its own subset of these helpers.
#![allow(dead_code)]

use fallow_core::PAGE_SIZE;

/// Fills `out` with bytes unique to `seed` (xorshift words), never same-filled.
pub fn unique_page_into(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
}

/// A page of bytes unique to `seed`, never same-filled.
pub fn unique_page(seed: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    unique_page_into(seed, &mut p);
    p
}
