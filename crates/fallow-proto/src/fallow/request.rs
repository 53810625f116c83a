//! Requests: what a client asks, as typed values, with their body layouts.
//!
//! Bodies are little-endian and fixed-width; batches put every key before every page, so a
//! node can check a whole batch before it touches the pool. `docs/protocol.md` lists each
//! layout with byte offsets.

use bytes::{BufMut, Bytes, BytesMut};
use fallow_core::{DedupScope, ObjectId, PageIndex, PoolId, PoolKind, PoolSpec, Sharing};
use fallow_core::{TrustDomain, PAGE_SIZE};

use super::frame::{Frame, FrameWriter};
use super::wire::{BodyError, Reader};
use super::{Op, MAGIC, MAX_BATCH, MAX_NAME_LEN};

/// The bytes of one key inside a batch: object and index.
const KEY_LEN: usize = 16;

/// The bytes of one content in a PUT_HASHES body: hash and checksum.
const CONTENT_LEN: usize = 20;

/// CREATE_POOL flag: compress cold pages.
const FLAG_COMPRESS: u8 = 1;
/// CREATE_POOL flag: the quota field holds a quota.
const FLAG_QUOTA: u8 = 2;
/// CREATE_POOL flag: a cluster pool, spread over the cluster by the node that receives the
/// request ([`Request::CreateClusterPool`]).
const FLAG_CLUSTER: u8 = 4;

/// The first request on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The lowest protocol version the client speaks.
    pub version_min: u16,
    /// The highest protocol version the client speaks.
    pub version_max: u16,
    /// The client's identity: its private pools belong to this id, so every connection of
    /// one client (and a reconnect) reaches the same private pools.
    pub client_id: u128,
    /// A name for the node's logs (host name, program), at most 64 bytes of UTF-8.
    pub name: String,
    /// The connection's place in its client's session, appended after `name`: absent in
    /// a HELLO of an older client (the node then fences nothing for it).
    pub session: Option<Session>,
}

/// Where a connection stands in its client's session (docs/protocol.md, §3.4): a client
/// that gave up on a request has its older connections fenced by the next one it opens, so
/// that the request cannot take effect after the client's later requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    /// Random per client object, so that two processes sharing a client id stay apart.
    pub id: u64,
    /// This connection's number in the session, counting up from 1.
    pub epoch: u32,
    /// The node stops every connection of the session numbered below this, and waits for
    /// the requests they are running, before it answers AUTH.
    pub fence_below: u32,
}

/// The length of a [`Session`] on the wire.
pub const SESSION_LEN: usize = 16;

/// A page inside the pool a batch names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageRef {
    /// The object.
    pub object: ObjectId,
    /// The page number inside the object.
    pub index: PageIndex,
}

/// A request, parsed from or encoded into a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Opens the connection.
    Hello(Hello),
    /// Answers the node's challenge.
    Auth {
        /// Fresh random bytes from the client, so the node's proof is fresh too.
        client_nonce: [u8; 32],
        /// `auth::client_proof` over the challenge.
        proof: [u8; 32],
    },
    /// Does nothing.
    Ping,
    /// Creates a pool, or attaches to the shared pool with the spec's UUID.
    CreatePool(PoolSpec),
    /// CREATE_POOL with the cluster flag (`0x04`): the node creates the pool across the
    /// cluster it gossips with and forwards every later request on it to the nodes that
    /// hold its pages (peer forwarding, `docs/cluster.md`), so a client of one node uses
    /// the whole cluster. Travels as [`Op::CreatePool`].
    CreateClusterPool(PoolSpec),
    /// Detaches from a pool.
    DestroyPool(PoolId),
    /// Removes every page of a pool.
    InvalidatePool(PoolId),
    /// Removes every page of one object.
    InvalidateObject {
        /// The pool.
        pool: PoolId,
        /// The object.
        object: ObjectId,
    },
    /// Removes a batch of pages.
    InvalidatePages {
        /// The pool.
        pool: PoolId,
        /// The pages (1 to [`MAX_BATCH`]).
        pages: Vec<PageRef>,
    },
    /// Stores a batch of pages.
    Put {
        /// The pool.
        pool: PoolId,
        /// The keys (1 to [`MAX_BATCH`]).
        pages: Vec<PageRef>,
        /// `pages.len()` × 4096 bytes, the i-th page for the i-th key.
        data: Bytes,
    },
    /// Reads a batch of pages; they stay.
    Get {
        /// The pool.
        pool: PoolId,
        /// The keys (1 to [`MAX_BATCH`]).
        pages: Vec<PageRef>,
    },
    /// Reads a batch of pages and removes those found.
    Take {
        /// The pool.
        pool: PoolId,
        /// The keys (1 to [`MAX_BATCH`]).
        pages: Vec<PageRef>,
    },
    /// Stores a batch of pages by content hash (dedup across nodes).
    PutHashes {
        /// The pool.
        pool: PoolId,
        /// The keys (1 to [`MAX_BATCH`]).
        pages: Vec<PageRef>,
        /// For the i-th key, its page's content hash and CRC-32C
        /// (`fallow_core::content`).
        contents: Vec<(u128, u32)>,
    },
    /// Node and pool counters.
    Stats,
    /// The cluster's members.
    Members,
    /// A piece of the content summary, from byte `offset` of its filter.
    ContentSummary {
        /// Where the piece starts in the filter's bytes (a multiple of 8).
        offset: u64,
    },
}

