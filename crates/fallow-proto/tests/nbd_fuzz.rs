//! The NBD decoders under random and mutated input: whatever bytes arrive, every decoder
//! returns a value, `None` or an error, never panics, never consumes a message it has not
//! finished, and never reserves more than its limit allows; every valid message survives an
//! encode–decode round trip unchanged, whole or split at any point. A few seconds in a debug
//! build; `FALLOW_FUZZ_CASES` raises the case count for a longer local run.

use bytes::{BufMut, Bytes, BytesMut};
use fallow_proto::nbd::handshake::{
    decode_client_flags, decode_export_name_reply, decode_greeting, encode_client_flags,
    encode_greeting,
};
use fallow_proto::nbd::*;
use proptest::prelude::*;

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("FALLOW_FUZZ_CASES").ok().and_then(|v| v.parse().ok());
    ProptestConfig { cases: cases.unwrap_or(default), ..ProptestConfig::default() }
}

/// The limits the fuzz run passes to the decoders that take one.
const MAX_WRITE: u32 = 4096;
const MAX_CHUNK: u32 = 4096 + 8;

/// The most a decoder may have reserved for `input`: the input itself, or the largest
/// message any decoder accepts (an option of 64 KiB), twice over for the allocator's
/// rounding.
fn capacity_bound(input: usize) -> usize {
    2 * input.max(16 + MAX_OPTION_LEN).max(28 + MAX_WRITE as usize)
}

/// Runs one decoder over `bytes` until it stops: each `Ok(Some)` must consume bytes, each
/// `Ok(None)` must leave the buffer as it was, and the buffer never grows past the bound.
fn drain<T>(bytes: &[u8], mut decode: impl FnMut(&mut BytesMut) -> Result<Option<T>, Error>) {
    let mut buf = BytesMut::from(bytes);
    loop {
        let before = buf.clone();
        let result = decode(&mut buf);
        assert!(buf.capacity() <= capacity_bound(bytes.len()), "reserved {}", buf.capacity());
        match result {
            Ok(Some(_)) => assert!(buf.len() < before.len(), "a message of no bytes"),
            Ok(None) => {
                assert_eq!(buf, before, "an incomplete message was consumed");
                return;
            }
            Err(_) => return,
        }
    }
}

/// Feeds `bytes` to every decoder and every parser.
fn chew(bytes: &[u8]) {
    drain(bytes, decode_greeting);
    drain(bytes, |b| decode_client_flags(b, 3));
    drain(bytes, |b| decode_client_flags(b, 1));
    drain(bytes, |b| decode_export_name_reply(b, 0));
    drain(bytes, |b| decode_export_name_reply(b, NBD_FLAG_C_NO_ZEROES));
    drain(bytes, |b| {
        let raw = decode_option(b)?;
        if let Some(raw) = &raw {
            let _ = Opt::parse(raw);
        }
        Ok(raw)
    });
    drain(bytes, |b| {
        let raw = decode_option_reply(b)?;
        if let Some(raw) = &raw {
            let _ = OptionReply::parse(raw);
        }
        Ok(raw)
    });
    drain(bytes, decode_request);
    drain(bytes, |b| decode_request_with_payload(b, MAX_WRITE));
    drain(bytes, |b| decode_reply(b, MAX_CHUNK));
    drain(bytes, |b| decode_reply_head(b, MAX_CHUNK - 8, MAX_CHUNK));
    drain(bytes, |b| decode_via_head(b, MAX_CHUNK - 8, MAX_CHUNK));
    // The data inside a message, parsed under every option and reply type it could carry.
    let data = Bytes::copy_from_slice(bytes);
    for option in 0..=12 {
        let _ = Opt::parse(&OptionRequest { option, data: data.clone() });
    }
    for reply_type in [0, 1, 2, 3, 4, 5, NBD_REP_ERR_UNSUP, NBD_REP_FLAG_ERROR | 99] {
        let _ = OptionReply::parse(&RawOptionReply { option: 7, reply_type, data: data.clone() });
    }
    for chunk_type in [0, 1, 2, 3, 5, 6, 0x8001, 0x8002, 0x8003] {
        for flags in [0, NBD_REPLY_FLAG_DONE] {
            let length = data.len() as u32;
            let _ = ChunkHead { flags, chunk_type, cookie: 1, length }.parse_payload(data.clone());
        }
    }
}

