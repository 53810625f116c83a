//! The cache layer of an export: reads go local tier → pool → backing store and populate
//! the tiers on the way back; writes go to the backing store first (write-through) and then
//! update or invalidate every cached copy, so that no reader, on any connection, sees stale
//! data. `docs/nbd.md` describes the modes; `coherence.rs` the rule that makes the
//! "no stale data" promise hold when reads and writes race.
//!
//! ```text
//!  read(offset, len)                                  write(offset, data)
//!   ├─ local tier (this process, CLOCK) ─ hit          ├─ mark stripes written
//!   ├─ pool (AsyncPageStore: engine or nodes) ─ hit    ├─ backing store write (FUA as asked)
//!   │     exclusive: take, inclusive: get              ├─ gates: local updated/removed,
//!   └─ backing store, whole pages                      │         pool copies invalidated
//!        populate local (and pool when inclusive,      └─ acknowledge
//!        or when there is no local tier)
//!  local tier eviction (exclusive) ─▶ demoter task ─▶ pool put, batched, off the request path
//! ```
//!
//! A pool that fails is never an error for the client: a failed lookup is a miss, a failed
//! populate is skipped. A failed invalidation is the one dangerous case (a stale copy may
//! remain in the pool), so the pool is then distrusted, reads skip it, and a background task
//! invalidates the export's whole object in the pool before trusting it again.
//!
//! # Components
//! [`split`]: byte ranges into page pieces. [`coherence`]: the race rule. [`local`]: the
//! local tier. [`CacheLayer`]: all of it over one backing store.

pub mod coherence;
mod dirty;
pub mod local;
pub mod split;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fallow_backing::BackingStore;
use fallow_core::{AsyncPageStore, ObjectId, PageKey, PoolId, PutOutcome, PAGE_SIZE};
use tokio::sync::mpsc;

use coherence::{Coherence, Ticket};
use local::LocalTier;
use split::{pieces, Piece};

const PAGE: u64 = PAGE_SIZE as u64;

/// Pages demoted to the pool per batch.
const DEMOTE_BATCH: usize = 64;

/// Demotions waiting for the pool; beyond this they are dropped (the pages are clean).
const DEMOTE_QUEUE: usize = 4096;

/// How the local tier and the pool share pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A page lives in one tier: a pool hit moves it to the local tier (take), and a page
    /// evicted from the local tier is put into the pool, in the background.
    Exclusive,
    /// The pool keeps its copy; pages read from the store go into both tiers.
    Inclusive,
}

/// The pool behind the local tier: a store, the pool in it, and the object id under which
/// this export's pages are kept (page number = page index).
#[derive(Clone)]
pub struct PoolTier {
    /// The engine in this process, or nodes through the client library.
    pub store: Arc<dyn AsyncPageStore>,
    /// The pool (ephemeral: a clean-page cache).
    pub pool: PoolId,
    /// This export's object in the pool.
    pub object: ObjectId,
}

impl std::fmt::Debug for PoolTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolTier").field("pool", &self.pool).field("object", &self.object).finish()
    }
}

/// When a write is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritePolicy {
    /// After the backing store has it (the default).
    Through,
    /// From memory: the page is kept dirty in this process and written to the store by
    /// FLUSH, by FUA, or by the background flusher, which keeps at most `max_dirty_bytes`
    /// dirty and none older than `max_age`. A crash loses dirty pages, never a write
    /// acknowledged before a completed FLUSH.
    Back {
        /// The most dirty bytes; writes wait for the flusher beyond this.
        max_dirty_bytes: u64,
        /// The oldest a dirty page may get before the flusher writes it.
        max_age: Duration,
    },
}

/// Settings of one export's cache.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Pages in the local tier (0: none).
    pub local_pages: usize,
    /// Exclusive or inclusive.
    pub mode: Mode,
    /// Reads of at least this many bytes are served from the caches when they hit but do
    /// not populate them: a large sequential scan would otherwise flush the working set.
    pub scan_bytes: u32,
    /// Write-through or write-back.
    pub write: WritePolicy,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            local_pages: 0,
            mode: Mode::Exclusive,
            scan_bytes: 1 << 20,
            write: WritePolicy::Through,
        }
    }
}

