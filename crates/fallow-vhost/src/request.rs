//! One virtio-blk request, read from a descriptor chain and checked before anything runs.
//!
//! A request is a chain of descriptors: a 16-byte header the device reads, then the data
//! (device-writable for a read, device-readable for a write and for the segments of a
//! discard or a zeroing), and last a status byte the device writes (VIRTIO 1.2, 5.2.6):
//!
//! ```text
//!  header (readable, 16 B)       data (0..n descriptors)            status (writable, 1 B)
//!  ├ le32 type                   IN: writable, whole sectors        └ u8 OK | IOERR | UNSUPP
//!  ├ le32 reserved (ioprio)      OUT: readable, whole sectors
//!  └ le64 sector                 DISCARD, WRITE_ZEROES: readable, 16-byte segments
//!                                GET_ID: writable, up to 20 bytes
//! ```
//!
//! The guest writes the chain, so everything in it is untrusted: a header that is too short
//! or not readable, data of the wrong direction, a range past the end of the disk, a
//! segment list that is not whole segments, an address outside the guest's memory table.
//! Each becomes an error status for that request and a log line; [`parse`] reads nothing
//! but the descriptors and the header, and never panics.

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

/// Bytes of a sector, the unit of the header's `sector` and of every length.
pub const SECTOR: u64 = 512;

/// Bytes of the request header.
const HEADER_LEN: u32 = 16;

/// Bytes of one discard or write-zeroes segment: le64 sector, le32 sectors, le32 flags.
pub const SEGMENT_LEN: u32 = 16;

/// The segment flag of WRITE_ZEROES that allows deallocating the range.
pub const SEGMENT_UNMAP: u32 = 1;

/// The longest data of one request: 32 MiB, as the NBD export's largest payload. Requests
/// are split by the guest's kernel long before that (`seg_max` descriptors of a page).
pub const MAX_DATA: u64 = 32 << 20;

/// Segments one discard or write-zeroes request may name (the configuration space's
/// `max_discard_seg` and `max_write_zeroes_seg`).
pub const MAX_SEGMENTS: u32 = 32;

/// The request types this device serves (VIRTIO 1.2, 5.2.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// VIRTIO_BLK_T_IN: read sectors into the data buffers.
    In,
    /// VIRTIO_BLK_T_OUT: write the data buffers' sectors.
    Out,
    /// VIRTIO_BLK_T_FLUSH: make completed writes durable.
    Flush,
    /// VIRTIO_BLK_T_GET_ID: the device's id string.
    GetId,
    /// VIRTIO_BLK_T_DISCARD: discard the segments' ranges.
    Discard,
    /// VIRTIO_BLK_T_WRITE_ZEROES: make the segments' ranges read as zeros.
    WriteZeroes,
}

impl Kind {
    /// The kind of header type `t`, or `None` for one this device does not serve.
    fn of(t: u32) -> Option<Kind> {
        use virtio_bindings::virtio_blk::*;
        Some(match t {
            VIRTIO_BLK_T_IN => Kind::In,
            VIRTIO_BLK_T_OUT => Kind::Out,
            VIRTIO_BLK_T_FLUSH => Kind::Flush,
            VIRTIO_BLK_T_GET_ID => Kind::GetId,
            VIRTIO_BLK_T_DISCARD => Kind::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => Kind::WriteZeroes,
            _ => return None,
        })
    }

    /// Its name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Kind::In => "read",
            Kind::Out => "write",
            Kind::Flush => "flush",
            Kind::GetId => "get_id",
            Kind::Discard => "discard",
            Kind::WriteZeroes => "write_zeroes",
        }
    }
}

/// The status byte a request ends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// VIRTIO_BLK_S_OK.
    Ok,
    /// VIRTIO_BLK_S_IOERR: the request failed, or was malformed.
    IoErr,
    /// VIRTIO_BLK_S_UNSUPP: a request type this device does not serve.
    Unsupp,
}

impl From<Status> for u8 {
    fn from(status: Status) -> u8 {
        use virtio_bindings::virtio_blk::*;
        (match status {
            Status::Ok => VIRTIO_BLK_S_OK,
            Status::IoErr => VIRTIO_BLK_S_IOERR,
            Status::Unsupp => VIRTIO_BLK_S_UNSUPP,
        }) as u8
    }
}

/// A piece of guest memory the request reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    /// Where it starts in the guest's physical address space.
    pub addr: GuestAddress,
    /// Its length in bytes.
    pub len: u32,
}

/// One discard or write-zeroes range, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Byte offset on the disk.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// WRITE_ZEROES may deallocate the range.
    pub unmap: bool,
}

