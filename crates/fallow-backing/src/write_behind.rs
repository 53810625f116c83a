//! The backup of a pool export (`pool:SIZE,backup=PATH`): a file that receives the
//! export's pages in the background, so that the disk survives the loss of every node that
//! held it (Infiniswap's disk backup of remote slabs).
//!
//! Every change (a page's new bytes, or pages zeroed) is recorded here *before* it goes to
//! the pool, and stays recorded until a writer task has written it into the file; the file
//! holds every page no recorded change covers. So a page is always in one of three places,
//! newest first: the pool, a recorded change, the file. A read the pool cannot answer (a
//! page it lost, or a pool that is gone) takes the recorded change, else the file, and
//! never waits for the writer; a write waits only while more than the limit is recorded
//! (the file is slower than the writes). `drain` waits until everything recorded is in the
//! file, and makes the file durable: the export's FLUSH.
//!
//! ```text
//!   write(page, bytes) ─▶ record (page → bytes) ─▶ put into the pool ─▶ ack
//!                              │
//!   writer task ◀──────────────┘ takes runs of recorded pages in page order, writes them
//!   into the file, forgets each page whose record did not change meanwhile
//! ```

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fallow_core::PAGE_SIZE;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::{BackingStore, Durability, FileStore, Zeroing};

/// The most pages one write into the file carries.
const RUN_PAGES: u64 = 256;

/// How long the writer waits before it tries the file again after an error.
const RETRY: Duration = Duration::from_secs(1);

/// A change not yet in the file.
#[derive(Debug, Clone)]
pub(crate) enum Change {
    /// The page's new bytes.
    Data(Bytes),
    /// The page reads as zeros.
    Zero,
}

/// The recorded changes.
#[derive(Debug, Default)]
struct Pending {
    /// Page → (generation of its last change, the change).
    pages: BTreeMap<u64, (u64, Change)>,
    /// Bytes of data held in `pages`.
    bytes: usize,
    next_generation: u64,
    /// The writer's last error, while the file keeps failing.
    error: Option<String>,
}

/// The backup file and the changes on their way to it.
#[derive(Debug)]
pub(crate) struct WriteBehind {
    file: Arc<FileStore>,
    pending: Arc<Mutex<Pending>>,
    /// Wakes the writer: a change was recorded.
    work: Arc<Notify>,
    /// Wakes writers and drains: the writer wrote something (or failed).
    progress: Arc<Notify>,
    /// Bytes of recorded data beyond which writes wait for the writer.
    limit: usize,
}

impl WriteBehind {
    /// Starts the writer for `file`, on the current runtime. Writes wait while more than
    /// `limit` bytes are on their way.
    pub(crate) fn start(file: FileStore, limit: usize) -> WriteBehind {
        let behind = WriteBehind {
            file: Arc::new(file),
            pending: Arc::new(Mutex::new(Pending::default())),
            work: Arc::new(Notify::new()),
            progress: Arc::new(Notify::new()),
            limit: limit.max(PAGE_SIZE),
        };
        let (file, pending) = (behind.file.clone(), behind.pending.clone());
        let (work, progress) = (behind.work.clone(), behind.progress.clone());
        // The task ends with the runtime; what it had not written is lost with the process,
        // as anything not flushed is.
        tokio::spawn(async move { writer(file, pending, work, progress).await });
        behind
    }

    /// The backup file.
    pub(crate) fn file(&self) -> &FileStore {
        &self.file
    }

    /// Records `data` (whole pages) for the pages from `first` on, or zeros for `count`
    /// pages when `data` is `None`; waits first while too much is recorded.
    pub(crate) async fn record(&self, first: u64, count: u64, data: Option<&Bytes>) {
        loop {
            let progressed = self.progress.notified();
            if self.pending.lock().bytes <= self.limit {
                break;
            }
            progressed.await;
        }
        let mut pending = self.pending.lock();
        for i in 0..count {
            let change = match data {
                Some(data) => {
                    let at = i as usize * PAGE_SIZE;
                    Change::Data(data.slice(at..at + PAGE_SIZE))
                }
                None => Change::Zero,
            };
            pending.next_generation += 1;
            let generation = pending.next_generation;
            let added = matches!(change, Change::Data(_)) as usize * PAGE_SIZE;
            if let Some((_, Change::Data(_))) =
                pending.pages.insert(first + i, (generation, change))
            {
                pending.bytes -= PAGE_SIZE;
            }
            pending.bytes += added;
        }
        drop(pending);
        self.work.notify_one();
    }