/// Counters of one export's cache.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// Pages found in the local tier.
    pub local_hits: AtomicU64,
    /// Pages found in the pool.
    pub pool_hits: AtomicU64,
    /// Pages read from the backing store.
    pub misses: AtomicU64,
    /// Reads sent to the backing store.
    pub backing_reads: AtomicU64,
    /// Microseconds spent in those reads, in total (for the mean backing latency).
    pub backing_read_micros: AtomicU64,
    /// Pages put into the pool (populate or demotion).
    pub pool_puts: AtomicU64,
    /// Pool operations that failed (each was treated as a miss or skipped).
    pub pool_errors: AtomicU64,
    /// Pages not cached because a write raced with the read that fetched them.
    pub populate_skipped: AtomicU64,
    /// Demotions dropped because the queue to the pool was full.
    pub demotions_dropped: AtomicU64,
    /// Pages served from the dirty set (write-back).
    pub dirty_hits: AtomicU64,
    /// Dirty pages written to the backing store (write-back).
    pub written_back: AtomicU64,
    /// Write-back attempts that failed (the pages stay dirty and are retried).
    pub write_back_errors: AtomicU64,
}

struct Shared {
    backing: Arc<dyn BackingStore>,
    local: LocalTier,
    pool: Option<PoolTier>,
    /// False after an invalidation in the pool failed: reads skip the pool until the
    /// export's object has been invalidated there.
    pool_trusted: AtomicBool,
    /// Counts distrust events, so a recovery that raced with a new failure does not
    /// restore trust.
    distrust_epoch: AtomicU64,
    coherence: Coherence,
    config: CacheConfig,
    /// Pages wholly inside the export: only these are cached.
    whole_pages: u64,
    stats: CacheStats,
    demote: Option<mpsc::Sender<(u64, Bytes, Ticket)>>,
    dirty: dirty::DirtySet,
    /// No local tier, no pool, write-through: nothing is ever cached or dirty, so reads go
    /// straight to the store (`read_through`).
    pass_through: bool,
}

