//! virtio-blk requests and configuration, as the driver writes and reads them (VIRTIO 1.2,
//! 5.2). All little-endian.
//!
//! ```text
//!  request header (device-readable, 16 B)   segment of DISCARD / WRITE_ZEROES (16 B)
//!    0 le32 type   4 le32 reserved            0 le64 sector   8 le32 sectors   12 le32 flags
//!    8 le64 sector (512-byte units)
//!  then the data (IN: device-writable; OUT, segments: readable), then 1 status byte
//!  (device-writable): OK 0, IOERR 1, UNSUPP 2.
//! ```

use std::fmt;

/// Bytes of a sector: the unit of the header's `sector` and of the capacity.
pub const SECTOR: u64 = 512;

/// Bytes of a request header.
pub const HEADER_LEN: u32 = 16;

/// Bytes of one DISCARD or WRITE_ZEROES segment.
pub const SEGMENT_LEN: u32 = 16;

/// Bytes of a GET_ID answer.
pub const ID_LEN: u32 = 20;

/// The request types the driver sends (`type` in the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RequestType {
    /// VIRTIO_BLK_T_IN: read sectors.
    In = 0,
    /// VIRTIO_BLK_T_OUT: write sectors.
    Out = 1,
    /// VIRTIO_BLK_T_FLUSH: make completed writes durable.
    Flush = 4,
    /// VIRTIO_BLK_T_GET_ID: the device's id string.
    GetId = 8,
    /// VIRTIO_BLK_T_DISCARD: drop the segments' ranges.
    Discard = 11,
    /// VIRTIO_BLK_T_WRITE_ZEROES: make the segments' ranges read as zeros.
    WriteZeroes = 13,
}

impl From<RequestType> for u32 {
    fn from(t: RequestType) -> u32 {
        t as u32
    }
}

/// The request header for `type_` (any value: a hostile test sends unknown ones) at
/// `sector`.
pub fn header(type_: u32, sector: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    let (t, rest) = b.split_at_mut(4);
    t.copy_from_slice(&type_.to_le_bytes());
    let (_reserved, s) = rest.split_at_mut(4);
    s.copy_from_slice(&sector.to_le_bytes());
    b
}

/// A DISCARD or WRITE_ZEROES segment: `sectors` sectors from `sector`; `unmap` is
/// WRITE_ZEROES' flag that lets the device deallocate.
pub fn segment(sector: u64, sectors: u32, unmap: bool) -> [u8; 16] {
    let mut b = [0u8; 16];
    let (s, rest) = b.split_at_mut(8);
    s.copy_from_slice(&sector.to_le_bytes());
    let (n, flags) = rest.split_at_mut(4);
    n.copy_from_slice(&sectors.to_le_bytes());
    flags.copy_from_slice(&u32::from(unmap).to_le_bytes());
    b
}

/// The status byte a device wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// VIRTIO_BLK_S_OK.
    Ok,
    /// VIRTIO_BLK_S_IOERR.
    IoErr,
    /// VIRTIO_BLK_S_UNSUPP.
    Unsupp,
    /// Any other value (the driver presets the byte to [`Status::UNWRITTEN`], so a device
    /// that answers without writing it shows as `Other(0xff)`).
    Other(u8),
}

impl Status {
    /// The byte the driver writes before a request: no device status has this value.
    pub const UNWRITTEN: u8 = 0xff;

    /// Whether it is OK.
    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }
}

impl From<u8> for Status {
    fn from(b: u8) -> Status {
        match b {
            0 => Status::Ok,
            1 => Status::IoErr,
            2 => Status::Unsupp,
            other => Status::Other(other),
        }
    }
}

impl From<Status> for u8 {
    fn from(s: Status) -> u8 {
        match s {
            Status::Ok => 0,
            Status::IoErr => 1,
            Status::Unsupp => 2,
            Status::Other(b) => b,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Ok => f.write_str("OK"),
            Status::IoErr => f.write_str("IOERR"),
            Status::Unsupp => f.write_str("UNSUPP"),
            Status::Other(Status::UNWRITTEN) => f.write_str("no status written"),
            Status::Other(b) => write!(f, "status {b}"),
        }
    }
}