/// A whole reply decoded the way a client that reads payloads itself does: the head with
/// [`decode_reply_head`], then the payload it announces (parsed with
/// [`ChunkHead::parse_payload`], or taken as `OFFSET_DATA` data). `Ok(None)` until all of it
/// is there, leaving `buf` untouched; it must agree with [`decode_reply`] on every chunk.
fn decode_via_head(
    buf: &mut BytesMut,
    max_data: u32,
    max_chunk: u32,
) -> Result<Option<Reply>, Error> {
    let mut rest = buf.clone();
    let Some(head) = decode_reply_head(&mut rest, max_data, max_chunk)? else {
        return Ok(None);
    };
    let payload_len = match head {
        ReplyHead::Simple(_) => 0,
        ReplyHead::Data { data_len, .. } => data_len as usize,
        ReplyHead::Chunk(chunk) => chunk.length as usize,
    };
    if rest.len() < payload_len {
        return Ok(None);
    }
    let payload = rest.split_to(payload_len).freeze();
    let reply = match head {
        ReplyHead::Simple(reply) => Reply::Simple(reply),
        ReplyHead::Data { flags, cookie, offset, .. } => Reply::Chunk(Chunk {
            flags,
            cookie,
            body: ChunkBody::OffsetData { offset, data: payload },
        }),
        ReplyHead::Chunk(chunk) => {
            let body = chunk.parse_payload(payload)?;
            Reply::Chunk(Chunk { flags: chunk.flags, cookie: chunk.cookie, body })
        }
    };
    *buf = rest;
    Ok(Some(reply))
}

// ---------------------------------------------------------------------------------------
// Strategies for valid messages
// ---------------------------------------------------------------------------------------

/// A string as the spec allows: UTF-8 without NUL (`\PC` excludes control characters).
fn name() -> impl Strategy<Value = String> {
    "\\PC{0,24}"
}

fn export_opt() -> impl Strategy<Value = ExportOpt> {
    (name(), prop::collection::vec(any::<u16>(), 0..6))
        .prop_map(|(name, info_requests)| ExportOpt { name, info_requests })
}

fn meta_context_opt() -> impl Strategy<Value = MetaContextOpt> {
    (name(), prop::collection::vec(name(), 0..5))
        .prop_map(|(export, queries)| MetaContextOpt { export, queries })
}

fn data() -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..40).prop_map(Bytes::from)
}

fn opt() -> impl Strategy<Value = Opt> {
    const KNOWN: [u32; 9] = [1, 2, 3, 5, 6, 7, 8, 9, 10];
    prop_oneof![
        name().prop_map(Opt::ExportName),
        Just(Opt::Abort),
        Just(Opt::List),
        Just(Opt::StartTls),
        export_opt().prop_map(Opt::Info),
        export_opt().prop_map(Opt::Go),
        Just(Opt::StructuredReply),
        meta_context_opt().prop_map(Opt::ListMetaContext),
        meta_context_opt().prop_map(Opt::SetMetaContext),
        (any::<u32>().prop_filter("unknown", |o| !KNOWN.contains(o)), data())
            .prop_map(|(option, data)| Opt::Unknown { option, data }),
    ]
}

fn info() -> impl Strategy<Value = Info> {
    prop_oneof![
        (any::<u64>(), any::<u16>()).prop_map(|(size, flags)| Info::Export { size, flags }),
        name().prop_map(Info::Name),
        name().prop_map(Info::Description),
        (any::<u32>(), any::<u32>(), any::<u32>())
            .prop_map(|(min, preferred, max)| Info::BlockSize(BlockSize { min, preferred, max })),
        (4..=u16::MAX, data()).prop_map(|(info_type, data)| Info::Unknown { info_type, data }),
    ]
}