/// One export's cache over its backing store. Cheap to share (`Arc` inside); every
/// connection of the export uses the same one, which is what keeps them coherent.
#[derive(Clone)]
pub struct CacheLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for CacheLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheLayer")
            .field("backing", &self.shared.backing)
            .field("pool", &self.shared.pool)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl CacheLayer {
    /// A cache over `backing`, with an optional pool behind the local tier. Starts the
    /// demoter (exclusive mode with both tiers) and the pool's trust keeper on the current
    /// tokio runtime.
    pub fn new(
        backing: Arc<dyn BackingStore>,
        pool: Option<PoolTier>,
        config: CacheConfig,
    ) -> Self {
        let demoting = pool.is_some() && config.mode == Mode::Exclusive && config.local_pages > 0;
        let (demote, demotions) = if demoting {
            let (tx, rx) = mpsc::channel(DEMOTE_QUEUE);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let pass_through =
            pool.is_none() && config.local_pages == 0 && config.write == WritePolicy::Through;
        let shared = Arc::new(Shared {
            pass_through,
            whole_pages: backing.size() / PAGE,
            backing,
            local: LocalTier::new(config.local_pages),
            pool,
            pool_trusted: AtomicBool::new(true),
            distrust_epoch: AtomicU64::new(0),
            coherence: Coherence::new(),
            config,
            stats: CacheStats::default(),
            demote,
            dirty: dirty::DirtySet::default(),
        });
        if let Some(rx) = demotions {
            tokio::spawn(demoter(Arc::downgrade(&shared), rx));
        }
        if let WritePolicy::Back { max_age, .. } = shared.config.write {
            tokio::spawn(flusher(Arc::downgrade(&shared), max_age));
        }
        if shared.pool.is_some() {
            tokio::spawn(trust_keeper(Arc::downgrade(&shared)));
        }
        CacheLayer { shared }
    }

    /// The backing store.
    pub fn backing(&self) -> &Arc<dyn BackingStore> {
        &self.shared.backing
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.shared.backing.size()
    }

    /// The counters.
    pub fn stats(&self) -> &CacheStats {
        &self.shared.stats
    }

    /// Pages in the local tier.
    pub fn local_pages(&self) -> usize {
        self.shared.local.len()
    }

    /// Bytes acknowledged but not yet written to the backing store (write-back).
    pub fn dirty_bytes(&self) -> u64 {
        self.shared.dirty.bytes()
    }

    /// False while the pool is skipped after a failed invalidation.
    pub fn pool_trusted(&self) -> bool {
        self.shared.pool_trusted.load(Relaxed)
    }

    fn keys(&self, pool: &PoolTier, pages: &[u64]) -> Vec<PageKey> {
        pages.iter().map(|p| PageKey::new(pool.pool, pool.object, *p)).collect()
    }

    /// Reads `len` bytes at `offset` (the caller has checked the range).
    ///
    /// The answer is built without zero-filling or copying where it can be: a read that one
    /// page or one store read answers whole is a slice of that buffer; otherwise the pieces
    /// are copied once, in order, into a buffer of the right size.
    pub async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        let s = &*self.shared;
        if s.pass_through {
            return self.read_through(offset, len).await;
        }
        let pieces: Vec<Piece> = pieces(offset, len as u64).collect();
        let populate = len < s.config.scan_bytes;
        // Each piece's bytes, as a slice of the page (or store read) they came from.
        let mut parts: Vec<Bytes> = vec![Bytes::new(); pieces.len()];
        let part = |i: usize, page: &Bytes| {
            let p = &pieces[i];
            page.slice(p.start..p.end)
        };

        // Tickets first (a write that starts after this invalidates them), then the dirty
        // set (write-back), then the local tier.
        let mut missing: Vec<usize> = Vec::new();
        let mut tickets: Vec<Option<Ticket>> = vec![None; pieces.len()];
        for (i, p) in pieces.iter().enumerate() {
            if p.page < s.whole_pages {
                tickets[i] = s.coherence.ticket(p.page);
                if let Some(page) = s.dirty.get(p.page) {
                    parts[i] = part(i, &page);
                    s.stats.dirty_hits.fetch_add(1, Relaxed);
                    tickets[i] = None;
                    continue;
                }
                if let Some(page) = s.local.get(p.page) {
                    parts[i] = part(i, &page);
                    s.stats.local_hits.fetch_add(1, Relaxed);
                    continue;
                }
            }
            missing.push(i);
        }

        // The pool.
        let mut from_pool: Vec<(usize, Bytes)> = Vec::new();
        if let Some(pool) = s.pool.as_ref().filter(|_| s.pool_trusted.load(Relaxed)) {
            let asked: Vec<usize> =
                missing.iter().copied().filter(|i| pieces[*i].page < s.whole_pages).collect();
            if !asked.is_empty() {
                let pages: Vec<u64> = asked.iter().map(|i| pieces[*i].page).collect();
                let keys = self.keys(pool, &pages);
                // Taking moves the page here; without a local tier to hold it, that would
                // lose it, so take only when there is one.
                let take = s.config.mode == Mode::Exclusive && s.config.local_pages > 0 && populate;
                let found = if take {
                    pool.store.take_many(&keys).await
                } else {
                    pool.store.get_many(&keys).await
                };
                match found {
                    Ok(found) => {
                        for (i, page) in asked.iter().zip(found) {
                            if let Some(page) = page {
                                parts[*i] = part(*i, &page);
                                from_pool.push((*i, page));
                            }
                        }
                        s.stats.pool_hits.fetch_add(from_pool.len() as u64, Relaxed);
                        missing.retain(|i| !from_pool.iter().any(|(j, _)| j == i));
                    }
                    Err(err) => {
                        s.stats.pool_errors.fetch_add(1, Relaxed);
                        tracing::debug!(%err, "pool lookup failed; reading from the backing store");
                    }
                }
            }
        }

        // The backing store, in runs of consecutive pages, whole pages where they are
        // cacheable.
        let mut from_store: Vec<(usize, Bytes)> = Vec::new();
        // Set when one store read covers the whole request: the answer is a slice of it.
        let mut whole: Option<Bytes> = None;
        let mut run_start = 0;
        while run_start < missing.len() {
            let mut run_end = run_start + 1;
            while run_end < missing.len()
                && pieces[missing[run_end]].page == pieces[missing[run_end - 1]].page + 1
            {
                run_end += 1;
            }
            let first = &pieces[missing[run_start]];
            let last = &pieces[missing[run_end - 1]];
            let start = first.page * PAGE;
            let end = ((last.page + 1) * PAGE).min(s.backing.size());
            let started = std::time::Instant::now();
            let data = s.backing.read(start, (end - start) as u32).await?;
            check_len(&data, end - start)?;
            s.stats.backing_read_micros.fetch_add(started.elapsed().as_micros() as u64, Relaxed);
            s.stats.backing_reads.fetch_add(1, Relaxed);
            if missing.len() == pieces.len() && run_end - run_start == pieces.len() {
                // Every piece, in one read: the request starts `first.start` bytes into it.
                whole = Some(data.slice(first.start..first.start + len as usize));
            }
            for &i in &missing[run_start..run_end] {
                let p = &pieces[i];
                let from = ((p.page * PAGE) - start) as usize;
                let page_end = (from + PAGE_SIZE).min(data.len());
                let page = data.slice(from..page_end);
                if whole.is_none() {
                    parts[i] = part(i, &page);
                }
                if p.page < s.whole_pages {
                    from_store.push((i, page));
                }
            }
            s.stats.misses.fetch_add((run_end - run_start) as u64, Relaxed);
            run_start = run_end;
        }

        if populate {
            self.populate(&pieces, &tickets, from_pool, from_store).await;
        }
        Ok(match whole {
            Some(data) => data,
            None if parts.len() == 1 => parts.pop().unwrap_or_default(),
            None => {
                let mut out = BytesMut::with_capacity(len as usize);
                for part in &parts {
                    out.extend_from_slice(part);
                }
                out.freeze()
            }
        })
    }

    /// A read with no tier to look in or fill and no dirty pages: straight to the store,
    /// exactly the range asked for, whose buffer is the answer.
    async fn read_through(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        let s = &*self.shared;
        if len == 0 {
            return Ok(Bytes::new());
        }
        let started = std::time::Instant::now();
        let data = s.backing.read(offset, len).await?;
        check_len(&data, len as u64)?;
        s.stats.backing_read_micros.fetch_add(started.elapsed().as_micros() as u64, Relaxed);
        s.stats.backing_reads.fetch_add(1, Relaxed);
        let pages = (offset + len as u64 - 1) / PAGE - offset / PAGE + 1;
        s.stats.misses.fetch_add(pages, Relaxed);
        Ok(data)
    }

    /// Puts what a read fetched into the tiers, for the pages whose tickets are still
    /// valid. Pool hits go to the local tier; store reads go to the local tier and, when
    /// inclusive or without a local tier, to the pool.
    async fn populate(
        &self,
        pieces: &[Piece],
        tickets: &[Option<Ticket>],
        from_pool: Vec<(usize, Bytes)>,
        from_store: Vec<(usize, Bytes)>,
    ) {
        let s = &*self.shared;
        let wanted: Vec<Ticket> =
            from_pool.iter().chain(from_store.iter()).filter_map(|(i, _)| tickets[*i]).collect();
        if wanted.is_empty() {
            s.stats
                .populate_skipped
                .fetch_add((from_pool.len() + from_store.len()) as u64, Relaxed);
            return;
        }
        let (_gates, valid) = s.coherence.admit(&wanted).await;
        let ok = |i: usize| tickets[i].is_some_and(|t| valid.contains(&t));
        let skipped = from_pool.len() + from_store.len() - valid.len();
        s.stats.populate_skipped.fetch_add(skipped as u64, Relaxed);
        let local = s.config.local_pages > 0;
        for (i, page) in from_pool.iter().chain(from_store.iter()) {
            if local && ok(*i) {
                keep_local(s, pieces[*i].page, page.clone());
            }
        }
        let to_pool = s.config.mode == Mode::Inclusive || !local;
        if let (true, Some(pool)) = (to_pool, s.pool.as_ref()) {
            let pages: Vec<(u64, &Bytes)> = from_store
                .iter()
                .filter(|(i, _)| ok(*i))
                .map(|(i, b)| (pieces[*i].page, b))
                .collect();
            if !pages.is_empty() && s.pool_trusted.load(Relaxed) {
                put_into_pool(s, pool, &pages, "populate").await;
            }
        }
    }

    /// Writes `data` at `offset`: through to the backing store, or into the dirty set
    /// (write-back; FUA writes it out before returning). Acknowledge only after `Ok`.
    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        match self.shared.config.write {
            WritePolicy::Through => self.write_through(offset, data, fua).await,
            WritePolicy::Back { max_dirty_bytes, .. } => {
                self.write_back(offset, data, fua, max_dirty_bytes).await
            }
        }
    }

    /// Write-through: the store first, then the local tier (whole pages) is updated and
    /// every other copy invalidated.
    async fn write_through(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        let s = &*self.shared;
        let pieces: Vec<Piece> = pieces(offset, data.len() as u64).collect();
        let guard = s.coherence.begin_write(pieces.iter().map(|p| p.page));
        let written = s.backing.write(offset, data.clone(), fua).await;
        let gates = guard.gates().await;
        // Even a failed write may have changed part of the range: drop every copy then.
        let mut at = 0;
        let mut replace = Vec::new();
        let mut invalidate = Vec::new();
        for p in &pieces {
            if p.page < s.whole_pages {
                if p.is_whole() && written.is_ok() && s.config.local_pages > 0 {
                    replace.push((p.page, data.slice(at..at + PAGE_SIZE)));
                } else {
                    s.local.remove(p.page);
                }
                invalidate.push(p.page);
            }
            at += p.len();
        }
        for (page, bytes) in replace {
            // Evictions here go to the demoter with no ticket for pages of this write's
            // stripes: those are dropped, never demoted stale.
            keep_local(s, page, bytes);
        }
        self.invalidate_in_pool(&invalidate).await;
        gates.finish();
        written
    }

    /// Removes cached copies of whole pages in the pool; on failure, distrusts the pool.
    async fn invalidate_in_pool(&self, pages: &[u64]) {
        let s = &*self.shared;
        let Some(pool) = &s.pool else { return };
        if pages.is_empty() {
            return;
        }
        if let Err(err) = pool.store.invalidate_pages(&self.keys(pool, pages)).await {
            s.stats.pool_errors.fetch_add(1, Relaxed);
            s.distrust_epoch.fetch_add(1, Relaxed);
            if s.pool_trusted.swap(false, Relaxed) {
                tracing::warn!(%err, "could not invalidate pages in the pool; skipping the pool until it is cleared");
            }
        }
    }

    /// Makes every completed write durable: dirty pages (write-back) are written out, then
    /// the store flushes.
    pub async fn flush(&self) -> io::Result<()> {
        write_back_all(&self.shared, None).await?;
        self.shared.backing.flush().await
    }

    /// Write-back: the whole pages of the range go into the dirty set (partial pages are
    /// merged with their current content); bytes past the last whole page of the export go
    /// through. The write waits while the dirty set is over its limit.
    async fn write_back(
        &self,
        offset: u64,
        data: Bytes,
        fua: bool,
        max_dirty: u64,
    ) -> io::Result<()> {
        let s = &*self.shared;
        // Over the limit, the writer writes back itself: that is the backpressure.
        while s.dirty.bytes() > max_dirty {
            write_back_all(s, None).await?;
        }
        let pieces: Vec<Piece> = pieces(offset, data.len() as u64).collect();
        let cached_end = s.whole_pages * PAGE;
        // The part past the last whole page is never cached: write it through.
        if offset + data.len() as u64 > cached_end {
            let from = cached_end.max(offset);
            let skip = (from - offset) as usize;
            self.write_through(from, data.slice(skip..), fua).await?;
        }
        let numbers: Vec<u64> =
            pieces.iter().map(|p| p.page).filter(|p| *p < s.whole_pages).collect();
        if numbers.is_empty() {
            return Ok(());
        }
        // The gates are taken before partial pages are merged, so two writes to different
        // bytes of one page cannot both read the old page and lose one of the changes.
        let guard = s.coherence.begin_write(numbers.iter().copied());
        let gates = guard.gates().await;
        let mut at = 0;
        for p in &pieces {
            if p.page < s.whole_pages {
                let piece = data.slice(at..at + p.len());
                let page = if p.is_whole() {
                    piece
                } else {
                    let current = match s.dirty.get(p.page).or_else(|| s.local.get(p.page)) {
                        Some(page) => page,
                        None => s.backing.read(p.page * PAGE, PAGE_SIZE as u32).await?,
                    };
                    let mut merged = BytesMut::from(&current[..]);
                    merged[p.start..p.end].copy_from_slice(&piece);
                    merged.freeze()
                };
                s.local.remove(p.page);
                s.dirty.insert(p.page, page);
            }
            at += p.len();
        }
        self.invalidate_in_pool(&numbers).await;
        gates.finish();
        if fua {
            write_back_all(s, Some(&numbers)).await?;
            s.backing.flush().await?;
        }
        Ok(())
    }

    /// Discards a range in the backing store and drops its cached copies.
    pub async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        self.discard(offset, len, |b| Box::pin(async move { b.backing.trim(offset, len).await }))
            .await
    }

    /// Zeroes a range in the backing store and drops its cached copies.
    pub async fn write_zeroes(&self, offset: u64, len: u32, may_trim: bool) -> io::Result<()> {
        self.discard(offset, len, |b| {
            Box::pin(async move { b.backing.write_zeroes(offset, len, may_trim).await })
        })
        .await
    }

    async fn discard<F>(&self, offset: u64, len: u32, op: F) -> io::Result<()>
    where
        F: for<'a> FnOnce(&'a Shared) -> futures::future::BoxFuture<'a, io::Result<()>>,
    {
        let s = &*self.shared;
        let pages: Vec<u64> = pieces(offset, len as u64).map(|p| p.page).collect();
        // Dirty pages of the range go out first, so the store applies the discard to their
        // newest content (a partial page keeps the rest of its bytes).
        write_back_all(s, Some(&pages)).await?;
        let guard = s.coherence.begin_write(pages.iter().copied());
        let result = op(s).await;
        let gates = guard.gates().await;
        let cached: Vec<u64> = pages.into_iter().filter(|p| *p < s.whole_pages).collect();
        for page in &cached {
            s.local.remove(*page);
        }
        self.invalidate_in_pool(&cached).await;
        gates.finish();
        result
    }

    /// Reads a range into the caches (the NBD CACHE command), returning nothing.
    pub async fn prefetch(&self, offset: u64, len: u32) -> io::Result<()> {
        // Chunks below the scan threshold, so that a prefetch does populate.
        let chunk = (self.shared.config.scan_bytes / 2).max(PAGE as u32);
        let mut at = offset;
        let end = offset + len as u64;
        while at < end {
            let n = (end - at).min(chunk as u64) as u32;
            self.read(at, n).await?;
            at += n as u64;
        }
        Ok(())
    }
}

