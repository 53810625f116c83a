//! HELLO and AUTH: version agreement, then challenge–response on the shared secret
//! (`fallow_proto::fallow::auth`). Until AUTH succeeds a peer reaches nothing: any other
//! request closes the connection.

use std::sync::Arc;

use bytes::BytesMut;
use fallow_proto::fallow::auth::Transcript;
use fallow_proto::fallow::{encode_error, Hello, HelloReply, Op, Reply, Session, Status, VERSION};
use tokio_util::sync::CancellationToken;

use crate::clients::Client;
use crate::fence::{Gate, Registration};
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

/// A connection that passed AUTH: its client, its place in the client's session (if it
/// named one), and the older connections of the session it fenced, whose running requests
/// must end before the AUTH reply goes out (`fence.rs`).
pub(crate) struct Authenticated {
    pub(crate) client: Arc<Client>,
    pub(crate) session: Option<Registration>,
    pub(crate) fenced: Vec<Arc<Gate>>,
}

/// Checks an AUTH and joins the connection to its session, if it named one (`stop` is
/// cancelled when a newer connection of the session fences it). On success the connection
/// is registered as one of the client's and the node's own proof is encoded into `out`; on
/// failure the refusal is encoded (AUTH_FAILED for a wrong proof, NOT_AUTHENTICATED for a
/// connection below its session's fence) and the node closes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn auth(
    node: &Node,
    version: u16,
    challenge: [u8; 32],
    client_id: u128,
    session: Option<Session>,
    stop: CancellationToken,
    client_nonce: [u8; 32],
    proof: &[u8; 32],
    id: u64,
    out: &mut BytesMut,
) -> Result<Authenticated, Status> {
    let transcript = Transcript { version, challenge, client_nonce, client_id };
    let secret = &node.config().secret;
    if !transcript.verify_client(secret, proof) {
        encode_error(out, Op::Auth as u8, id, Status::AuthFailed, "authentication failed");
        return Err(Status::AuthFailed);
    }
    let (session, fenced) = match session.map(|s| node.sessions().join(client_id, s, stop)) {
        None => (None, Vec::new()),
        Some(Ok((registration, fenced))) => (Some(registration), fenced),
        Some(Err(stale)) => {
            // The client gave up on this handshake long ago.
            let status = Status::NotAuthenticated;
            encode_error(out, Op::Auth as u8, id, status, &stale.to_string());
            return Err(status);
        }
    };
    Reply::Auth { proof: transcript.node_proof(secret) }.encode(Op::Auth, id, out);
    Ok(Authenticated { client: node.clients().connect(client_id), session, fenced })
}
