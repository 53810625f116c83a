//! The guest's memory: one memfd, mapped shared here and, through the vhost-user memory
//! table, in the backend, as QEMU shares a guest's RAM with a vhost-user device.
//!
//! Addresses are guest-physical (GPA): the one region starts at [`GUEST_BASE`], not at 0, so
//! that a descriptor pointing at a low address points outside the memory table, as a hostile
//! test wants. Every access goes through vm-memory's checked, volatile accessors (the
//! backend writes the same bytes from another process): an address outside the region is an
//! error, never undefined behaviour, and this module needs no `unsafe`.
//!
//! Canaries: [`GuestMemory::fill_canary`] writes a pattern that depends on each byte's
//! address, so a stray write is found wherever it lands and whatever it writes (even a
//! displaced copy of canary bytes), by [`GuestMemory::canary_damage`]. Where a test has
//! also written its own headers and tables among the canaries, a [`Snapshot`] taken before
//! the request tells what the device changed.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhost::VhostUserMemoryRegionInfo;
use vm_memory::{
    AtomicAccess, Bytes, FileOffset, GuestAddress, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress,
};

/// The guest-physical address where the memory starts: 1 GiB, so that everything below it
/// (address 0 included) is outside the memory table.
pub const GUEST_BASE: u64 = 1 << 30;

/// Why an access to guest memory failed: the range is not inside the region. For the
/// driver's own structures that is a bug; for a test's addresses, the test's mistake.
#[derive(Debug, thiserror::Error)]
#[error("guest memory: {len} bytes at {addr:#x} are not inside {base:#x}..{end:#x}")]
pub struct MemoryError {
    /// The first address of the access.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Where the region starts.
    pub base: u64,
    /// Where it ends (exclusive).
    pub end: u64,
}

/// The guest's memory: one shared mapping of a memfd. Cloning is cheap and shares the
/// mapping (the null device's thread holds a clone).
#[derive(Clone, Debug)]
pub struct GuestMemory {
    region: Arc<GuestRegionMmap>,
    size: u64,
}

impl GuestMemory {
    /// Creates a memfd of `size` bytes (sparse: pages cost nothing until touched) and maps
    /// it shared at [`GUEST_BASE`].
    pub fn new(size: u64) -> io::Result<GuestMemory> {
        let fd = rustix::fs::memfd_create("fallow-bench-blk", rustix::fs::MemfdFlags::CLOEXEC)?;
        let file = File::from(fd);
        file.set_len(size)?;
        let len = usize::try_from(size).map_err(|_| io::Error::other("memory size too large"))?;
        let region = GuestRegionMmap::from_range(
            GuestAddress(GUEST_BASE),
            len,
            Some(FileOffset::new(file, 0)),
        )
        .map_err(|e| io::Error::other(format!("mapping the guest memory: {e}")))?;
        Ok(GuestMemory { region: Arc::new(region), size })
    }

    /// Bytes of memory.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The guest-physical range of the memory.
    pub fn range(&self) -> Range<u64> {
        GUEST_BASE..GUEST_BASE + self.size
    }

