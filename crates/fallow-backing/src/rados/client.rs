//! Owners of the librados handles, and each RADOS operation the store needs as a call that
//! submits it at once and returns a [`Pending`] future for its result.
//!
//! # Why librados' asynchronous API
//! An export keeps many requests in flight and a request spans several 4 MiB objects, so
//! the store wants many RADOS operations outstanding at once. The synchronous API would
//! tie up one of tokio's blocking threads per outstanding operation (and up to 512 of them
//! under load, each with its own stack); the asynchronous one costs a heap box and a
//! oneshot channel per operation and no thread at all, and librados already runs its own
//! messenger and finisher threads. Only connecting (a blocking call made once) runs on a
//! blocking thread.
//!
//! # Who owns what while an operation is in flight
//! ```text
//!  submit ─ Box<InFlight>{oid, op: buffers, sender} ─ into_raw ─▶ librados (callback arg)
//!                                                                    │ completes
//!  Pending::wait ◀─ oneshot ◀─ on_complete: Box::from_raw, return value, release ◀─┘
//! ```
//! Everything librados may touch (the object name, the read buffer, the stat results)
//! lives in the `InFlight` box, and only the completion callback frees it. Dropping a
//! [`Pending`] (a cancelled request) therefore never frees memory that librados still
//! writes into: the callback frees it later.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::ffi;

/// `ENOENT` and `EEXIST` as librados returns them (negated): the host's errno values, the
/// same on every Linux target.
const ENOENT: c_int = 2;
const EEXIST: c_int = 17;

/// An `io::Error` for a negative errno returned by librados.
pub(super) fn errno(rv: c_int) -> io::Error {
    io::Error::from_raw_os_error(rv.saturating_neg())
}

/// Why [`Cluster::connect`] failed, by stage, so that the caller can say what to fix.
#[derive(Debug)]
pub(super) enum ConnectError {
    /// `rados_create` failed.
    Create(io::Error),
    /// The configuration file could not be read or parsed.
    Config(io::Error),
    /// Setting an option failed (the option name is given).
    Option(&'static str, io::Error),
    /// No monitor answered in time, or authentication failed.
    Connect(io::Error),
}

/// A connected cluster handle. Dropping it disconnects (and blocks until librados' threads
/// have stopped).
#[derive(Debug)]
pub(super) struct Cluster {
    raw: ffi::rados_t,
}

// SAFETY: librados' cluster handle is thread-safe once connected: its state is behind
// librados' own locks. The only calls that are not (configuration before `rados_connect`)
// happen in `Cluster::connect`, before the handle can be shared.
unsafe impl Send for Cluster {}
// SAFETY: as above; `&Cluster` only ever opens I/O contexts, which librados synchronizes.
unsafe impl Sync for Cluster {}

impl Cluster {
    /// Creates a handle for `user` (`admin`, not `client.admin`), reads `conf` (which names
    /// the monitors and the keyring), and connects, giving up after `timeout` without an
    /// answering monitor. Blocks: call it on a blocking thread.
    pub(super) fn connect(
        user: &CStr,
        conf: &CStr,
        timeout: Duration,
    ) -> Result<Cluster, ConnectError> {
        let mut raw: ffi::rados_t = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and `user` is NUL-terminated.
        let rv = unsafe { ffi::rados_create(&mut raw, user.as_ptr()) };
        if rv < 0 {
            return Err(ConnectError::Create(errno(rv)));
        }
        // From here on `Drop` frees the handle: `rados_shutdown` also takes a handle that
        // never connected.
        let cluster = Cluster { raw };
        // SAFETY: `raw` is a live handle that has not connected; `conf` is NUL-terminated.
        let rv = unsafe { ffi::rados_conf_read_file(cluster.raw, conf.as_ptr()) };
        if rv < 0 {
            return Err(ConnectError::Config(errno(rv)));
        }
        // librados waits 300 s by default for a monitor; a command line wants an answer
        // sooner. The same bound covers authentication and fetching the first maps.
        let secs = format!("{}", timeout.as_secs_f64().max(0.001));
        cluster.set("client_mount_timeout", &secs)?;
        // SAFETY: `raw` is a live handle, configured above and not yet connected.
        let rv = unsafe { ffi::rados_connect(cluster.raw) };
        if rv < 0 {
            return Err(ConnectError::Connect(errno(rv)));
        }
        Ok(cluster)
    }

