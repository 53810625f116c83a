//! The read path: dirty set, local tier, pool, backing store; populating the tiers with
//! what a read fetched; prefetch (NBD CACHE).

#![expect(
    clippy::indexing_slicing,
    reason = "a read's pieces, parts and tickets are parallel arrays of one length, built here"
)]

use std::io;
use std::sync::atomic::Ordering::Relaxed;

use bytes::{Bytes, BytesMut};
use fallow_core::PAGE_SIZE;

use crate::coherence::Ticket;
use crate::split::{pieces, Piece};
use crate::tiers::{keep_local, put_into_pool};
use crate::{CacheLayer, Mode, PAGE};

impl CacheLayer {
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
    pub(crate) async fn read_through(&self, offset: u64, len: u32) -> io::Result<Bytes> {
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
    pub(crate) async fn populate(
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
pub(crate) fn check_len(data: &Bytes, expected: u64) -> io::Result<()> {
    if data.len() as u64 == expected {
        return Ok(());
    }
    let why = format!("the backing store returned {} bytes for a read of {expected}", data.len());
    Err(io::Error::new(io::ErrorKind::InvalidData, why))
}
