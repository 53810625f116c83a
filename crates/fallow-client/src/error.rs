//! Every way a client request can fail. A miss is not an error (`Ok(None)`), nor is a
//! refused put (`PutOutcome::NotStored`).

use std::time::Duration;

use fallow_core::{PoolId, StoreError};
use fallow_proto::fallow::Status;

/// A failed client operation.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is not `HOST:PORT`, `fallow://HOST:PORT` or `unix:PATH`.
    #[error("invalid node address `{0}`: expected HOST:PORT, fallow://HOST:PORT or unix:PATH")]
    InvalidAddress(String),
    /// Connecting failed.
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        /// The node.
        endpoint: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TLS handshake with the node failed: a certificate the client does not trust
    /// (or that names another host), or a node without `--node-tls`, which closes.
    #[error("TLS with {endpoint} failed: {why} (does the node run with --node-tls, and does its certificate chain to this client's ca-cert.pem and name the host?)")]
    Tls {
        /// The node.
        endpoint: String,
        /// Why.
        why: String,
    },
    /// The node speaks only TLS on this address and the client connected in the clear.
    #[error(
        "the node requires TLS: connect with --node-tls DIR (the CA of the cluster's certificates)"
    )]
    TlsRequired,
    /// The connection failed while in use.
    #[error("connection to the node failed: {0}")]
    Io(#[from] std::io::Error),
    /// The connection closed with this request in flight; it may or may not have run.
    #[error("the node closed the connection")]
    Disconnected,
    /// No reply within the timeout.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The node refused the secret (or the client's proof).
    #[error("authentication failed: the node does not accept this secret")]
    AuthFailed,
    /// The node answered AUTH with a proof that does not match the secret: whatever
    /// answered does not hold it.
    #[error("the node could not prove it holds the secret")]
    NodeNotAuthenticated,
    /// No protocol version in common.
    #[error("no protocol version in common: the node speaks {node_min}..={node_max}")]
    VersionMismatch {
        /// The node's lowest version.
        node_min: u16,
        /// The node's highest version.
        node_max: u16,
    },
    /// The pool does not exist or this client may not reach it.
    #[error("unknown {0}")]
    UnknownPool(PoolId),
    /// The node refused the request.
    #[error("the node answered {}: {message}", status.name())]
    Refused {
        /// The status.
        status: Status,
        /// The node's message.
        message: String,
    },
    /// A buffer that is not one page (or one page per key).
    #[error("buffer of {got} bytes where {expected} were expected")]
    BadLength {
        /// The length passed.
        got: usize,
        /// The length needed.
        expected: usize,
    },
    /// The node sent something the protocol does not allow.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A new connection found a restarted node (another node id) and the client was
    /// configured to refuse it ([`crate::NodeRestart::Refuse`]).
    #[error("the node restarted (node id {found:#034x}, was {expected:#034x})")]
    NodeRestarted {
        /// The node id of the first connection.
        expected: u128,
        /// The node id the new connection found.
        found: u128,
    },
}

impl ClientError {
    /// True when the request may not have reached the node or its connection broke:
    /// retrying it on a fresh connection can succeed.
    pub fn is_connection_error(&self) -> bool {
        matches!(
            self,
            ClientError::Connect { .. }
                | ClientError::Io(_)
                | ClientError::Disconnected
                | ClientError::Timeout(_)
        )
    }
}

impl From<ClientError> for StoreError {
    fn from(err: ClientError) -> StoreError {
        match err {
            ClientError::UnknownPool(pool) => StoreError::UnknownPool(pool),
            ClientError::BadLength { got, expected } => StoreError::BadLength { got, expected },
            ClientError::Refused { status: Status::TooManyPools, .. } => StoreError::TooManyPools,
            ClientError::Refused { status: Status::InvalidSpec, .. } => {
                StoreError::InvalidSpec("refused by the node")
            }
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}