fn rep_error() -> impl Strategy<Value = RepError> {
    prop_oneof![
        (1u32..=9).prop_map(|n| RepError::try_from(NBD_REP_FLAG_ERROR | n).unwrap()),
        (10u32..(1 << 31)).prop_map(|n| RepError::Other(NBD_REP_FLAG_ERROR | n)),
    ]
}

fn option_reply() -> impl Strategy<Value = OptionReply> {
    prop_oneof![
        Just(OptionReply::Ack),
        (name(), name()).prop_map(|(name, description)| OptionReply::Server { name, description }),
        info().prop_map(OptionReply::Info),
        (any::<u32>(), name()).prop_map(|(id, name)| OptionReply::MetaContext { id, name }),
        (rep_error(), name()).prop_map(|(error, message)| OptionReply::Error { error, message }),
        (5u32..(1 << 31), data())
            .prop_map(|(reply_type, data)| OptionReply::Unknown { reply_type, data }),
    ]
}

fn request() -> impl Strategy<Value = Request> {
    (any::<u16>(), any::<u16>(), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(
        |(flags, cmd, cookie, offset, length)| {
            let cmd = Cmd::from(cmd % 12); // mostly known commands, a few unknown ones
                                           // A WRITE's length is its payload: keep it small enough to carry.
            let length = if cmd == Cmd::Write { length % 64 } else { length };
            Request { flags, cmd, cookie, offset, length }
        },
    )
}

fn chunk_body() -> impl Strategy<Value = ChunkBody> {
    let nonempty = prop::collection::vec(any::<u8>(), 1..40).prop_map(Bytes::from);
    let extent = (1..=u32::MAX, any::<u32>()).prop_map(|(length, flags)| Extent { length, flags });
    prop_oneof![
        Just(ChunkBody::None),
        (any::<u64>(), nonempty).prop_map(|(offset, data)| ChunkBody::OffsetData { offset, data }),
        (any::<u64>(), 1..=u32::MAX)
            .prop_map(|(offset, length)| ChunkBody::OffsetHole { offset, length }),
        (any::<u32>(), prop::collection::vec(extent, 1..8))
            .prop_map(|(context_id, extents)| ChunkBody::BlockStatus { context_id, extents }),
        (1..=u32::MAX, name()).prop_map(|(error, message)| ChunkBody::Error { error, message }),
        (1..=u32::MAX, name(), any::<u64>())
            .prop_map(|(error, message, offset)| ChunkBody::ErrorOffset { error, message, offset }),
        (0x8003..=u16::MAX, any::<u32>(), name(), data()).prop_map(
            |(chunk_type, error, message, rest)| ChunkBody::UnknownError {
                chunk_type,
                error,
                message,
                rest
            }
        ),
        (prop_oneof![3..=4u16, 6..0x8000u16], data())
            .prop_map(|(chunk_type, data)| ChunkBody::Unknown { chunk_type, data }),
    ]
}

fn chunk() -> impl Strategy<Value = Chunk> {
    (any::<u16>(), any::<u64>(), chunk_body()).prop_map(|(flags, cookie, body)| {
        // NONE is only valid as the final chunk.
        let flags = if body == ChunkBody::None { flags | NBD_REPLY_FLAG_DONE } else { flags };
        Chunk { flags, cookie, body }
    })
}

/// One valid message of any kind, encoded, for the mutation tests.
fn any_message() -> impl Strategy<Value = Vec<u8>> {
    let encode = |f: &dyn Fn(&mut BytesMut)| {
        let mut buf = BytesMut::new();
        f(&mut buf);
        buf.to_vec()
    };
    prop_oneof![
        any::<u16>().prop_map(move |flags| encode(&|b| encode_greeting(b, flags))),
        opt().prop_map(move |opt| encode(&|b| opt.encode(b))),
        (any::<u32>(), option_reply())
            .prop_map(move |(option, reply)| encode(&|b| reply.encode(option, b))),
        request().prop_map(move |request| encode(&|b| {
            request.encode(b);
            if request.has_payload() {
                b.put_bytes(0xa5, request.length as usize);
            }
        })),
        (any::<u32>(), any::<u64>()).prop_map(move |(error, cookie)| {
            encode(&|b| SimpleReply { error, cookie }.encode(b))
        }),
        chunk().prop_map(move |chunk| encode(&|b| chunk.encode(b))),
    ]
}

/// Encodes with `encode`, then checks that `decode` gives `None` on a prefix (leaving it
/// untouched) and the value back on the whole message, consuming exactly it.
fn round_trip<T: std::fmt::Debug>(
    cut: prop::sample::Index,
    encode: impl Fn(&mut BytesMut),
    decode: impl Fn(&mut BytesMut) -> Result<Option<T>, Error>,
) -> Result<T, TestCaseError> {
    let mut whole = BytesMut::new();
    encode(&mut whole);
    let cut = cut.index(whole.len());
    let mut part = BytesMut::from(&whole[..cut]);
    prop_assert!(matches!(decode(&mut part), Ok(None)), "prefix of {} bytes", cut);
    prop_assert_eq!(&part[..], &whole[..cut]);
    // A second message behind the first must not be touched.
    whole.put_slice(b"next");
    let value = decode(&mut whole).map_err(|e| TestCaseError::fail(format!("{e}")))?;
    prop_assert_eq!(&whole[..], b"next");
    value.ok_or_else(|| TestCaseError::fail("a whole message decoded as incomplete"))
}

// ---------------------------------------------------------------------------------------
// The fuzz run
// ---------------------------------------------------------------------------------------

proptest! {
    // Random input: cheap cases, many of them.
    #![proptest_config(cases(6000))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        chew(&bytes);
    }

    #[test]
    fn random_data_behind_valid_headers_never_panics(
        code in any::<u32>(),
        chunk_type in any::<u16>(),
        flags in any::<u16>(),
        data in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut buf = BytesMut::new();
        OptionRequest { option: code % 16, data: Bytes::from(data.clone()) }.encode(&mut buf);
        RawOptionReply { option: 7, reply_type: code, data: Bytes::from(data.clone()) }
            .encode(&mut buf);
        // Mostly the known chunk types, with and without the error bit.
        let chunk_type = (chunk_type % 8) | (chunk_type & NBD_REPLY_TYPE_FLAG_ERROR);
        encode_chunk_header(&mut buf, flags, chunk_type, 1, data.len() as u32);
        buf.put_slice(&data);
        chew(&buf);
        // Each message at the front of its own buffer, too.
        let reply_at = 16 + data.len();
        let chunk_at = reply_at + 20 + data.len();
        chew(&buf[reply_at..]);
        chew(&buf[chunk_at..]);
    }
}