    /// Sets a configuration option before connecting.
    fn set(&self, option: &'static str, value: &str) -> Result<(), ConnectError> {
        let invalid = |_| ConnectError::Option(option, io::ErrorKind::InvalidInput.into());
        let name = CString::new(option).map_err(invalid)?;
        let value = CString::new(value).map_err(invalid)?;
        // SAFETY: `raw` is live and not yet connected; both strings are NUL-terminated.
        let rv = unsafe { ffi::rados_conf_set(self.raw, name.as_ptr(), value.as_ptr()) };
        if rv < 0 {
            return Err(ConnectError::Option(option, errno(rv)));
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `rados_create` and this is its last use; every `IoCtx`
        // holds an `Arc<Cluster>`, so none outlives it.
        unsafe { ffi::rados_shutdown(self.raw) };
    }
}

/// An I/O context: one pool and namespace of a connected cluster. It keeps the cluster
/// alive (librados must not shut down under a live context).
#[derive(Debug)]
pub(super) struct IoCtx {
    raw: ffi::rados_ioctx_t,
    /// Dropped after `raw` is destroyed (the `Drop` impl runs before the fields drop).
    _cluster: Arc<Cluster>,
}

// SAFETY: operations on one I/O context may be issued from any thread at once; what is
// not thread-safe is changing its settings (namespace, snapshot, locator), which happens
// only in `IoCtx::open`, before the context is shared.
unsafe impl Send for IoCtx {}
// SAFETY: as above: `&IoCtx` only submits operations.
unsafe impl Sync for IoCtx {}

impl IoCtx {
    /// Opens `pool` (and `namespace`, if any). Blocks briefly (it may wait for the OSD map).
    pub(super) fn open(
        cluster: Arc<Cluster>,
        pool: &CStr,
        namespace: Option<&CStr>,
    ) -> io::Result<IoCtx> {
        let mut raw: ffi::rados_ioctx_t = ptr::null_mut();
        // SAFETY: the cluster is connected; `raw` is a valid out-pointer; `pool` is
        // NUL-terminated.
        let rv = unsafe { ffi::rados_ioctx_create(cluster.raw, pool.as_ptr(), &mut raw) };
        if rv < 0 {
            return Err(errno(rv));
        }
        let io = IoCtx { raw, _cluster: cluster };
        if let Some(namespace) = namespace {
            // SAFETY: `raw` is live and not shared yet, so changing its namespace races
            // with nothing; librados copies the string.
            unsafe { ffi::rados_ioctx_set_namespace(io.raw, namespace.as_ptr()) };
        }
        Ok(io)
    }

    /// Reads `len` bytes at `off` of object `oid`. Bytes past the object's end, and every
    /// byte of a missing object, read as zeros.
    pub(super) fn read(&self, oid: CString, off: u64, len: usize) -> io::Result<Pending<Vec<u8>>> {
        // Zeroed up front: a short read leaves the tail as it is.
        let op = Op::Read { off, buf: vec![0u8; len] };
        self.submit("read", oid, op, |rv, op| match op {
            Op::Read { buf, .. } if rv >= 0 || rv == -ENOENT => Ok(buf),
            _ => Err(rv),
        })
    }

    /// Writes `data` at `off` of object `oid`, creating the object if needed. Completes
    /// once the write is committed on every replica.
    pub(super) fn write(&self, oid: CString, off: u64, data: Bytes) -> io::Result<Pending<()>> {
        self.submit("write", oid, Op::Write { off, data }, |rv, _| ok_if(rv >= 0, rv))
    }

    /// Deletes object `oid`; a missing object is fine.
    pub(super) fn remove(&self, oid: CString) -> io::Result<Pending<()>> {
        self.submit("remove", oid, Op::Remove, |rv, _| ok_if(rv >= 0 || rv == -ENOENT, rv))
    }

    /// Zeroes `len` bytes at `off` of object `oid`; a missing object stays missing.
    pub(super) fn zero(&self, oid: CString, off: u64, len: u64) -> io::Result<Pending<()>> {
        let op = WriteOp::new()?;
        // SAFETY: `op.0` is a live write operation that only this function holds.
        unsafe {
            // Without the assertion, zeroing would create an empty object where none was.
            ffi::rados_write_op_assert_exists(op.0);
            ffi::rados_write_op_zero(op.0, off, len);
        }
        let op = Op::Compound { op, _data: None };
        self.submit("zero", oid, op, |rv, _| ok_if(rv >= 0 || rv == -ENOENT, rv))
    }

    /// The size of object `oid`, or `None` if it does not exist.
    pub(super) fn stat(&self, oid: CString) -> io::Result<Pending<Option<u64>>> {
        self.submit("stat", oid, Op::Stat { size: 0, mtime: 0 }, |rv, op| match op {
            Op::Stat { size, .. } if rv >= 0 => Ok(Some(size)),
            _ if rv == -ENOENT => Ok(None),
            _ => Err(rv),
        })
    }

