//! HELLO and AUTH: version agreement, then challenge–response on the shared secret
//! (`fallow_proto::fallow::auth`). Until AUTH succeeds a peer reaches nothing: any other
//! request closes the connection.

use std::sync::Arc;

use bytes::BytesMut;
use fallow_proto::fallow::auth::Transcript;
use fallow_proto::fallow::{encode_error, Hello, HelloReply, Op, Reply, Session, Status, VERSION};

use crate::clients::Client;
use crate::node::Node;

/// Where a connection is in its life.
#[derive(Debug)]
pub(crate) enum Phase {
    /// Nothing received yet.
    AwaitHello,
    /// HELLO answered; the challenge is out.
    AwaitAuth {
        /// The version, challenge and client id the proof must cover.
        version: u16,
        challenge: [u8; 32],
        client_id: u128,
        name: String,
        /// Where the connection stands in its client's session (`fence.rs`).
        session: Option<Session>,
    },
    /// Authenticated, its AUTH reply held back until the older connections of its session
    /// it fences have finished the requests they were running (`fence.rs`).
    Fencing { client_id: u128, client: Arc<Client> },
    /// Authenticated as this client.
    Ready { client_id: u128, client: Arc<Client> },
}

/// Answers a HELLO. Returns the next phase, or the status with which the node closes.
pub(crate) fn hello(
    node: &Node,
    hello: Hello,
    id: u64,
    out: &mut BytesMut,
) -> Result<Phase, Status> {
    if hello.version_min > VERSION || hello.version_max < VERSION {
        Reply::VersionMismatch { min: VERSION, max: VERSION }.encode(Op::Hello, id, out);
        return Err(Status::UnsupportedVersion);
    }
    let challenge: [u8; 32] = rand::random();
    Reply::Hello(HelloReply {
        version: VERSION,
        max_batch: fallow_proto::fallow::MAX_BATCH as u32,
        node_id: node.node_id(),
        challenge,
    })
    .encode(Op::Hello, id, out);
    Ok(Phase::AwaitAuth {
        version: VERSION,
        challenge,
        client_id: hello.client_id,
        name: hello.name,
        session: hello.session,
    })
}

/// Checks an AUTH. On success the connection is registered as one of the client's, the
/// node's own proof is encoded into `out` and the client returned; on failure AUTH_FAILED
/// is encoded and the node closes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn auth(
    node: &Node,
    version: u16,
    challenge: [u8; 32],
    client_id: u128,
    client_nonce: [u8; 32],
    proof: &[u8; 32],
    id: u64,
    out: &mut BytesMut,
) -> Result<Arc<Client>, Status> {
    let transcript = Transcript { version, challenge, client_nonce, client_id };
    let secret = &node.config().secret;
    if !transcript.verify_client(secret, proof) {
        encode_error(out, Op::Auth as u8, id, Status::AuthFailed, "authentication failed");
        return Err(Status::AuthFailed);
    }
    Reply::Auth { proof: transcript.node_proof(secret) }.encode(Op::Auth, id, out);
    Ok(node.clients().connect(client_id))
}
