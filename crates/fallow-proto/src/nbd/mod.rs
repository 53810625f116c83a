//! The NBD wire format (fixed-newstyle handshake and transmission phase) as a sans-io codec,
//! for both ends of a connection: `fallow nbd` is a server to VMs and tools, and the upstream
//! backing store is a client of another NBD server, so every message can be encoded and
//! decoded. The normative text is NetworkBlockDevice/nbd `doc/proto.md`; constants carry the
//! spec's names so a reader can search for them there.
//!
//! ```text
//!  client                                                         server
//!    │ ◀── NBDMAGIC, IHAVEOPT, handshake flags (18 B) ─────────── │ greeting
//!    │ ─── client flags (4 B) ──────────────────────────────────▶ │
//!    │ ─── IHAVEOPT, option, length, data (16 B + data) ────────▶ │ option haggling,
//!    │ ◀── NBD_REP_MAGIC, option, type, length, data (20 B + …) ─ │ repeated; LIST,
//!    │ ◀── … more replies, the last one ACK or an error ──────── │ INFO, GO and the
//!    │                                                            │ META_CONTEXTs
//!    │ ─── NBD_OPT_GO (export name, info requests) ─────────────▶ │ answer several
//!    │ ◀── NBD_REP_INFO (EXPORT, BLOCK_SIZE, …), then ACK ─────── │ ACK: transmission
//!    │       or: NBD_OPT_EXPORT_NAME ▶ ◀ size, flags, [124 zeroes] (cannot fail)
//!    │ ─── request (28 B) [+ WRITE data] ───────────────────────▶ │ transmission,
//!    │ ◀── simple reply (16 B) [+ READ data] ─────────────────── │ pipelined; replies
//!    │ ◀── or structured chunks (20 B + payload) … DONE ──────── │ in any order, by
//!    │ ─── NBD_CMD_DISC (no reply), then close ─────────────────▶ │ cookie
//! ```
//!
//! Every number is big-endian. Nothing here does I/O: decoders take bytes off the front of a
//! `BytesMut` and return `Ok(None)` while a message is incomplete (the buffer is then left
//! untouched), encoders append to a `BytesMut`. Length fields from the peer are checked
//! against a limit before anything is buffered or allocated for them:
//!
//! * option data and option replies: at most [`MAX_OPTION_LEN`] (64 KiB), far above the
//!   largest valid option (a 4 KiB name and a list of meta-context queries);
//! * strings (names, queries, messages): at most [`MAX_STRING_LEN`] (4096 bytes, the
//!   spec's hard limit);
//! * WRITE payloads and structured-reply chunks: a limit the caller passes, typically the
//!   maximum payload it advertised or asked for ([`DEFAULT_MAX_PAYLOAD`] is the spec's
//!   default of 32 MiB).
//!
//! Unknown options, info types, option replies, commands and chunk types decode into typed
//! `Unknown` values: what to answer is the server's (or client's) decision, not the codec's.
//! Negotiation state (did the client ask for structured replies, which meta contexts are
//! selected, is FUA advertised) is the caller's too: the codec checks syntax, never policy.
//!
//! # Components
//! [`handshake`]: the greeting, the client flags, and the ending of `NBD_OPT_EXPORT_NAME`.
//! [`Opt`]: option requests ([`OptionRequest`] on the wire) and their typed forms.
//! [`OptionReply`]: the server's answers during haggling ([`RawOptionReply`] on the wire),
//! with [`Info`] items and [`BlockSize`] constraints.
//! [`Request`]: the transmission request header, [`Cmd`], and WRITE payloads.
//! [`Reply`]: simple replies and structured reply chunks ([`Chunk`]), block-status
//! [`Extent`]s included; [`ReplyHead`], for a client that reads payloads itself.
//! [`Error`]: why bytes do not decode, and which errors a connection survives.

mod error;
pub mod handshake;
mod option;
mod option_reply;
mod reply;
mod request;
mod wire;

pub use error::Error;
pub use handshake::ExportNameReply;
pub use option::{decode_option, option_name, ExportOpt, MetaContextOpt, Opt, OptionRequest};
pub use option_reply::{
    decode_option_reply, BlockSize, Info, OptionReply, RawOptionReply, RepError,
};
pub use reply::{
    decode_reply, decode_reply_head, encode_chunk_header, encode_offset_data_header, Chunk,
    ChunkBody, ChunkHead, Extent, Reply, ReplyHead, SimpleReply, CHUNK_HEADER_LEN, DATA_HEAD_LEN,
    SIMPLE_REPLY_LEN,
};
pub use request::{
    decode_request, decode_request_with_payload, take_payload, Cmd, Request, REQUEST_LEN,
};

// ---------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------