/// A store that answers a read with the wrong number of bytes is broken; the reply to the
/// client must still be exactly as long as it says (the NBD stream has no other framing).
fn check_len(data: &Bytes, expected: u64) -> io::Result<()> {
    if data.len() as u64 == expected {
        return Ok(());
    }
    let why = format!("the backing store returned {} bytes for a read of {expected}", data.len());
    Err(io::Error::new(io::ErrorKind::InvalidData, why))
}

/// Puts clean pages into the pool in one batch; a failure is counted and logged, never an
/// error (the pages are clean: losing them costs a re-read).
async fn put_into_pool(s: &Shared, pool: &PoolTier, pages: &[(u64, &Bytes)], what: &str) {
    let keys: Vec<PageKey> =
        pages.iter().map(|(p, _)| PageKey::new(pool.pool, pool.object, *p)).collect();
    let mut data = BytesMut::with_capacity(pages.len() * PAGE_SIZE);
    for (_, b) in pages {
        data.extend_from_slice(b);
    }
    match pool.store.put_many(&keys, data.freeze()).await {
        Ok(outcomes) => {
            let stored = outcomes.iter().filter(|o| **o == PutOutcome::Stored).count();
            s.stats.pool_puts.fetch_add(stored as u64, Relaxed);
        }
        Err(err) => {
            s.stats.pool_errors.fetch_add(1, Relaxed);
            tracing::debug!(%err, what, "putting pages into the pool failed");
        }
    }
}