    /// The recorded change of `page`, if one is on its way to the file.
    pub(crate) fn lookup(&self, page: u64) -> Option<Change> {
        self.pending.lock().pages.get(&page).map(|(_, change)| change.clone())
    }

    /// Waits until every change recorded before the call is in the file, then makes the
    /// file durable. Fails while the file fails.
    pub(crate) async fn drain(&self) -> io::Result<()> {
        let target = self.pending.lock().next_generation;
        loop {
            let progressed = self.progress.notified();
            {
                let pending = self.pending.lock();
                if let Some(err) = &pending.error {
                    return Err(io::Error::other(format!("the backup file: {err}")));
                }
                if pending.pages.values().all(|(generation, _)| *generation > target) {
                    break;
                }
            }
            self.work.notify_one();
            progressed.await;
        }
        self.file.flush().await
    }

    /// Bytes of data on their way to the file.
    pub(crate) fn pending_bytes(&self) -> usize {
        self.pending.lock().bytes
    }
}

/// The writer: runs of recorded pages into the file, oldest page numbers first.
async fn writer(
    file: Arc<FileStore>,
    pending: Arc<Mutex<Pending>>,
    work: Arc<Notify>,
    progress: Arc<Notify>,
) {
    loop {
        let run = next_run(&pending.lock());
        let Some((first, run)) = run else {
            work.notified().await;
            continue;
        };
        let result = write_run(&file, first, &run).await;
        {
            let mut pending = pending.lock();
            match &result {
                Ok(()) => {
                    pending.error = None;
                    for (i, (generation, change)) in run.iter().enumerate() {
                        let page = first + i as u64;
                        // A page changed again meanwhile stays for the next run.
                        if pending.pages.get(&page).is_some_and(|(g, _)| g == generation) {
                            pending.pages.remove(&page);
                            if matches!(change, Change::Data(_)) {
                                pending.bytes -= PAGE_SIZE;
                            }
                        }
                    }
                }
                Err(err) => {
                    if pending.error.is_none() {
                        tracing::error!(%err, "the backup file failed; retrying every second");
                    }
                    pending.error = Some(err.to_string());
                }
            }
        }
        progress.notify_waiters();
        if result.is_err() {
            tokio::time::sleep(RETRY).await;
        }
    }
}

/// The first run of consecutive recorded pages of one kind (data or zeros), up to
/// [`RUN_PAGES`].
fn next_run(pending: &Pending) -> Option<(u64, Vec<(u64, Change)>)> {
    let mut pages = pending.pages.iter();
    let (&first, entry) = pages.next()?;
    let zero = matches!(entry.1, Change::Zero);
    let mut run = vec![entry.clone()];
    for (&page, entry) in pages {
        if page != first + run.len() as u64
            || matches!(entry.1, Change::Zero) != zero
            || run.len() as u64 == RUN_PAGES
        {
            break;
        }
        run.push(entry.clone());
    }
    Some((first, run))
}

/// Writes one run into the file.
async fn write_run(file: &FileStore, first: u64, run: &[(u64, Change)]) -> io::Result<()> {
    let offset = first * PAGE_SIZE as u64;
    if matches!(run.first(), Some((_, Change::Zero))) {
        let len = u32::try_from(run.len() * PAGE_SIZE).unwrap_or(u32::MAX);
        return file.write_zeroes(offset, len, Zeroing::MayDeallocate).await;
    }
    let mut data = BytesMut::with_capacity(run.len() * PAGE_SIZE);
    for (_, change) in run {
        match change {
            Change::Data(bytes) => data.extend_from_slice(bytes),
            Change::Zero => data.resize(data.len() + PAGE_SIZE, 0),
        }
    }
    file.write(offset, data.freeze(), Durability::AtFlush).await
}