/// The longest string (export name, meta-context name or query, message) in bytes: the spec
/// says a string "MUST be no longer than 4096 bytes".
pub const MAX_STRING_LEN: usize = 4096;

/// The most option data (in a request) or reply data (in an option reply) this codec
/// accepts: 64 KiB. The spec sets no limit; the largest valid option is a GO with a
/// 4096-byte name and a few info requests, or a META_CONTEXT option with a handful of
/// queries, far below this. A longer length field is refused before anything is buffered.
pub const MAX_OPTION_LEN: usize = 64 * 1024;

/// The spec's default maximum payload, 2^25 bytes (32 MiB): the size a server should accept
/// without advertising `NBD_INFO_BLOCK_SIZE`, and the payload no peer should consider a
/// denial of service.
pub const DEFAULT_MAX_PAYLOAD: u32 = 1 << 25;

/// The most descriptors a server should put in one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk
/// (2^20, so a chunk stays below 8 MiB + 4 bytes).
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 1 << 20;

/// The metadata context every server offers and fallow exports.
pub const BASE_ALLOCATION: &str = "base:allocation";

// ---------------------------------------------------------------------------------------
// Magic numbers
// ---------------------------------------------------------------------------------------

/// `NBDMAGIC` (the spec's `INIT_PASSWD`): the first 8 bytes a server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: follows `NBDMAGIC` in a newstyle greeting, and starts every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// `cliserv_magic`: follows `NBDMAGIC` in an oldstyle greeting, which this crate refuses.
pub const CLISERV_MAGIC: u64 = 0x0000_4202_8186_1253;
/// The magic of every option reply (`0x3e889045565a9`; libnbd's `NBD_REP_MAGIC`).
pub const NBD_REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// The magic of a transmission request.
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// The magic of a simple reply (formerly `NBD_REPLY_MAGIC`).
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// The magic of a structured reply chunk.
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------------------
// Handshake flags (16 bits, server → client) and client flags (32 bits, client → server)
// ---------------------------------------------------------------------------------------

/// Handshake flag: the server speaks fixed newstyle.
pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the server must omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------------------------------
// Transmission flags (16 bits, in NBD_INFO_EXPORT and the EXPORT_NAME ending)
// ---------------------------------------------------------------------------------------