impl Request {
    /// The op this request travels under.
    pub fn op(&self) -> Op {
        match self {
            Request::Hello(_) => Op::Hello,
            Request::Auth { .. } => Op::Auth,
            Request::Ping => Op::Ping,
            Request::CreatePool(_) | Request::CreateClusterPool(_) => Op::CreatePool,
            Request::DestroyPool(_) => Op::DestroyPool,
            Request::InvalidatePool(_) => Op::InvalidatePool,
            Request::InvalidateObject { .. } => Op::InvalidateObject,
            Request::InvalidatePages { .. } => Op::InvalidatePages,
            Request::Put { .. } => Op::Put,
            Request::Get { .. } => Op::Get,
            Request::Take { .. } => Op::Take,
            Request::PutHashes { .. } => Op::PutHashes,
            Request::Stats => Op::Stats,
            Request::Members => Op::Members,
            Request::ContentSummary { .. } => Op::ContentSummary,
        }
    }

    /// Appends this request as one frame with request id `id`.
    ///
    /// # Panics
    /// If a batch is empty or over [`MAX_BATCH`], a PUT's data is not one page per key, or
    /// a HELLO name is over 64 bytes: the client library checks these before encoding.
    pub fn encode(&self, id: u64, buf: &mut BytesMut) {
        let frame = FrameWriter::begin(buf, self.op() as u8, 0, id);
        match self {
            Request::Hello(hello) => {
                assert!(hello.name.len() <= MAX_NAME_LEN, "client name too long");
                buf.put_slice(&MAGIC);
                buf.put_u16_le(hello.version_min);
                buf.put_u16_le(hello.version_max);
                buf.put_u128_le(hello.client_id);
                buf.put_u8(hello.name.len() as u8);
                buf.put_slice(hello.name.as_bytes());
                if let Some(session) = hello.session {
                    buf.put_u64_le(session.id);
                    buf.put_u32_le(session.epoch);
                    buf.put_u32_le(session.fence_below);
                }
            }
            Request::Auth { client_nonce, proof } => {
                buf.put_slice(client_nonce);
                buf.put_slice(proof);
            }
            Request::Ping | Request::Stats | Request::Members => {}
            Request::CreatePool(spec) => encode_spec(spec, Spread::Node, buf),
            Request::CreateClusterPool(spec) => encode_spec(spec, Spread::Cluster, buf),
            Request::DestroyPool(pool) | Request::InvalidatePool(pool) => buf.put_u32_le(pool.0),
            Request::InvalidateObject { pool, object } => {
                buf.put_u32_le(pool.0);
                buf.put_u32_le(0);
                buf.put_u64_le(*object);
            }
            Request::InvalidatePages { pool, pages }
            | Request::Get { pool, pages }
            | Request::Take { pool, pages } => encode_keys(*pool, pages, buf),
            Request::Put { pool, pages, data } => {
                assert_eq!(data.len(), pages.len() * PAGE_SIZE, "one page per key");
                encode_keys(*pool, pages, buf);
                buf.put_slice(data);
            }
            Request::PutHashes { pool, pages, contents } => {
                assert_eq!(contents.len(), pages.len(), "one content per key");
                encode_keys(*pool, pages, buf);
                buf.reserve(contents.len() * CONTENT_LEN);
                for (hash, crc) in contents {
                    buf.put_u128_le(*hash);
                    buf.put_u32_le(*crc);
                }
            }
            Request::ContentSummary { offset } => buf.put_u64_le(*offset),
        }
        frame.finish(buf);
    }

