//! Operation codes and reply statuses: the one-byte numbers on the wire.

/// What a request asks for. A reply carries the op of the request it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Opens a connection: versions and client id; answered with a challenge.
    Hello = 0x01,
    /// Proves knowledge of the shared secret; answered with the node's own proof.
    Auth = 0x02,
    /// Does nothing; measures a round trip and keeps idle connections alive.
    Ping = 0x03,
    /// Creates a pool or attaches to a shared one.
    CreatePool = 0x10,
    /// Detaches from a pool (its pages go when the last user detaches).
    DestroyPool = 0x11,
    /// Removes every page of a pool.
    InvalidatePool = 0x12,
    /// Removes every page of one object.
    InvalidateObject = 0x13,
    /// Removes a batch of pages.
    InvalidatePages = 0x14,
    /// Stores a batch of pages.
    Put = 0x20,
    /// Copies a batch of pages out; they stay.
    Get = 0x21,
    /// Copies a batch of pages out and removes those found.
    Take = 0x22,
    /// Stores a batch of pages by content hash, when the node holds that content.
    PutHashes = 0x23,
    /// Node and pool counters.
    Stats = 0x30,
    /// The cluster's members as this node sees them.
    Members = 0x31,
    /// A piece of the node's content summary (a Bloom filter of the hashes it holds).
    ContentSummary = 0x32,
}

impl Op {
    /// Every op, in code order.
    pub const ALL: [Op; 15] = [
        Op::Hello,
        Op::Auth,
        Op::Ping,
        Op::CreatePool,
        Op::DestroyPool,
        Op::InvalidatePool,
        Op::InvalidateObject,
        Op::InvalidatePages,
        Op::Put,
        Op::Get,
        Op::Take,
        Op::PutHashes,
        Op::Stats,
        Op::Members,
        Op::ContentSummary,
    ];

    /// The op with this code, if any.
    pub fn from_code(code: u8) -> Option<Op> {
        Op::ALL.into_iter().find(|op| *op as u8 == code)
    }

    /// True for the ops a node runs in the background because they may take long (they
    /// walk a whole pool or object, every counter or every stored content): the "slow"
    /// column of `docs/protocol.md` §4. Their replies may overtake, and be overtaken by,
    /// page requests sent later, and clients give them a longer timeout.
    pub fn is_slow(self) -> bool {
        matches!(
            self,
            Op::DestroyPool
                | Op::InvalidatePool
                | Op::InvalidateObject
                | Op::Stats
                | Op::ContentSummary
        )
    }

    /// A lower-case name for logs and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::Auth => "auth",
            Op::Ping => "ping",
            Op::CreatePool => "create_pool",
            Op::DestroyPool => "destroy_pool",
            Op::InvalidatePool => "invalidate_pool",
            Op::InvalidateObject => "invalidate_object",
            Op::InvalidatePages => "invalidate_pages",
            Op::Put => "put",
            Op::Get => "get",
            Op::Take => "take",
            Op::PutHashes => "put_hashes",
            Op::Stats => "stats",
            Op::Members => "members",
            Op::ContentSummary => "content_summary",
        }
    }
}

/// The outcome of a request, in byte 5 of a reply. Requests carry 0 there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// Done; the body is the op's reply.
    Ok = 0,
    /// The op code is not one this node knows. The connection stays open.
    UnknownOp = 1,
    /// The body does not have the layout the op requires. The connection stays open.
    Malformed = 2,
    /// A batch larger than [`super::MAX_BATCH`]. The connection stays open.
    TooLarge = 3,
    /// A request other than HELLO/AUTH before authentication. The node closes.
    NotAuthenticated = 4,
    /// The AUTH proof was wrong. The node closes.
    AuthFailed = 5,
    /// No version in common, or not a fallow HELLO. The node closes.
    UnsupportedVersion = 6,
    /// The pool does not exist or this client may not reach it.
    UnknownPool = 7,
    /// A pool spec the node cannot honour.
    InvalidSpec = 8,
    /// A shared pool with this UUID exists with other options.
    SharedPoolMismatch = 9,
    /// The node has no more pool ids.
    TooManyPools = 10,
    /// The node failed internally; the request may be retried.
    Internal = 11,
    /// The frame's length field is out of range; sent with request id 0, then the node
    /// closes (the stream cannot be resynchronised).
    BadFrame = 12,
    /// The node speaks only TLS on this listener (`--node-tls`) and the peer began in the
    /// clear; sent in the clear with request id 0, then the node closes.
    TlsRequired = 13,
}

impl Status {
    /// Every status, in code order.
    pub const ALL: [Status; 14] = [
        Status::Ok,
        Status::UnknownOp,
        Status::Malformed,
        Status::TooLarge,
        Status::NotAuthenticated,
        Status::AuthFailed,
        Status::UnsupportedVersion,
        Status::UnknownPool,
        Status::InvalidSpec,
        Status::SharedPoolMismatch,
        Status::TooManyPools,
        Status::Internal,
        Status::BadFrame,
        Status::TlsRequired,
    ];

    /// The status with this code, if any.
    pub fn from_code(code: u8) -> Option<Status> {
        Status::ALL.into_iter().find(|s| *s as u8 == code)
    }

    /// A lower-case name for logs and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::UnknownOp => "unknown_op",
            Status::Malformed => "malformed",
            Status::TooLarge => "too_large",
            Status::NotAuthenticated => "not_authenticated",
            Status::AuthFailed => "auth_failed",
            Status::UnsupportedVersion => "unsupported_version",
            Status::UnknownPool => "unknown_pool",
            Status::InvalidSpec => "invalid_spec",
            Status::SharedPoolMismatch => "shared_pool_mismatch",
            Status::TooManyPools => "too_many_pools",
            Status::Internal => "internal",
            Status::BadFrame => "bad_frame",
            Status::TlsRequired => "tls_required",
        }
    }

    /// True when the node closes the connection after sending this status.
    pub fn closes_connection(self) -> bool {
        matches!(
            self,
            Status::NotAuthenticated
                | Status::AuthFailed
                | Status::UnsupportedVersion
                | Status::BadFrame
                | Status::TlsRequired
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for op in Op::ALL {
            assert_eq!(Op::from_code(op as u8), Some(op));
        }
        for status in Status::ALL {
            assert_eq!(Status::from_code(status as u8), Some(status));
        }
        assert_eq!(Op::from_code(0), None);
        assert_eq!(Op::from_code(0xff), None);
        assert_eq!(Status::from_code(14), None);
    }
}
