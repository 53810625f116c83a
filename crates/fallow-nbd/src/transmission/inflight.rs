//! The requests in flight on one connection, polled by the connection's own task.
//!
//! A fixed number of slots, each a boxed future that is reused for the next request (no
//! allocation per request once the slots exist), and each with a waker of its own that
//! marks the slot ready and wakes the connection's task: only the requests that were woken
//! are polled again. Why not `futures`' `FuturesUnordered`: it wakes its task again every
//! time it has polled all its futures (a fairness rule), which cost a spurious wake-up,
//! and on 2 CPUs a sibling worker's `futex` wake and wait, per request at queue depth 1.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures::task::AtomicWaker;

/// The most requests in flight at once: one bit each in [`Woken::bits`].
pub const SLOTS: usize = 64;

/// Which slots were woken since the set last looked, and the task to wake.
#[derive(Default)]
struct Woken {
    bits: AtomicU64,
    task: AtomicWaker,
}

/// One slot's waker.
struct SlotWaker {
    woken: Arc<Woken>,
    bit: u64,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.bits.fetch_or(self.bit, Ordering::AcqRel);
        self.woken.task.wake();
    }
}

struct Slot<F> {
    future: Pin<Box<Option<F>>>,
    waker: Waker,
}

/// Up to [`SLOTS`] futures of one type, run to completion in any order.
pub struct InFlight<F: Future> {
    slots: Vec<Slot<F>>,
    /// Slots whose future is `None`.
    free: Vec<usize>,
    woken: Arc<Woken>,
    /// Outputs of futures that finished, not yet handed out.
    done: VecDeque<F::Output>,
    running: usize,
}

impl<F: Future> Default for InFlight<F> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            woken: Arc::default(),
            done: VecDeque::new(),
            running: 0,
        }
    }
}

impl<F: Future> InFlight<F> {
    /// Futures running or finished but not yet handed out.
    pub fn len(&self) -> usize {
        self.running + self.done.len()
    }

    /// True when nothing is running or waiting to be handed out.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when [`push`](Self::push) would have to refuse.
    pub fn is_full(&self) -> bool {
        self.len() >= SLOTS
    }

    /// Adds a future; it is first polled by the next [`poll_next`](Self::poll_next).
    ///
    /// # Panics
    /// When full: the caller checks [`is_full`](Self::is_full) first.
    #[expect(clippy::indexing_slicing, reason = "free slot numbers are below `SLOTS`")]
    pub fn push(&mut self, future: F) {
        assert!(!self.is_full(), "more than {SLOTS} requests in flight");
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i].future.set(Some(future));
                i
            }
            None => {
                let i = self.slots.len();
                let waker =
                    Waker::from(Arc::new(SlotWaker { woken: self.woken.clone(), bit: 1 << i }));
                self.slots.push(Slot { future: Box::pin(Some(future)), waker });
                i
            }
        };
        self.running += 1;
        self.woken.bits.fetch_or(1 << i, Ordering::AcqRel);
    }

    /// Polls the futures that were woken (or are new); hands out one finished output.
    /// `Pending` when none has finished; the task is woken when one of them is woken.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<F::Output>> {
        if let Some(output) = self.done.pop_front() {
            return Poll::Ready(Some(output));
        }
        if self.running == 0 {
            return Poll::Ready(None);
        }
        // Register before taking the bits: a wake that comes after the swap wakes the
        // task, and the bits it sets are seen on the next call.
        self.woken.task.register(cx.waker());
        let mut bits = self.woken.bits.swap(0, Ordering::AcqRel);
        while bits != 0 {
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            // A wake-up for a slot that finished (from a waker kept by whoever held it),
            // or for one since reused, costs at most an extra poll.
            let Some(slot) = self.slots.get_mut(i) else { continue };
            let Some(future) = slot.future.as_mut().as_pin_mut() else { continue };
            let mut slot_cx = Context::from_waker(&slot.waker);
            if let Poll::Ready(output) = future.poll(&mut slot_cx) {
                slot.future.set(None);
                self.free.push(i);
                self.running -= 1;
                self.done.push_back(output);
            }
        }
        match self.done.pop_front() {
            Some(output) => Poll::Ready(Some(output)),
            None => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn every_future_finishes_and_slots_are_reused() {
        let mut set = InFlight::default();
        let mut outputs = Vec::new();
        for round in 0..3u64 {
            for i in 0..SLOTS as u64 {
                // Finish in reverse order of pushing, some at once.
                let delay = Duration::from_micros((SLOTS as u64 - i) * 50 * (i % 2));
                set.push(async move {
                    tokio::time::sleep(delay).await;
                    round * 1000 + i
                });
            }
            assert!(set.is_full());
            while let Some(out) = std::future::poll_fn(|cx| set.poll_next(cx)).await {
                outputs.push(out);
            }
            assert!(set.is_empty());
        }
        assert_eq!(set.slots.len(), SLOTS, "slots are reused, not added");
        outputs.sort_unstable();
        let expected: Vec<u64> =
            (0..3).flat_map(|r| (0..SLOTS as u64).map(move |i| r * 1000 + i)).collect();
        assert_eq!(outputs, expected);
    }

    #[tokio::test]
    async fn a_wake_from_another_task_wakes_the_owner() {
        let mut set = InFlight::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        set.push(async move { rx.await.unwrap_or(0) });
        let pending = std::future::poll_fn(|cx| Poll::Ready(set.poll_next(cx))).await;
        assert!(pending.is_pending());
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            tx.send(7).unwrap();
        });
        let got = tokio::time::timeout(
            Duration::from_secs(5),
            std::future::poll_fn(|cx| set.poll_next(cx)),
        )
        .await
        .expect("the owner was woken");
        assert_eq!(got, Some(7));
        sender.await.unwrap();
    }
}
