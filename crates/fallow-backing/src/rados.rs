//! A Ceph RADOS image: a byte-addressed device of fixed size striped over 4 MiB RADOS
//! objects, as RBD and Archipelago lay out their volumes. Built only with the cargo
//! feature `rados`, because it links against librados (see below).
//!
//! # Layout
//! ```text
//!  image offset   0        4 MiB       8 MiB             size
//!                 ├─────────┼───────────┼─── … ───┼────────┤
//!  object         PREFIX.0000000000000000  PREFIX.0000000000000001  …   (16 hex digits)
//!  header         PREFIX.header: "fallow-rados-image 1\nsize N\nobject_size 4194304\n"
//! ```
//! Every object lives in one pool (and, if given, one namespace). Byte `o` of the image is
//! byte `o % 4 MiB` of object `o / 4 MiB`. Objects are created by the first write that
//! touches them, so a new image costs only its header. The header object holds the size,
//! so reopening needs no size, and a size that differs from it is refused (an image is
//! never silently grown or cut).
//!
//! # Semantics
//! * A missing object, and the part of an object past its end, read as zeros.
//! * A request that crosses object boundaries is split; the pieces run in parallel. A
//!   multi-object write is not atomic (as with RBD): a failure may leave some pieces
//!   written, and the request fails.
//! * Durability: a RADOS write completes only once it is committed on every replica of its
//!   placement group (`rados_aio_create_completion2` fires on commit), so every
//!   acknowledged write is already durable: `flush` has nothing to do and a FUA write is
//!   an ordinary write. (An OSD on `memstore`, as in the tests, keeps nothing across a
//!   restart.)
//! * Trim and write-zeroes of a whole object delete it; of part of an object they zero
//!   that range in place (an OSD `zero`, which keeps a missing object missing).
//!   Write-zeroes with [`Zeroing::KeepAllocated`] (NBD's `NO_HOLE`) zeroes in place and
//!   deletes nothing.
//! * Block status stats the objects: a missing object, and an object's bytes past its
//!   end, are holes that read as zeros. One answer covers at most
//!   [`MAX_STATUS_OBJECTS`] objects.
//! * Every connection sees every completed write (RADOS is coherent per object), so the
//!   store allows multi-conn.
//! * Opening gives up after the connect timeout (10 s by default) if no monitor, or no OSD,
//!   answers. After that, a request waits as long as librados does, which by default is
//!   until the cluster recovers (`rados osd op timeout` in ceph.conf changes that).
//!
//! # Why a cargo feature
//! librados is a C library. With the feature `rados` (of this crate, and of `fallow`,
//! which passes it on), the crate links against `librados.so` (Debian: `librados-dev` to
//! build, `librados2` to run); without it, nothing here is compiled and `cargo build`
//! works on a machine without Ceph's headers or libraries. `scripts/test.sh` installs
//! them, and builds, lints and tests with the feature, against a throwaway cluster
//! (`tests/ceph/`). Loading librados at run time (`dlopen`) was the alternative: one build
//! for everyone, but two dozen symbols looked up by name and cast to hand-written function
//! types, more `unsafe`, and a missing symbol found only when it is first called; the
//! feature keeps an ordinary `extern` block that the linker checks, at the cost of one
//! flag in CI.
//!
//! `rados/client.rs` says why requests use librados' asynchronous API.

mod client;
mod ffi;

use std::ffi::CString;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};

use crate::{check_range, BackingStore, Capabilities, Durability, Extent, Zeroing};
use client::{Cluster, ConnectError, IoCtx};

/// The size of every data object (the last one of an image may stay shorter).
pub const OBJECT_SIZE: u64 = 4 << 20;

/// The most objects one block-status answer looks at (512 MiB of image): each costs a
/// `stat`, and an NBD client asks again for the rest.
pub const MAX_STATUS_OBJECTS: usize = 128;

/// The configuration file read when none is given.
pub const DEFAULT_CONF: &str = "/etc/ceph/ceph.conf";

/// The first line of a header object; a layout change gets a new number.
const HEADER_MAGIC: &str = "fallow-rados-image 1";

/// The largest header object accepted.
const MAX_HEADER_LEN: u64 = 4096;

/// Where an image lives and how to reach its cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RadosConfig {
    pool: String,
    prefix: String,
    namespace: Option<String>,
    conf: PathBuf,
    user: String,
    connect_timeout: Duration,
}

