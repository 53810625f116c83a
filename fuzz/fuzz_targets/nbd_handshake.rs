//! The NBD server's handshake (`fallow_nbd::handshake::negotiate`) against a client that
//! sends the input: the client flags, then options (and, after GO or EXPORT_NAME, the first
//! transmission requests, as a pipelining client would), then closes its side.
//!
//! Checked, whatever the client sent, by reading the server's bytes as a client would:
//! * the greeting comes first, then only whole option replies that parse, grouped per
//!   option: each group answers the client's next option, in order, with its code, and
//!   ends in a final reply (ACK or an error);
//! * a session ends right after a GO (whose group carries the export's size and flags and
//!   an ACK) or an EXPORT_NAME (whose reply, with or without the 124 zeroes, is the last
//!   thing sent), with `base:allocation` only on top of structured replies, and the bytes
//!   after the last option are handed on to transmission untouched;
//! * ABORT gets one ACK, and a hang-up leaves nothing half-sent.

#![no_main]

use std::sync::Arc;

use bytes::BytesMut;
use fallow_nbd::handshake::{negotiate, HandshakeError, Session};
use fallow_nbd::{Export, TlsPolicy};
use fallow_proto::nbd::handshake::{
    decode_client_flags, decode_export_name_reply, decode_greeting,
};
use fallow_proto::nbd::*;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What `negotiate` returned, without the stream (dropped, so the client sees the end).
type Outcome = Result<Option<(Session, BytesMut)>, HandshakeError>;

fuzz_target!(|input: &[u8]| {
    let fixture = fallow_fuzz::nbd_fixture();
    let (sent, outcome) = fixture.runtime.block_on(converse(input, &fixture.exports));
    check(input, &sent, outcome, &fixture.exports);
});

/// Runs the server over an in-memory stream, writing `input` to it, closing the client's
/// side and reading everything the server sends, all at once so neither side can block
/// the other.
async fn converse(input: &[u8], exports: &[Arc<Export>]) -> (Vec<u8>, Outcome) {
    let (client, server) = tokio::io::duplex(1 << 16);
    let (mut from_server, mut to_server) = tokio::io::split(client);
    let serve = async {
        let negotiated = negotiate(Box::new(server), exports, &TlsPolicy::Off).await?;
        Ok(negotiated.session.map(|session| (session, negotiated.input)))
    };
    let send = async move {
        // The server may hang up before it has read everything: that is not an error here.
        let _ = to_server.write_all(input).await;
        let _ = to_server.shutdown().await;
    };
    let receive = async move {
        let mut sent = Vec::new();
        let _ = from_server.read_to_end(&mut sent).await;
        sent
    };
    let (outcome, (), sent) = tokio::join!(serve, send, receive);
    (sent, outcome)
}

fn check(input: &[u8], sent: &[u8], outcome: Outcome, exports: &[Arc<Export>]) {
    let advertised = NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES;
    let mut server = BytesMut::from(sent);
    assert_eq!(decode_greeting(&mut server), Ok(Some(advertised)), "the greeting comes first");

    // The client's side, decoded on its own: its flags, then its options, each with the
    // number of input bytes left after it.
    let mut client = BytesMut::from(input);
    let client_flags = match decode_client_flags(&mut client, advertised) {
        Ok(Some(flags)) => flags,
        _ => {
            assert!(
                server.is_empty(),
                "{} bytes answered bad or missing client flags",
                server.len()
            );
            assert!(outcome.is_err(), "a session without client flags");
            return;
        }
    };
    let mut options = Vec::new();
    while let Ok(Some(option)) = decode_option(&mut client) {
        options.push((option.option, client.len()));
    }

    // The server's side: whole option replies, grouped by the option they answer.
    let mut groups: Vec<(u32, Vec<OptionReply>)> = Vec::new();
    let mut open: Option<(u32, Vec<OptionReply>)> = None;
    loop {
        let mut rest = server.clone();
        let Ok(Some(raw)) = decode_option_reply(&mut rest) else { break };
        server = rest;
        let reply = OptionReply::parse(&raw).unwrap_or_else(|e| {
            panic!("the server sent an option reply that does not parse: {e}: {raw:?}")
        });
        let group = open.get_or_insert_with(|| (raw.option, Vec::new()));
        assert_eq!(group.0, raw.option, "a reply to another option before the final reply");
        let last = reply.is_final();
        group.1.push(reply);
        if last {
            groups.extend(open.take());
        }
    }
    assert!(open.is_none(), "the replies to the last option end without a final reply");
    assert!(groups.len() <= options.len(), "more reply groups than options");
    for (i, (code, _)) in groups.iter().enumerate() {
        assert_eq!(*code, options[i].0, "reply group {i} does not answer option {i}");
    }

    match outcome {
        Ok(Some((session, leftover))) => {
            assert!(client_flags & !(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES) == 0);
            assert!(!session.base_allocation || session.structured, "base:allocation alone");
            let export = &session.export;
            assert!(exports.iter().any(|e| Arc::ptr_eq(e, export)), "an export nobody serves");
            let (size, flags) = (export.size(), export.transmission_flags());
            let used = if server.is_empty() {
                let (code, replies) = groups.last().expect("a session without a GO or EXPORT_NAME");
                assert_eq!(*code, NBD_OPT_GO, "a session after an option other than GO");
                assert_eq!(replies.last(), Some(&OptionReply::Ack));
                assert!(replies.contains(&OptionReply::Info(Info::Export { size, flags })));
                groups.len()
            } else {
                assert!(!session.structured || client_flags & NBD_FLAG_C_FIXED_NEWSTYLE != 0);
                assert_eq!(options.get(groups.len()).map(|o| o.0), Some(NBD_OPT_EXPORT_NAME));
                assert_eq!(
                    server.len(),
                    ExportNameReply::wire_len(client_flags),
                    "after EXPORT_NAME"
                );
                let reply = decode_export_name_reply(&mut server, client_flags);
                assert_eq!(reply, Ok(Some(ExportNameReply { size, flags })));
                groups.len() + 1
            };
            let after = options[used - 1].1;
            assert_eq!(&leftover[..], &input[input.len() - after..], "pipelined bytes lost");
        }
        Ok(None) => {
            let (code, replies) = groups.last().expect("an abort without a reply");
            assert_eq!((*code, &replies[..]), (NBD_OPT_ABORT, &[OptionReply::Ack][..]));
            assert!(server.is_empty(), "bytes after the ACK of ABORT");
        }
        Err(_) => assert!(server.is_empty(), "{} stray bytes before a hang-up", server.len()),
    }
}
