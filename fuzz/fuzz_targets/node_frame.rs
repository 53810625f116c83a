//! The node protocol (`fallow_proto::fallow`): frames split off a byte stream, each parsed
//! as a request (what a node reads) and as a reply to the request of its op (what a client
//! reads), and the AUTH proof checked as the node checks it.
//!
//! The first two input bytes (little-endian, modulo 300) are the number of keys the
//! request being answered carried, which a PUT, PUT_HASHES, GET or TAKE reply is parsed
//! against (more than `MAX_BATCH` included); the rest is the stream.
//!
//! Checked: a frame re-encodes to its bytes (the reserved field and, in requests, the
//! status aside); a request parses back to itself after encoding, with the same body
//! bytes (only HELLO may carry bytes it ignores: later versions may append fields); a reply
//! parses back to itself after encoding (an error message, made valid UTF-8 on the way,
//! may change once, then no more); a proof made with the secret verifies, and a proof
//! from the input verifies only if it is that proof.

#![no_main]

use bytes::BytesMut;
use fallow_proto::fallow::auth::Transcript;
use fallow_proto::fallow::frame::{decode, encode};
use fallow_proto::fallow::{Frame, Op, Reply, Request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((keys, stream)) = input.split_first_chunk::<2>() else { return };
    let keys = usize::from(u16::from_le_bytes(*keys)) % 300;
    let mut buf = BytesMut::from(stream);
    loop {
        let at = stream.len() - buf.len();
        let before = buf.clone();
        let frame = match decode(&mut buf) {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                assert_eq!(buf, before, "an incomplete frame was consumed");
                return;
            }
            Err(_) => return,
        };
        let used = stream.len() - buf.len() - at;
        let mut again = BytesMut::new();
        encode(&mut again, frame.op, frame.status, frame.id, &frame.body);
        // Bytes 6..8 are the reserved field, which the decoder ignores.
        assert_eq!((&again[..6], &again[8..]), (&stream[at..at + 6], &stream[at + 8..at + used]));
        request(&frame);
        if let Some(op) = Op::from_code(frame.op) {
            reply(&frame, op, keys);
        }
    }
});

fn request(frame: &Frame) {
    let Ok(request) = Request::parse(frame.clone()) else { return };
    assert_eq!(request.op() as u8, frame.op);
    let again = reframe(|buf| request.encode(frame.id, buf));
    assert_eq!(again.status, 0);
    let parsed = Request::parse(again.clone()).expect("a request's own encoding parses");
    assert_eq!(parsed, request, "request round trip");
    if request.op() != Op::Hello {
        assert_eq!(
            again.body,
            frame.body,
            "{:?}: a second encoding of the same request",
            request.op()
        );
    }
    if let Request::Auth { client_nonce, proof } = request {
        auth(client_nonce, proof, &frame.body);
    }
}

fn reply(frame: &Frame, op: Op, keys: usize) {
    let Ok(reply) = Reply::parse(frame.clone(), op, keys) else { return };
    let once = reparse(&reply, op, frame.id, keys);
    assert_eq!(reparse(&once, op, frame.id, keys), once, "not a fixed point");
    if !matches!(reply, Reply::Error { .. }) {
        assert_eq!(once, reply, "reply round trip");
    }
}

fn reparse(reply: &Reply, op: Op, id: u64, keys: usize) -> Reply {
    let frame = reframe(|buf| reply.encode(op, id, buf));
    Reply::parse(frame, op, keys).unwrap_or_else(|e| panic!("own encoding of {reply:?}: {e}"))
}

/// The one frame `encode` writes.
fn reframe(encode: impl FnOnce(&mut BytesMut)) -> Frame {
    let mut buf = BytesMut::new();
    encode(&mut buf);
    let frame = decode(&mut buf).expect("own encoding").expect("a whole frame");
    assert!(buf.is_empty(), "bytes after one frame");
    frame
}

/// The node's check of an AUTH, on a transcript and secret taken from the frame's body.
fn auth(client_nonce: [u8; 32], proof: [u8; 32], body: &[u8]) {
    let transcript = Transcript {
        version: 1,
        challenge: proof,
        client_nonce,
        client_id: u128::from(body.len() as u64),
    };
    let secret = &body[..body.len().min(24)];
    let right = transcript.client_proof(secret);
    assert!(transcript.verify_client(secret, &right));
    assert_eq!(transcript.verify_client(secret, &proof), proof == right);
    assert!(!transcript.verify_node(secret, &right), "a client proof passed as the node's");
    assert!(transcript.verify_node(secret, &transcript.node_proof(secret)));
}
