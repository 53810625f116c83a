//! Keeping cached copies coherent with the backing store when reads and writes race.
//!
//! The danger: a read misses, fetches the page from the backing store, and puts it into the
//! cache; meanwhile a write changes the page in the store and invalidates the cache. If the
//! read's put lands after the write's invalidation, the cache holds the old page forever.
//!
//! The rule, per stripe of pages (a page's stripe is fixed by its number):
//!
//! ```text
//!  write:  writers += 1; gen += 1        (before touching the store)
//!          store write
//!          gate.write():  update or invalidate cached copies; gen += 1
//!          writers -= 1                  (then the write is acknowledged)
//!
//!  read miss:  ticket = gen, unless writers > 0   (before reading the store)
//!              store read
//!              gate.read():  if gen == ticket and writers == 0 → populate the cache
//! ```
//!
//! A read that took its ticket before a write began sees `gen` changed and does not
//! populate; one that began during the write got no ticket; one whose populate is under way
//! when the write wants the gate holds the gate, so the write waits, then invalidates what
//! was just put. A populate never lands after a write's invalidation. A write leaves its
//! own data as a page's cached copy only if no other write of the stripe overlapped it
//! ([`WriteGates::alone_on`]): the store may apply two overlapping writes in the order
//! opposite to that of their answers, so the cache keeps neither. The gates are tokio
//! `RwLock`s because a populate into a remote pool is a network round trip; gates of
//! several stripes are always taken in ascending stripe order, so readers and writers
//! cannot deadlock.

#![expect(
    clippy::indexing_slicing,
    reason = "stripe numbers are taken modulo the number of stripes"
)]

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Stripes per export: enough that unrelated pages rarely share one.
pub const STRIPES: usize = 4096;

#[derive(Debug, Default)]
struct Stripe {
    gate: RwLock<()>,
    gen: AtomicU64,
    writers: AtomicU32,
}

/// The stripes of one export.
#[derive(Debug)]
pub struct Coherence {
    stripes: Box<[Stripe]>,
}

/// A read's permission to populate one page, taken before it read the backing store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// The page.
    pub page: u64,
    gen: u64,
}

/// Gates held by a reader while it populates.
#[derive(Debug)]
pub struct ReadGates<'a> {
    _guards: Vec<RwLockReadGuard<'a, ()>>,
}

/// A write in progress over a set of stripes.
#[derive(Debug)]
#[must_use = "a write must be finished, or its stripes stay marked as being written"]
pub struct WriteGuard<'a> {
    coherence: &'a Coherence,
    /// Ascending.
    stripes: Vec<usize>,
    /// Each stripe's `gen` as this write's start left it.
    gens: Vec<u64>,
}

impl Default for Coherence {
    fn default() -> Self {
        Self::new()
    }
}

impl Coherence {
    /// Fresh stripes.
    pub fn new() -> Self {
        Self { stripes: (0..STRIPES).map(|_| Stripe::default()).collect() }
    }

    fn stripe_of(page: u64) -> usize {
        // Neighbouring pages go to different stripes, so a large write spreads out.
        (page.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize % STRIPES
    }

    /// A ticket for `page`, or `None` while a write of its stripe is in flight.
    pub fn ticket(&self, page: u64) -> Option<Ticket> {
        let stripe = &self.stripes[Self::stripe_of(page)];
        // Read `gen` after `writers`: a writer raises `writers` before `gen`, so a zero
        // here and an unchanged `gen` later mean no write overlapped the read.
        if stripe.writers.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(Ticket { page, gen: stripe.gen.load(Ordering::Acquire) })
    }

    fn sorted_stripes(pages: impl Iterator<Item = u64>) -> Vec<usize> {
        let mut stripes: Vec<usize> = pages.map(Self::stripe_of).collect();
        stripes.sort_unstable();
        stripes.dedup();
        stripes
    }

    /// Takes the read gates of the tickets' stripes and returns the tickets still valid:
    /// those pages may be put into the cache while the gates are held.
    pub async fn admit(&self, tickets: &[Ticket]) -> (ReadGates<'_>, Vec<Ticket>) {
        let mut guards = Vec::new();
        for s in Self::sorted_stripes(tickets.iter().map(|t| t.page)) {
            guards.push(self.stripes[s].gate.read().await);
        }
        let valid = tickets
            .iter()
            .copied()
            .filter(|t| {
                let stripe = &self.stripes[Self::stripe_of(t.page)];
                stripe.writers.load(Ordering::Acquire) == 0
                    && stripe.gen.load(Ordering::Acquire) == t.gen
            })
            .collect();
        (ReadGates { _guards: guards }, valid)
    }

    /// Marks the start of a write of `pages` (before the backing store is touched).
    pub fn begin_write(&self, pages: impl Iterator<Item = u64>) -> WriteGuard<'_> {
        let stripes = Self::sorted_stripes(pages);
        let mut gens = Vec::with_capacity(stripes.len());
        for s in &stripes {
            let stripe = &self.stripes[*s];
            stripe.writers.fetch_add(1, Ordering::AcqRel);
            gens.push(stripe.gen.fetch_add(1, Ordering::AcqRel) + 1);
        }
        WriteGuard { coherence: self, stripes, gens }
    }
}

