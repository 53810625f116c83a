//! Replies: what the node answers, as typed values, with their body layouts.
//!
//! A reply carries the op and request id of the request it answers; its body depends on
//! both the op and the status. Any status other than OK has a body of one UTF-8 message for
//! humans (at most 256 bytes), except UNSUPPORTED_VERSION, whose body is the node's version
//! range.

use bytes::{BufMut, Bytes, BytesMut};
use fallow_core::{HashPutOutcome, NotStored, PoolId, PutOutcome, PAGE_SIZE};

use super::frame::{Frame, FrameWriter};
use super::members::{self, MemberInfo};
use super::wire::{truncate_utf8, BodyError, Reader};
use super::{Op, Status, MAX_BATCH, MAX_MESSAGE_LEN, SUMMARY_CHUNK};

/// The node's answer to HELLO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloReply {
    /// The version both sides will speak.
    pub version: u16,
    /// The most pages the node takes in one batch (at most [`MAX_BATCH`]).
    pub max_batch: u32,
    /// The node's identity, stable while it runs.
    pub node_id: u128,
    /// Fresh random bytes the client must prove it can MAC with the secret.
    pub challenge: [u8; 32],
}

/// One named counter of a STATS reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatEntry {
    /// A dotted lower-case name, at most 255 bytes: `pages`, `pool.3.hits`, ...
    pub name: String,
    /// The value.
    pub value: u64,
}

/// A piece of a node's content summary (CONTENT_SUMMARY): a Bloom filter of the content
/// hashes it holds, `fallow_core::content::ContentFilter`'s bit array from `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryChunk {
    /// Changes whenever the node builds a new summary: pieces of one summary all carry
    /// the same number.
    pub generation: u64,
    /// Hashes in the filter.
    pub entries: u64,
    /// The whole filter's size in bytes (a multiple of 8; 0 when the node holds nothing).
    pub total_len: u64,
    /// Probes per item (1 to 16; 0 when `total_len` is 0).
    pub hashes: u8,
    /// Where `data` starts in the filter.
    pub offset: u64,
    /// At most [`super::SUMMARY_CHUNK`] bytes of the filter.
    pub data: Bytes,
}

/// A reply, parsed from or encoded into a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// HELLO accepted: the challenge.
    Hello(HelloReply),
    /// AUTH accepted: the node's own proof, so the client knows the node holds the secret.
    Auth {
        /// `auth::node_proof`.
        proof: [u8; 32],
    },
    /// Done, nothing to report (PING, DESTROY_POOL, INVALIDATE_PAGES).
    Empty,
    /// The pool created or attached (CREATE_POOL).
    Pool(PoolId),
    /// How many pages were removed (INVALIDATE_POOL, INVALIDATE_OBJECT).
    Count(u64),
    /// One outcome per page (PUT).
    Put(Vec<PutOutcome>),
    /// One outcome per page (PUT_HASHES).
    PutHashes(Vec<HashPutOutcome>),
    /// A piece of the content summary (CONTENT_SUMMARY).
    Summary(SummaryChunk),
    /// GET or TAKE: which keys were found, and the pages found, in key order.
    Pages {
        /// `found[i]` is true when the i-th key hit.
        found: Vec<bool>,
        /// 4096 bytes for each `true` in `found`, in order.
        data: Bytes,
    },
    /// Named counters (STATS).
    Stats(Vec<StatEntry>),
    /// The cluster's members (MEMBERS); empty when the node is not in a cluster.
    Members(Vec<MemberInfo>),
    /// HELLO refused: no version in common. The node closes after sending it.
    VersionMismatch {
        /// The node's lowest version.
        min: u16,
        /// The node's highest version.
        max: u16,
    },
    /// Any other failure.
    Error {
        /// Why (never [`Status::Ok`] or [`Status::UnsupportedVersion`]).
        status: Status,
        /// For humans.
        message: String,
    },
}

/// PUT outcome codes.
const STORED: u8 = 0;
const NOT_STORED_FULL: u8 = 1;
const NOT_STORED_OVER_QUOTA: u8 = 2;
/// PUT_HASHES only: the node holds no such content; send the page.
const NOT_HELD: u8 = 3;

fn put_code(outcome: PutOutcome) -> u8 {
    match outcome {
        PutOutcome::Stored => STORED,
        PutOutcome::NotStored(NotStored::Full) => NOT_STORED_FULL,
        PutOutcome::NotStored(NotStored::OverQuota) => NOT_STORED_OVER_QUOTA,
    }
}

fn parse_put_code(code: u8) -> Option<HashPutOutcome> {
    Some(match code {
        STORED => HashPutOutcome::Stored,
        NOT_STORED_FULL => HashPutOutcome::NotStored(NotStored::Full),
        NOT_STORED_OVER_QUOTA => HashPutOutcome::NotStored(NotStored::OverQuota),
        NOT_HELD => HashPutOutcome::NotHeld,
        _ => return None,
    })
}

