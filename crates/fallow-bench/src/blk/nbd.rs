//! The same load over NBD, through the upstream NBD client of the backing stores
//! (`fallow_backing::NbdStore`: fixed newstyle, pipelined, replies matched by cookie), for
//! side-by-side runs with the vhost-user path. fio's nbd engine stays the NBD reference.
//!
//! QD tasks on a single-threaded tokio runtime, each with one request in flight at a time,
//! all sharing one connection (the store's default). A request that the server answers
//! with an error counts as an error and the run goes on; a connection that fails (the
//! store reconnects once, then gives up) ends the run.

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use fallow_backing::{BackingStore, Durability, NbdStore};

use super::report::{BlkReport, Stats};
use super::run::{report, Offsets};
use super::{BlkError, BlkOptions};

/// Runs `opts` against the NBD export at `uri`.
pub(super) fn run(uri: &str, opts: &BlkOptions) -> Result<BlkReport, BlkError> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(BlkError::Io)?;
    runtime.block_on(load(uri, opts))
}

async fn load(uri: &str, opts: &BlkOptions) -> Result<BlkReport, BlkError> {
    let connect = |source| BlkError::Connect { target: uri.to_string(), source };
    let store = Arc::new(NbdStore::connect(uri).await.map_err(connect)?);
    let capacity = store.size();
    let (mut offsets, range) = Offsets::new(opts, capacity)?;
    let mut data = vec![0u8; opts.bs as usize];
    offsets.fill(&mut data);
    let data = Bytes::from(data);
    // One generator for every task, so the sequence is the same at any queue depth. The
    // runtime has one thread: the lock is never contended.
    let offsets = Arc::new(Mutex::new(offsets));
    let end = Instant::now() + opts.duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..opts.qd {
        let (store, offsets, data) = (store.clone(), offsets.clone(), data.clone());
        let (writes, bs) = (opts.rw.writes(), opts.bs);
        tasks.spawn(async move { worker(&store, &offsets, data, writes, bs, end).await });
    }
    let mut stats = Stats::new();
    let mut fatal = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(theirs)) => stats.merge(&theirs),
            Ok(Err(e)) => {
                fatal.get_or_insert(e);
            }
            Err(e) => {
                fatal.get_or_insert(BlkError::Io(io::Error::other(e.to_string())));
            }
        }
    }
    if let Some(e) = fatal {
        return Err(e);
    }
    Ok(report(opts, uri.to_string(), &stats, opts.duration, capacity, range))
}

/// One request at a time until `end`.
async fn worker(
    store: &NbdStore,
    offsets: &Mutex<super::run::Offsets>,
    data: Bytes,
    writes: bool,
    bs: u32,
    end: Instant,
) -> Result<Stats, BlkError> {
    let mut stats = Stats::new();
    loop {
        let offset = match offsets.lock() {
            Ok(mut o) => o.next_offset(),
            Err(_) => return Err(BlkError::Io(io::Error::other("a worker panicked"))),
        };
        let started = Instant::now();
        if started >= end {
            return Ok(stats);
        }
        let result = if writes {
            store.write(offset, data.clone(), Durability::AtFlush).await
        } else {
            store.read(offset, bs).await.map(drop)
        };
        let now = Instant::now();
        match result {
            Ok(()) if now <= end => stats.ok(now - started),
            Ok(()) => {}
            Err(e) if connection_failed(&e) => return Err(BlkError::Disconnected(e.to_string())),
            Err(e) => stats.error(|| format!("at {offset}: {e}")),
        }
    }
}

/// Whether an error of the NBD store means the connection is gone (rather than an error
/// reply to one request).
fn connection_failed(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted
            | ConnectionRefused
            | ConnectionReset
            | BrokenPipe
            | UnexpectedEof
            | NotConnected
            | NotFound
            | InvalidData
            | TimedOut
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_connections_end_the_run_and_error_replies_do_not() {
        assert!(connection_failed(&io::Error::from(io::ErrorKind::ConnectionAborted)));
        assert!(connection_failed(&io::Error::from(io::ErrorKind::ConnectionRefused)));
        assert!(!connection_failed(&io::Error::from(io::ErrorKind::InvalidInput)));
        assert!(!connection_failed(&io::Error::other("upstream NBD error 5")));
    }

    #[test]
    fn an_unreachable_server_is_a_connect_error() {
        let uri = "nbd+unix:///x?socket=/nonexistent/fallow-bench-blk.sock";
        let opts = BlkOptions::new(super::super::BlkTarget::Nbd(uri.into()));
        let err = run(uri, &opts).unwrap_err();
        assert!(matches!(err, BlkError::Connect { .. }), "{err}");
    }
}
