//! The recorder: a [`BackingStore`] that passes every operation to the store it wraps and
//! logs each WRITE (with its data, and whether it was FUA), WRITE_ZEROES, TRIM and FLUSH
//! that completed, with the ticks of a [`Clock`] taken as it began and as it ended.
//!
//! The clock is shared with whatever else the test records (the client's history,
//! markers such as "`sync` returned"), so one number orders every event of a run: an
//! operation that ended before another began has a smaller `end` than the other's
//! `start`, and two whose intervals overlap ran concurrently, in either order as far as
//! the store is concerned.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use fallow_backing::{BackingStore, Capabilities, Durability, Extent, Zeroing};

/// A counter that orders the events of a run; cheap to clone (an `Arc` inside).
#[derive(Debug, Clone, Default)]
pub struct Clock(Arc<AtomicU64>);

impl Clock {
    /// A clock whose first tick is 1, so that 0 can stand for "before anything".
    pub fn new() -> Clock {
        Clock::default()
    }

    /// The next tick: distinct and increasing across every thread.
    pub fn tick(&self) -> u64 {
        // SeqCst: ticks taken on different threads must agree with real time, as the
        // order of the events they stamp does.
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// What one recorded store operation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreOpKind {
    /// A write of `data` at `offset`; `fua`: durable when it completed.
    Write {
        /// Where.
        offset: u64,
        /// The bytes written.
        data: Bytes,
        /// Written with FUA (`Durability::Immediate`).
        fua: bool,
    },
    /// `write_zeroes` of a range.
    Zero {
        /// Where.
        offset: u64,
        /// How many bytes.
        len: u64,
    },
    /// `trim` of a range (the replay zeroes it, as a store that reads zeros after a trim).
    Trim {
        /// Where.
        offset: u64,
        /// How many bytes.
        len: u64,
    },
    /// `flush`: every operation that completed before it began is durable once it ends.
    Flush,
}

/// One store operation that completed successfully, with the clock's ticks around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOp {
    /// Taken before the operation was passed on.
    pub start: u64,
    /// Taken after it completed.
    pub end: u64,
    /// What it did.
    pub kind: StoreOpKind,
}

impl StoreOp {
    /// True for a FUA write: durable on its own once it completed.
    pub fn is_fua(&self) -> bool {
        matches!(self.kind, StoreOpKind::Write { fua: true, .. })
    }

    /// True for a flush.
    pub fn is_flush(&self) -> bool {
        self.kind == StoreOpKind::Flush
    }
}

/// A store that records every completed WRITE, WRITE_ZEROES, TRIM and FLUSH reaching the
/// store it wraps. Reads and block status pass through unrecorded; a failed operation is
/// not recorded (the tests that use the recorder run over stores that do not fail).
///
/// It advertises what the wrapped store can do, except that `flush` and `fua` are always
/// on: the recording stands for a disk with a volatile write cache, whose contents after
/// a crash the replay ([`super::states`]) works out, so the cache above it must flush.
#[derive(Debug)]
pub struct RecordingStore {
    inner: Arc<dyn BackingStore>,
    clock: Clock,
    /// Completed operations, in the order they were recorded (about completion order;
    /// sort by `end` for the exact one). A std mutex held for one push.
    log: Mutex<Vec<StoreOp>>,
}

impl RecordingStore {
    /// Records what reaches `inner`, stamping each operation with `clock`'s ticks.
    pub fn new(inner: Arc<dyn BackingStore>, clock: Clock) -> RecordingStore {
        RecordingStore { inner, clock, log: Mutex::new(Vec::new()) }
    }

    /// The clock the operations are stamped with.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// A copy of the log so far, sorted by completion (`end`).
    pub fn log(&self) -> Vec<StoreOp> {
        let mut ops = self.log.lock().unwrap_or_else(|e| e.into_inner()).clone();
        ops.sort_by_key(|op| op.end);
        ops
    }

    /// Operations recorded so far.
    pub fn len(&self) -> usize {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True before anything was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn record<T>(&self, start: u64, result: io::Result<T>, kind: StoreOpKind) -> io::Result<T> {
        let end = self.clock.tick();
        if result.is_ok() {
            self.log.lock().unwrap_or_else(|e| e.into_inner()).push(StoreOp { start, end, kind });
        }
        result
    }
}

#[async_trait]
impl BackingStore for RecordingStore {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { flush: true, fua: true, ..self.inner.capabilities() }
    }

    fn min_block_size(&self) -> u32 {
        self.inner.min_block_size()
    }

    fn preferred_block_size(&self) -> u32 {
        self.inner.preferred_block_size()
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        self.inner.read(offset, len).await
    }

    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> io::Result<()> {
        let start = self.clock.tick();
        let result = self.inner.write(offset, data.clone(), durability).await;
        let fua = durability == Durability::Immediate;
        self.record(start, result, StoreOpKind::Write { offset, data, fua })
    }

    async fn flush(&self) -> io::Result<()> {
        let start = self.clock.tick();
        let result = self.inner.flush().await;
        self.record(start, result, StoreOpKind::Flush)
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        let start = self.clock.tick();
        let result = self.inner.trim(offset, len).await;
        self.record(start, result, StoreOpKind::Trim { offset, len: len.into() })
    }

    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        let start = self.clock.tick();
        let result = self.inner.write_zeroes(offset, len, zeroing).await;
        self.record(start, result, StoreOpKind::Zero { offset, len: len.into() })
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        self.inner.block_status(offset, len).await
    }
}