impl Reply {
    /// Appends this reply to request `id` of kind `op` as one frame.
    pub fn encode(&self, op: Op, id: u64, buf: &mut BytesMut) {
        let status = match self {
            Reply::VersionMismatch { .. } => Status::UnsupportedVersion,
            Reply::Error { status, .. } => *status,
            _ => Status::Ok,
        };
        let frame = FrameWriter::begin(buf, op as u8, status as u8, id);
        match self {
            Reply::Hello(hello) => {
                buf.put_u16_le(hello.version);
                buf.put_u16_le(0);
                buf.put_u32_le(hello.max_batch);
                buf.put_u128_le(hello.node_id);
                buf.put_slice(&hello.challenge);
            }
            Reply::Auth { proof } => buf.put_slice(proof),
            Reply::Empty => {}
            Reply::Pool(pool) => buf.put_u32_le(pool.0),
            Reply::Count(n) => buf.put_u64_le(*n),
            Reply::Put(outcomes) => outcomes.iter().for_each(|o| buf.put_u8(put_code(*o))),
            Reply::PutHashes(outcomes) => {
                for outcome in outcomes {
                    buf.put_u8(match *outcome {
                        HashPutOutcome::Stored => STORED,
                        HashPutOutcome::NotStored(why) => put_code(PutOutcome::NotStored(why)),
                        HashPutOutcome::NotHeld => NOT_HELD,
                    });
                }
            }
            Reply::Summary(chunk) => {
                buf.put_u64_le(chunk.generation);
                buf.put_u64_le(chunk.entries);
                buf.put_u64_le(chunk.total_len);
                buf.put_u8(chunk.hashes);
                buf.put_slice(&[0; 7]);
                buf.put_u64_le(chunk.offset);
                buf.put_slice(&chunk.data);
            }
            Reply::Pages { found, data } => {
                debug_assert_eq!(found.iter().filter(|f| **f).count() * PAGE_SIZE, data.len());
                for f in found {
                    buf.put_u8(*f as u8);
                }
                buf.put_slice(data);
            }
            Reply::Stats(entries) => {
                let entries = entries.iter().take(u16::MAX as usize);
                buf.put_u16_le(entries.len() as u16);
                for entry in entries {
                    let name = truncate_utf8(&entry.name, u8::MAX as usize);
                    buf.put_u8(name.len() as u8);
                    buf.put_slice(name.as_bytes());
                    buf.put_u64_le(entry.value);
                }
            }
            Reply::Members(list) => members::encode(list, buf),
            Reply::VersionMismatch { min, max } => {
                buf.put_u16_le(*min);
                buf.put_u16_le(*max);
            }
            Reply::Error { message, .. } => {
                buf.put_slice(truncate_utf8(message, MAX_MESSAGE_LEN).as_bytes());
            }
        }
        frame.finish(buf);
    }

