//! Every hash of a page key, and where a key lives, in one place: the key's hash (the
//! index and the eviction policy use it), the run of 128 page indexes a key falls in, the
//! hashes of a span and of an object (the span tables), and the shard a key belongs to.
//! Keeping them together keeps their constants apart on purpose: [`group_hash`], which
//! picks shards, differs from [`span_hash`], so that the spans one shard gets do not
//! share bits of their hashes.

use fallow_core::{ObjectId, PageKey, PoolId};

/// log2 of the pages of a run: a span covers one run of consecutive page indexes.
pub const RUN_BITS: u32 = 7;

/// The number of the run of `1 << RUN_BITS` indexes that page `index` falls in.
pub const fn run(index: u64) -> u64 {
    index >> RUN_BITS
}

/// splitmix64's finalizer: spreads a 64-bit value over all bits, for the shard's small
/// tables (spans, fill words), which use both a hash's high bits (tags) and its low bits
/// (buckets).
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A well-mixed hash of a key: it feeds the index and the policy.
pub(crate) fn key_hash(key: &PageKey) -> u64 {
    let mut b = [0u8; 20];
    b[..4].copy_from_slice(&key.pool.0.to_le_bytes());
    b[4..12].copy_from_slice(&key.object.to_le_bytes());
    b[12..].copy_from_slice(&key.index.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&b)
}

/// Which of `shards` (a power of two) holds `key`. By the run of 128 indexes it falls in
/// ([`run`]), not the key, so that a run's pages share one shard and one span, and
/// the span's 44 bytes are split between up to 128 pages instead of a few.
///
/// Each aligned group of `shards` consecutive runs of an object goes one run to a shard,
/// rotated by an offset hashed from the object and the group. With every run placed by
/// hash, a shard's share of a cache of dense objects varied √128 ≈ 11 times more than
/// with keys placed one by one, so full shards outgrew the tables sized for them while
/// others had room. Rotating within a group makes a large object's share exact, and the
/// hashed offset keeps runs that are a multiple of `shards` apart (a file system's
/// per-group metadata, say) on shards picked by hash, not all on one.
///
/// An object of fewer runs than shards covers only some of them: a 4 MiB object has 8
/// runs, half of 16 shards. With an offset hashed per object, which half is chance, and
/// a 1 GiB cache of such objects in 16 shards is resident for 33.6 B a page instead of
/// 30.8 B (RFC 0001, "Outcome"). So objects are taken in aligned
/// blocks of `shards` consecutive ids that share the hashed offset, and each adds its id
/// within the block with its bits reversed: ids 0 and 1 of a block start half the shards
/// apart, ids 0–3 a quarter apart, and so on. Any aligned pair of consecutive objects of
/// `shards / 2` runs covers every shard once, any four of `shards / 4` runs, down to
/// `shards` objects of one run. Objects whose ids are hashes land as they did.
pub(crate) fn shard_of(key: &PageKey, shards: usize) -> usize {
    debug_assert!(shards.is_power_of_two(), "{shards} shards");
    let bits = shards.trailing_zeros();
    let run = run(key.index);
    let offset = group_hash(key.pool, key.object >> bits, run >> bits) >> 32;
    // The id's low `bits` bits, reversed; none with one shard.
    let spread = key.object.reverse_bits().checked_shr(64 - bits).unwrap_or(0);
    (offset.wrapping_add(run).wrapping_add(spread) as usize) & (shards - 1)
}

/// A well-mixed hash of `(pool, object)`.
pub(crate) fn object_hash(pool: PoolId, object: ObjectId) -> u64 {
    mix64(object ^ u64::from(pool.0).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// A well-mixed hash of `(pool, object, group)` for a group of consecutive runs, which
/// picks shards ([`shard_of`]): apart from [`span_hash`], so that the spans a shard
/// gets are not those whose hashes share some bits.
pub(crate) fn group_hash(pool: PoolId, object: ObjectId, group: u64) -> u64 {
    mix64(object_hash(pool, object).rotate_left(29) ^ group.wrapping_mul(0xA076_1D64_78BD_642F))
}

/// A well-mixed hash of `(pool, object, run)`.
pub(crate) fn span_hash(pool: PoolId, object: ObjectId, run: u64) -> u64 {
    mix64(object_hash(pool, object) ^ run.wrapping_mul(0xD6E8_FEB8_6659_FD93))
}