    /// Creates object `oid` holding `data`, atomically, unless it exists: `true` if it was
    /// created, `false` if it already existed (and is left as it was).
    pub(super) fn create_exclusive(&self, oid: CString, data: Bytes) -> io::Result<Pending<bool>> {
        let op = WriteOp::new()?;
        // SAFETY: `op.0` is a live write operation that only this function holds; librados
        // copies `data` into the operation, which we keep alive until completion anyway.
        unsafe {
            ffi::rados_write_op_create(op.0, ffi::LIBRADOS_CREATE_EXCLUSIVE, ptr::null());
            ffi::rados_write_op_write_full(op.0, data.as_ptr().cast::<c_char>(), data.len());
        }
        let op = Op::Compound { op, _data: Some(data) };
        self.submit("create", oid, op, |rv, _| match rv {
            rv if rv >= 0 => Ok(true),
            rv if rv == -EEXIST => Ok(false),
            rv => Err(rv),
        })
    }

    /// Hands `op` on object `oid` to librados; see the module doc for who owns what.
    fn submit<T>(
        &self,
        what: &'static str,
        oid: CString,
        op: Op,
        finish: Finish<T>,
    ) -> io::Result<Pending<T>> {
        let (done, rx) = oneshot::channel();
        let flight = Box::into_raw(Box::new(InFlight { oid, op, done }));
        let mut c: ffi::rados_completion_t = ptr::null_mut();
        // SAFETY: `c` is a valid out-pointer; the callback argument is `flight`, which only
        // `on_complete` takes back once the completion fires.
        let rv = unsafe {
            ffi::rados_aio_create_completion2(flight.cast::<c_void>(), Some(on_complete), &mut c)
        };
        if rv < 0 {
            // SAFETY: there is no completion, so nothing else will take `flight` back.
            drop(unsafe { Box::from_raw(flight) });
            return Err(errno(rv));
        }
        // SAFETY: `flight` comes from `Box::into_raw` and nothing has touched it; `c` is a
        // fresh completion whose callback argument is `flight`; `self.raw` is live.
        let rv = unsafe { start(self.raw, c, flight) };
        if rv < 0 {
            // SAFETY: librados refused the operation before submitting it, so the
            // completion never fires: the box and our reference to `c` are still ours.
            let flight = unsafe {
                ffi::rados_aio_release(c);
                Box::from_raw(flight)
            };
            return Err(op_error(what, &flight.oid, rv));
        }
        Ok(Pending { rx, what, finish })
    }
}

impl Drop for IoCtx {
    fn drop(&mut self) {
        // SAFETY: `raw` is live and this is its last use. Flushing first lets writes whose
        // requests were cancelled finish before the context (then the cluster) goes away.
        unsafe {
            ffi::rados_aio_flush(self.raw);
            ffi::rados_ioctx_destroy(self.raw);
        }
    }
}

/// `Ok(())` if `ok`, else the errno.
fn ok_if(ok: bool, rv: c_int) -> Result<(), c_int> {
    if ok {
        Ok(())
    } else {
        Err(rv)
    }
}

/// An `io::Error` for a failed operation, naming it and its object.
fn op_error(what: &str, oid: &CStr, rv: c_int) -> io::Error {
    let err = errno(rv);
    io::Error::new(err.kind(), format!("RADOS {what} of {}: {err}", oid.to_string_lossy()))
}

/// Turns a completed operation's return value (and what it owned) into its result, or the
/// errno that fails it.
type Finish<T> = fn(c_int, Op) -> Result<T, c_int>;

/// One operation and what librados may read or write until it completes.
enum Op {
    /// `rados_aio_read` into `buf`.
    Read { off: u64, buf: Vec<u8> },
    /// `rados_aio_write` of `data`.
    Write { off: u64, data: Bytes },
    /// `rados_aio_remove`.
    Remove,
    /// `rados_aio_stat`, into these two fields.
    Stat { size: u64, mtime: ffi::time_t },
    /// `rados_aio_write_op_operate` of a compound operation (and the bytes it carries).
    Compound { op: WriteOp, _data: Option<Bytes> },
}

/// An operation in flight: freed by `on_complete`, never by the submitter once submitted.
struct InFlight {
    oid: CString,
    op: Op,
    done: oneshot::Sender<Done>,
}

/// What `on_complete` sends back.
struct Done {
    rv: c_int,
    oid: CString,
    op: Op,
}

/// The result of an operation in flight. Dropping it abandons the result, not the
/// operation, which completes regardless.
pub(super) struct Pending<T> {
    rx: oneshot::Receiver<Done>,
    what: &'static str,
    finish: Finish<T>,
}

impl<T> Pending<T> {
    /// Waits for the operation to complete.
    pub(super) async fn wait(self) -> io::Result<T> {
        let Done { rv, oid, op } = self.rx.await.map_err(|_| {
            io::Error::other(format!("librados dropped a {} without completing it", self.what))
        })?;
        (self.finish)(rv, op).map_err(|rv| op_error(self.what, &oid, rv))
    }
}

/// A compound write operation; released when dropped (after it completed, or if it was
/// never submitted).
struct WriteOp(ffi::rados_write_op_t);

// SAFETY: a write operation is plain data that librados reads only while it is being
// submitted; whoever holds the `WriteOp` holds the only handle to it.
unsafe impl Send for WriteOp {}

impl WriteOp {
    fn new() -> io::Result<WriteOp> {
        // SAFETY: no preconditions.
        let raw = unsafe { ffi::rados_create_write_op() };
        if raw.is_null() {
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, "rados_create_write_op failed"));
        }
        Ok(WriteOp(raw))
    }
}

