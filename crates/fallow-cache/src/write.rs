//! The write paths: write-through, write-back (the dirty set and writing it back), FLUSH,
//! and the discards (TRIM, WRITE_ZEROES).

#![expect(
    clippy::indexing_slicing,
    reason = "pieces lie within their page; runs and tickets are ranges of one snapshot"
)]

use std::io;
use std::sync::atomic::Ordering::Relaxed;

use bytes::{Bytes, BytesMut};
use fallow_backing::{Durability, Zeroing};
use fallow_core::PAGE_SIZE;

use crate::coherence::Ticket;
use crate::split::{pieces, Piece};
use crate::tiers::keep_local;
use crate::{CacheLayer, Shared, WritePolicy, PAGE};

impl CacheLayer {
    /// Writes `data` at `offset`: through to the backing store, or into the dirty set
    /// (write-back; FUA writes it out before returning). Acknowledge only after `Ok`.
    pub async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> io::Result<()> {
        match self.shared.write_policy() {
            WritePolicy::Through => self.write_through(offset, data, durability).await,
            WritePolicy::Back { max_dirty_bytes, .. } => {
                self.write_back(offset, data, durability, max_dirty_bytes).await
            }
        }
    }

    /// Write-through: the store first, then the local tier (whole pages) is updated and
    /// every other copy invalidated.
    pub(crate) async fn write_through(
        &self,
        offset: u64,
        data: Bytes,
        durability: Durability,
    ) -> io::Result<()> {
        let s = &*self.shared;
        let pieces: Vec<Piece> = pieces(offset, data.len() as u64).collect();
        let guard = s.coherence.begin_write(pieces.iter().map(|p| p.page));
        let written = s.backing.write(offset, data.clone(), durability).await;
        let gates = guard.gates().await;
        // Even a failed write may have changed part of the range: drop every copy then.
        // So does a write that overlapped another of the same page: the store may have
        // applied them in either order.
        let mut at = 0;
        let mut replace = Vec::new();
        let mut invalidate = Vec::new();
        for p in &pieces {
            if p.page < s.whole_pages {
                let alone = gates.alone_on(p.page);
                if p.is_whole() && written.is_ok() && s.config.local_pages > 0 && alone {
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

    /// Makes every completed write durable: dirty pages (write-back) are written out, then
    /// the store flushes.
    pub async fn flush(&self) -> io::Result<()> {
        write_back_all(&self.shared, None).await?;
        self.shared.backing.flush().await
    }

    /// Write-back: the whole pages of the range go into the dirty set (partial pages are
    /// merged with their current content); bytes past the last whole page of the export go
    /// through. The write waits while the dirty set is over its limit.
    pub(crate) async fn write_back(
        &self,
        offset: u64,
        data: Bytes,
        durability: Durability,
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
            self.write_through(from, data.slice(skip..), durability).await?;
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
        // Every page is built before any goes into the dirty set: a store read for a
        // partial page can fail, and the write must then change nothing (a page made dirty
        // here would skip the pool invalidation below, and its older pool copy would be
        // served once the page is written back).
        let mut pages = Vec::with_capacity(numbers.len());
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
                pages.push((p.page, page));
            }
            at += p.len();
        }
        for (number, page) in pages {
            s.local.remove(number);
            s.dirty.insert(number, page);
        }
        self.invalidate_in_pool(&numbers).await;
        gates.finish();
        if durability == Durability::Immediate {
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
    pub async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        self.discard(offset, len, |b| {
            Box::pin(async move { b.backing.write_zeroes(offset, len, zeroing).await })
        })
        .await
    }

    pub(crate) async fn discard<F>(&self, offset: u64, len: u32, op: F) -> io::Result<()>
    where
        F: for<'a> FnOnce(&'a Shared) -> futures::future::BoxFuture<'a, io::Result<()>>,
    {
        let s = &*self.shared;
        let range: Vec<Piece> = pieces(offset, len as u64).collect();
        let pages: Vec<u64> = range.iter().map(|p| p.page).collect();
        // No write-back pass runs until the discard is done: the store may apply a write
        // that overlaps the discard in either order, and a page a pass holds may be older
        // than the discard (`a_write_back_pass_during_a_zeroing_of_its_page_…`).
        let one_at_a_time = s.dirty.flushing().await;
        // Dirty pages of the range go out first, so the store applies the discard to their
        // newest content (a partial page keeps the rest of its bytes).
        write_back_held(s, Some(&pages)).await?;
        let guard = s.coherence.begin_write(pages.iter().copied());
        let result = op(s).await;
        let gates = guard.gates().await;
        if result.is_ok() {
            // A write-back write of one of these pages that took the gates since the
            // write-back above made the page dirty again, merged with what the store or
            // the local tier held before the discard. The two overlapped, so the write may
            // count as the older: the discard applies to the dirty copy too, or that
            // copy's write-back would put the discarded bytes back after the store
            // dropped them (`a_partial_write_racing_a_zeroing_of_its_page_…`).
            for p in range.iter().filter(|p| p.page < s.whole_pages) {
                s.dirty.zero(p.page, p.start, p.end);
            }
        }
        drop(one_at_a_time);
        let cached: Vec<u64> = pages.into_iter().filter(|p| *p < s.whole_pages).collect();
        for page in &cached {
            s.local.remove(*page);
        }
        self.invalidate_in_pool(&cached).await;
        gates.finish();
        result
    }
}

/// How many runs of dirty pages a write-back keeps in flight to the backing store. A
/// guest's page cache writes back scattered runs (Postmark, a database, random writes);
/// written one at a time over a store with a millisecond of latency, a flush took a
/// millisecond per run and writers waiting on the dirty limit stalled behind it, so that
/// write-back ran slower than write-through, whose requests arrive with the guest's own
/// parallelism.
pub(crate) const WRITE_BACK_IN_FLIGHT: usize = 16;

/// The longest run of consecutive dirty pages written as one request (1 MiB).
pub(crate) const WRITE_BACK_RUN_PAGES: usize = 256;

/// Writes dirty pages to the backing store (all of them, or those in `only`), in runs of
/// consecutive pages, up to [`WRITE_BACK_IN_FLIGHT`] runs at once, and forgets each page
/// written unless it was written again meanwhile. A page written back stays cached as a
/// clean page in the local tier (as a write-through write leaves it), unless a write of it
/// began since the pass took its snapshot: a workload that reads what it wrote (Postmark,
/// a database) would otherwise miss on every page that had been dirty. Flushes are
/// serialised, so a FLUSH that returns has seen every page dirty when it began. On the
/// first failed run no further run starts and the error is returned once those in flight
/// have ended; pages of runs that did not complete stay dirty.
pub(crate) async fn write_back_all(s: &Shared, only: Option<&[u64]>) -> io::Result<()> {
    let _one_at_a_time = s.dirty.flushing().await;
    write_back_held(s, only).await
}

/// [`write_back_all`] for a caller that holds the dirty set's `flushing` lock.
async fn write_back_held(s: &Shared, only: Option<&[u64]>) -> io::Result<()> {
    use futures::StreamExt;

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
            match s.backing.write(first * PAGE, bytes.freeze(), Durability::AtFlush).await {
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