/// Feature bits of a virtio-blk device that the driver understands.
pub mod features {
    /// VIRTIO_BLK_F_SIZE_MAX: `size_max` is valid.
    pub const SIZE_MAX: u64 = 1 << 1;
    /// VIRTIO_BLK_F_SEG_MAX: `seg_max` is valid.
    pub const SEG_MAX: u64 = 1 << 2;
    /// VIRTIO_BLK_F_RO: the device is read-only.
    pub const RO: u64 = 1 << 5;
    /// VIRTIO_BLK_F_BLK_SIZE: `blk_size` is valid.
    pub const BLK_SIZE: u64 = 1 << 6;
    /// VIRTIO_BLK_F_FLUSH: FLUSH is served.
    pub const FLUSH: u64 = 1 << 9;
    /// VIRTIO_BLK_F_TOPOLOGY: the topology fields are valid.
    pub const TOPOLOGY: u64 = 1 << 10;
    /// VIRTIO_BLK_F_MQ: `num_queues` is valid.
    pub const MQ: u64 = 1 << 12;
    /// VIRTIO_BLK_F_DISCARD: DISCARD is served.
    pub const DISCARD: u64 = 1 << 13;
    /// VIRTIO_BLK_F_WRITE_ZEROES: WRITE_ZEROES is served.
    pub const WRITE_ZEROES: u64 = 1 << 14;
    /// VIRTIO_RING_F_INDIRECT_DESC: chains may continue in a descriptor table.
    pub const INDIRECT_DESC: u64 = 1 << 28;
    /// VIRTIO_RING_F_EVENT_IDX: notifications by event index.
    pub const EVENT_IDX: u64 = 1 << 29;
    /// VHOST_USER_F_PROTOCOL_FEATURES (vhost-user's own bit).
    pub const PROTOCOL_FEATURES: u64 = 1 << 30;
    /// VIRTIO_F_VERSION_1: a modern device.
    pub const VERSION_1: u64 = 1 << 32;

    /// Everything above: what the driver accepts when the device offers it (EVENT_IDX only
    /// when asked for).
    pub const UNDERSTOOD: u64 = SIZE_MAX
        | SEG_MAX
        | RO
        | BLK_SIZE
        | FLUSH
        | TOPOLOGY
        | MQ
        | DISCARD
        | WRITE_ZEROES
        | INDIRECT_DESC
        | PROTOCOL_FEATURES
        | VERSION_1;
}

/// Bytes of the configuration space the driver reads: up to and with
/// `write_zeroes_may_unmap` (and its padding), the part every device has had for years.
pub const CONFIG_LEN: u32 = 60;

/// The device configuration fields the driver uses (`struct virtio_blk_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlkConfig {
    /// Capacity in 512-byte sectors (offset 0).
    pub capacity: u64,
    /// The largest segment, if the device says (offset 8).
    pub size_max: u32,
    /// The most segments in a request (offset 12).
    pub seg_max: u32,
    /// The logical block size (offset 20), 512 if the device does not say.
    pub blk_size: u32,
    /// Queues the device has (offset 34), 1 if it does not say.
    pub num_queues: u16,
}

impl BlkConfig {
    /// The fields of the first [`CONFIG_LEN`] bytes of the configuration space, read as the
    /// negotiated `features` say (a field of a feature not offered is left at its
    /// default). `None` if `bytes` is shorter than that.
    pub fn parse(bytes: &[u8], features: u64) -> Option<BlkConfig> {
        let u32_at = |at: usize| -> Option<u32> {
            Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
        };
        let u16_at = |at: usize| -> Option<u16> {
            Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
        };
        let capacity = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
        bytes.get(..CONFIG_LEN as usize)?;
        let has = |f: u64| features & f != 0;
        Some(BlkConfig {
            capacity,
            size_max: if has(features::SIZE_MAX) { u32_at(8)? } else { 0 },
            seg_max: if has(features::SEG_MAX) { u32_at(12)? } else { 0 },
            blk_size: if has(features::BLK_SIZE) { u32_at(20)? } else { SECTOR as u32 },
            num_queues: if has(features::MQ) { u16_at(34)?.max(1) } else { 1 },
        })
    }

    /// The capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity.saturating_mul(SECTOR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_segments_are_little_endian() {
        assert_eq!(
            header(RequestType::Out.into(), 0x0102_0304_0506_0708),
            [1, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1]
        );
        assert_eq!(header(RequestType::GetId.into(), 0)[0], 8);
        assert_eq!(segment(9, 0x100, true), [9, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0]);
        assert_eq!(segment(9, 1, false)[12..], [0, 0, 0, 0]);
    }

    #[test]
    fn statuses_round_trip() {
        for b in 0..=255u8 {
            assert_eq!(u8::from(Status::from(b)), b);
        }
        assert!(Status::from(0).is_ok() && !Status::from(1).is_ok());
        assert_eq!(Status::from(Status::UNWRITTEN).to_string(), "no status written");
    }

    #[test]
    fn config_fields_follow_features() {
        let mut bytes = [0u8; 60];
        bytes[0..8].copy_from_slice(&2048u64.to_le_bytes());
        bytes[12..16].copy_from_slice(&126u32.to_le_bytes());
        bytes[20..24].copy_from_slice(&4096u32.to_le_bytes());
        bytes[34..36].copy_from_slice(&4u16.to_le_bytes());
        let all = BlkConfig::parse(&bytes, features::UNDERSTOOD).unwrap();
        assert_eq!((all.capacity, all.seg_max, all.blk_size, all.num_queues), (2048, 126, 4096, 4));
        assert_eq!(all.capacity_bytes(), 1 << 20);
        let none = BlkConfig::parse(&bytes, 0).unwrap();
        assert_eq!((none.seg_max, none.blk_size, none.num_queues), (0, 512, 1));
        assert_eq!(BlkConfig::parse(&bytes[..59], 0), None);
    }
}
