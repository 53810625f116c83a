//! One export: a name, its cache layer over a backing store, and what it advertises.

use fallow_proto::nbd::*;

use fallow_cache::CacheLayer;

/// The largest READ or WRITE the server accepts (and advertises as its maximum block
/// size): 32 MiB, the protocol's customary default.
pub const MAX_PAYLOAD: u32 = DEFAULT_MAX_PAYLOAD;

/// An export served by the NBD server.
#[derive(Debug, Clone)]
pub struct Export {
    /// The name clients ask for (the first export is also the default, empty name).
    pub name: String,
    /// Text for humans (LIST, INFO).
    pub description: String,
    /// The cache over the backing store.
    pub cache: CacheLayer,
    /// Refuse writes even if the store takes them.
    pub read_only: bool,
}

impl Export {
    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.cache.size()
    }

    /// True when writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only || self.cache.backing().capabilities().read_only
    }

    /// The transmission flags: what the backing store can do, through the cache.
    pub fn transmission_flags(&self) -> u16 {
        let caps = self.cache.backing().capabilities();
        let mut flags = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_CACHE | NBD_FLAG_SEND_DF;
        if self.is_read_only() {
            flags |= NBD_FLAG_READ_ONLY;
        } else {
            flags |= NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA | NBD_FLAG_SEND_WRITE_ZEROES;
            if caps.trim {
                flags |= NBD_FLAG_SEND_TRIM;
            }
            if caps.fast_zero {
                flags |= NBD_FLAG_SEND_FAST_ZERO;
            }
        }
        // Every connection shares this export's one cache layer, which keeps the cached
        // copies coherent; the store must make writes visible across connections too.
        if caps.multi_conn {
            flags |= NBD_FLAG_CAN_MULTI_CONN;
        }
        flags
    }

    /// The block sizes: the backing store's minimum (1 for most: unaligned reads are split
    /// into head, pages and tail; an upstream NBD export may need aligned writes), 4 KiB or
    /// the store's preference, payloads up to [`MAX_PAYLOAD`].
    pub fn block_size(&self) -> BlockSize {
        let preferred = PREFERRED.max(self.cache.backing().preferred_block_size().min(1 << 20));
        BlockSize { min: self.min_block(), preferred, max: MAX_PAYLOAD }
    }

    /// The alignment writes, trims and zeroes must keep: the backing store's.
    pub fn min_block(&self) -> u32 {
        self.cache.backing().min_block_size().clamp(1, PREFERRED)
    }

    /// True when BLOCK_STATUS `base:allocation` can be answered.
    pub fn has_block_status(&self) -> bool {
        self.cache.backing().capabilities().block_status
    }
}

const PREFERRED: u32 = fallow_core::PAGE_SIZE as u32;