impl RadosConfig {
    /// The image `prefix` in `pool`, reached through [`DEFAULT_CONF`] as `client.admin`,
    /// with a 10 s connect timeout.
    pub fn new(pool: impl Into<String>, prefix: impl Into<String>) -> RadosConfig {
        RadosConfig {
            pool: pool.into(),
            prefix: prefix.into(),
            namespace: None,
            conf: PathBuf::from(DEFAULT_CONF),
            user: "admin".into(),
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// Puts the image's objects in a RADOS namespace of the pool.
    pub fn namespace(mut self, namespace: impl Into<String>) -> RadosConfig {
        self.namespace = Some(namespace.into());
        self
    }

    /// The Ceph configuration file: it names the monitors and the keyring.
    pub fn conf(mut self, path: impl Into<PathBuf>) -> RadosConfig {
        self.conf = path.into();
        self
    }

    /// The Ceph user, without `client.` (a leading `client.` is dropped).
    pub fn user(mut self, user: impl Into<String>) -> RadosConfig {
        let user = user.into();
        self.user = user.strip_prefix("client.").map(str::to_string).unwrap_or(user);
        self
    }

    /// How long opening may wait for a monitor (and authentication), and then for the OSD
    /// that holds the header object, before failing.
    pub fn connect_timeout(mut self, timeout: Duration) -> RadosConfig {
        self.connect_timeout = timeout;
        self
    }

    /// The image as people name it: `rados:POOL/PREFIX`, with its namespace if any.
    pub fn image(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("rados:{}/{} (namespace {ns})", self.pool, self.prefix),
            None => format!("rados:{}/{}", self.pool, self.prefix),
        }
    }

    /// The name of the header object.
    fn header_oid(&self) -> String {
        format!("{}.header", self.prefix)
    }
}

/// Why an image could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum RadosError {
    /// A name (pool, prefix, namespace, user, path) is empty or holds a NUL byte.
    #[error("invalid RADOS {what} {value:?}")]
    InvalidName {
        /// Which name.
        what: &'static str,
        /// The name given.
        value: String,
    },
    /// The configuration file could not be read.
    #[error("cannot read the Ceph configuration {}: {source}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What librados said.
        source: io::Error,
    },
    /// No monitor answered in time, or authentication failed.
    #[error(
        "cannot connect to the Ceph cluster of {} as client.{user} (timeout {timeout:?}): {source}",
        conf.display()
    )]
    Connect {
        /// The configuration file used.
        conf: PathBuf,
        /// The user.
        user: String,
        /// The connect timeout.
        timeout: Duration,
        /// What librados said (`Connection timed out`: no monitor answered).
        source: io::Error,
    },
    /// The pool does not exist.
    #[error("the RADOS pool {0:?} does not exist")]
    PoolMissing(String),
    /// The image has no header object and no size was given to create it.
    #[error("{0} does not exist; give its size (size=SIZE) to create it")]
    ImageMissing(String),
    /// The image exists with another size.
    #[error("{image} exists with {stored} bytes, not the {asked} asked for")]
    SizeMismatch {
        /// The image.
        image: String,
        /// The size in its header.
        stored: u64,
        /// The size asked for.
        asked: u64,
    },
    /// The header object is not one this version understands.
    #[error("{image}: its header object is not a fallow image header: {reason}")]
    BadHeader {
        /// The image.
        image: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Any other failure talking to the cluster.
    #[error("{image}: {source}")]
    Io {
        /// The image.
        image: String,
        /// The error.
        source: io::Error,
    },
}

/// A RADOS image opened for reading and writing.
#[derive(Debug)]
pub struct RadosStore {
    io: IoCtx,
    /// `rados:POOL/PREFIX`, for messages.
    image: String,
    prefix: String,
    size: u64,
}

