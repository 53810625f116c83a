//! An export whose only store is a persistent pool (`--export NAME=pool:SIZE`): a RAM disk
//! in the page pool, in this process, on a node, or spread over a cluster with two copies
//! of every page. Frontswap's use of transcendent memory: a machine short of memory swaps
//! to another machine's idle RAM.
//!
//! Page `n` of the device (bytes `n × 4096 ..`) is the pool page `(pool, object, n)`.
//!
//! * A page never written, trimmed or zeroed is absent from the pool and reads as zeros;
//!   `block_status` reports it as a hole.
//! * Writes, trims and zeroes must be whole pages ([`BackingStore::min_block_size`] is
//!   4096, which the front ends advertise): a put replaces a page whole, and a put the pool
//!   refuses leaves no older version behind (`docs/semantics.md`), so a partial write
//!   merged into an old page could lose the old page's other bytes, which were
//!   acknowledged long ago. With whole pages, a refused write loses only what it was
//!   writing, as a failed write may.
//! * A write the pool refuses (full, over quota, no live node with room) fails with
//!   `ENOSPC`; earlier writes stay.
//! * A write is in the pool when it completes, so `flush` has nothing to do and FUA
//!   nothing to add. How long the pool keeps it is the pool's matter: as long as the
//!   process that holds it (a local pool), the node's client lease (a node), or any one of
//!   two nodes (a cluster).
//! * With a backup file ([`PoolStore::with_backup`], `write_behind.rs`), every change also
//!   goes to the file in the background; a page the pool cannot give back is read from the
//!   change on its way or from the file, and `flush` waits until the file has every change
//!   and is durable. Block status is then not offered: a hole in the pool may be data in
//!   the file.

use std::io;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use fallow_core::{
    AsyncPageStore, NotStored, ObjectId, PageKey, PoolId, PutOutcome, StoreError, PAGE_SIZE,
};

use crate::write_behind::{Change, WriteBehind};
use crate::{check_range, BackingStore, Capabilities, Durability, Extent, FileStore, Zeroing};

/// The most pages one request to the pool carries (the node protocol's batch limit).
const BATCH: usize = fallow_proto::fallow::MAX_BATCH;

/// The most pages one `block_status` answer covers: it reads every page it reports on.
const STATUS_PAGES: u64 = 1024;

/// A device of `size` bytes kept in object `object` of persistent pool `pool`.
pub struct PoolStore {
    pages: Arc<dyn AsyncPageStore>,
    pool: PoolId,
    object: ObjectId,
    size: u64,
    backup: Option<WriteBehind>,
}

impl std::fmt::Debug for PoolStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolStore")
            .field("pool", &self.pool)
            .field("object", &self.object)
            .field("size", &self.size)
            .field("backup_pending_bytes", &self.backup.as_ref().map(WriteBehind::pending_bytes))
            .finish_non_exhaustive()
    }
}

impl PoolStore {
    /// A device of `size` bytes (a whole number of pages) in `object` of `pool`, which the
    /// caller created persistent in `pages`.
    pub fn new(
        pages: Arc<dyn AsyncPageStore>,
        pool: PoolId,
        object: ObjectId,
        size: u64,
    ) -> io::Result<PoolStore> {
        if size == 0 || !size.is_multiple_of(PAGE_SIZE as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a pool export's size must be a positive multiple of 4 KiB, not {size}"),
            ));
        }
        Ok(PoolStore { pages, pool, object, size, backup: None })
    }

    /// Backs the device up into `file` (of the device's size) in the background, holding
    /// at most `limit` bytes on their way to it; starts the writer on the current runtime.
    /// A file that already holds the disk (the pool was lost) serves every page the pool
    /// does not have.
    pub fn with_backup(mut self, file: FileStore, limit: usize) -> io::Result<PoolStore> {
        if file.size() != self.size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the backup file holds {} bytes, the export {}", file.size(), self.size),
            ));
        }
        self.backup = Some(WriteBehind::start(file, limit));
        Ok(self)
    }

    /// The pool the device lives in.
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    fn key(&self, page: u64) -> PageKey {
        PageKey::new(self.pool, self.object, page)
    }

    /// The pages of `offset..offset+len`, which must lie in the device.
    fn page_range(&self, offset: u64, len: u64) -> io::Result<std::ops::Range<u64>> {
        check_range(offset, len, self.size)?;
        let page = PAGE_SIZE as u64;
        Ok(offset / page..(offset + len).div_ceil(page))
    }

    /// Like [`PoolStore::page_range`], for a range that must be whole pages.
    fn whole_pages(&self, what: &str, offset: u64, len: u64) -> io::Result<std::ops::Range<u64>> {
        let page = PAGE_SIZE as u64;
        if !offset.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{what} at {offset}+{len}: a pool export takes whole 4 KiB pages"),
            ));
        }
        self.page_range(offset, len)
    }

    /// The pages `first..end`, absent ones `None`.
    async fn get(&self, pages: std::ops::Range<u64>) -> io::Result<Vec<Option<Bytes>>> {
        let keys: Vec<PageKey> = pages.map(|n| self.key(n)).collect();
        let mut found = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(BATCH) {
            found.extend(self.pages.get_many(chunk).await.map_err(pool_error)?);
        }
        Ok(found)
    }

    /// Puts `data` (whole pages) from page `first` on; the first refusal is `ENOSPC`.
    async fn put(&self, first: u64, data: Bytes) -> io::Result<()> {
        let count = (data.len() / PAGE_SIZE) as u64;
        let keys: Vec<PageKey> = (first..first + count).map(|n| self.key(n)).collect();
        for (i, chunk) in keys.chunks(BATCH).enumerate() {
            let at = i * BATCH * PAGE_SIZE;
            let pages = data.slice(at..at + chunk.len() * PAGE_SIZE);
            let outcomes = self.pages.put_many(chunk, pages).await.map_err(pool_error)?;
            if let Some((key, PutOutcome::NotStored(why))) =
                chunk.iter().zip(&outcomes).find(|(_, o)| **o != PutOutcome::Stored)
            {
                let why = match why {
                    NotStored::Full => "the pool is full",
                    NotStored::OverQuota => "the export's quota of pages is spent",
                };
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!("page {} not stored: {why}", key.index),
                ));
            }
        }
        Ok(())
    }

    /// Removes the pages `pages` from the pool.
    async fn remove(&self, pages: std::ops::Range<u64>) -> io::Result<()> {
        let keys: Vec<PageKey> = pages.map(|n| self.key(n)).collect();
        for chunk in keys.chunks(BATCH) {
            self.pages.invalidate_pages(chunk).await.map_err(pool_error)?;
        }
        Ok(())
    }
}