    /// Whether `len` bytes at `addr` are all inside the memory.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= GUEST_BASE && addr.checked_add(len).is_some_and(|end| end <= GUEST_BASE + self.size)
    }

    /// The memory table entry that shares this memory with a vhost-user backend.
    pub fn region_info(&self) -> io::Result<VhostUserMemoryRegionInfo> {
        VhostUserMemoryRegionInfo::from_guest_region(&self.region)
            .map_err(|e| io::Error::other(format!("memory table entry: {e}")))
    }

    /// The address in this process of guest address `addr`, which vhost-user's
    /// SET_VRING_ADDR speaks in (the backend translates it through the memory table).
    pub fn host_address(&self, addr: u64) -> Result<u64, MemoryError> {
        let offset = self.offset(addr, 1)?;
        let ptr = self.region.get_host_address(offset).map_err(|_| self.error(addr, 1))?;
        Ok(ptr as u64)
    }

    /// Copies `buf` to `addr`.
    pub fn write(&self, addr: u64, buf: &[u8]) -> Result<(), MemoryError> {
        let offset = self.offset(addr, buf.len() as u64)?;
        self.region.write_slice(buf, offset).map_err(|_| self.error(addr, buf.len() as u64))
    }

    /// Fills `buf` from `addr`.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let len = buf.len() as u64;
        let offset = self.offset(addr, len)?;
        self.region.read_slice(buf, offset).map_err(|_| self.error(addr, len))
    }

    /// `len` bytes from `addr`, as a vector.
    pub fn read_vec(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        let mut buf = vec![0; len];
        self.read(addr, &mut buf)?;
        Ok(buf)
    }

    /// The byte at `addr`.
    pub fn read_u8(&self, addr: u64) -> Result<u8, MemoryError> {
        let mut b = [0u8];
        self.read(addr, &mut b)?;
        Ok(b[0])
    }

    /// Sets `len` bytes from `addr` to `byte`.
    pub fn fill(&self, addr: u64, len: u64, byte: u8) -> Result<(), MemoryError> {
        self.write_chunks(addr, len, |_, chunk| chunk.fill(byte))
    }

    /// An atomic load of a naturally aligned integer (ring indexes and flags).
    pub fn load<T: AtomicAccess>(&self, addr: u64, order: Ordering) -> Result<T, MemoryError> {
        let len = std::mem::size_of::<T>() as u64;
        let offset = self.offset(addr, len)?;
        self.region.load(offset, order).map_err(|_| self.error(addr, len))
    }

    /// An atomic store of a naturally aligned integer.
    pub fn store<T: AtomicAccess>(
        &self,
        value: T,
        addr: u64,
        order: Ordering,
    ) -> Result<(), MemoryError> {
        let len = std::mem::size_of::<T>() as u64;
        let offset = self.offset(addr, len)?;
        self.region.store(value, offset, order).map_err(|_| self.error(addr, len))
    }

    /// Fills `len` bytes at `addr` with the canary pattern (see the module documentation).
    pub fn fill_canary(&self, addr: u64, len: u64) -> Result<(), MemoryError> {
        self.write_chunks(addr, len, |at, chunk| {
            for (i, b) in chunk.iter_mut().enumerate() {
                *b = canary_byte(at + i as u64);
            }
        })
    }

    /// The ranges within `len` bytes at `addr` that no longer hold the canary pattern,
    /// leaving out the ranges in `except` (the buffers a request may write). Adjacent
    /// damaged bytes form one range. Empty: nothing outside `except` was touched.
    pub fn canary_damage(
        &self,
        addr: u64,
        len: u64,
        except: &[Range<u64>],
    ) -> Result<Vec<Range<u64>>, MemoryError> {
        self.differences(addr, len, canary_byte, except)
    }

    /// A copy of `len` bytes at `addr`, to see later what changed in them
    /// ([`Snapshot::changes`]): canaries, and the headers and tables a test wrote among them.
    pub fn snapshot(&self, addr: u64, len: u64) -> Result<Snapshot, MemoryError> {
        let len_usize = usize::try_from(len).map_err(|_| self.error(addr, len))?;
        Ok(Snapshot { addr, bytes: self.read_vec(addr, len_usize)? })
    }

    /// The ranges within `len` bytes at `addr` whose bytes differ from `expected(address)`,
    /// outside `except`; adjacent bytes form one range.
    fn differences(
        &self,
        addr: u64,
        len: u64,
        expected: impl Fn(u64) -> u8,
        except: &[Range<u64>],
    ) -> Result<Vec<Range<u64>>, MemoryError> {
        self.offset(addr, len)?;
        let mut found: Vec<Range<u64>> = Vec::new();
        let mut chunk = vec![0u8; CHUNK.min(len) as usize];
        let mut at = addr;
        while at < addr + len {
            let n = CHUNK.min(addr + len - at) as usize;
            let buf = chunk.get_mut(..n).ok_or_else(|| self.error(at, n as u64))?;
            self.read(at, buf)?;
            for (i, b) in buf.iter().enumerate() {
                let a = at + i as u64;
                if *b == expected(a) || except.iter().any(|r| r.contains(&a)) {
                    continue;
                }
                match found.last_mut() {
                    Some(last) if last.end == a => last.end = a + 1,
                    _ => found.push(a..a + 1),
                }
            }
            at += n as u64;
        }
        Ok(found)
    }

    /// Writes `len` bytes at `addr`, a chunk at a time, each made by `make(address, chunk)`.
    fn write_chunks(
        &self,
        addr: u64,
        len: u64,
        mut make: impl FnMut(u64, &mut [u8]),
    ) -> Result<(), MemoryError> {
        self.offset(addr, len)?;
        let mut chunk = vec![0u8; CHUNK.min(len) as usize];
        let mut at = addr;
        while at < addr + len {
            let n = CHUNK.min(addr + len - at) as usize;
            let buf = chunk.get_mut(..n).ok_or_else(|| self.error(at, n as u64))?;
            make(at, buf);
            self.write(at, buf)?;
            at += n as u64;
        }
        Ok(())
    }

    /// The region offset of `len` bytes at `addr`, if they are all inside.
    fn offset(&self, addr: u64, len: u64) -> Result<MemoryRegionAddress, MemoryError> {
        if self.contains(addr, len) {
            Ok(MemoryRegionAddress(addr - GUEST_BASE))
        } else {
            Err(self.error(addr, len))
        }
    }

    fn error(&self, addr: u64, len: u64) -> MemoryError {
        MemoryError { addr, len, base: GUEST_BASE, end: GUEST_BASE + self.size }
    }
}

