//! The node protocol: length-prefixed binary frames with request ids, pipelined and
//! answered in any order, with batched page operations. `docs/protocol.md` specifies every
//! byte; this module is the reference implementation of that document.
//!
//! ```text
//!  0       4    5        6          8                16
//!  +-------+----+--------+----------+----------------+---------------+
//!  | len   | op | status | reserved | request id     | body ...      |
//!  | u32le | u8 | u8     | u16 (0)  | u64le          | len - 12 bytes|
//!  +-------+----+--------+----------+----------------+---------------+
//! ```
//!
//! A connection starts with HELLO (versions, client id; the node answers with a challenge)
//! and AUTH (an HMAC-SHA256 proof over the challenge, answered by the node's own proof).
//! Nothing else is served before AUTH succeeds.
//!
//! # Components
//! [`frame`]: splitting a byte stream into frames, and writing frame headers.
//! [`Request`]: what a client asks, parsed from a frame body or encoded into one.
//! [`Reply`]: what the node answers.
//! [`auth`]: the challenge–response proofs. [`MemberInfo`]: one entry of a MEMBERS reply.

pub mod auth;
pub mod frame;
mod members;
mod op;
mod reply;
mod request;
mod wire;

pub use frame::{Frame, FrameError, FrameWriter};
pub use members::{MemberInfo, MemberState, MAX_MEMBERS, MEMBER_ENTRY_LEN};
pub use op::{Op, Status};
pub use reply::{encode_error, encode_pages_with, HelloReply, Reply, StatEntry, SummaryChunk};
pub use request::{Hello, PageRef, Request, Session, SESSION_LEN};
pub use wire::BodyError;

/// The protocol version this crate speaks. A node and a client agree on the highest
/// version both support during HELLO.
pub const VERSION: u16 = 1;

/// The eight bytes that open every HELLO body: they tell a fallow node from anything else
/// listening on the port.
pub const MAGIC: [u8; 8] = *b"FALLOWPP";

/// Bytes of the fixed frame header, the length field included.
pub const HEADER_LEN: usize = 16;

/// The most pages one PUT, GET, TAKE or INVALIDATE_PAGES may carry.
pub const MAX_BATCH: usize = 256;

/// The largest value of the length field: a full batch of pages, its keys and the small
/// fixed part of a body, with room to spare. Anything larger is a broken or hostile peer.
pub const MAX_FRAME_LEN: usize = (MAX_BATCH * fallow_core::PAGE_SIZE) + 64 * 1024;

/// The most filter bytes one CONTENT_SUMMARY reply carries; a larger summary is fetched
/// in several requests.
pub const SUMMARY_CHUNK: usize = 1 << 20;

/// The longest client name a HELLO may carry, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// The longest error message a reply may carry, in bytes.
pub const MAX_MESSAGE_LEN: usize = 256;