    /// Parses a request frame. The frame's status byte is ignored (it is 0 in requests).
    pub fn parse(frame: Frame) -> Result<Request, BodyError> {
        let op = Op::from_code(frame.op).ok_or(BodyError::UnknownOp(frame.op))?;
        let mut r = Reader::new(frame.body);
        let request = match op {
            Op::Hello => {
                if r.array::<8>("magic")? != MAGIC {
                    return Err(BodyError::Invalid("magic: not a fallow HELLO"));
                }
                let version_min = r.u16("version_min")?;
                let version_max = r.u16("version_max")?;
                if version_min > version_max {
                    return Err(BodyError::Invalid("version range: min above max"));
                }
                let client_id = r.u128("client_id")?;
                let len = r.u8("name length")? as usize;
                if len > MAX_NAME_LEN {
                    return Err(BodyError::Invalid("name length: over 64 bytes"));
                }
                let name = String::from_utf8(r.bytes(len, "name")?.to_vec())
                    .map_err(|_| BodyError::Invalid("name: not UTF-8"))?;
                // The session follows the name. Later versions may append more fields; a
                // node reads what it knows and ignores the rest, so it can still answer
                // with its version range. Fewer bytes than a session are no session.
                let session = match r.remaining() >= SESSION_LEN {
                    true => Some(Session {
                        id: r.u64("session id")?,
                        epoch: r.u32("session epoch")?,
                        fence_below: r.u32("session fence")?,
                    }),
                    false => None,
                };
                return Ok(Request::Hello(Hello {
                    version_min,
                    version_max,
                    client_id,
                    name,
                    session,
                }));
            }
            Op::Auth => {
                Request::Auth { client_nonce: r.array("client_nonce")?, proof: r.array("proof")? }
            }
            Op::Ping => Request::Ping,
            Op::Stats => Request::Stats,
            Op::Members => Request::Members,
            Op::CreatePool => match parse_spec(&mut r)? {
                (spec, Spread::Node) => Request::CreatePool(spec),
                (spec, Spread::Cluster) => Request::CreateClusterPool(spec),
            },
            Op::DestroyPool => Request::DestroyPool(PoolId(r.u32("pool")?)),
            Op::InvalidatePool => Request::InvalidatePool(PoolId(r.u32("pool")?)),
            Op::InvalidateObject => {
                let pool = PoolId(r.u32("pool")?);
                if r.u32("reserved")? != 0 {
                    return Err(BodyError::Invalid("reserved field: not zero"));
                }
                Request::InvalidateObject { pool, object: r.u64("object")? }
            }
            Op::InvalidatePages => {
                let (pool, pages) = parse_keys(&mut r)?;
                Request::InvalidatePages { pool, pages }
            }
            Op::Get => {
                let (pool, pages) = parse_keys(&mut r)?;
                Request::Get { pool, pages }
            }
            Op::Take => {
                let (pool, pages) = parse_keys(&mut r)?;
                Request::Take { pool, pages }
            }
            Op::Put => {
                let (pool, pages) = parse_keys(&mut r)?;
                let data = r.bytes(pages.len() * PAGE_SIZE, "page data")?;
                Request::Put { pool, pages, data }
            }
            Op::PutHashes => {
                let (pool, pages) = parse_keys(&mut r)?;
                if r.remaining() < pages.len() * CONTENT_LEN {
                    return Err(BodyError::Truncated("contents"));
                }
                let mut contents = Vec::with_capacity(pages.len());
                for _ in 0..pages.len() {
                    contents.push((r.u128("content hash")?, r.u32("checksum")?));
                }
                Request::PutHashes { pool, pages, contents }
            }
            Op::ContentSummary => {
                let offset = r.u64("offset")?;
                if !offset.is_multiple_of(8) {
                    return Err(BodyError::Invalid("offset: not a multiple of 8"));
                }
                Request::ContentSummary { offset }
            }
        };
        r.finish()?;
        Ok(request)
    }
}

fn encode_keys(pool: PoolId, pages: &[PageRef], buf: &mut BytesMut) {
    assert!((1..=MAX_BATCH).contains(&pages.len()), "batch of {} pages", pages.len());
    buf.reserve(8 + pages.len() * KEY_LEN);
    buf.put_u32_le(pool.0);
    buf.put_u32_le(pages.len() as u32);
    for page in pages {
        buf.put_u64_le(page.object);
        buf.put_u64_le(page.index);
    }
}