impl<'a> WriteGuard<'a> {
    /// Takes the write gates (waiting for populates under way), for the caller to update
    /// or invalidate the cached copies; then call [`WriteGates::finish`].
    pub async fn gates(self) -> WriteGates<'a> {
        let mut guards = Vec::with_capacity(self.stripes.len());
        for s in &self.stripes {
            guards.push(self.coherence.stripes[*s].gate.write().await);
        }
        WriteGates { guard: self, _guards: guards }
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        // Also on error paths: bump `gen` so no ticket from before survives, then let reads
        // populate again.
        for s in &self.stripes {
            let stripe = &self.coherence.stripes[*s];
            stripe.gen.fetch_add(1, Ordering::AcqRel);
            stripe.writers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The write gates of a write, held while the caches are updated.
#[derive(Debug)]
pub struct WriteGates<'a> {
    /// Declared first, so it drops first: `gen` moves on and `writers` falls while the
    /// gates below are still held.
    guard: WriteGuard<'a>,
    _guards: Vec<RwLockWriteGuard<'a, ()>>,
}

impl WriteGates<'_> {
    /// Whether this write had `page`'s stripe to itself: no other write of the stripe was
    /// in flight when it began, began since, or is in flight now. Only then may it leave
    /// its data as the page's cached copy: of two overlapping writes of a page, the store
    /// may apply the one whose answer comes first last, so neither knows it is the newer.
    pub fn alone_on(&self, page: u64) -> bool {
        let guard = &self.guard;
        let Ok(i) = guard.stripes.binary_search(&Coherence::stripe_of(page)) else {
            return false;
        };
        let stripe = &guard.coherence.stripes[guard.stripes[i]];
        // `writers` first: a write that begins raises it before `gen`.
        stripe.writers.load(Ordering::Acquire) == 1
            && stripe.gen.load(Ordering::Acquire) == guard.gens[i]
    }

    /// Ends the write: `gen` moves on and reads may populate again.
    pub fn finish(self) {
        let WriteGates { guard, _guards } = self;
        drop(guard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_ticket_from_before_a_write_is_refused() {
        let c = Coherence::new();
        let ticket = c.ticket(7).unwrap();
        let write = c.begin_write([7].into_iter());
        assert!(c.ticket(7).is_none(), "no tickets while a write is in flight");
        let (_, valid) = c.admit(&[ticket]).await;
        assert!(valid.is_empty());
        write.gates().await.finish();
        let (_, valid) = c.admit(&[ticket]).await;
        assert!(valid.is_empty(), "gen moved on");
        let fresh = c.ticket(7).unwrap();
        let (_, valid) = c.admit(&[fresh]).await;
        assert_eq!(valid, vec![fresh]);
    }

    #[tokio::test]
    async fn a_write_waits_for_a_populate_under_way() {
        let c = std::sync::Arc::new(Coherence::new());
        let ticket = c.ticket(3).unwrap();
        let (gates, valid) = c.admit(&[ticket]).await;
        assert_eq!(valid.len(), 1);
        let writer = {
            let c = c.clone();
            tokio::spawn(async move {
                let w = c.begin_write([3].into_iter());
                let g = w.gates().await;
                g.finish();
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!writer.is_finished(), "the write waits for the reader's gate");
        drop(gates);
        writer.await.unwrap();
        assert!(c.ticket(3).is_some());
    }

    #[tokio::test]
    async fn a_write_overlapped_by_another_is_not_alone() {
        let c = Coherence::new();
        let gates = c.begin_write([5].into_iter()).gates().await;
        assert!(gates.alone_on(5));
        gates.finish();
        // One began before the other ended: neither is alone, whatever the order.
        let first = c.begin_write([5].into_iter());
        let second = c.begin_write([5].into_iter());
        let gates = first.gates().await;
        assert!(!gates.alone_on(5));
        gates.finish();
        let gates = second.gates().await;
        assert!(!gates.alone_on(5), "the first ended after the second began");
        gates.finish();
        let gates = c.begin_write([5].into_iter()).gates().await;
        assert!(gates.alone_on(5), "writes that ended before it began do not count");
        assert!(!gates.alone_on(6), "a page it does not write");
    }

    #[test]
    fn a_dropped_write_releases_its_stripes() {
        let c = Coherence::new();
        drop(c.begin_write([1, 2, 3].into_iter()));
        assert!(c.ticket(2).is_some());
    }
}