impl RadosStore {
    /// Connects to the cluster and opens the image described by `config`. With `size`, a
    /// missing image is created with that size and an existing one must have it; without,
    /// the image must exist.
    pub async fn open(config: &RadosConfig, size: Option<u64>) -> Result<RadosStore, RadosError> {
        let image = config.image();
        let io_error = |source| RadosError::Io { image: image.clone(), source };
        let user = c_name("user", &config.user)?;
        let conf = c_name("configuration path", &config.conf.to_string_lossy())?;
        let pool = c_name("pool", &config.pool)?;
        let namespace =
            config.namespace.as_deref().map(|ns| c_name("namespace", ns)).transpose()?;
        c_name("prefix", &config.prefix)?;
        let timeout = config.connect_timeout;
        let connected = tokio::task::spawn_blocking(move || {
            let cluster = Cluster::connect(&user, &conf, timeout)?;
            Ok::<_, ConnectError>(IoCtx::open(Arc::new(cluster), &pool, namespace.as_deref()))
        })
        .await
        .map_err(|e| io_error(io::Error::other(format!("the connecting thread failed: {e}"))))?;
        let io = match connected {
            Ok(Ok(io)) => io,
            Ok(Err(e)) if e.kind() == io::ErrorKind::NotFound => {
                return Err(RadosError::PoolMissing(config.pool.clone()))
            }
            Ok(Err(source)) => return Err(io_error(source)),
            Err(e) => return Err(connect_error(config, e)),
        };
        let store = RadosStore { io, image: image.clone(), prefix: config.prefix.clone(), size: 0 };
        // Monitors that answer do not mean OSDs that do, and librados waits for an OSD
        // forever by default: opening gives up instead, with a message saying why.
        let size = tokio::time::timeout(timeout, store.find_or_create(config, size))
            .await
            .map_err(|_| {
                io_error(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no OSD answered for the header object within {timeout:?}"),
                ))
            })??;
        tracing::info!(image = %image, size, "opened a RADOS image");
        Ok(RadosStore { size, ..store })
    }

    /// Reads the header for the image's size, creating it (with `size`) if it is missing.
    async fn find_or_create(
        &self,
        config: &RadosConfig,
        size: Option<u64>,
    ) -> Result<u64, RadosError> {
        let header = config.header_oid();
        let io_error = |source| RadosError::Io { image: self.image.clone(), source };
        // Twice at most: a racing creator may win between our read and our create.
        for _ in 0..2 {
            let stored = self.read_header(&header).await?;
            match (stored, size) {
                (Some(stored), None) => return Ok(stored),
                (Some(stored), Some(asked)) if stored == asked => return Ok(stored),
                (Some(stored), Some(asked)) => {
                    return Err(RadosError::SizeMismatch {
                        image: self.image.clone(),
                        stored,
                        asked,
                    })
                }
                (None, None) => return Err(RadosError::ImageMissing(self.image.clone())),
                (None, Some(asked)) => {
                    let text = Bytes::from(header_text(asked));
                    let created = self.io.create_exclusive(self.c_oid(&header)?, text);
                    if created.map_err(io_error)?.wait().await.map_err(io_error)? {
                        tracing::info!(image = %self.image, size = asked, "created a RADOS image");
                        return Ok(asked);
                    }
                }
            }
        }
        Err(io_error(io::Error::other("the header object appeared and vanished while opening")))
    }

    /// The size recorded in the header object, or `None` if there is none.
    async fn read_header(&self, header: &str) -> Result<Option<u64>, RadosError> {
        let io_error = |source| RadosError::Io { image: self.image.clone(), source };
        let bad = |reason: String| RadosError::BadHeader { image: self.image.clone(), reason };
        let stat = self.io.stat(self.c_oid(header)?).map_err(io_error)?;
        let Some(len) = stat.wait().await.map_err(io_error)? else {
            return Ok(None);
        };
        if len > MAX_HEADER_LEN {
            return Err(bad(format!("{len} bytes long")));
        }
        let read = self.io.read(self.c_oid(header)?, 0, len as usize).map_err(io_error)?;
        let bytes = read.wait().await.map_err(io_error)?;
        parse_header(&bytes).map(Some).map_err(bad)
    }

    /// The image, as `rados:POOL/PREFIX`.
    pub fn image(&self) -> &str {
        &self.image
    }

    /// The name of data object `object`.
    fn oid(&self, object: u64) -> io::Result<CString> {
        CString::new(format!("{}.{object:016x}", self.prefix))
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in the object prefix"))
    }

    /// An object name as a C string (the prefix was checked for NUL bytes when opening).
    fn c_oid(&self, name: &str) -> Result<CString, RadosError> {
        c_name("object name", name)
    }

    /// Zeroes (or, where `zeroing` allows, deletes whole objects of) a range.
    async fn zero_range(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        check_range(offset, len as u64, self.size)?;
        let mut pending = Vec::new();
        for p in pieces(offset, len as u64) {
            let whole = p.offset == 0 && (p.len == OBJECT_SIZE || p.end_in_image() == self.size);
            let oid = self.oid(p.object)?;
            pending.push(if zeroing == Zeroing::MayDeallocate && whole {
                self.io.remove(oid)?
            } else {
                self.io.zero(oid, p.offset, p.len)?
            });
        }
        for p in pending {
            p.wait().await?;
        }
        Ok(())
    }
}

