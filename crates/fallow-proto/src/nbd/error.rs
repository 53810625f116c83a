//! Why NBD bytes do not decode.
//!
//! Every decoder in [`crate::nbd`] is total: whatever a peer sends, it returns a value, `None`
//! (more bytes needed) or one of these errors, and never panics. Which errors a connection
//! survives depends on where they come from, and each decoder says so:
//!
//! * from a *framing* decoder (`decode_*`): the stream cannot be resynchronised, so the
//!   caller hangs up (a "hard disconnect" in the spec's words);
//! * from [`Opt::parse`](super::Opt::parse): the option was well delimited, so the server
//!   answers `NBD_REP_ERR_INVALID` and reads the next option;
//! * from [`OptionReply::parse`](super::OptionReply::parse) and the structured-chunk
//!   decoder: the server broke the protocol, and the client hangs up.

/// A message that does not decode. The `what` fields name the message or field, for logs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A magic number is not the one this message starts with: the peer does not speak
    /// NBD, or the stream lost its framing.
    #[error("bad {what} magic {found:#x}")]
    BadMagic {
        /// The message whose magic was expected.
        what: &'static str,
        /// The bytes found where the magic belongs.
        found: u64,
    },
    /// The server opened with the oldstyle greeting, which this crate does not speak (nor
    /// does the reference server since 3.10).
    #[error("the server uses oldstyle negotiation")]
    Oldstyle,
    /// The client set a flag the server does not know or did not advertise; the spec makes
    /// the server drop the connection.
    #[error("client flags {flags:#x} set an unknown or unadvertised bit")]
    BadClientFlags {
        /// The client flags as received.
        flags: u32,
    },
    /// A length field claims more bytes than this side accepts. The limit is a defence
    /// against a peer that would make us buffer gigabytes.
    #[error("{what} of {len} bytes is over the limit of {max}")]
    TooLong {
        /// The message or field.
        what: &'static str,
        /// The length as received.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A field runs past the end of its message's data.
    #[error("{0} runs past the end of the message")]
    Truncated(&'static str),
    /// Bytes left over after the last field of a message that has no room for them.
    #[error("{extra} unexpected bytes after {what}")]
    Trailing {
        /// The message.
        what: &'static str,
        /// How many bytes were left over.
        extra: usize,
    },
    /// A field holds a value the protocol does not allow.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// The field.
        what: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
}