    /// Parses a reply frame, given the op of the request it answers and, for a batch, the
    /// number of keys that request carried.
    pub fn parse(frame: Frame, op: Op, keys: usize) -> Result<Reply, BodyError> {
        if frame.op != op as u8 {
            return Err(BodyError::Invalid("op: not the op of the request"));
        }
        let status = Status::from_code(frame.status).ok_or(BodyError::Invalid("status code"))?;
        let mut r = Reader::new(frame.body);
        let reply = match (status, op) {
            (Status::UnsupportedVersion, _) => {
                Reply::VersionMismatch { min: r.u16("version_min")?, max: r.u16("version_max")? }
            }
            (Status::Ok, Op::Hello) => {
                let version = r.u16("version")?;
                let _reserved = r.u16("reserved")?;
                Reply::Hello(HelloReply {
                    version,
                    max_batch: r.u32("max_batch")?,
                    node_id: r.u128("node_id")?,
                    challenge: r.array("challenge")?,
                })
            }
            (Status::Ok, Op::Auth) => Reply::Auth { proof: r.array("proof")? },
            (Status::Ok, Op::Ping | Op::DestroyPool | Op::InvalidatePages) => Reply::Empty,
            (Status::Ok, Op::CreatePool) => Reply::Pool(PoolId(r.u32("pool")?)),
            (Status::Ok, Op::InvalidatePool | Op::InvalidateObject) => {
                Reply::Count(r.u64("count")?)
            }
            (Status::Ok, Op::Put | Op::PutHashes) => {
                let mut outcomes = Vec::with_capacity(keys.min(MAX_BATCH));
                for _ in 0..keys {
                    let code = r.u8("put outcome")?;
                    let outcome = match parse_put_code(code) {
                        Some(HashPutOutcome::NotHeld) if op == Op::Put => None,
                        other => other,
                    };
                    outcomes.push(outcome.ok_or(BodyError::Invalid("put outcome code"))?);
                }
                match op {
                    Op::PutHashes => Reply::PutHashes(outcomes),
                    _ => Reply::Put(outcomes.into_iter().map(page_outcome).collect()),
                }
            }
            (Status::Ok, Op::ContentSummary) => {
                let generation = r.u64("generation")?;
                let entries = r.u64("entries")?;
                let total_len = r.u64("total_len")?;
                let hashes = r.u8("hashes")?;
                if r.array::<7>("reserved")? != [0; 7] {
                    return Err(BodyError::Invalid("reserved field: not zero"));
                }
                let offset = r.u64("offset")?;
                let len = r.remaining();
                let fits = offset.checked_add(len as u64).is_some_and(|end| end <= total_len);
                if len > SUMMARY_CHUNK || !fits {
                    return Err(BodyError::Invalid("summary piece: past the filter's end"));
                }
                let data = r.bytes(len, "filter bytes")?;
                Reply::Summary(SummaryChunk {
                    generation,
                    entries,
                    total_len,
                    hashes,
                    offset,
                    data,
                })
            }
            (Status::Ok, Op::Get | Op::Take) => {
                let mut found = Vec::with_capacity(keys.min(MAX_BATCH));
                for _ in 0..keys {
                    found.push(match r.u8("found flag")? {
                        0 => false,
                        1 => true,
                        _ => return Err(BodyError::Invalid("found flag: not 0 or 1")),
                    });
                }
                let hits = found.iter().filter(|f| **f).count();
                let data = r.bytes(hits * PAGE_SIZE, "page data")?;
                Reply::Pages { found, data }
            }
            (Status::Ok, Op::Stats) => {
                let count = r.u16("entry count")?;
                let mut entries = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let len = r.u8("name length")? as usize;
                    let name = String::from_utf8(r.bytes(len, "name")?.to_vec())
                        .map_err(|_| BodyError::Invalid("stat name: not UTF-8"))?;
                    entries.push(StatEntry { name, value: r.u64("value")? });
                }
                Reply::Stats(entries)
            }
            (Status::Ok, Op::Members) => Reply::Members(members::parse(&mut r)?),
            (status, _) => {
                let len = r.remaining().min(MAX_MESSAGE_LEN);
                let text = r.bytes(len, "message")?;
                Reply::Error { status, message: String::from_utf8_lossy(&text).into_owned() }
            }
        };
        r.finish()?;
        Ok(reply)
    }
}

/// Appends a GET or TAKE reply whose pages are written in place: `fill` gets a zeroed slice
/// of `count` pages to copy the pool's pages into, and returns which keys hit. Pages that
/// missed are squeezed out before the frame is finished. If `fill` fails, nothing is left
/// in `buf` and its error is returned, for the caller to answer with an error reply.
#[expect(
    clippy::indexing_slicing,
    reason = "offsets within the flags and pages this function sized the buffer for"
)]
pub fn encode_pages_with<E>(
    buf: &mut BytesMut,
    op: Op,
    id: u64,
    count: usize,
    fill: impl FnOnce(&mut [u8]) -> Result<Vec<bool>, E>,
) -> Result<(), E> {
    let start = buf.len();
    let frame = FrameWriter::begin(buf, op as u8, Status::Ok as u8, id);
    let flags_at = buf.len();
    let data_at = flags_at + count;
    buf.resize(data_at + count * PAGE_SIZE, 0);
    let found = match fill(&mut buf[data_at..]) {
        Ok(found) => found,
        Err(err) => {
            buf.truncate(start);
            return Err(err);
        }
    };
    assert_eq!(found.len(), count, "one found flag per key");
    let mut kept = 0;
    for (i, hit) in found.iter().enumerate() {
        buf[flags_at + i] = *hit as u8;
        if *hit {
            if kept != i {
                let from = data_at + i * PAGE_SIZE;
                buf.copy_within(from..from + PAGE_SIZE, data_at + kept * PAGE_SIZE);
            }
            kept += 1;
        }
    }
    buf.truncate(data_at + kept * PAGE_SIZE);
    frame.finish(buf);
    Ok(())
}

/// A PUT's outcome codes are PUT_HASHES' without "not held" (refused when parsing).
fn page_outcome(outcome: HashPutOutcome) -> PutOutcome {
    match outcome {
        HashPutOutcome::Stored => PutOutcome::Stored,
        HashPutOutcome::NotStored(why) => PutOutcome::NotStored(why),
        HashPutOutcome::NotHeld => PutOutcome::NotStored(NotStored::Full),
    }
}

/// Appends an error reply to a request whose op code may be unknown (so it cannot be an
/// [`Op`]): the reply echoes the raw code, as every reply does.
pub fn encode_error(buf: &mut BytesMut, op: u8, id: u64, status: Status, message: &str) {
    debug_assert!(!matches!(status, Status::Ok | Status::UnsupportedVersion));
    let frame = FrameWriter::begin(buf, op, status as u8, id);
    buf.put_slice(truncate_utf8(message, MAX_MESSAGE_LEN).as_bytes());
    frame.finish(buf);
}