#[async_trait]
impl BackingStore for RadosStore {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            // A write completes once committed on every replica: there is no volatile
            // cache for flush or FUA to empty.
            flush: false,
            fua: false,
            trim: true,
            trim_zeroes: true,
            // Deleting or zeroing in place sends no zeros over the network.
            fast_zero: true,
            block_status: true,
            multi_conn: true,
        }
    }

    /// 4 KiB, not the object size. The only user is the NBD block-size constraint, where a
    /// larger preferred size tells clients that smaller requests cost a read-modify-write;
    /// here they do not: an OSD reads and writes any byte range of an object in place, and
    /// the cache above works in 4 KiB pages anyway.
    fn preferred_block_size(&self) -> u32 {
        4096
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        check_range(offset, len as u64, self.size)?;
        // Every piece is submitted before any is awaited, so they run in parallel.
        let mut pending = pieces(offset, len as u64)
            .map(|p| self.io.read(self.oid(p.object)?, p.offset, p.len as usize))
            .collect::<io::Result<Vec<_>>>()?;
        if pending.len() == 1 {
            if let Some(only) = pending.pop() {
                return Ok(Bytes::from(only.wait().await?)); // no copy for the common case
            }
        }
        let mut out = BytesMut::with_capacity(len as usize);
        for p in pending {
            out.extend_from_slice(&p.wait().await?);
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, _: Durability) -> io::Result<()> {
        check_range(offset, data.len() as u64, self.size)?;
        let mut at = 0;
        let mut pending = Vec::new();
        for p in pieces(offset, data.len() as u64) {
            let piece = data.slice(at..at + p.len as usize);
            at += p.len as usize;
            pending.push(self.io.write(self.oid(p.object)?, p.offset, piece)?);
        }
        for p in pending {
            p.wait().await?;
        }
        Ok(())
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(()) // every completed write is already durable (see the module doc)
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        self.zero_range(offset, len, Zeroing::MayDeallocate).await
    }

    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        self.zero_range(offset, len, zeroing).await
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        check_range(offset, len as u64, self.size)?;
        let pieces: Vec<Piece> = pieces(offset, len as u64).take(MAX_STATUS_OBJECTS).collect();
        let pending = pieces
            .iter()
            .map(|p| self.io.stat(self.oid(p.object)?))
            .collect::<io::Result<Vec<_>>>()?;
        let mut extents = Vec::new();
        for (p, stat) in pieces.iter().zip(pending) {
            let data = match stat.wait().await? {
                Some(object_len) => object_len.saturating_sub(p.offset).min(p.len),
                None => 0,
            };
            push_extent(&mut extents, data, false);
            push_extent(&mut extents, p.len - data, true);
        }
        Ok(extents)
    }
}

/// Appends `length` bytes of data (or of hole, which reads as zeros), merged with the last
/// extent when it is of the same kind.
fn push_extent(extents: &mut Vec<Extent>, length: u64, hole: bool) {
    if length == 0 {
        return;
    }
    match extents.last_mut() {
        Some(last) if last.hole == hole => last.length += length,
        _ => extents.push(Extent { length, hole, zero: hole }),
    }
}

/// The part of a request that falls in one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    object: u64,
    /// Offset within the object.
    offset: u64,
    len: u64,
}

impl Piece {
    /// The image offset just past the piece.
    fn end_in_image(&self) -> u64 {
        self.object * OBJECT_SIZE + self.offset + self.len
    }
}

/// Splits `offset..offset+len` at object boundaries (the caller checked the range).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = Piece> {
    let end = offset + len;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let (object, within) = (at / OBJECT_SIZE, at % OBJECT_SIZE);
        let len = (OBJECT_SIZE - within).min(end - at);
        at += len;
        Some(Piece { object, offset: within, len })
    })
}

/// The header object's content for an image of `size` bytes.
fn header_text(size: u64) -> String {
    format!("{HEADER_MAGIC}\nsize {size}\nobject_size {OBJECT_SIZE}\n")
}