proptest! {
    #![proptest_config(cases(1500))]

    #[test]
    fn mutated_messages_never_panic(
        message in any_message(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = message;
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        chew(&bytes);
        chew(&bytes[..cut.index(bytes.len())]);
    }

    #[test]
    fn options_round_trip(opt in opt(), cut in any::<prop::sample::Index>()) {
        let raw = round_trip(cut, |b| opt.encode(b), decode_option)?;
        prop_assert_eq!(raw.option, opt.code());
        prop_assert_eq!(Opt::parse(&raw).unwrap(), opt);
    }

    #[test]
    fn option_replies_round_trip(
        option in any::<u32>(),
        reply in option_reply(),
        cut in any::<prop::sample::Index>(),
    ) {
        let raw = round_trip(cut, |b| reply.encode(option, b), decode_option_reply)?;
        prop_assert_eq!((raw.option, raw.reply_type), (option, reply.reply_type()));
        prop_assert_eq!(OptionReply::parse(&raw).unwrap(), reply);
    }

    #[test]
    fn handshake_messages_round_trip(
        handshake_flags in any::<u16>(),
        client_flags in 0u32..4,
        size in any::<u64>(),
        flags in any::<u16>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let got = round_trip(cut, |b| encode_greeting(b, handshake_flags), decode_greeting)?;
        prop_assert_eq!(got, handshake_flags);
        let got = round_trip(cut, |b| encode_client_flags(b, client_flags),
            |b| decode_client_flags(b, 3))?;
        prop_assert_eq!(got, client_flags);
        let reply = ExportNameReply { size, flags };
        let got = round_trip(cut, |b| reply.encode(b, client_flags),
            |b| decode_export_name_reply(b, client_flags))?;
        prop_assert_eq!(got, reply);
    }

    #[test]
    fn requests_round_trip(request in request(), cut in any::<prop::sample::Index>()) {
        let got = round_trip(cut, |b| request.encode(b), decode_request)?;
        prop_assert_eq!(got, request);
        let payload = vec![0x5a; if request.has_payload() { request.length as usize } else { 0 }];
        let (got, data) = round_trip(
            cut,
            |b| {
                request.encode(b);
                b.put_slice(&payload);
            },
            |b| decode_request_with_payload(b, MAX_WRITE),
        )?;
        prop_assert_eq!(got, request);
        prop_assert_eq!(&data[..], &payload[..]);
    }

    #[test]
    fn replies_round_trip(
        chunk in chunk(),
        error in any::<u32>(),
        cookie in any::<u64>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let got = round_trip(cut, |b| chunk.encode(b), |b| decode_reply(b, MAX_CHUNK))?;
        prop_assert_eq!(&got, &Reply::Chunk(chunk.clone()));
        let got = round_trip(cut, |b| chunk.encode(b), |b| decode_via_head(b, MAX_CHUNK - 8, MAX_CHUNK))?;
        prop_assert_eq!(got, Reply::Chunk(chunk));
        let simple = SimpleReply { error, cookie };
        let got = round_trip(cut, |b| simple.encode(b), |b| decode_reply(b, 0))?;
        prop_assert_eq!(got, Reply::Simple(simple));
        let got = round_trip(cut, |b| simple.encode(b), |b| decode_reply_head(b, 0, 0))?;
        prop_assert_eq!(got, ReplyHead::Simple(simple));
    }

    #[test]
    fn hostile_lengths_are_refused_before_buffering(
        len in any::<u32>(),
        max in 0u32..(1 << 20),
    ) {
        // A WRITE claiming `len` bytes, a chunk claiming `len` bytes: with a limit of `max`,
        // either the claim fits (and the decoder waits) or it is refused, and the buffer
        // never holds room for more than the limit.
        let mut buf = BytesMut::new();
        Request { flags: 0, cmd: Cmd::Write, cookie: 1, offset: 0, length: len }.encode(&mut buf);
        let result = decode_request_with_payload(&mut buf, max);
        prop_assert_eq!(result.is_err(), len > max);
        prop_assert!(buf.capacity() <= 2 * (28 + max as usize).max(64));
        let mut buf = BytesMut::new();
        encode_chunk_header(&mut buf, 0, NBD_REPLY_TYPE_OFFSET_DATA, 1, len);
        let result = decode_reply(&mut buf, max);
        // A length of 0 is a whole chunk already: an OFFSET_DATA chunk without its offset,
        // which is malformed (the saved regression case, len = 0, max = 0).
        prop_assert_eq!(result.is_err(), len > max || len == 0);
        prop_assert!(buf.capacity() <= 2 * (20 + max as usize).max(64));
        // The head decoder reserves nothing at all, and refuses data over its own limit
        // (or too short for an offset and a byte) and other chunks over the other.
        for chunk_type in [NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_TYPE_BLOCK_STATUS] {
            let mut buf = BytesMut::new();
            encode_chunk_header(&mut buf, 0, chunk_type, 1, len);
            let capacity = buf.capacity();
            let result = decode_reply_head(&mut buf, max, max);
            let refused = if chunk_type == NBD_REPLY_TYPE_OFFSET_DATA {
                len < 9 || len - 8 > max
            } else {
                len > max
            };
            prop_assert_eq!(result.is_err(), refused);
            // Never more room than the header had (a header it consumed may leave less).
            prop_assert!(buf.capacity() <= capacity, "{} > {capacity}", buf.capacity());
        }
    }
}
