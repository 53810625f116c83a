//! The part of librados' C API (`<rados/librados.h>`, Ceph Pacific 16.2 and later) that the
//! RADOS store calls, declared by hand and checked against the Pacific header.
//!
//! Why not a bindings crate: `ceph` 3.2.5 would bring nom 5, nix 0.18, uuid 0.8 and serde
//! for a few calls, and its `IoCtx` can outlive the `Rados` it came from; `rados-sys` runs
//! bindgen, which needs libclang at build time. These declarations need only `librados.so`
//! to link against (Debian: `librados-dev`), and only with the `rados` feature.
//!
//! Every function returns 0 or a count on success and a negative errno on failure, unless
//! it returns nothing.
#![expect(non_camel_case_types, reason = "the C API's type names, kept as librados.h spells them")]

use std::ffi::{c_char, c_int, c_long, c_void};

/// A cluster handle: configuration, authentication, connections to monitors and OSDs.
pub type rados_t = *mut c_void;
/// An I/O context: one pool (and namespace) of a connected cluster.
pub type rados_ioctx_t = *mut c_void;
/// The state of one asynchronous operation.
pub type rados_completion_t = *mut c_void;
/// A compound write operation, applied to one object atomically.
pub type rados_write_op_t = *mut c_void;
/// `time_t`: a C `long` on every 64-bit Linux target (and on 32-bit glibc without
/// `_TIME_BITS=64`, which is how Debian builds librados).
pub type time_t = c_long;
/// Called on a librados thread when an operation completes; `arg` is the callback
/// argument given to [`rados_aio_create_completion2`].
pub type rados_callback_t = Option<unsafe extern "C" fn(cb: rados_completion_t, arg: *mut c_void)>;

/// `LIBRADOS_CREATE_EXCLUSIVE`: fail with `EEXIST` if the object exists.
pub const LIBRADOS_CREATE_EXCLUSIVE: c_int = 1;
/// `LIBRADOS_OPERATION_NOFLAG`.
pub const LIBRADOS_OPERATION_NOFLAG: c_int = 0;

#[link(name = "rados")]
extern "C" {
    /// Creates a handle for user `id` (`admin`, not `client.admin`).
    pub fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    /// Reads a Ceph configuration file into the handle (before `rados_connect`).
    pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    /// Sets one configuration option (before `rados_connect`); `-ENOENT` for an unknown one.
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    /// Connects: finds the monitors, authenticates, fetches the maps. Blocks.
    pub fn rados_connect(cluster: rados_t) -> c_int;
    /// Disconnects and frees the handle; it may also be called on a handle that never
    /// connected. Blocks until librados' threads have stopped.
    pub fn rados_shutdown(cluster: rados_t);
    /// Opens an I/O context on a pool; `-ENOENT` if there is no such pool.
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool_name: *const c_char,
        ioctx: *mut rados_ioctx_t,
    ) -> c_int;
    /// Frees an I/O context (pending operations keep their own reference).
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
    /// Sets the namespace of every later operation on `io`; not thread-safe.
    pub fn rados_ioctx_set_namespace(io: rados_ioctx_t, nspace: *const c_char);
    /// Waits until every asynchronous write on `io` has completed.
    pub fn rados_aio_flush(io: rados_ioctx_t) -> c_int;
    /// Creates a completion whose callback runs once the operation is committed on all
    /// replicas (Octopus and later).
    pub fn rados_aio_create_completion2(
        cb_arg: *mut c_void,
        cb_complete: rados_callback_t,
        pc: *mut rados_completion_t,
    ) -> c_int;
    /// The operation's result: bytes read, 0, or a negative errno.
    pub fn rados_aio_get_return_value(c: rados_completion_t) -> c_int;
    /// Drops the caller's reference to a completion (an operation in flight keeps its own).
    pub fn rados_aio_release(c: rados_completion_t);
    /// Reads up to `len` bytes at `off` into `buf`, which must stay valid until completion.
    pub fn rados_aio_read(
        io: rados_ioctx_t,
        oid: *const c_char,
        completion: rados_completion_t,
        buf: *mut c_char,
        len: usize,
        off: u64,
    ) -> c_int;
    /// Writes `len` bytes at `off` (librados copies `buf` before returning).
    pub fn rados_aio_write(
        io: rados_ioctx_t,
        oid: *const c_char,
        completion: rados_completion_t,
        buf: *const c_char,
        len: usize,
        off: u64,
    ) -> c_int;
    /// Deletes an object; `-ENOENT` if there is none.
    pub fn rados_aio_remove(
        io: rados_ioctx_t,
        oid: *const c_char,
        completion: rados_completion_t,
    ) -> c_int;
    /// Size and modification time of an object, into `psize` and `pmtime`, which must stay
    /// valid until completion; `-ENOENT` if there is none.
    pub fn rados_aio_stat(
        io: rados_ioctx_t,
        oid: *const c_char,
        completion: rados_completion_t,
        psize: *mut u64,
        pmtime: *mut time_t,
    ) -> c_int;
    /// A new, empty compound write operation.
    pub fn rados_create_write_op() -> rados_write_op_t;
    /// Frees a compound write operation.
    pub fn rados_release_write_op(write_op: rados_write_op_t);
    /// Fails the whole operation with `-ENOENT` if the object does not exist.
    pub fn rados_write_op_assert_exists(write_op: rados_write_op_t);
    /// Creates the object; with [`LIBRADOS_CREATE_EXCLUSIVE`], `-EEXIST` if it exists.
    pub fn rados_write_op_create(
        write_op: rados_write_op_t,
        exclusive: c_int,
        category: *const c_char,
    );
    /// Replaces the object's content (librados copies `buffer`).
    pub fn rados_write_op_write_full(write_op: rados_write_op_t, buffer: *const c_char, len: usize);
    /// Zeroes `len` bytes at `offset` (a range reaching the end truncates the object).
    pub fn rados_write_op_zero(write_op: rados_write_op_t, offset: u64, len: u64);
    /// Submits a compound write operation; `mtime` NULL means now.
    pub fn rados_aio_write_op_operate(
        write_op: rados_write_op_t,
        io: rados_ioctx_t,
        completion: rados_completion_t,
        oid: *const c_char,
        mtime: *mut time_t,
        flags: c_int,
    ) -> c_int;
}
