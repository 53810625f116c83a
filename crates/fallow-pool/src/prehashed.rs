//! A `HashMap` hasher for keys that already are well-mixed hashes (content hashes, key
//! hashes): hashing them again with the std default (SipHash) would only cost time.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Passes the key's own bits through as its hash.
#[derive(Default)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(w);
        }
    }

    fn write_u32(&mut self, v: u32) {
        // Spread a 32-bit fingerprint over the high bits too: hashbrown takes its control
        // byte from the top 7 bits.
        self.0 ^= u64::from(v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }

    fn write_u128(&mut self, v: u128) {
        self.0 ^= v as u64;
    }
}

/// A `HashMap` whose keys are already hashes.
pub type PrehashedMap<K, V> = HashMap<K, V, BuildHasherDefault<PassThrough>>;
