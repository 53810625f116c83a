//! How a page is named: `(pool, object, index)`, as in Xen's transcendent memory.

use std::fmt;

/// A pool's handle, chosen by the store when the pool is created. Ids are never reused
/// while the store lives, so a key that outlives its pool can never reach a new pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PoolId(pub u32);

/// A 64-bit object id inside a pool: a file, a volume, a 4 MiB backing object.
pub type ObjectId = u64;

/// The page number inside an object.
pub type PageIndex = u64;

/// The full name of one page. Ordered by pool, then object, then index, so that all pages
/// of one object (or one pool) form a contiguous range in an ordered index.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageKey {
    /// The pool the page lives in.
    pub pool: PoolId,
    /// The object inside the pool.
    pub object: ObjectId,
    /// The page number inside the object.
    pub index: PageIndex,
}

impl PageKey {
    /// Names page `index` of `object` in `pool`.
    pub const fn new(pool: PoolId, object: ObjectId, index: PageIndex) -> Self {
        Self { pool, object, index }
    }
}

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{:#x}/{}", self.pool.0, self.object, self.index)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pool {}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_one_object_sort_together() {
        let p = PoolId(1);
        let mut keys =
            [PageKey::new(p, 2, 0), PageKey::new(p, 1, 9), PageKey::new(PoolId(0), 9, 9)];
        keys.sort();
        assert_eq!(keys[0].pool, PoolId(0));
        assert_eq!((keys[1].object, keys[1].index), (1, 9));
        assert_eq!((keys[2].object, keys[2].index), (2, 0));
    }
}