impl Drop for WriteOp {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `rados_create_write_op`, and it is released once.
        unsafe { ffi::rados_release_write_op(self.0) };
    }
}

/// What `start` passes to librados, computed before anything is submitted.
enum Call {
    Read(*mut c_char, usize, u64),
    Write(*const c_char, usize, u64),
    Remove,
    Stat(*mut u64, *mut ffi::time_t),
    Compound(ffi::rados_write_op_t),
}

/// Submits the operation of `flight` on `io`, to complete through `c`; returns what the
/// submitting call returned (negative: refused, and `c` will never fire).
///
/// # Safety
/// `io` is a live I/O context; `flight` comes from `Box::into_raw` and nothing else
/// touches it until `c` fires; `c` is a fresh completion whose callback argument is
/// `flight`.
unsafe fn start(
    io: ffi::rados_ioctx_t,
    c: ffi::rados_completion_t,
    flight: *mut InFlight,
) -> c_int {
    // The pointers are taken before the operation is submitted: from then on the
    // callback may run (on another thread) and free `flight`, so it is not touched again.
    let (oid, call) = {
        // SAFETY: nothing else touches `*flight` before submission (the caller's promise),
        // and this borrow ends before the submitting call below.
        let f = unsafe { &mut *flight };
        let call = match &mut f.op {
            Op::Read { off, buf } => Call::Read(buf.as_mut_ptr().cast(), buf.len(), *off),
            Op::Write { off, data } => Call::Write(data.as_ptr().cast(), data.len(), *off),
            Op::Remove => Call::Remove,
            Op::Stat { size, mtime } => Call::Stat(size, mtime),
            Op::Compound { op, .. } => Call::Compound(op.0),
        };
        (f.oid.as_ptr(), call)
    };
    // SAFETY: `io` is live (the caller's promise); `oid` and every buffer pointer point into
    // `*flight` or memory it owns, which only `on_complete` frees, after completion.
    unsafe {
        match call {
            Call::Read(buf, len, off) => ffi::rados_aio_read(io, oid, c, buf, len, off),
            Call::Write(buf, len, off) => ffi::rados_aio_write(io, oid, c, buf, len, off),
            Call::Remove => ffi::rados_aio_remove(io, oid, c),
            Call::Stat(size, mtime) => ffi::rados_aio_stat(io, oid, c, size, mtime),
            Call::Compound(op) => ffi::rados_aio_write_op_operate(
                op,
                io,
                c,
                oid,
                ptr::null_mut(),
                ffi::LIBRADOS_OPERATION_NOFLAG,
            ),
        }
    }
}

/// The completion callback, on a librados finisher thread: takes the operation back, reads
/// its result, releases the completion and wakes the waiter (if it still waits).
extern "C" fn on_complete(c: ffi::rados_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the box `submit` leaked for this completion, and librados calls
    // the callback once per completion, so the box is taken back exactly once.
    let flight = unsafe { Box::from_raw(arg.cast::<InFlight>()) };
    // SAFETY: librados holds its own reference to `c` while the callback runs, so reading
    // it and then dropping ours (the one `rados_aio_create_completion2` gave) is sound.
    let rv = unsafe {
        let rv = ffi::rados_aio_get_return_value(c);
        ffi::rados_aio_release(c);
        rv
    };
    let InFlight { oid, op, done } = *flight;
    // The receiver is gone if the request was cancelled: the buffers are then freed here.
    let _ = done.send(Done { rv, oid, op });
}
