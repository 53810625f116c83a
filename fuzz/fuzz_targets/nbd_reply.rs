//! The client's side of NBD, as the upstream NBD backing store reads another server: the
//! greeting, option replies, the EXPORT_NAME reply, and transmission replies (simple and
//! structured, whole or head first). Every decoder reads the whole input, message after
//! message, until it needs more bytes or refuses them.
//!
//! Checked: a decoder that needs more bytes leaves the buffer untouched; what decodes
//! re-encodes to the bytes it came from where the encoding is unique (headers, framing,
//! simple replies), and otherwise decodes again to the same value once re-encoded
//! (messages for humans are made valid UTF-8 and cut to 4096 bytes, so the first round may
//! change them, the second may not); and the two ways of reading a reply, whole
//! (`decode_reply`) or head first (`decode_reply_head`, then the payload), agree.

#![no_main]

use bytes::{Bytes, BytesMut};
use fallow_proto::nbd::handshake::{decode_export_name_reply, decode_greeting, encode_greeting};
use fallow_proto::nbd::*;
use libfuzzer_sys::fuzz_target;

/// The chunk limit of the whole-reply decoder; the head decoder gets the same for chunks
/// and 8 bytes less (the offset) for data, so the two accept the same replies.
const MAX_CHUNK: u32 = 1 << 16;

fuzz_target!(|input: &[u8]| {
    greeting(input);
    option_replies(input);
    export_name_reply(input);
    replies(input);
});

fn greeting(input: &[u8]) {
    let mut buf = BytesMut::from(input);
    if let Ok(Some(flags)) = decode_greeting(&mut buf) {
        let mut again = BytesMut::new();
        encode_greeting(&mut again, flags);
        assert_eq!(&again[..], &input[..again.len()]);
    }
}

fn option_replies(input: &[u8]) {
    let mut buf = BytesMut::from(input);
    loop {
        let at = input.len() - buf.len();
        let before = buf.clone();
        let raw = match decode_option_reply(&mut buf) {
            Ok(Some(raw)) => raw,
            Ok(None) => {
                assert_eq!(buf, before, "an incomplete option reply was consumed");
                return;
            }
            Err(_) => return,
        };
        let mut framed = BytesMut::new();
        raw.encode(&mut framed);
        assert_eq!(&framed[..], &input[at..at + framed.len()], "option reply framing");
        let Ok(reply) = OptionReply::parse(&raw) else { continue };
        assert_eq!(reply.reply_type(), raw.reply_type, "{reply:?}");
        let once = reparse_option_reply(raw.option, &reply);
        assert_eq!(reparse_option_reply(raw.option, &once), once, "not a fixed point");
        if !has_text(&reply) {
            assert_eq!(once, reply, "option reply round trip");
        }
    }
}

fn reparse_option_reply(option: u32, reply: &OptionReply) -> OptionReply {
    let mut buf = BytesMut::new();
    reply.encode(option, &mut buf);
    let raw = decode_option_reply(&mut buf).expect("own encoding").expect("whole");
    assert!(buf.is_empty(), "bytes left after an option reply");
    assert_eq!(raw.option, option);
    OptionReply::parse(&raw).unwrap_or_else(|e| panic!("own encoding of {reply:?}: {e}"))
}

/// Option replies that carry a message or a name, which the encoder may cut.
fn has_text(reply: &OptionReply) -> bool {
    matches!(reply, OptionReply::Error { .. } | OptionReply::Server { .. })
}

fn export_name_reply(input: &[u8]) {
    for client_flags in
        [NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES]
    {
        let mut buf = BytesMut::from(input);
        match decode_export_name_reply(&mut buf, client_flags) {
            Ok(Some(reply)) => {
                let len = ExportNameReply::wire_len(client_flags);
                assert_eq!(buf.len(), input.len() - len);
                let mut again = BytesMut::new();
                reply.encode(&mut again, client_flags);
                // The padding is skipped unread: only size and flags must match.
                assert_eq!(&again[..10], &input[..10]);
            }
            Ok(None) => assert_eq!(&buf[..], input),
            Err(e) => panic!("the EXPORT_NAME reply has no way to fail: {e}"),
        }
    }
}

