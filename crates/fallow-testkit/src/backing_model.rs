//! The model every backing store is checked against, shared by the backing stores'
//! conformance suites (`conformance.rs` for the stores that need nothing outside the
//! process, `rados.rs` for the one that needs a Ceph cluster): random reads, writes, trims, zeroing and flushes,
//! run on a store and on a byte vector, whose reads must agree.

use bytes::Bytes;
use fallow_backing::{BackingStore, Durability, Zeroing};
use proptest::prelude::*;

/// The store size of the suites that need no particular geometry.
pub const SIZE: u64 = 64 * 1024;

/// One operation on a store.
#[derive(Debug, Clone)]
pub enum Op {
    /// Writes [`pattern`]`(fill, i)` at `offset + i`.
    Write {
        /// Where.
        offset: u64,
        /// How many bytes.
        len: u32,
        /// Which pattern.
        fill: u8,
        /// FUA or not.
        durability: Durability,
    },
    /// Reads the range and compares it with the model.
    Read {
        /// Where.
        offset: u64,
        /// How many bytes.
        len: u32,
    },
    /// Discards the range (the model keeps the bytes unless the store reads zeros after).
    Trim {
        /// Where.
        offset: u64,
        /// How many bytes.
        len: u32,
    },
    /// Makes the range read as zeros.
    Zero {
        /// Where.
        offset: u64,
        /// How many bytes.
        len: u32,
        /// Whether it may be deallocated.
        zeroing: Zeroing,
    },
    /// Makes every completed write durable.
    Flush,
}

/// The byte a write with `fill` puts at position `i` of its range. It varies along the
/// range, so a store that puts a piece of a write in the wrong place reads back wrong.
pub fn pattern(fill: u8, i: usize) -> u8 {
    fill ^ ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// Where the operations of a suite fall.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    /// The store's size.
    pub size: u64,
    /// The longest operation.
    pub max_len: u32,
    /// If not 0, half the ranges start near a multiple of this (an object boundary).
    pub boundary: u64,
}

impl Geometry {
    /// Ranges of up to 20,000 bytes anywhere in a [`SIZE`]-byte store.
    pub const SMALL: Geometry = Geometry { size: SIZE, max_len: 20_000, boundary: 0 };
}

/// A range within the store, at least one byte long. With a boundary, a third of the
/// ranges start on one or near one, and some are exactly one boundary long, so that the
/// whole-object paths of a store run as often as the partial ones.
pub fn range(g: Geometry) -> BoxedStrategy<(u64, u32)> {
    let size = g.size;
    let short = g.max_len.clamp(2, 20_000);
    // Mostly short requests, some as long as the geometry allows.
    let len = prop_oneof![3 => 1..short, 1 => 1..g.max_len.max(2)];
    let (start, len) = if g.boundary > 0 && g.boundary < size {
        let (boundary, reach) = (g.boundary as i64, i64::from(short));
        let delta = prop_oneof![Just(0i64), -reach..reach];
        let near_edge = (0..=size / g.boundary, delta).prop_map(move |(k, delta)| {
            (k as i64 * boundary + delta).clamp(0, size as i64 - 1) as u64
        });
        let whole = u32::try_from(g.boundary).unwrap_or(u32::MAX);
        (
            prop_oneof![2 => 0..size, 1 => near_edge].boxed(),
            prop_oneof![4 => len, 1 => Just(whole)].boxed(),
        )
    } else {
        ((0..size).boxed(), len.boxed())
    };
    (start, len)
        .prop_map(move |(offset, len)| (offset, (len as u64).min(size - offset) as u32))
        .boxed()
}

/// One operation: mostly reads and writes.
pub fn op(g: Geometry) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (range(g), any::<u8>(), any::<bool>()).prop_map(|((offset, len), fill, fua)| Op::Write {
            offset,
            len,
            fill,
            durability: if fua { Durability::Immediate } else { Durability::AtFlush },
        }),
        4 => range(g).prop_map(|(offset, len)| Op::Read { offset, len }),
        1 => range(g).prop_map(|(offset, len)| Op::Trim { offset, len }),
        1 => (range(g), any::<bool>()).prop_map(|((offset, len), may_trim)| Op::Zero {
            offset,
            len,
            zeroing: if may_trim { Zeroing::MayDeallocate } else { Zeroing::KeepAllocated },
        }),
        1 => Just(Op::Flush),
    ]
}

/// `op` with the range of a write, trim or zeroing widened to whole multiples of `align`
/// (within `size`), for stores that take only aligned changes; reads stay as they are.
pub fn aligned(op: Op, align: u64, size: u64) -> Op {
    let widen = |offset: u64, len: u32| {
        let start = offset / align * align;
        let end = (offset + u64::from(len)).div_ceil(align) * align;
        (start, (end.min(size) - start) as u32)
    };
    match op {
        Op::Write { offset, len, fill, durability } => {
            let (offset, len) = widen(offset, len);
            Op::Write { offset, len, fill, durability }
        }
        Op::Trim { offset, len } => {
            let (offset, len) = widen(offset, len);
            Op::Trim { offset, len }
        }
        Op::Zero { offset, len, zeroing } => {
            let (offset, len) = widen(offset, len);
            Op::Zero { offset, len, zeroing }
        }
        other => other,
    }
}

/// Runs `ops` against `store` and a model of `store.size()` bytes; trims are checked as
/// reading zeros or the old bytes (a trim is a hint), everything else exactly.
pub async fn check(store: &dyn BackingStore, ops: &[Op]) {
    let size = store.size() as usize;
    let mut model = vec![0u8; size];
    // Bytes whose content is uncertain after a trim that may keep data.
    let mut fuzzy = vec![false; size];
    for op in ops {
        match op.clone() {
            Op::Write { offset, len, fill, durability } => {
                let data: Vec<u8> = (0..len as usize).map(|i| pattern(fill, i)).collect();
                store.write(offset, Bytes::from(data.clone()), durability).await.unwrap();
                let r = offset as usize..offset as usize + len as usize;
                model[r.clone()].copy_from_slice(&data);
                fuzzy[r].fill(false);
            }
            Op::Read { offset, len } => {
                let got = store.read(offset, len).await.unwrap();
                assert_eq!(got.len(), len as usize);
                for (i, b) in got.iter().enumerate() {
                    let at = offset as usize + i;
                    if fuzzy[at] {
                        assert!(*b == 0 || *b == model[at], "byte {at} after trim");
                    } else if *b != model[at] {
                        panic!("byte {at} is {b}, not {}, after {ops:?}", model[at]);
                    }
                }
            }
            Op::Trim { offset, len } => {
                store.trim(offset, len).await.unwrap();
                // A trim is a hint, and even a store whose trims read as zeros punches
                // whole file-system blocks only: each byte reads as zero or as before.
                fuzzy[offset as usize..offset as usize + len as usize].fill(true);
            }
            Op::Zero { offset, len, zeroing } => {
                store.write_zeroes(offset, len, zeroing).await.unwrap();
                let r = offset as usize..offset as usize + len as usize;
                model[r.clone()].fill(0);
                fuzzy[r].fill(false);
            }
            Op::Flush => store.flush().await.unwrap(),
        }
    }
}