/// The size recorded in a header object; `Err` says what is wrong with it.
fn parse_header(bytes: &[u8]) -> Result<u64, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "it is not UTF-8 text".to_string())?;
    let mut lines = text.lines();
    if lines.next() != Some(HEADER_MAGIC) {
        return Err(format!("its first line is not {HEADER_MAGIC:?}"));
    }
    let (mut size, mut object_size) = (None, None);
    for line in lines {
        match line.split_once(' ') {
            Some(("size", v)) => size = Some(v.parse::<u64>().map_err(|_| format!("size {v:?}"))?),
            Some(("object_size", v)) => {
                object_size = Some(v.parse::<u64>().map_err(|_| format!("object_size {v:?}"))?)
            }
            _ => {} // room for later, optional fields
        }
    }
    match (size, object_size) {
        (Some(size), Some(OBJECT_SIZE)) => Ok(size),
        (Some(_), Some(other)) => Err(format!("objects of {other} bytes, not {OBJECT_SIZE}")),
        _ => Err("it lacks the size or the object size".to_string()),
    }
}

/// `value` as a C string; an empty name or one with a NUL byte is refused.
fn c_name(what: &'static str, value: &str) -> Result<CString, RadosError> {
    let invalid = || RadosError::InvalidName { what, value: value.to_string() };
    if value.is_empty() {
        return Err(invalid());
    }
    CString::new(value).map_err(|_| invalid())
}

/// The error for a failed connection, by the stage that failed.
fn connect_error(config: &RadosConfig, e: ConnectError) -> RadosError {
    let connect = |source| RadosError::Connect {
        conf: config.conf.clone(),
        user: config.user.clone(),
        timeout: config.connect_timeout,
        source,
    };
    match e {
        ConnectError::Config(source) => RadosError::Config { path: config.conf.clone(), source },
        ConnectError::Create(source) | ConnectError::Connect(source) => connect(source),
        ConnectError::Option(name, source) => {
            connect(io::Error::new(source.kind(), format!("setting {name}: {source}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_request_inside_one_object_is_one_piece() {
        let got: Vec<Piece> = pieces(MIB, 4096).collect();
        assert_eq!(got, [Piece { object: 0, offset: MIB, len: 4096 }]);
        let got: Vec<Piece> = pieces(9 * MIB, MIB).collect();
        assert_eq!(got, [Piece { object: 2, offset: MIB, len: MIB }]);
    }

    #[test]
    fn a_request_across_boundaries_is_split_at_each() {
        let got: Vec<Piece> = pieces(4 * MIB - 100, 8 * MIB + 200).collect();
        assert_eq!(
            got,
            [
                Piece { object: 0, offset: 4 * MIB - 100, len: 100 },
                Piece { object: 1, offset: 0, len: 4 * MIB },
                Piece { object: 2, offset: 0, len: 4 * MIB },
                Piece { object: 3, offset: 0, len: 100 },
            ]
        );
        assert_eq!(got.iter().map(|p| p.len).sum::<u64>(), 8 * MIB + 200);
        assert_eq!(got[3].end_in_image(), 12 * MIB + 100);
        assert_eq!(pieces(5, 0).count(), 0);
    }

    #[test]
    fn the_header_round_trips_and_bad_ones_are_refused() {
        assert_eq!(parse_header(header_text(64 * MIB).as_bytes()), Ok(64 * MIB));
        let later = format!("{}striping none\n", header_text(7));
        assert_eq!(parse_header(later.as_bytes()), Ok(7), "unknown fields are skipped");
        for bad in [
            &b"fallow-rados-image 2\nsize 1\nobject_size 4194304\n"[..],
            b"fallow-rados-image 1\nsize 1\n",
            b"fallow-rados-image 1\nsize x\nobject_size 4194304\n",
            b"fallow-rados-image 1\nsize 1\nobject_size 1048576\n",
            b"\xff\xfe",
            b"",
        ] {
            assert!(parse_header(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn extents_merge_and_skip_empty_pieces() {
        let mut e = Vec::new();
        push_extent(&mut e, 10, false);
        push_extent(&mut e, 0, true);
        push_extent(&mut e, 5, false);
        push_extent(&mut e, 7, true);
        push_extent(&mut e, 1, true);
        assert_eq!(
            e,
            [
                Extent { length: 15, hole: false, zero: false },
                Extent { length: 8, hole: true, zero: true },
            ]
        );
    }

    #[test]
    fn config_names_the_image_and_drops_a_client_prefix() {
        let c = RadosConfig::new("cache", "img").user("client.bob").namespace("t1");
        assert_eq!(c.user, "bob");
        assert_eq!(c.image(), "rados:cache/img (namespace t1)");
        assert_eq!(RadosConfig::new("p", "x").image(), "rados:p/x");
        assert!(matches!(c_name("pool", "a\0b"), Err(RadosError::InvalidName { .. })));
        assert!(matches!(c_name("pool", ""), Err(RadosError::InvalidName { .. })));
    }
}