/// A request that passed [`parse`]: its kind, where on the disk, its data buffers and
/// where its status goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub kind: Kind,
    /// The byte offset on the disk (IN and OUT).
    pub offset: u64,
    /// The data buffers, in order.
    pub data: Vec<Buffer>,
    /// Their total length.
    pub data_len: u64,
    /// The ranges of a discard or a zeroing.
    pub segments: Vec<Segment>,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No status descriptor can be found: the chain is returned with nothing written.
    #[error("no writable status byte at the end of the chain")]
    NoStatus,
    /// Answered with IOERR (the status byte is at `status`).
    #[error("{why}")]
    IoErr {
        /// Where the status byte goes.
        status: GuestAddress,
        /// What was wrong.
        why: String,
    },
    /// Answered with UNSUPP.
    #[error("request type {kind} is not supported")]
    Unsupported {
        /// Where the status byte goes.
        status: GuestAddress,
        /// The header's type.
        kind: u32,
    },
}

impl Refusal {
    /// The status byte to write and where, if any.
    pub fn status(&self) -> Option<(GuestAddress, Status)> {
        match self {
            Refusal::NoStatus => None,
            Refusal::IoErr { status, .. } => Some((*status, Status::IoErr)),
            Refusal::Unsupported { status, .. } => Some((*status, Status::Unsupp)),
        }
    }
}

/// One descriptor as the chain gives it: address, length, device-writable.
pub type Descriptor = (GuestAddress, u32, bool);

/// Checks a chain's descriptors (`descriptors`, in order) against the device: `capacity`
/// bytes, writable unless `read_only`. Reads the header (and a discard's or a zeroing's
/// segments) from `mem`.
pub fn parse<M: GuestMemory>(
    mem: &M,
    descriptors: &[Descriptor],
    capacity: u64,
    read_only: bool,
) -> Result<Request, Refusal> {
    let Some((&(last, last_len, last_writable), rest)) = descriptors.split_last() else {
        return Err(Refusal::NoStatus);
    };
    // The status is the request's last byte: the last byte of the last descriptor, which
    // must be one the device may write.
    let status = match last_len.checked_sub(1) {
        Some(at) if last_writable => last.checked_add(u64::from(at)).ok_or(Refusal::NoStatus)?,
        _ => return Err(Refusal::NoStatus),
    };
    let io_err = |why: String| Refusal::IoErr { status, why };
    let Some((&(header_addr, header_len, header_writable), data)) = rest.split_first() else {
        return Err(io_err("no header descriptor".into()));
    };
    if header_len < HEADER_LEN || header_writable {
        return Err(io_err(format!("a header of {header_len} bytes, or one the device may write")));
    }
    let mut header = [0u8; HEADER_LEN as usize];
    mem.read_slice(&mut header, header_addr)
        .map_err(|e| io_err(format!("header at {:#x}: {e}", header_addr.0)))?;
    let (t, sector) = header_fields(&header);
    let Some(kind) = Kind::of(t) else {
        return Err(Refusal::Unsupported { status, kind: t });
    };
    let writes_device = matches!(kind, Kind::Out | Kind::Discard | Kind::WriteZeroes);
    if writes_device && read_only {
        return Err(io_err(format!("{} on a read-only disk", kind.name())));
    }
    // The device writes the data of IN and GET_ID, and reads the rest.
    let device_writes_data = matches!(kind, Kind::In | Kind::GetId);
    let mut buffers = Vec::with_capacity(data.len());
    let mut data_len = 0u64;
    for &(addr, len, writable) in data {
        if writable != device_writes_data {
            return Err(io_err(format!(
                "a data descriptor of the wrong direction for {}",
                kind.name()
            )));
        }
        data_len += u64::from(len);
        buffers.push(Buffer { addr, len });
    }
    if data_len > MAX_DATA {
        return Err(io_err(format!("{data_len} bytes of data, over the {MAX_DATA}-byte limit")));
    }
    let mut request =
        Request { kind, offset: 0, data: buffers, data_len, segments: Vec::new(), status };
    match kind {
        Kind::In | Kind::Out => {
            if !data_len.is_multiple_of(SECTOR) {
                return Err(io_err(format!("{data_len} bytes is not whole sectors")));
            }
            request.offset = sector
                .checked_mul(SECTOR)
                .filter(|o| o.checked_add(data_len).is_some_and(|end| end <= capacity))
                .ok_or_else(|| {
                    io_err(format!("sector {sector} + {data_len} bytes is past the end"))
                })?;
        }
        Kind::Discard | Kind::WriteZeroes => {
            request.segments = segments(mem, &request.data, capacity).map_err(io_err)?;
        }
        Kind::Flush | Kind::GetId => {}
    }
    Ok(request)
}