/// Inserts into the local tier; an evicted page goes to the demoter (exclusive mode).
fn keep_local(s: &Shared, page: u64, data: Bytes) {
    if let Some((evicted, bytes)) = s.local.insert(page, data) {
        if let Some(demote) = &s.demote {
            // The evicted page was valid while in the tier; its ticket now guards the
            // trip to the pool against a write that starts meanwhile.
            match s.coherence.ticket(evicted) {
                Some(ticket) => {
                    if demote.try_send((evicted, bytes, ticket)).is_err() {
                        s.stats.demotions_dropped.fetch_add(1, Relaxed);
                    }
                }
                None => {
                    s.stats.populate_skipped.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

/// How many runs of dirty pages a write-back keeps in flight to the backing store. A
/// guest's page cache writes back scattered runs (Postmark, a database, random writes);
/// written one at a time over a store with a millisecond of latency, a flush took a
/// millisecond per run and writers waiting on the dirty limit stalled behind it, so that
/// write-back ran slower than write-through, whose requests arrive with the guest's own
/// parallelism.
const WRITE_BACK_IN_FLIGHT: usize = 16;

/// The longest run of consecutive dirty pages written as one request (1 MiB).
const WRITE_BACK_RUN_PAGES: usize = 256;

/// Writes dirty pages to the backing store (all of them, or those in `only`), in runs of
/// consecutive pages, up to [`WRITE_BACK_IN_FLIGHT`] runs at once, and forgets each page
/// written unless it was written again meanwhile. A page written back stays cached as a
/// clean page in the local tier (as a write-through write leaves it), unless a write of it
/// began since the pass took its snapshot: a workload that reads what it wrote (Postmark,
/// a database) would otherwise miss on every page that had been dirty. Flushes are
/// serialised, so a FLUSH that returns has seen every page dirty when it began. On the
/// first failed run no further run starts and the error is returned once those in flight
/// have ended; pages of runs that did not complete stay dirty.
async fn write_back_all(s: &Shared, only: Option<&[u64]>) -> io::Result<()> {
    use futures::StreamExt;

    let _one_at_a_time = s.dirty.flushing().await;
    let snapshot = s.dirty.snapshot(only);
    // Taken with the snapshot: a write that begins later invalidates the ticket, so its
    // page is not put back into the local tier with the older bytes.
    let keep = s.config.local_pages > 0;
    let tickets: Vec<Option<Ticket>> = snapshot
        .iter()
        .map(|(page, _, _)| if keep { s.coherence.ticket(*page) } else { None })
        .collect();
    let mut runs = Vec::new();
    let mut i = 0;
    while i < snapshot.len() {
        let mut j = i + 1;
        while j < snapshot.len()
            && snapshot[j].0 == snapshot[j - 1].0 + 1
            && j - i < WRITE_BACK_RUN_PAGES
        {
            j += 1;
        }
        runs.push((&snapshot[i..j], &tickets[i..j]));
        i = j;
    }
    let failed = std::sync::Mutex::new(None);
    let failed_ref = &failed;
    futures::stream::iter(runs)
        .for_each_concurrent(WRITE_BACK_IN_FLIGHT, |(run, tickets)| async move {
            let failed = failed_ref;
            let Some(&(first, _, _)) = run.first() else { return };
            if failed.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                return;
            }
            let mut bytes = BytesMut::with_capacity(run.len() * PAGE_SIZE);
            for (_, page, _) in run {
                bytes.extend_from_slice(page);
            }
            match s.backing.write(first * PAGE, bytes.freeze(), false).await {
                Ok(()) => {
                    let held: Vec<Ticket> = tickets.iter().flatten().copied().collect();
                    let (_gates, valid) = s.coherence.admit(&held).await;
                    for ((page, bytes, version), ticket) in run.iter().zip(tickets) {
                        s.dirty.clean(*page, *version);
                        if ticket.is_some_and(|t| valid.contains(&t)) {
                            keep_local(s, *page, bytes.clone());
                        }
                    }
                    s.stats.written_back.fetch_add(run.len() as u64, Relaxed);
                }
                Err(err) => {
                    s.stats.write_back_errors.fetch_add(1, Relaxed);
                    tracing::warn!(%err, page = first, "write-back failed; the pages stay dirty");
                    failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(err);
                }
            }
        })
        .await;
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// Writes dirty pages out when they get old or too many. Stops when the cache is dropped.
async fn flusher(cache: std::sync::Weak<Shared>, max_age: Duration) {
    let tick = (max_age / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::time::sleep(tick).await;
        let Some(s) = cache.upgrade() else { return };
        if s.dirty.is_empty() {
            continue;
        }
        let WritePolicy::Back { max_dirty_bytes, .. } = s.config.write else { return };
        let old = s.dirty.oldest_age().is_some_and(|age| age >= max_age);
        if old || s.dirty.bytes() > max_dirty_bytes / 2 {
            if let Err(err) = write_back_all(&s, None).await {
                tracing::debug!(%err, "background write-back failed; retrying later");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Moves pages evicted from the local tier into the pool, in batches, off the request
/// path. Stops when the cache is dropped.
async fn demoter(cache: std::sync::Weak<Shared>, mut rx: mpsc::Receiver<(u64, Bytes, Ticket)>) {
    let mut batch = Vec::with_capacity(DEMOTE_BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < DEMOTE_BATCH {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let Some(s) = cache.upgrade() else { return };
        let Some(pool) = &s.pool else { return };
        if s.pool_trusted.load(Relaxed) {
            let tickets: Vec<Ticket> = batch.iter().map(|(_, _, t)| *t).collect();
            let (_gates, valid) = s.coherence.admit(&tickets).await;
            let items: Vec<&(u64, Bytes, Ticket)> =
                batch.iter().filter(|(_, _, t)| valid.contains(t)).collect();
            if !items.is_empty() {
                let pages: Vec<(u64, &Bytes)> = items.iter().map(|(p, b, _)| (*p, b)).collect();
                put_into_pool(&s, pool, &pages, "demotion").await;
            }
        }
        batch.clear();
    }
}

/// Restores trust in the pool after a failed invalidation, by invalidating the export's
/// whole object there. Stops when the cache is dropped.
async fn trust_keeper(cache: std::sync::Weak<Shared>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(s) = cache.upgrade() else { return };
        if s.pool_trusted.load(Relaxed) {
            continue;
        }
        let Some(pool) = &s.pool else { return };
        let epoch = s.distrust_epoch.load(Relaxed);
        match pool.store.invalidate_object(pool.pool, pool.object).await {
            Ok(n) if s.distrust_epoch.load(Relaxed) == epoch => {
                s.pool_trusted.store(true, Relaxed);
                tracing::info!(pages = n, "pool cleared of this export's pages; using it again");
            }
            Ok(_) => {} // another failure meanwhile: clear again next round
            Err(err) => tracing::debug!(%err, "pool still unavailable"),
        }
    }
}