fn replies(input: &[u8]) {
    let mut buf = BytesMut::from(input);
    loop {
        let at = input.len() - buf.len();
        let before = buf.clone();
        let mut by_head = buf.clone();
        let whole = decode_reply(&mut buf, MAX_CHUNK);
        let headed = decode_via_head(&mut by_head, MAX_CHUNK - 8, MAX_CHUNK);
        match (&whole, &headed) {
            (Ok(Some(a)), Ok(Some(b))) => {
                assert_eq!(a, b, "decode_reply and decode_reply_head disagree");
                assert_eq!(buf, by_head, "the two decoders took different lengths");
            }
            (Ok(Some(reply)), other) | (other, Ok(Some(reply))) => {
                panic!("one decoder read {reply:?}, the other {other:?}")
            }
            _ => {}
        }
        let reply = match whole {
            Ok(Some(reply)) => reply,
            Ok(None) => {
                assert_eq!(buf, before, "an incomplete reply was consumed");
                return;
            }
            Err(_) => return,
        };
        let used = input.len() - buf.len() - at;
        match &reply {
            Reply::Simple(simple) => {
                let mut again = BytesMut::new();
                simple.encode(&mut again);
                assert_eq!(&again[..], &input[at..at + used], "simple reply round trip");
            }
            Reply::Chunk(chunk) => {
                let once = reparse_chunk(chunk);
                assert_eq!(reparse_chunk(&once), once, "not a fixed point");
                if !matches!(
                    chunk.body,
                    ChunkBody::Error { .. }
                        | ChunkBody::ErrorOffset { .. }
                        | ChunkBody::UnknownError { .. }
                ) {
                    assert_eq!(&once, chunk, "chunk round trip");
                    let mut again = BytesMut::new();
                    chunk.encode(&mut again);
                    assert_eq!(&again[..], &input[at..at + used], "chunk bytes round trip");
                }
            }
        }
    }
}

fn reparse_chunk(chunk: &Chunk) -> Chunk {
    let mut buf = BytesMut::new();
    chunk.encode(&mut buf);
    match decode_reply(&mut buf, u32::MAX) {
        Ok(Some(Reply::Chunk(again))) if buf.is_empty() => again,
        other => panic!("own encoding of {chunk:?} read back as {other:?}"),
    }
}

/// A whole reply read the way a client that reads payloads itself does: the head, then
/// the payload it announces. `Ok(None)` until all of it is there, leaving `buf` untouched.
fn decode_via_head(
    buf: &mut BytesMut,
    max_data: u32,
    max_chunk: u32,
) -> Result<Option<Reply>, Error> {
    let mut rest = buf.clone();
    let Some(head) = decode_reply_head(&mut rest, max_data, max_chunk)? else {
        assert_eq!(rest, *buf, "an incomplete reply head was consumed");
        return Ok(None);
    };
    let payload_len = match head {
        ReplyHead::Simple(_) => 0,
        ReplyHead::Data { data_len, .. } => data_len as usize,
        ReplyHead::Chunk(chunk) => chunk.length as usize,
    };
    let Some(payload) = take_payload(&mut rest, payload_len) else { return Ok(None) };
    let reply = match head {
        ReplyHead::Simple(reply) => Reply::Simple(reply),
        ReplyHead::Data { flags, cookie, offset, .. } => Reply::Chunk(Chunk {
            flags,
            cookie,
            body: ChunkBody::OffsetData { offset, data: payload },
        }),
        ReplyHead::Chunk(chunk) => {
            let body = chunk.parse_payload(Bytes::clone(&payload))?;
            Reply::Chunk(Chunk { flags: chunk.flags, cookie: chunk.cookie, body })
        }
    };
    *buf = rest;
    Ok(Some(reply))
}