/// A pool error as an I/O error of the export (`EIO` to a client): the pool could not be
/// reached, or lost both copies of a page.
fn pool_error(err: StoreError) -> io::Error {
    io::Error::other(format!("pool: {err}"))
}

#[async_trait]
impl BackingStore for PoolStore {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            // Nothing is volatile between a write and the pool; with a backup, the file is
            // durable only once a flush has drained what is on its way.
            flush: self.backup.is_some(),
            fua: false,
            trim: true,
            trim_zeroes: true,
            fast_zero: true,
            block_status: self.backup.is_none(),
            multi_conn: true,
        }
    }

    fn min_block_size(&self) -> u32 {
        PAGE_SIZE as u32
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        let pages = self.page_range(offset, u64::from(len))?;
        let (first, count) = (pages.start, (pages.end - pages.start) as usize);
        let found = match (self.get(pages.clone()).await, &self.backup) {
            (Ok(found), _) => found,
            (Err(err), None) => return Err(err),
            // The pool is gone or lost pages: the backup has them all.
            (Err(err), Some(_)) => {
                tracing::warn!(%err, "the pool failed a read; reading the backup instead");
                vec![None; count]
            }
        };
        let mut out = BytesMut::zeroed(count * PAGE_SIZE);
        let mut from_file: Option<Bytes> = None;
        for (i, page) in found.iter().enumerate() {
            let Some(dst) = out.get_mut(i * PAGE_SIZE..(i + 1) * PAGE_SIZE) else { break };
            match (page, &self.backup) {
                (Some(page), _) => dst.copy_from_slice(page),
                (None, None) => {}
                (None, Some(backup)) => match backup.lookup(first + i as u64) {
                    Some(Change::Data(bytes)) => dst.copy_from_slice(&bytes),
                    Some(Change::Zero) => {}
                    None => {
                        if from_file.is_none() {
                            let whole = u32::try_from(count * PAGE_SIZE).unwrap_or(u32::MAX);
                            let at = first * PAGE_SIZE as u64;
                            from_file = Some(backup.file().read(at, whole).await?);
                        }
                        if let Some(src) = from_file
                            .as_ref()
                            .and_then(|f| f.get(i * PAGE_SIZE..(i + 1) * PAGE_SIZE))
                        {
                            dst.copy_from_slice(src);
                        }
                    }
                },
            }
        }
        let skip = (offset - first * PAGE_SIZE as u64) as usize;
        Ok(out.freeze().slice(skip..skip + len as usize))
    }

    async fn write(&self, offset: u64, data: Bytes, _durability: Durability) -> io::Result<()> {
        let pages = self.whole_pages("write", offset, data.len() as u64)?;
        if let Some(backup) = &self.backup {
            backup.record(pages.start, pages.end - pages.start, Some(&data)).await;
        }
        self.put(pages.start, data).await
    }

    async fn flush(&self) -> io::Result<()> {
        match &self.backup {
            Some(backup) => backup.drain().await,
            None => Ok(()),
        }
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        let pages = self.whole_pages("trim", offset, u64::from(len))?;
        if let Some(backup) = &self.backup {
            backup.record(pages.start, pages.end - pages.start, None).await;
        }
        self.remove(pages).await
    }

    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        let pages = self.whole_pages("write zeroes", offset, u64::from(len))?;
        if let Some(backup) = &self.backup {
            backup.record(pages.start, pages.end - pages.start, None).await;
        }
        match zeroing {
            Zeroing::MayDeallocate => self.remove(pages).await,
            // A zero page is a fill in the pool: it costs its index entry, no frame.
            Zeroing::KeepAllocated => {
                let count = (pages.end - pages.start) as usize;
                self.put(pages.start, Bytes::from(vec![0u8; count * PAGE_SIZE])).await
            }
        }
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        let pages = self.page_range(offset, u64::from(len))?;
        let pages = pages.start..pages.end.min(pages.start + STATUS_PAGES);
        let first = pages.start;
        let found = self.get(pages).await?;
        let end = offset + u64::from(len);
        let mut extents: Vec<Extent> = Vec::new();
        for (i, page) in found.iter().enumerate() {
            let page_start = (first + i as u64) * PAGE_SIZE as u64;
            let from = page_start.max(offset);
            let to = (page_start + PAGE_SIZE as u64).min(end);
            let (hole, zero) = match page {
                None => (true, true),
                Some(bytes) => (false, bytes.iter().all(|b| *b == 0)),
            };
            match extents.last_mut() {
                Some(last) if last.hole == hole && last.zero == zero => last.length += to - from,
                _ => extents.push(Extent { length: to - from, hole, zero }),
            }
        }
        Ok(extents)
    }
}
