//! A RAM disk: pages allocated on first write, zeros elsewhere. Nothing is durable; it is
//! the store of tests and of an export whose only copy lives in a persistent pool.

use std::collections::HashMap;
use std::io;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use fallow_core::PAGE_SIZE;
use parking_lot::RwLock;

use crate::{check_range, BackingStore, Capabilities, Durability, Extent, Zeroing};

/// An in-memory store of `size` bytes.
#[derive(Debug)]
pub struct MemStore {
    size: u64,
    /// Page number → its bytes; absent pages read as zeros.
    pages: RwLock<HashMap<u64, Box<[u8]>>>,
}

impl MemStore {
    /// A store of `size` bytes, all zeros.
    pub fn new(size: u64) -> MemStore {
        MemStore { size, pages: RwLock::new(HashMap::new()) }
    }

    /// Pages allocated (written and not trimmed).
    pub fn allocated_pages(&self) -> usize {
        self.pages.read().len()
    }

    /// Calls `f(page, start, end)` for each page piece of `offset..offset+len`.
    fn pieces(offset: u64, len: u64, mut f: impl FnMut(u64, usize, usize)) {
        let page = PAGE_SIZE as u64;
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let n = at / page;
            let start = (at % page) as usize;
            let stop = ((end - n * page).min(page)) as usize;
            f(n, start, stop);
            at = n * page + stop as u64;
        }
    }
}

#[async_trait]
impl BackingStore for MemStore {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            flush: false,
            fua: false,
            trim: true,
            trim_zeroes: true,
            fast_zero: true,
            block_status: true,
            multi_conn: true,
        }
    }

    // A page piece's `start..stop` lies within its page (`pieces`), and a write's pieces
    // take its bytes in order.
    #[expect(clippy::indexing_slicing, reason = "pieces lie within their page")]
    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        check_range(offset, len as u64, self.size)?;
        let pages = self.pages.read();
        let mut out = BytesMut::with_capacity(len as usize);
        Self::pieces(offset, len as u64, |n, start, stop| match pages.get(&n) {
            Some(bytes) => out.extend_from_slice(&bytes[start..stop]),
            None => out.resize(out.len() + (stop - start), 0),
        });
        Ok(out.freeze())
    }

    #[expect(clippy::indexing_slicing, reason = "pieces lie within their page and the data")]
    async fn write(&self, offset: u64, data: Bytes, _: Durability) -> io::Result<()> {
        check_range(offset, data.len() as u64, self.size)?;
        let mut pages = self.pages.write();
        let mut taken = 0;
        Self::pieces(offset, data.len() as u64, |n, start, stop| {
            let page = pages.entry(n).or_insert_with(|| vec![0u8; PAGE_SIZE].into_boxed_slice());
            page[start..stop].copy_from_slice(&data[taken..taken + (stop - start)]);
            taken += stop - start;
        });
        Ok(())
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        self.write_zeroes(offset, len, Zeroing::MayDeallocate).await
    }

    #[expect(clippy::indexing_slicing, reason = "pieces lie within their page")]
    async fn write_zeroes(&self, offset: u64, len: u32, _: Zeroing) -> io::Result<()> {
        check_range(offset, len as u64, self.size)?;
        let mut pages = self.pages.write();
        Self::pieces(offset, len as u64, |n, start, stop| {
            if start == 0 && stop == PAGE_SIZE {
                pages.remove(&n);
            } else if let Some(page) = pages.get_mut(&n) {
                page[start..stop].fill(0);
            }
        });
        Ok(())
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        check_range(offset, len as u64, self.size)?;
        let pages = self.pages.read();
        let mut extents: Vec<Extent> = Vec::new();
        Self::pieces(offset, len as u64, |n, start, stop| {
            let hole = !pages.contains_key(&n);
            let length = (stop - start) as u64;
            match extents.last_mut() {
                Some(last) if last.hole == hole => last.length += length,
                _ => extents.push(Extent { length, hole, zero: hole }),
            }
        });
        Ok(extents)
    }
}