fn parse_keys(r: &mut Reader) -> Result<(PoolId, Vec<PageRef>), BodyError> {
    let pool = PoolId(r.u32("pool")?);
    let count = r.u32("count")? as usize;
    if count == 0 {
        return Err(BodyError::Invalid("count: an empty batch"));
    }
    if count > MAX_BATCH {
        return Err(BodyError::TooLarge { count: count as u64, max: MAX_BATCH });
    }
    if r.remaining() < count * KEY_LEN {
        return Err(BodyError::Truncated("keys"));
    }
    let mut pages = Vec::with_capacity(count);
    for _ in 0..count {
        pages.push(PageRef { object: r.u64("object")?, index: r.u64("index")? });
    }
    Ok((pool, pages))
}

/// Where a pool's pages live: the CREATE_POOL cluster flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spread {
    /// On the node that received the request.
    Node,
    /// Over the cluster that node gossips with.
    Cluster,
}

fn encode_spec(spec: &PoolSpec, spread: Spread, buf: &mut BytesMut) {
    buf.put_u8(match spec.kind {
        PoolKind::Ephemeral => 0,
        PoolKind::Persistent => 1,
    });
    let uuid = match spec.sharing {
        Sharing::Private => {
            buf.put_u8(0);
            0
        }
        Sharing::Shared { uuid } => {
            buf.put_u8(1);
            uuid
        }
    };
    let domain = match spec.dedup {
        DedupScope::Off => {
            buf.put_u8(0);
            0
        }
        DedupScope::Domain(TrustDomain(domain)) => {
            buf.put_u8(1);
            domain
        }
    };
    let mut flags = 0;
    if spec.compress {
        flags |= FLAG_COMPRESS;
    }
    if spec.quota_pages.is_some() {
        flags |= FLAG_QUOTA;
    }
    if spread == Spread::Cluster {
        flags |= FLAG_CLUSTER;
    }
    buf.put_u8(flags);
    buf.put_u32_le(0);
    buf.put_u64_le(spec.quota_pages.unwrap_or(0));
    buf.put_u64_le(domain);
    buf.put_u128_le(uuid);
}

fn parse_spec(r: &mut Reader) -> Result<(PoolSpec, Spread), BodyError> {
    let kind = match r.u8("kind")? {
        0 => PoolKind::Ephemeral,
        1 => PoolKind::Persistent,
        _ => return Err(BodyError::Invalid("kind: not 0 or 1")),
    };
    let shared = match r.u8("sharing")? {
        0 => false,
        1 => true,
        _ => return Err(BodyError::Invalid("sharing: not 0 or 1")),
    };
    let dedup_on = match r.u8("dedup")? {
        0 => false,
        1 => true,
        _ => return Err(BodyError::Invalid("dedup: not 0 or 1")),
    };
    let flags = r.u8("flags")?;
    if flags & !(FLAG_COMPRESS | FLAG_QUOTA | FLAG_CLUSTER) != 0 {
        return Err(BodyError::Invalid("flags: unknown bits set"));
    }
    if r.u32("reserved")? != 0 {
        return Err(BodyError::Invalid("reserved field: not zero"));
    }
    let quota = r.u64("quota_pages")?;
    let domain = r.u64("trust_domain")?;
    let uuid = r.u128("uuid")?;
    if !dedup_on && domain != 0 {
        return Err(BodyError::Invalid("trust_domain: set while dedup is off"));
    }
    if !shared && uuid != 0 {
        return Err(BodyError::Invalid("uuid: set on a private pool"));
    }
    if flags & FLAG_QUOTA == 0 && quota != 0 {
        return Err(BodyError::Invalid("quota_pages: set without the quota flag"));
    }
    let spec = PoolSpec {
        kind,
        sharing: if shared { Sharing::Shared { uuid } } else { Sharing::Private },
        dedup: if dedup_on { DedupScope::Domain(TrustDomain(domain)) } else { DedupScope::Off },
        compress: flags & FLAG_COMPRESS != 0,
        quota_pages: (flags & FLAG_QUOTA != 0).then_some(quota),
    };
    let spread = if flags & FLAG_CLUSTER != 0 { Spread::Cluster } else { Spread::Node };
    Ok((spec, spread))
}