/// Always set.
pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
/// The export is read-only: writes fail.
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_CMD_FLUSH` is supported.
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_CMD_FLAG_FUA` is supported.
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
/// The export behaves like a rotational medium.
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
/// `NBD_CMD_TRIM` is supported.
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_CMD_WRITE_ZEROES` (and `NBD_CMD_FLAG_NO_HOLE`) is supported.
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_CMD_FLAG_DF` is supported on READ (only with structured replies).
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
/// FLUSH and FUA are visible across every connection to the export, so a client may
/// spread its requests over several connections.
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_CMD_RESIZE` (experimental RESIZE extension).
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
/// `NBD_CMD_CACHE` is understood.
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
/// `NBD_CMD_FLAG_FAST_ZERO` is supported on WRITE_ZEROES.
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
/// Block-status payloads (experimental EXTENDED_HEADERS extension).
pub const NBD_FLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

// ---------------------------------------------------------------------------------------
// Option codes (32 bits)
// ---------------------------------------------------------------------------------------

/// Choose an export and enter transmission; the server cannot answer with an error.
pub const NBD_OPT_EXPORT_NAME: u32 = 1;
/// End the negotiation (soft disconnect).
pub const NBD_OPT_ABORT: u32 = 2;
/// List the exports.
pub const NBD_OPT_LIST: u32 = 3;
/// Withdrawn experimental option; not in use.
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
/// Upgrade the connection to TLS.
pub const NBD_OPT_STARTTLS: u32 = 5;
/// Describe an export without entering transmission.
pub const NBD_OPT_INFO: u32 = 6;
/// Describe an export and enter transmission.
pub const NBD_OPT_GO: u32 = 7;
/// Use structured replies in transmission.
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
/// List metadata contexts.
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
/// Select metadata contexts for `NBD_CMD_BLOCK_STATUS`.
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
/// Experimental EXTENDED_HEADERS extension.
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// ---------------------------------------------------------------------------------------
// Option reply types (32 bits); errors have bit 31 set
// ---------------------------------------------------------------------------------------

/// The option succeeded, or the list of replies to it is complete. No data.
pub const NBD_REP_ACK: u32 = 1;
/// One export, in answer to `NBD_OPT_LIST`.
pub const NBD_REP_SERVER: u32 = 2;
/// One item of information about an export, in answer to INFO or GO.
pub const NBD_REP_INFO: u32 = 3;
/// One metadata context, in answer to LIST_META_CONTEXT or SET_META_CONTEXT.
pub const NBD_REP_META_CONTEXT: u32 = 4;
/// The bit that marks an option reply type as an error.
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
/// The option is unknown to this server.
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
/// Server policy forbids the option.
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
/// The option is syntactically or semantically invalid.
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
/// The option is not supported on this platform or build.
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
/// TLS must be initiated first.
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
/// The export is not available.
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
/// The server is shutting down.
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
/// The client must request `NBD_INFO_BLOCK_SIZE` before GO.
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
/// The request or the reply is too large.
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;
/// Experimental EXTENDED_HEADERS extension.
pub const NBD_REP_ERR_EXT_HEADER_REQD: u32 = NBD_REP_FLAG_ERROR | 10;

// ---------------------------------------------------------------------------------------
// Information types (16 bits), in NBD_OPT_INFO/GO requests and NBD_REP_INFO replies
// ---------------------------------------------------------------------------------------

/// Export size and transmission flags (always sent before a successful ACK).
pub const NBD_INFO_EXPORT: u16 = 0;
/// The server's canonical name of the export.
pub const NBD_INFO_NAME: u16 = 1;
/// A description of the export for humans.
pub const NBD_INFO_DESCRIPTION: u16 = 2;
/// Block-size constraints: minimum, preferred, maximum payload.
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------------------
// Commands (16 bits) and command flags (16 bits)
// ---------------------------------------------------------------------------------------

/// Read `length` bytes at `offset`.
pub const NBD_CMD_READ: u16 = 0;
/// Write the `length` bytes that follow the request.
pub const NBD_CMD_WRITE: u16 = 1;
/// Disconnect: no reply, and nothing may follow.
pub const NBD_CMD_DISC: u16 = 2;
/// Make every completed write durable.
pub const NBD_CMD_FLUSH: u16 = 3;
/// The range is no longer needed (a hint).
pub const NBD_CMD_TRIM: u16 = 4;
/// The client will access the range soon (a hint).
pub const NBD_CMD_CACHE: u16 = 5;
/// Write zeroes without a payload.
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
/// Query the selected metadata contexts over a range.
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;
/// Experimental RESIZE extension.
pub const NBD_CMD_RESIZE: u16 = 8;

/// Force unit access: reply only once the command's writes are durable.
pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
/// WRITE_ZEROES: do not punch a hole; keep the range allocated.
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// READ: "don't fragment", at most one content chunk.
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
/// BLOCK_STATUS: one extent per context, no longer than the request.
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// WRITE_ZEROES: fail fast with `NBD_ENOTSUP` unless zeroing is faster than writing.
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Experimental EXTENDED_HEADERS extension.
pub const NBD_CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// ---------------------------------------------------------------------------------------
// Structured replies: flags and chunk types (16 bits each)
// ---------------------------------------------------------------------------------------

/// The last chunk of a structured reply.
pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;
/// No payload; only as the final chunk.
pub const NBD_REPLY_TYPE_NONE: u16 = 0;
/// An offset, then data read from it.
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// An offset and a length that read as zeroes.
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// A context id, then extent descriptors.
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Experimental EXTENDED_HEADERS extension.
pub const NBD_REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// The bit that marks a chunk type as an error chunk.
pub const NBD_REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
/// An error and a message.
pub const NBD_REPLY_TYPE_ERROR: u16 = NBD_REPLY_TYPE_FLAG_ERROR | 1;
/// An error, a message and the offset where it happened.
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = NBD_REPLY_TYPE_FLAG_ERROR | 2;

// ---------------------------------------------------------------------------------------
// Error values (32 bits), in simple replies and error chunks
// ---------------------------------------------------------------------------------------

/// Operation not permitted (a write to a read-only export).
pub const NBD_EPERM: u32 = 1;
/// Input/output error.
pub const NBD_EIO: u32 = 5;
/// Cannot allocate memory (to be avoided).
pub const NBD_ENOMEM: u32 = 12;
/// Invalid argument (bad alignment, out of bounds, unknown command or flag).
pub const NBD_EINVAL: u32 = 22;
/// No space left (a write beyond the end of the export).
pub const NBD_ENOSPC: u32 = 28;
/// Value too large (a DF read that cannot be sent unfragmented).
pub const NBD_EOVERFLOW: u32 = 75;
/// Operation not supported (a FAST_ZERO that would not be fast).
pub const NBD_ENOTSUP: u32 = 95;
/// The server is shutting down.
pub const NBD_ESHUTDOWN: u32 = 108;

// ---------------------------------------------------------------------------------------
// base:allocation status flags (32 bits, in block-status descriptors)
// ---------------------------------------------------------------------------------------

/// The extent is a hole (not allocated).
pub const NBD_STATE_HOLE: u32 = 1 << 0;
/// The extent reads as zeroes.
pub const NBD_STATE_ZERO: u32 = 1 << 1;