/// A copy of some guest memory taken by [`GuestMemory::snapshot`].
#[derive(Debug, Clone)]
pub struct Snapshot {
    addr: u64,
    bytes: Vec<u8>,
}

impl Snapshot {
    /// The ranges that changed since the snapshot, outside `except` (the buffers a request
    /// may write); adjacent bytes form one range. Empty: nothing else was touched.
    pub fn changes(
        &self,
        mem: &GuestMemory,
        except: &[Range<u64>],
    ) -> Result<Vec<Range<u64>>, MemoryError> {
        // `differences` asks only for addresses inside the snapshot, so the lookup holds.
        let at = |a: u64| {
            let i = a.checked_sub(self.addr).and_then(|i| usize::try_from(i).ok());
            i.and_then(|i| self.bytes.get(i)).copied().unwrap_or(0)
        };
        mem.differences(self.addr, self.bytes.len() as u64, at, except)
    }
}

/// How much a canary fill or check reads or writes at once.
const CHUNK: u64 = 64 * 1024;

/// The canary byte at guest address `addr`: 2 to 252, so never 0, 1 or 0xff (what a device
/// writes most: zeros, OK and IOERR statuses, fills), and different at each of 251
/// neighbouring addresses, so a shifted copy shows.
fn canary_byte(addr: u64) -> u8 {
    // 251 is prime: the pattern does not line up with sector or page sizes.
    (addr % 251) as u8 + 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accesses_outside_the_region_fail() {
        let mem = GuestMemory::new(1 << 20).unwrap();
        assert!(mem.write(GUEST_BASE, &[1, 2, 3]).is_ok());
        assert_eq!(mem.read_vec(GUEST_BASE, 3).unwrap(), [1, 2, 3]);
        assert!(mem.write(0, &[1]).is_err());
        assert!(mem.write(GUEST_BASE + (1 << 20) - 1, &[1, 2]).is_err());
        assert!(mem.read_u8(u64::MAX).is_err());
        assert!(mem.load::<u16>(GUEST_BASE - 2, Ordering::Acquire).is_err());
        mem.store(0xbeef_u16, GUEST_BASE + 8, Ordering::Release).unwrap();
        assert_eq!(mem.read_vec(GUEST_BASE + 8, 2).unwrap(), [0xef, 0xbe]);
        assert!(mem.contains(GUEST_BASE, 1 << 20) && !mem.contains(GUEST_BASE, (1 << 20) + 1));
        assert!(!mem.contains(u64::MAX, 2));
    }

    #[test]
    fn canaries_find_every_stray_byte() {
        let mem = GuestMemory::new(1 << 20).unwrap();
        let (at, len) = (GUEST_BASE + 4096, 200_000);
        mem.fill_canary(at, len).unwrap();
        assert!(mem.canary_damage(at, len, &[]).unwrap().is_empty());
        // A write inside an allowed buffer is fine; one byte after it is not.
        let buf = at + 1000..at + 1512;
        mem.fill(buf.start, 513, 0).unwrap();
        let damage = mem.canary_damage(at, len, std::slice::from_ref(&buf)).unwrap();
        assert_eq!(damage, vec![buf.end..buf.end + 1]);
        // A copy of canary bytes moved elsewhere is damage too.
        let moved = mem.read_vec(at, 100).unwrap();
        mem.write(at + 150_001, &moved).unwrap();
        let wider = buf.start..buf.end + 1;
        let damage = mem.canary_damage(at, len, std::slice::from_ref(&wider)).unwrap();
        assert_eq!(damage.len(), 1);
        assert!(damage[0].start >= at + 150_001 && damage[0].end <= at + 150_101);
    }

    #[test]
    fn a_snapshot_tells_what_changed() {
        let mem = GuestMemory::new(1 << 20).unwrap();
        let at = GUEST_BASE + 8192;
        mem.fill_canary(at, 4096).unwrap();
        mem.write(at + 100, b"header").unwrap();
        let snap = mem.snapshot(at, 4096).unwrap();
        assert!(snap.changes(&mem, &[]).unwrap().is_empty());
        mem.write(at + 2000, &[0, 0]).unwrap();
        mem.write(at + 101, b"E").unwrap();
        assert_eq!(
            snap.changes(&mem, &[]).unwrap(),
            vec![at + 101..at + 102, at + 2000..at + 2002]
        );
        let zeros = at + 2000..at + 2002;
        let changes = snap.changes(&mem, std::slice::from_ref(&zeros)).unwrap();
        assert_eq!(changes, std::slice::from_ref(&(at + 101..at + 102)));
        // Bytes outside the snapshot are not its business.
        mem.write(at + 4096, &[0]).unwrap();
        let all = at..at + 4096;
        assert!(snap.changes(&mem, std::slice::from_ref(&all)).unwrap().is_empty());
    }
}