/// The header's type and sector (little-endian, VIRTIO 1.2, 5.2.6).
fn header_fields(header: &[u8; HEADER_LEN as usize]) -> (u32, u64) {
    let (t, rest) = header.split_at(4);
    let (_ioprio, sector) = rest.split_at(4);
    let t = u32::from_le_bytes(t.try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(sector.try_into().unwrap_or_default());
    (t, sector)
}

/// The segments a discard or a zeroing names, each checked to lie on the disk.
fn segments<M: GuestMemory>(
    mem: &M,
    data: &[Buffer],
    capacity: u64,
) -> Result<Vec<Segment>, String> {
    let total: u64 = data.iter().map(|b| u64::from(b.len)).sum();
    if total > u64::from(MAX_SEGMENTS * SEGMENT_LEN) {
        return Err(format!("{total} bytes of segments, over the {MAX_SEGMENTS} segments offered"));
    }
    let mut bytes = Vec::new();
    for buffer in data {
        let start = bytes.len();
        bytes.resize(start + buffer.len as usize, 0);
        let into = bytes.get_mut(start..).unwrap_or_default();
        mem.read_slice(into, buffer.addr)
            .map_err(|e| format!("segments at {:#x}: {e}", buffer.addr.0))?;
    }
    if bytes.is_empty() || bytes.len() % SEGMENT_LEN as usize != 0 {
        return Err(format!("{} bytes of segments is not whole 16-byte segments", bytes.len()));
    }
    let mut out = Vec::with_capacity(bytes.len() / SEGMENT_LEN as usize);
    for raw in bytes.chunks_exact(SEGMENT_LEN as usize) {
        let (sector, rest) = raw.split_at(8);
        let (sectors, flags) = rest.split_at(4);
        let sector = u64::from_le_bytes(sector.try_into().unwrap_or_default());
        let sectors = u32::from_le_bytes(sectors.try_into().unwrap_or_default());
        let flags = u32::from_le_bytes(flags.try_into().unwrap_or_default());
        let len = u64::from(sectors) * SECTOR;
        if len > MAX_DATA {
            return Err(format!("a segment of {sectors} sectors, over the {MAX_DATA}-byte limit"));
        }
        let offset = sector
            .checked_mul(SECTOR)
            .filter(|o| o.checked_add(len).is_some_and(|end| end <= capacity))
            .ok_or_else(|| {
                format!("segment at sector {sector} of {sectors} sectors is past the end")
            })?;
        if flags & !SEGMENT_UNMAP != 0 {
            return Err(format!("segment flags {flags:#x}"));
        }
        out.push(Segment { offset, len, unmap: flags & SEGMENT_UNMAP != 0 });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    const MIB: u64 = 1 << 20;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MIB as usize)]).unwrap()
    }

    fn header(mem: &GuestMemoryMmap, at: u64, t: u32, sector: u64) -> Descriptor {
        let mut h = Vec::new();
        h.extend_from_slice(&t.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
        (GuestAddress(at), 16, false)
    }

    const STATUS: Descriptor = (GuestAddress(0x1000), 1, true);

    #[test]
    fn a_read_is_its_sectors_and_buffers() {
        let mem = memory();
        let chain = [
            header(&mem, 0, 0, 8),
            (GuestAddress(0x2000), 4096, true),
            (GuestAddress(0x3000), 512, true),
            STATUS,
        ];
        let r = parse(&mem, &chain, 1 << 30, false).unwrap();
        assert_eq!((r.kind, r.offset, r.data_len, r.data.len()), (Kind::In, 4096, 4608, 2));
        assert_eq!(r.status, GuestAddress(0x1000));
        // A status descriptor longer than a byte: the status is its last byte.
        let long_status = [header(&mem, 0, 0, 8), (GuestAddress(0x1000), 8, true)];
        assert_eq!(parse(&mem, &long_status, 1 << 30, false).unwrap().status, GuestAddress(0x1007));
    }

    #[test]
    fn malformed_chains_are_refused_with_the_right_status() {
        let mem = memory();
        let cap = 1 << 20;
        // No writable status byte: nothing can be answered.
        assert_eq!(parse(&mem, &[], cap, false), Err(Refusal::NoStatus));
        let no_status = [header(&mem, 0, 0, 0), (GuestAddress(0x1000), 1, false)];
        assert_eq!(parse(&mem, &no_status, cap, false), Err(Refusal::NoStatus));
        let io_err = |r: Result<Request, Refusal>| matches!(r, Err(Refusal::IoErr { status, .. }) if status == STATUS.0);
        // A short header, a writable one, none at all.
        assert!(io_err(parse(&mem, &[(GuestAddress(0), 8, false), STATUS], cap, false)));
        assert!(io_err(parse(&mem, &[(GuestAddress(0), 16, true), STATUS], cap, false)));
        assert!(io_err(parse(&mem, &[STATUS], cap, false)));
        // A read into a buffer the device may not write; a write from one it may only write.
        let read_ro = [header(&mem, 0, 0, 0), (GuestAddress(0x2000), 512, false), STATUS];
        assert!(io_err(parse(&mem, &read_ro, cap, false)));
        let write_wo = [header(&mem, 0, 1, 0), (GuestAddress(0x2000), 512, true), STATUS];
        assert!(io_err(parse(&mem, &write_wo, cap, false)));
        // Past the end, by a little or by an overflowing sector; not whole sectors.
        let past = [header(&mem, 0, 0, 2047), (GuestAddress(0x2000), 1024, true), STATUS];
        assert!(io_err(parse(&mem, &past, cap, false)));
        let huge = [header(&mem, 0, 0, u64::MAX / 2), (GuestAddress(0x2000), 512, true), STATUS];
        assert!(io_err(parse(&mem, &huge, cap, false)));
        let partial = [header(&mem, 0, 0, 0), (GuestAddress(0x2000), 100, true), STATUS];
        assert!(io_err(parse(&mem, &partial, cap, false)));
        // A header outside the guest's memory.
        let outside = [(GuestAddress(16 * MIB), 16, false), STATUS];
        assert!(io_err(parse(&mem, &outside, cap, false)));
        // A write to a read-only disk; an unknown type is UNSUPP.
        let write = [header(&mem, 0, 1, 0), (GuestAddress(0x2000), 512, false), STATUS];
        assert!(io_err(parse(&mem, &write, cap, true)));
        assert!(parse(&mem, &write, cap, false).is_ok());
        let scsi = [header(&mem, 0, 2, 0), STATUS];
        assert!(matches!(
            parse(&mem, &scsi, cap, false),
            Err(Refusal::Unsupported { kind: 2, .. })
        ));
    }

    #[test]
    fn discard_segments_are_read_and_checked() {
        let mem = memory();
        let cap = 1 << 20;
        let mut seg = Vec::new();
        for (sector, sectors, flags) in [(8u64, 16u32, 0u32), (100, 8, 1)] {
            seg.extend_from_slice(&sector.to_le_bytes());
            seg.extend_from_slice(&sectors.to_le_bytes());
            seg.extend_from_slice(&flags.to_le_bytes());
        }
        mem.write_slice(&seg, GuestAddress(0x2000)).unwrap();
        let chain = [header(&mem, 0, 13, 0), (GuestAddress(0x2000), 32, false), STATUS];
        let r = parse(&mem, &chain, cap, false).unwrap();
        assert_eq!(r.kind, Kind::WriteZeroes);
        assert_eq!(
            r.segments,
            [
                Segment { offset: 4096, len: 8192, unmap: false },
                Segment { offset: 51200, len: 4096, unmap: true }
            ]
        );
        // Not whole segments; a segment past the end; unknown flags.
        let short = [header(&mem, 0, 11, 0), (GuestAddress(0x2000), 20, false), STATUS];
        assert!(matches!(parse(&mem, &short, cap, false), Err(Refusal::IoErr { .. })));
        assert!(matches!(parse(&mem, &chain, 32 * 1024, false), Err(Refusal::IoErr { .. })));
        mem.write_slice(&7u32.to_le_bytes(), GuestAddress(0x2000 + 12)).unwrap();
        assert!(matches!(parse(&mem, &chain, cap, false), Err(Refusal::IoErr { .. })));
        // A segment longer than the limit the device offers; more segments than it offers.
        let mut long = Vec::new();
        long.extend_from_slice(&0u64.to_le_bytes());
        long.extend_from_slice(&u32::MAX.to_le_bytes());
        long.extend_from_slice(&0u32.to_le_bytes());
        mem.write_slice(&long, GuestAddress(0x2000)).unwrap();
        let one = [header(&mem, 0, 11, 0), (GuestAddress(0x2000), 16, false), STATUS];
        assert!(matches!(parse(&mem, &one, u64::MAX, false), Err(Refusal::IoErr { .. })));
        let many = [header(&mem, 0, 11, 0), (GuestAddress(0x2000), 33 * 16, false), STATUS];
        assert!(matches!(parse(&mem, &many, cap, false), Err(Refusal::IoErr { .. })));
    }
}
