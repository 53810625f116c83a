//! What the device offers: its feature bits, and its configuration space, the
//! `virtio_blk_config` structure the guest's driver reads (VIRTIO 1.2, 5.2.4), all
//! little-endian:
//!
//! ```text
//!  offset  0 le64 capacity (sectors)      24 u8 physical_block_exp, u8 alignment_offset,
//!          8 le32 size_max                   le16 min_io_size, le32 opt_io_size
//!         12 le32 seg_max                 32 u8 writeback   33 u8 unused
//!         16 le16 cylinders, u8 heads,    34 le16 num_queues
//!            u8 sectors (geometry)        36 le32 max_discard_sectors   40 le32 max_discard_seg
//!         20 le32 blk_size                44 le32 discard_sector_alignment
//!                                         48 le32 max_write_zeroes_sectors
//!                                         52 le32 max_write_zeroes_seg
//!                                         56 u8 write_zeroes_may_unmap, 3 bytes unused
//! ```

use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::request::{MAX_DATA, MAX_SEGMENTS, SECTOR};

/// Bytes of the configuration space this device fills.
const CONFIG_LEN: usize = 60;

/// Bytes of a physical block: a page.
const PHYSICAL: u32 = 4096;

/// Descriptors of one virtqueue.
pub const QUEUE_SIZE: u16 = 256;

/// Data descriptors one request may have: the queue, less the header and the status.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;

/// The device as the guest sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes of the disk.
    pub capacity: u64,
    /// Virtqueues offered.
    pub queues: u16,
    /// Writes are refused.
    pub read_only: bool,
    /// The store can discard (trim).
    pub discard: bool,
    /// The logical block size: 512, or 4096 for a store that takes only whole pages (a
    /// pool export), so that the guest never writes less.
    pub block_size: u32,
}

impl Geometry {
    /// The virtio feature bits the device offers.
    pub fn features(&self) -> u64 {
        let mut bits = [
            VIRTIO_BLK_F_SEG_MAX,
            VIRTIO_BLK_F_BLK_SIZE,
            VIRTIO_BLK_F_FLUSH,
            VIRTIO_BLK_F_TOPOLOGY,
            VIRTIO_BLK_F_MQ,
            VIRTIO_BLK_F_WRITE_ZEROES,
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_RING_F_INDIRECT_DESC,
        ]
        .iter()
        .fold(0u64, |acc, bit| acc | 1 << bit);
        if self.read_only {
            bits |= 1 << VIRTIO_BLK_F_RO;
        }
        if self.discard {
            bits |= 1 << VIRTIO_BLK_F_DISCARD;
        }
        bits | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    /// The configuration space, whole.
    pub fn config_space(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let mut put = |at: usize, bytes: &[u8]| {
            if let Some(field) = c.get_mut(at..at + bytes.len()) {
                field.copy_from_slice(bytes);
            }
        };
        let max_sectors = (MAX_DATA / SECTOR) as u32;
        put(0, &(self.capacity / SECTOR).to_le_bytes());
        put(12, &SEG_MAX.to_le_bytes());
        // Logical blocks of 512 bytes, as every disk's, unless the store needs whole pages;
        // physical ones of 4 KiB, the page the caches work in, which is also the smallest
        // I/O without a penalty.
        let logical = self.block_size.clamp(SECTOR as u32, PHYSICAL);
        let per_physical = PHYSICAL / logical;
        put(20, &logical.to_le_bytes());
        put(24, &[per_physical.trailing_zeros() as u8, 0]);
        put(26, &(per_physical as u16).to_le_bytes());
        put(34, &self.queues.to_le_bytes());
        put(36, &max_sectors.to_le_bytes());
        put(40, &MAX_SEGMENTS.to_le_bytes());
        put(44, &8u32.to_le_bytes()); // discard_sector_alignment: 4 KiB
        put(48, &max_sectors.to_le_bytes());
        put(52, &MAX_SEGMENTS.to_le_bytes());
        put(56, &[1]); // write_zeroes_may_unmap
        c
    }

    /// `size` bytes of the configuration space at `offset`, as a driver's read asks; zeros
    /// past its end.
    pub fn config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = self.config_space();
        let start = (offset as usize).min(CONFIG_LEN);
        let end = (offset as usize).saturating_add(size as usize).min(CONFIG_LEN);
        let mut out = space.get(start..end).unwrap_or_default().to_vec();
        out.resize(size as usize, 0);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_space_is_little_endian_at_the_spec_offsets() {
        let g = Geometry {
            capacity: 64 << 20,
            queues: 4,
            read_only: false,
            discard: true,
            block_size: 512,
        };
        let c = g.config_space();
        assert_eq!(&c[0..8], &(131072u64).to_le_bytes(), "capacity in sectors");
        assert_eq!(&c[12..16], &SEG_MAX.to_le_bytes());
        assert_eq!(&c[20..24], &512u32.to_le_bytes());
        assert_eq!(c[24], 3, "4 KiB physical blocks");
        assert_eq!(&c[34..36], &4u16.to_le_bytes());
        assert_eq!(c[56], 1);
        assert_eq!(g.config(34, 2), 4u16.to_le_bytes());
        assert_eq!(g.config(58, 8), vec![0; 8], "past the end reads zeros");
        assert_eq!(g.config(u32::MAX, 4), vec![0; 4]);
        let f = g.features();
        assert_ne!(f & 1 << VIRTIO_BLK_F_DISCARD, 0);
        assert_eq!(f & 1 << VIRTIO_BLK_F_RO, 0);
        let ro = Geometry { read_only: true, discard: false, ..g }.features();
        assert_ne!(ro & 1 << VIRTIO_BLK_F_RO, 0);
        // A store of whole pages: logical blocks of 4 KiB, one per physical block.
        let paged = Geometry { block_size: 4096, ..g }.config_space();
        assert_eq!(&paged[20..24], &4096u32.to_le_bytes());
        assert_eq!((paged[24], &paged[26..28]), (0, &1u16.to_le_bytes()[..]));
        assert_eq!(&paged[0..8], &c[0..8], "capacity still in 512-byte sectors");
        assert_eq!(ro & 1 << VIRTIO_BLK_F_DISCARD, 0);
    }
}
