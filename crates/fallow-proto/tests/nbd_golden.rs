//! Golden bytes for every NBD message, both directions: each test writes the expected bytes
//! out by hand from NetworkBlockDevice/nbd `doc/proto.md` (every number big-endian; offsets
//! in the comments), checks that the encoder produces exactly them, that the decoder turns
//! them back into the same value, and that every shorter prefix decodes as "need more
//! bytes" and leaves the buffer as it was. These bytes are what qemu, libnbd and nbdkit
//! send and expect: a change that breaks one breaks interoperability.

use bytes::{BufMut, Bytes, BytesMut};
use fallow_proto::nbd::handshake::{
    decode_client_flags, decode_export_name_reply, decode_greeting, encode_client_flags,
    encode_greeting,
};
use fallow_proto::nbd::*;

mod seeds;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Concatenates byte pieces, so a message reads field by field.
fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// Every strict prefix of `whole` decodes as `None` and is left untouched; then `whole`
/// decodes completely.
fn check_prefixes<T: std::fmt::Debug>(
    whole: &[u8],
    mut decode: impl FnMut(&mut BytesMut) -> Result<Option<T>, Error>,
) -> T {
    for cut in 0..whole.len() {
        let mut part = BytesMut::from(&whole[..cut]);
        let got = decode(&mut part);
        assert!(matches!(got, Ok(None)), "prefix of {cut} bytes: {got:?}");
        assert_eq!(&part[..], &whole[..cut], "prefix of {cut} bytes was consumed");
    }
    let mut buf = BytesMut::from(whole);
    let value = decode(&mut buf).unwrap().unwrap();
    assert!(buf.is_empty(), "{} bytes left over", buf.len());
    value
}

// The magic numbers, as the spec writes them.
const NBDMAGIC_BYTES: [u8; 8] = [0x4e, 0x42, 0x44, 0x4d, 0x41, 0x47, 0x49, 0x43]; // "NBDMAGIC"
const IHAVEOPT_BYTES: [u8; 8] = [0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54]; // "IHAVEOPT"
const REP_MAGIC: [u8; 8] = [0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9]; // 0x3e889045565a9
const REQUEST_MAGIC: [u8; 4] = [0x25, 0x60, 0x95, 0x13];
const SIMPLE_MAGIC: [u8; 4] = [0x67, 0x44, 0x66, 0x98];
const CHUNK_MAGIC: [u8; 4] = [0x66, 0x8e, 0x33, 0xef];
const COOKIE: [u8; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
const COOKIE_U64: u64 = 0x0102_0304_0506_0708;

/// An option request: IHAVEOPT (0..8), option (8..12), length (12..16), data.
fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u32).to_be_bytes();
    cat(&[&IHAVEOPT_BYTES, &option.to_be_bytes(), &len, data])
}

/// An option reply: magic (0..8), option (8..12), type (12..16), length (16..20), data.
fn rep_bytes(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u32).to_be_bytes();
    cat(&[&REP_MAGIC, &option.to_be_bytes(), &reply_type.to_be_bytes(), &len, data])
}

fn check_opt(opt: Opt, expected: Vec<u8>) {
    // The client flags (FIXED_NEWSTYLE | NO_ZEROES), then the option.
    seeds::seed("nbd_handshake", &[0, 0, 0, 3], &expected);
    let mut buf = BytesMut::new();
    opt.encode(&mut buf);
    assert_eq!(&buf[..], &expected[..], "encoding of {opt:?}");
    let raw = check_prefixes(&expected, decode_option);
    assert_eq!(raw.option, opt.code());
    assert_eq!(Opt::parse(&raw).unwrap(), opt);
    let mut again = BytesMut::new();
    raw.encode(&mut again);
    assert_eq!(&again[..], &expected[..], "raw re-encoding of {opt:?}");
}

fn check_option_reply(option: u32, reply: OptionReply, expected: Vec<u8>) {
    seeds::seed("nbd_reply", &[], &expected);
    let mut buf = BytesMut::new();
    reply.encode(option, &mut buf);
    assert_eq!(&buf[..], &expected[..], "encoding of {reply:?}");
    let raw = check_prefixes(&expected, decode_option_reply);
    assert_eq!((raw.option, raw.reply_type), (option, reply.reply_type()));
    assert_eq!(OptionReply::parse(&raw).unwrap(), reply);
    let mut again = BytesMut::new();
    raw.encode(&mut again);
    assert_eq!(&again[..], &expected[..], "raw re-encoding of {reply:?}");
}

fn check_request(request: Request, expected: Vec<u8>) {
    // Structured replies and base:allocation negotiated, on the first export.
    seeds::seed("nbd_request", &[3], &expected);
    let mut buf = BytesMut::new();
    request.encode(&mut buf);
    assert_eq!(&buf[..], &expected[..], "encoding of {request:?}");
    assert_eq!(&request.to_bytes()[..], &expected[..], "array encoding of {request:?}");
    assert_eq!(check_prefixes(&expected, decode_request), request);
}

fn check_chunk(chunk: Chunk, expected: Vec<u8>) {
    seeds::seed("nbd_reply", &[], &expected);
    let mut buf = BytesMut::new();
    chunk.encode(&mut buf);
    assert_eq!(&buf[..], &expected[..], "encoding of {chunk:?}");
    let reply = check_prefixes(&expected, |b| decode_reply(b, 1 << 20));
    assert_eq!(reply, Reply::Chunk(chunk));
}

/// A chunk: magic (0..4), flags (4..6), type (6..8), cookie (8..16), length (16..20),
/// payload.
fn chunk_bytes(flags: u16, chunk_type: u16, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    cat(&[&CHUNK_MAGIC, &flags.to_be_bytes(), &chunk_type.to_be_bytes(), &COOKIE, &len, payload])
}

// ---------------------------------------------------------------------------------------
// Constants against the spec's numbers
// ---------------------------------------------------------------------------------------

#[test]
fn constants_have_the_spec_values() {
    assert_eq!(NBDMAGIC.to_be_bytes(), *b"NBDMAGIC");
    assert_eq!(IHAVEOPT.to_be_bytes(), *b"IHAVEOPT");
    assert_eq!(CLISERV_MAGIC, 0x00420281861253);
    assert_eq!(NBD_REP_MAGIC, 0x3e889045565a9);
    // nbdkit's memory plugin advertises 0xded: flush fua trim zeroes df multi cache fast-zero.
    let flags = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        | NBD_FLAG_SEND_FUA
        | NBD_FLAG_SEND_TRIM
        | NBD_FLAG_SEND_WRITE_ZEROES
        | NBD_FLAG_SEND_DF
        | NBD_FLAG_CAN_MULTI_CONN
        | NBD_FLAG_SEND_CACHE
        | NBD_FLAG_SEND_FAST_ZERO;
    assert_eq!(flags, 0x0ded);
    assert_eq!((NBD_FLAG_READ_ONLY, NBD_FLAG_ROTATIONAL, NBD_FLAG_SEND_RESIZE), (2, 16, 512));
    assert_eq!(NBD_FLAG_BLOCK_STATUS_PAYLOAD, 4096);
    let opts = [
        NBD_OPT_EXPORT_NAME,
        NBD_OPT_ABORT,
        NBD_OPT_LIST,
        NBD_OPT_PEEK_EXPORT,
        NBD_OPT_STARTTLS,
        NBD_OPT_INFO,
        NBD_OPT_GO,
        NBD_OPT_STRUCTURED_REPLY,
        NBD_OPT_LIST_META_CONTEXT,
        NBD_OPT_SET_META_CONTEXT,
        NBD_OPT_EXTENDED_HEADERS,
    ];
    assert_eq!(opts, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    let errs = [
        NBD_REP_ERR_UNSUP,
        NBD_REP_ERR_POLICY,
        NBD_REP_ERR_INVALID,
        NBD_REP_ERR_PLATFORM,
        NBD_REP_ERR_TLS_REQD,
        NBD_REP_ERR_UNKNOWN,
        NBD_REP_ERR_SHUTDOWN,
        NBD_REP_ERR_BLOCK_SIZE_REQD,
        NBD_REP_ERR_TOO_BIG,
        NBD_REP_ERR_EXT_HEADER_REQD,
    ];
    assert_eq!(errs.map(|e| e - (1 << 31)), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    let cmd_flags = [
        NBD_CMD_FLAG_FUA,
        NBD_CMD_FLAG_NO_HOLE,
        NBD_CMD_FLAG_DF,
        NBD_CMD_FLAG_REQ_ONE,
        NBD_CMD_FLAG_FAST_ZERO,
        NBD_CMD_FLAG_PAYLOAD_LEN,
    ];
    assert_eq!(cmd_flags, [1, 2, 4, 8, 16, 32]);
    assert_eq!((NBD_REPLY_TYPE_ERROR, NBD_REPLY_TYPE_ERROR_OFFSET), (32769, 32770));
    let errnos = [
        NBD_EPERM,
        NBD_EIO,
        NBD_ENOMEM,
        NBD_EINVAL,
        NBD_ENOSPC,
        NBD_EOVERFLOW,
        NBD_ENOTSUP,
        NBD_ESHUTDOWN,
    ];
    assert_eq!(errnos, [1, 5, 12, 22, 28, 75, 95, 108]);
    assert_eq!((NBD_STATE_HOLE, NBD_STATE_ZERO), (1, 2));
}

// ---------------------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------------------

#[test]
fn greeting() {
    // 0..8 NBDMAGIC, 8..16 IHAVEOPT, 16..18 handshake flags (FIXED_NEWSTYLE | NO_ZEROES).
    let expected = cat(&[&NBDMAGIC_BYTES, &IHAVEOPT_BYTES, &[0x00, 0x03]]);
    let mut buf = BytesMut::new();
    encode_greeting(&mut buf, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
    assert_eq!(&buf[..], &expected[..]);
    assert_eq!(check_prefixes(&expected, decode_greeting), 3);
    seeds::seed("nbd_reply", &[], &expected);
}

#[test]
fn greeting_refusals() {
    let oldstyle = cat(&[&NBDMAGIC_BYTES, &[0x00, 0x00, 0x42, 0x02, 0x81, 0x86, 0x12, 0x53]]);
    assert_eq!(decode_greeting(&mut BytesMut::from(&oldstyle[..])), Err(Error::Oldstyle));
    let http = b"HTTP/1.1 400 Bad Request\r\n";
    let err = decode_greeting(&mut BytesMut::from(&http[..])).unwrap_err();
    assert!(matches!(err, Error::BadMagic { what: "greeting", .. }), "{err:?}");
    let wrong_second = cat(&[&NBDMAGIC_BYTES, b"IHAVEOPX"]);
    let err = decode_greeting(&mut BytesMut::from(&wrong_second[..])).unwrap_err();
    assert!(matches!(err, Error::BadMagic { .. }), "{err:?}");
}

#[test]
fn client_flags() {
    let expected = vec![0x00, 0x00, 0x00, 0x03]; // C_FIXED_NEWSTYLE | C_NO_ZEROES
    let mut buf = BytesMut::new();
    encode_client_flags(&mut buf, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES);
    assert_eq!(&buf[..], &expected[..]);
    assert_eq!(check_prefixes(&expected, |b| decode_client_flags(b, 3)), 3);
    // No flags at all: an old client, accepted (the server decides whether to serve it).
    assert_eq!(decode_client_flags(&mut BytesMut::from(&[0u8; 4][..]), 1), Ok(Some(0)));
    for flags in [4u32, 1 << 31] {
        let mut buf = BytesMut::from(&flags.to_be_bytes()[..]);
        assert_eq!(decode_client_flags(&mut buf, 3), Err(Error::BadClientFlags { flags }));
        assert_eq!(buf.len(), 4, "a refused flags word is not consumed");
    }
}

#[test]
fn export_name_reply_with_and_without_zeroes() {
    let reply = ExportNameReply { size: 1 << 30, flags: 0x0ded };
    // 0..8 size, 8..10 transmission flags, then 124 zero bytes unless C_NO_ZEROES.
    let short = vec![0, 0, 0, 0, 0x40, 0, 0, 0, 0x0d, 0xed];
    let long = cat(&[&short, &[0u8; 124]]);
    for (client_flags, expected) in [(NBD_FLAG_C_FIXED_NEWSTYLE, &long), (3, &short)] {
        let mut buf = BytesMut::new();
        reply.encode(&mut buf, client_flags);
        assert_eq!(&buf[..], &expected[..]);
        assert_eq!(ExportNameReply::wire_len(client_flags), expected.len());
        seeds::seed("nbd_reply", &[], expected);
        let got = check_prefixes(expected, |b| decode_export_name_reply(b, client_flags));
        assert_eq!(got, reply);
    }
}

// ---------------------------------------------------------------------------------------
// Option requests
// ---------------------------------------------------------------------------------------

#[test]
fn option_export_name() {
    // The whole data is the name.
    check_opt(Opt::ExportName("exp".into()), option_bytes(1, b"exp"));
    check_opt(Opt::ExportName(String::new()), option_bytes(1, b""));
}

#[test]
fn options_without_data() {
    check_opt(Opt::Abort, option_bytes(2, b""));
    check_opt(Opt::List, option_bytes(3, b""));
    check_opt(Opt::StartTls, option_bytes(5, b""));
    check_opt(Opt::StructuredReply, option_bytes(8, b""));
    // Literally, for one of them: IHAVEOPT, option 8, length 0.
    let literal = [0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54, 0, 0, 0, 8, 0, 0, 0, 0];
    assert_eq!(option_bytes(8, b""), literal);
}

#[test]
fn option_info_and_go() {
    // u32 name length (0..4), name, u16 count, count x u16 info types.
    let info = ExportOpt { name: "disk".into(), info_requests: vec![NBD_INFO_BLOCK_SIZE] };
    let data = [0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 1, 0, 3];
    check_opt(Opt::Info(info), option_bytes(6, &data));
    let go = ExportOpt { name: String::new(), info_requests: vec![0, 3, 1] };
    let data = [0, 0, 0, 0, 0, 3, 0, 0, 0, 3, 0, 1];
    check_opt(Opt::Go(go), option_bytes(7, &data));
    // An info type the spec does not define is kept: the server ignores it.
    let odd = ExportOpt { name: "a".into(), info_requests: vec![0xbeef] };
    check_opt(Opt::Go(odd), option_bytes(7, &[0, 0, 0, 1, b'a', 0, 1, 0xbe, 0xef]));
}

#[test]
fn option_meta_contexts() {
    // u32 export length, export, u32 query count, then (u32 length, query) each.
    let set = MetaContextOpt { export: "disk".into(), queries: vec![BASE_ALLOCATION.into()] };
    let data = cat(&[&[0, 0, 0, 4], b"disk", &[0, 0, 0, 1], &[0, 0, 0, 15], b"base:allocation"]);
    assert_eq!(data.len(), 31);
    check_opt(Opt::SetMetaContext(set), option_bytes(10, &data));
    let list = MetaContextOpt { export: String::new(), queries: vec!["base:".into(), "x:".into()] };
    let data = cat(&[&[0, 0, 0, 0], &[0, 0, 0, 2], &[0, 0, 0, 5], b"base:", &[0, 0, 0, 2], b"x:"]);
    check_opt(Opt::ListMetaContext(list), option_bytes(9, &data));
    let all = MetaContextOpt::default();
    check_opt(Opt::ListMetaContext(all), option_bytes(9, &[0; 8]));
}

#[test]
fn unknown_options_keep_code_and_data() {
    for option in [NBD_OPT_PEEK_EXPORT, NBD_OPT_EXTENDED_HEADERS, 0, 0x1234_5678] {
        let unknown = Opt::Unknown { option, data: Bytes::from_static(&[1, 2]) };
        check_opt(unknown, option_bytes(option, &[1, 2]));
    }
    assert_eq!(option_name(NBD_OPT_GO), "go");
    assert_eq!(option_name(99), "unknown");
}

#[test]
fn option_refusals() {
    // Framing: a bad magic, and data over 64 KiB, are refused from the header.
    let mut buf = BytesMut::from(&option_bytes(7, b"")[..]);
    buf[0] = b'X';
    assert!(matches!(decode_option(&mut buf), Err(Error::BadMagic { what: "option", .. })));
    let mut buf = BytesMut::from(&cat(&[&IHAVEOPT_BYTES, &[0, 0, 0, 7, 0, 1, 0, 1]])[..]);
    let err = decode_option(&mut buf).unwrap_err();
    assert_eq!(err, Error::TooLong { what: "option data", len: 65537, max: 65536 });
    // Exactly 64 KiB is fine: the decoder waits for it.
    let mut buf = BytesMut::from(&cat(&[&IHAVEOPT_BYTES, &[0, 0, 0, 7, 0, 1, 0, 0]])[..]);
    assert_eq!(decode_option(&mut buf), Ok(None));

    // Parsing: each of these is answered NBD_REP_ERR_INVALID.
    let parse = |option: u32, data: &[u8]| {
        Opt::parse(&OptionRequest { option, data: Bytes::copy_from_slice(data) })
    };
    // GO: name length beyond the data (the spec: "MUST be no larger than length - 6").
    assert_eq!(parse(7, &[0, 0, 0, 5, b'a', 0, 0]), Err(Error::Truncated("export name")));
    assert_eq!(parse(7, &[0, 0, 0, 2, b'a', b'b']), Err(Error::Truncated("info request count")));
    // GO: fewer info types than the count says, then more.
    assert_eq!(parse(7, &[0, 0, 0, 0, 0, 2, 0, 1]), Err(Error::Truncated("info requests")));
    let err = parse(7, &[0, 0, 0, 0, 0, 1, 0, 1, 0]).unwrap_err();
    assert!(matches!(err, Error::Trailing { what: "go", extra: 1 }), "{err:?}");
    // GO with no data at all.
    assert_eq!(parse(7, &[]), Err(Error::Truncated("export name")));
    // Names: not UTF-8, NUL inside, over 4096 bytes.
    let err = parse(1, &[0xff, 0xfe]).unwrap_err();
    assert_eq!(err, Error::Invalid { what: "export name", why: "not UTF-8" });
    let err = parse(1, b"a\0b").unwrap_err();
    assert_eq!(err, Error::Invalid { what: "export name", why: "contains NUL" });
    let long = vec![b'a'; 4097];
    assert!(matches!(parse(1, &long), Err(Error::TooLong { len: 4097, max: 4096, .. })));
    assert_eq!(parse(1, &long[..4096]).unwrap(), Opt::ExportName("a".repeat(4096)));
    let mut go = 4097u32.to_be_bytes().to_vec();
    go.extend(&long);
    go.extend([0, 0]);
    assert!(matches!(parse(7, &go), Err(Error::TooLong { len: 4097, .. })));
    // SET_META_CONTEXT: a query length past the end.
    let data = cat(&[&[0, 0, 0, 0], &[0, 0, 0, 1], &[0, 0, 0, 9], b"base:"]);
    assert_eq!(parse(10, &data), Err(Error::Truncated("meta context query")));
    // Options that take no data.
    for option in [NBD_OPT_LIST, NBD_OPT_STARTTLS, NBD_OPT_STRUCTURED_REPLY] {
        assert!(matches!(parse(option, b"?"), Err(Error::Trailing { extra: 1, .. })));
    }
    // ABORT's data is ignored, as the spec asks.
    assert_eq!(parse(2, b"bye"), Ok(Opt::Abort));
}

// ---------------------------------------------------------------------------------------
// Option replies
// ---------------------------------------------------------------------------------------

#[test]
fn option_reply_ack() {
    check_option_reply(7, OptionReply::Ack, rep_bytes(7, 1, b""));
    let literal = [
        0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // magic
        0, 0, 0, 7, // option: GO
        0, 0, 0, 1, // NBD_REP_ACK
        0, 0, 0, 0, // length
    ];
    assert_eq!(rep_bytes(7, 1, b""), literal);
}

#[test]
fn option_reply_server() {
    // u32 name length, name, then a description for humans.
    let reply = OptionReply::Server { name: "disk".into(), description: "RAM".into() };
    check_option_reply(3, reply, rep_bytes(3, 2, &cat(&[&[0, 0, 0, 4], b"disk", b"RAM"])));
    let bare = OptionReply::Server { name: String::new(), description: String::new() };
    check_option_reply(3, bare, rep_bytes(3, 2, &[0, 0, 0, 0]));
}

#[test]
fn option_reply_info_items() {
    // NBD_INFO_EXPORT: length 12 = u16 type, u64 size, u16 transmission flags.
    let export = Info::Export { size: 1 << 30, flags: 0x0ded };
    let data = [0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 0x0d, 0xed];
    check_option_reply(7, OptionReply::Info(export), rep_bytes(7, 3, &data));
    // NBD_INFO_NAME and NBD_INFO_DESCRIPTION: u16 type, the string.
    let name = Info::Name("disk".into());
    check_option_reply(6, OptionReply::Info(name), rep_bytes(6, 3, &cat(&[&[0, 1], b"disk"])));
    let text = Info::Description("fallow".into());
    check_option_reply(6, OptionReply::Info(text), rep_bytes(6, 3, &cat(&[&[0, 2], b"fallow"])));
    // NBD_INFO_BLOCK_SIZE: length 14 = u16 type, u32 min, u32 preferred, u32 max payload.
    let sizes = BlockSize { min: 4096, preferred: 65536, max: 1 << 25 };
    let data = [0, 3, 0, 0, 0x10, 0, 0, 1, 0, 0, 2, 0, 0, 0];
    check_option_reply(7, OptionReply::Info(Info::BlockSize(sizes)), rep_bytes(7, 3, &data));
    // An unknown info type is kept for the client to ignore.
    let unknown = Info::Unknown { info_type: 9, data: Bytes::from_static(&[0xaa]) };
    check_option_reply(7, OptionReply::Info(unknown), rep_bytes(7, 3, &[0, 9, 0xaa]));
}

#[test]
fn option_reply_meta_context() {
    // u32 context id, then the name.
    let reply = OptionReply::MetaContext { id: 1, name: BASE_ALLOCATION.into() };
    let data = cat(&[&[0, 0, 0, 1], b"base:allocation"]);
    check_option_reply(10, reply, rep_bytes(10, 4, &data));
}

#[test]
fn option_reply_errors() {
    let table = [
        (RepError::Unsup, [0x80, 0, 0, 1]),
        (RepError::Policy, [0x80, 0, 0, 2]),
        (RepError::Invalid, [0x80, 0, 0, 3]),
        (RepError::Platform, [0x80, 0, 0, 4]),
        (RepError::TlsReqd, [0x80, 0, 0, 5]),
        (RepError::UnknownExport, [0x80, 0, 0, 6]),
        (RepError::Shutdown, [0x80, 0, 0, 7]),
        (RepError::BlockSizeReqd, [0x80, 0, 0, 8]),
        (RepError::TooBig, [0x80, 0, 0, 9]),
        (RepError::Other(0x8000_000a), [0x80, 0, 0, 10]),
    ];
    for (error, code) in table {
        let code = u32::from_be_bytes(code);
        let bare = OptionReply::Error { error, message: String::new() };
        check_option_reply(7, bare, rep_bytes(7, code, b""));
        let said = OptionReply::Error { error, message: "no such export".into() };
        check_option_reply(7, said, rep_bytes(7, code, b"no such export"));
    }
}

#[test]
fn option_reply_unknown_type() {
    let reply = OptionReply::Unknown { reply_type: 5, data: Bytes::from_static(&[1]) };
    check_option_reply(7, reply.clone(), rep_bytes(7, 5, &[1]));
    assert!(!reply.is_final());
}

#[test]
fn option_reply_refusals() {
    let mut buf = BytesMut::from(&rep_bytes(7, 1, b"")[..]);
    buf[7] ^= 1;
    let err = decode_option_reply(&mut buf).unwrap_err();
    assert!(matches!(err, Error::BadMagic { what: "option reply", .. }), "{err:?}");
    let header = cat(&[&REP_MAGIC, &[0, 0, 0, 3, 0, 0, 0, 2], &[0xff, 0xff, 0xff, 0xff]]);
    let err = decode_option_reply(&mut BytesMut::from(&header[..])).unwrap_err();
    assert!(matches!(err, Error::TooLong { what: "option reply data", .. }), "{err:?}");

    let parse = |reply_type: u32, data: &[u8]| {
        let raw = RawOptionReply { option: 7, reply_type, data: Bytes::copy_from_slice(data) };
        OptionReply::parse(&raw)
    };
    // ACK with data.
    assert!(matches!(parse(1, &[0]), Err(Error::Trailing { extra: 1, .. })));
    // SERVER: name length beyond the data ("MUST be no larger than length - 4").
    assert_eq!(parse(2, &[0, 0, 0, 5, b'd', b'i']), Err(Error::Truncated("export name")));
    assert_eq!(parse(2, &[0, 0]), Err(Error::Truncated("export name")));
    // INFO: no type; BLOCK_SIZE of 13 bytes.
    assert_eq!(parse(3, &[0]), Err(Error::Truncated("info type")));
    let short = [0, 3, 0, 0, 2, 0, 0, 0, 16, 0, 0, 0, 32];
    assert_eq!(parse(3, &short), Err(Error::Truncated("maximum payload size")));
    // META_CONTEXT: no id; a name that is not UTF-8.
    assert_eq!(parse(4, &[0, 0]), Err(Error::Truncated("meta context id")));
    let err = parse(4, &[0, 0, 0, 1, 0xc3]).unwrap_err();
    assert_eq!(err, Error::Invalid { what: "context name", why: "not UTF-8" });
    // An error message is for humans: invalid UTF-8 is replaced, not refused.
    let reply = parse(NBD_REP_ERR_POLICY, &[b'n', 0xff, b'o']).unwrap();
    let message = "n\u{fffd}o".to_string();
    assert_eq!(reply, OptionReply::Error { error: RepError::Policy, message });
}

// ---------------------------------------------------------------------------------------
// Transmission: requests
// ---------------------------------------------------------------------------------------

/// A request: magic (0..4), flags (4..6), type (6..8), cookie (8..16), offset (16..24),
/// length (24..28).
fn request_bytes(flags: [u8; 2], cmd: [u8; 2], offset: [u8; 8], length: [u8; 4]) -> Vec<u8> {
    cat(&[&REQUEST_MAGIC, &flags, &cmd, &COOKIE, &offset, &length])
}

fn request(flags: u16, cmd: Cmd, offset: u64, length: u32) -> Request {
    Request { flags, cmd, cookie: COOKIE_U64, offset, length }
}

#[test]
fn requests_every_command() {
    let off = [0, 0, 0, 0, 0, 0, 0x10, 0]; // 4096
    let len = [0, 0, 0x02, 0]; // 512
    let zero8 = [0; 8];
    let zero4 = [0; 4];
    let table = [
        (request(NBD_CMD_FLAG_DF, Cmd::Read, 4096, 512), request_bytes([0, 4], [0, 0], off, len)),
        (request(0, Cmd::Disc, 0, 0), request_bytes([0, 0], [0, 2], zero8, zero4)),
        (request(0, Cmd::Flush, 0, 0), request_bytes([0, 0], [0, 3], zero8, zero4)),
        (request(NBD_CMD_FLAG_FUA, Cmd::Trim, 4096, 512), request_bytes([0, 1], [0, 4], off, len)),
        (request(0, Cmd::Cache, 4096, 512), request_bytes([0, 0], [0, 5], off, len)),
        (
            request(NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO, Cmd::WriteZeroes, 4096, 512),
            request_bytes([0, 0x12], [0, 6], off, len),
        ),
        (
            request(NBD_CMD_FLAG_REQ_ONE, Cmd::BlockStatus, 4096, 512),
            request_bytes([0, 8], [0, 7], off, len),
        ),
        (request(0, Cmd::Unknown(8), 0, 0), request_bytes([0, 0], [0, 8], zero8, zero4)),
        (request(0xffff, Cmd::Unknown(0xabcd), 1, 1), {
            request_bytes([0xff, 0xff], [0xab, 0xcd], [0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 1])
        }),
    ];
    for (request, expected) in table {
        check_request(request, expected.clone());
        // Without a payload, the one-step decoder takes the header alone.
        let mut buf = BytesMut::from(&expected[..]);
        let (got, payload) = decode_request_with_payload(&mut buf, 0).unwrap().unwrap();
        assert_eq!((got, payload.len(), buf.len()), (request, 0, 0));
    }
    let literal = [
        0x25, 0x60, 0x95, 0x13, // NBD_REQUEST_MAGIC
        0, 4, // NBD_CMD_FLAG_DF
        0, 0, // NBD_CMD_READ
        1, 2, 3, 4, 5, 6, 7, 8, // cookie
        0, 0, 0, 0, 0, 0, 0x10, 0, // offset 4096
        0, 0, 2, 0, // length 512
    ];
    assert_eq!(request_bytes([0, 4], [0, 0], off, len), literal);
}

#[test]
fn write_request_and_its_payload() {
    let write = request(NBD_CMD_FLAG_FUA, Cmd::Write, 0x200, 4);
    let header = request_bytes([0, 1], [0, 1], [0, 0, 0, 0, 0, 0, 2, 0], [0, 0, 0, 4]);
    check_request(write, header.clone());
    let whole = cat(&[&header, b"abcd"]);
    seeds::seed("nbd_request", &[3], &whole);
    // One step: nothing until header and payload are all there.
    let (got, payload) = check_prefixes(&whole, |b| decode_request_with_payload(b, 4));
    assert_eq!((got, &payload[..]), (write, &b"abcd"[..]));
    // Two steps: the header, then the payload.
    let mut buf = BytesMut::from(&whole[..30]);
    assert_eq!(decode_request(&mut buf), Ok(Some(write)));
    assert_eq!(take_payload(&mut buf, 4), None);
    buf.put_slice(b"cd");
    assert_eq!(take_payload(&mut buf, 4).as_deref(), Some(&b"abcd"[..]));
    assert!(buf.is_empty());
    // A payload over the server's limit is refused from the header alone.
    let err = decode_request_with_payload(&mut BytesMut::from(&header[..]), 3).unwrap_err();
    assert_eq!(err, Error::TooLong { what: "write payload", len: 4, max: 3 });
}

#[test]
fn request_refusals_and_flag_rules() {
    let mut bad = request_bytes([0, 0], [0, 0], [0; 8], [0; 4]);
    bad[3] = 0x14; // 0x25609514: the transaction-log magic, never sent on the wire
    let err = decode_request(&mut BytesMut::from(&bad[..])).unwrap_err();
    assert_eq!(err, Error::BadMagic { what: "request", found: 0x2560_9514 });
    // The magic is checked as soon as its four bytes are in.
    assert!(decode_request(&mut BytesMut::from(&bad[..4])).is_err());

    assert_eq!(Cmd::Read.valid_flags(), NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_DF);
    assert_eq!(Cmd::WriteZeroes.valid_flags(), 0x13);
    assert_eq!(Cmd::BlockStatus.valid_flags(), 0x09);
    for cmd in [Cmd::Write, Cmd::Disc, Cmd::Flush, Cmd::Trim, Cmd::Cache] {
        assert_eq!(cmd.valid_flags(), NBD_CMD_FLAG_FUA, "{}", cmd.name());
    }
    assert_eq!(Cmd::Unknown(8).valid_flags(), 0);
}

// ---------------------------------------------------------------------------------------
// Transmission: replies
// ---------------------------------------------------------------------------------------

#[test]
fn simple_replies() {
    // magic (0..4), error (4..8), cookie (8..16).
    let ok = SimpleReply { error: 0, cookie: COOKIE_U64 };
    let eio = SimpleReply { error: NBD_EIO, cookie: COOKIE_U64 };
    for (reply, expected) in [
        (ok, cat(&[&SIMPLE_MAGIC, &[0, 0, 0, 0], &COOKIE])),
        (eio, cat(&[&SIMPLE_MAGIC, &[0, 0, 0, 5], &COOKIE])),
    ] {
        let mut buf = BytesMut::new();
        reply.encode(&mut buf);
        assert_eq!(&buf[..], &expected[..]);
        let got = check_prefixes(&expected, |b| decode_reply(b, 0));
        assert_eq!(got, Reply::Simple(reply));
        seeds::seed("nbd_reply", &[], &expected);
        assert_eq!(got.cookie(), COOKIE_U64);
    }
    // A READ's data follows the header: the decoder leaves it for take_payload.
    let mut buf = BytesMut::from(&cat(&[&SIMPLE_MAGIC, &[0; 4], &COOKIE, b"data"])[..]);
    assert_eq!(decode_reply(&mut buf, 0), Ok(Some(Reply::Simple(ok))));
    assert_eq!(take_payload(&mut buf, 4).as_deref(), Some(&b"data"[..]));
}

#[test]
fn chunk_none() {
    let chunk = Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: COOKIE_U64, body: ChunkBody::None };
    check_chunk(chunk, chunk_bytes(1, 0, b""));
    let literal = [
        0x66, 0x8e, 0x33, 0xef, // NBD_STRUCTURED_REPLY_MAGIC
        0, 1, // NBD_REPLY_FLAG_DONE
        0, 0, // NBD_REPLY_TYPE_NONE
        1, 2, 3, 4, 5, 6, 7, 8, // cookie
        0, 0, 0, 0, // length
    ];
    assert_eq!(chunk_bytes(1, 0, b""), literal);
}

#[test]
fn chunk_offset_data_and_its_header_writer() {
    // u64 offset, then data.
    let body = ChunkBody::OffsetData { offset: 0x200, data: Bytes::from_static(b"hello") };
    let chunk = Chunk { flags: 0, cookie: COOKIE_U64, body };
    let expected = chunk_bytes(0, 1, &cat(&[&[0, 0, 0, 0, 0, 0, 2, 0], b"hello"]));
    assert_eq!(&expected[16..20], &[0, 0, 0, 13]);
    check_chunk(chunk, expected.clone());
    // The zero-copy writer produces the same bytes once the data is appended.
    let mut buf = BytesMut::new();
    encode_offset_data_header(&mut buf, 0, COOKIE_U64, 0x200, 5);
    buf.put_slice(b"hello");
    assert_eq!(&buf[..], &expected[..]);
}

#[test]
fn chunk_offset_hole() {
    // u64 offset, u32 hole size.
    let body = ChunkBody::OffsetHole { offset: 0x1000, length: 0x10000 };
    let chunk = Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: COOKIE_U64, body };
    let payload = [0, 0, 0, 0, 0, 0, 0x10, 0, 0, 1, 0, 0];
    check_chunk(chunk, chunk_bytes(1, 2, &payload));
}

#[test]
fn chunk_block_status() {
    // u32 context id, then (u32 length, u32 status flags) per extent.
    let extents = vec![
        Extent { length: 4096, flags: NBD_STATE_HOLE | NBD_STATE_ZERO },
        Extent { length: 8192, flags: 0 },
    ];
    let body = ChunkBody::BlockStatus { context_id: 1, extents };
    let chunk = Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: COOKIE_U64, body };
    let payload = [
        0, 0, 0, 1, // context id
        0, 0, 0x10, 0, 0, 0, 0, 3, // 4096 bytes: hole, zero
        0, 0, 0x20, 0, 0, 0, 0, 0, // 8192 bytes: data
    ];
    check_chunk(chunk, chunk_bytes(1, 5, &payload));
}

#[test]
fn chunk_errors() {
    // u32 error, u16 message length, message.
    let body = ChunkBody::Error { error: NBD_EIO, message: "disk on fire".into() };
    let chunk = Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: COOKIE_U64, body };
    let payload = cat(&[&[0, 0, 0, 5], &[0, 12], b"disk on fire"]);
    check_chunk(chunk, chunk_bytes(1, 0x8001, &payload));
    // ... then u64 offset for ERROR_OFFSET.
    let body = ChunkBody::ErrorOffset { error: NBD_EINVAL, message: String::new(), offset: 0x2000 };
    let chunk = Chunk { flags: 0, cookie: COOKIE_U64, body };
    let payload = [0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0, 0, 0x20, 0];
    check_chunk(chunk, chunk_bytes(0, 0x8002, &payload));
    // An unknown error type still yields its error and message.
    let body = ChunkBody::UnknownError {
        chunk_type: 0x8003,
        error: NBD_ENOSPC,
        message: "x".into(),
        rest: Bytes::from_static(&[9]),
    };
    let chunk = Chunk { flags: 0, cookie: COOKIE_U64, body };
    assert!(chunk.body.is_error());
    check_chunk(chunk, chunk_bytes(0, 0x8003, &[0, 0, 0, 28, 0, 1, b'x', 9]));
}

#[test]
fn chunk_unknown_type() {
    // BLOCK_STATUS_EXT belongs to an extension this crate does not speak.
    let body = ChunkBody::Unknown { chunk_type: 6, data: Bytes::from_static(&[1, 2, 3]) };
    let chunk = Chunk { flags: 0, cookie: COOKIE_U64, body };
    assert!(!chunk.body.is_error());
    check_chunk(chunk, chunk_bytes(0, 6, &[1, 2, 3]));
}

#[test]
fn chunk_refusals() {
    let decode = |bytes: Vec<u8>| decode_reply(&mut BytesMut::from(&bytes[..]), 1 << 20);
    let err = decode(cat(&[&[0x67, 0x44, 0x66, 0x99], &[0; 12]])).unwrap_err();
    assert!(matches!(err, Error::BadMagic { what: "reply", .. }), "{err:?}");
    // Over the caller's limit, refused from the header.
    let err = decode_reply(&mut BytesMut::from(&chunk_bytes(0, 1, &[0; 10])[..]), 9);
    assert_eq!(err, Err(Error::TooLong { what: "reply chunk", len: 10, max: 9 }));
    // NONE without DONE, or with a payload.
    let err = decode(chunk_bytes(0, 0, b"")).unwrap_err();
    assert!(matches!(err, Error::Invalid { what: "NONE chunk", .. }), "{err:?}");
    assert!(matches!(decode(chunk_bytes(1, 0, b"x")), Err(Error::Trailing { .. })));
    // OFFSET_DATA: length must be at least 9.
    assert_eq!(decode(chunk_bytes(0, 1, &[0; 7])), Err(Error::Truncated("data offset")));
    let err = decode(chunk_bytes(0, 1, &[0; 8])).unwrap_err();
    assert!(matches!(err, Error::Invalid { what: "OFFSET_DATA chunk", .. }), "{err:?}");
    // OFFSET_HOLE: exactly 12, size nonzero.
    assert!(matches!(decode(chunk_bytes(0, 2, &[1; 13])), Err(Error::Trailing { .. })));
    let err = decode(chunk_bytes(0, 2, &[0; 12])).unwrap_err();
    assert_eq!(err, Error::Invalid { what: "hole size", why: "zero" });
    // BLOCK_STATUS: 4 + a positive multiple of 8.
    for len in [3, 4, 11, 13] {
        let err = decode(chunk_bytes(1, 5, &vec![1; len])).unwrap_err();
        assert!(matches!(err, Error::Truncated(_) | Error::Invalid { .. }), "{len}: {err:?}");
    }
    // ERROR: shorter than 6, error value 0, message past the end.
    assert_eq!(decode(chunk_bytes(1, 0x8001, &[0, 0, 0, 5, 0])), {
        Err(Error::Truncated("message length"))
    });
    let err = decode(chunk_bytes(1, 0x8001, &[0, 0, 0, 0, 0, 0])).unwrap_err();
    assert!(matches!(err, Error::Invalid { what: "error chunk", .. }), "{err:?}");
    let err = decode(chunk_bytes(1, 0x8003, &[0, 0, 0, 5, 0, 2, b'x'])).unwrap_err();
    assert_eq!(err, Error::Truncated("error message"));
    // ERROR_OFFSET: no room for the offset after the message.
    let err = decode(chunk_bytes(1, 0x8002, &[0, 0, 0, 5, 0, 1, b'x', 0, 0])).unwrap_err();
    assert_eq!(err, Error::Truncated("error offset"));
}

// ---------------------------------------------------------------------------------------
// Transmission: reply heads, for a client that reads payloads itself
// ---------------------------------------------------------------------------------------

#[test]
fn reply_head_of_a_simple_reply_leaves_the_data() {
    // magic (0..4), error (4..8), cookie (8..16); the READ data after it stays in the buffer.
    let head = cat(&[&SIMPLE_MAGIC, &[0, 0, 0, 0], &COOKIE]);
    let got = check_prefixes(&head, |b| decode_reply_head(b, 0, 0));
    assert_eq!(got, ReplyHead::Simple(SimpleReply { error: 0, cookie: COOKIE_U64 }));
    assert_eq!(got.cookie(), COOKIE_U64);
    let mut buf = BytesMut::from(&cat(&[&head, b"data"])[..]);
    assert_eq!(decode_reply_head(&mut buf, 0, 0).unwrap(), Some(got));
    assert_eq!(&buf[..], b"data");
}

#[test]
fn reply_head_of_offset_data_is_header_and_offset() {
    // The chunk header (0..20) and the u64 offset (20..28): DATA_HEAD_LEN bytes; the five
    // bytes of data stay in the buffer.
    let whole = chunk_bytes(1, 1, &cat(&[&[0, 0, 0, 0, 0, 0, 2, 0], b"hello"]));
    assert_eq!(DATA_HEAD_LEN, 28);
    let got = check_prefixes(&whole[..28], |b| decode_reply_head(b, 5, 0));
    let expected = ReplyHead::Data { flags: 1, cookie: COOKIE_U64, offset: 0x200, data_len: 5 };
    assert_eq!(got, expected);
    let mut buf = BytesMut::from(&whole[..]);
    assert_eq!(decode_reply_head(&mut buf, 5, 0).unwrap(), Some(expected));
    assert_eq!(&buf[..], b"hello");
}

#[test]
fn reply_head_of_other_chunks_is_the_header() {
    // u32 context id, one descriptor: the payload stays, and parses as decode_reply's would.
    let payload = [0, 0, 0, 1, 0, 0, 0x10, 0, 0, 0, 0, 3];
    let whole = chunk_bytes(1, 5, &payload);
    let got = check_prefixes(&whole[..20], |b| decode_reply_head(b, 0, 12));
    let head = ChunkHead { flags: 1, chunk_type: 5, cookie: COOKIE_U64, length: 12 };
    assert_eq!(got, ReplyHead::Chunk(head));
    assert!(head.is_done());
    let body = head.parse_payload(Bytes::copy_from_slice(&payload)).unwrap();
    let extents = vec![Extent { length: 4096, flags: NBD_STATE_HOLE | NBD_STATE_ZERO }];
    assert_eq!(body, ChunkBody::BlockStatus { context_id: 1, extents });
    let Reply::Chunk(chunk) = decode_reply(&mut BytesMut::from(&whole[..]), 12).unwrap().unwrap()
    else {
        panic!("not a chunk");
    };
    assert_eq!(chunk.body, body);
    // NONE: a header and nothing else.
    let got = check_prefixes(&chunk_bytes(1, 0, b""), |b| decode_reply_head(b, 0, 0));
    let head = ChunkHead { flags: 1, chunk_type: 0, cookie: COOKIE_U64, length: 0 };
    assert_eq!(got, ReplyHead::Chunk(head));
    assert_eq!(head.parse_payload(Bytes::new()), Ok(ChunkBody::None));
}

#[test]
fn reply_head_refusals() {
    let head = |bytes: Vec<u8>, data: u32, chunk: u32| {
        decode_reply_head(&mut BytesMut::from(&bytes[..]), data, chunk)
    };
    let err = head(cat(&[&[0x67, 0x44, 0x66, 0x99], &[0; 12]]), 0, 0).unwrap_err();
    assert!(matches!(err, Error::BadMagic { what: "reply", .. }), "{err:?}");
    // OFFSET_DATA: the data limit counts data bytes (length - 8), refused from the header.
    let data = chunk_bytes(0, 1, &[0; 18]);
    assert_eq!(head(data.clone(), 10, 0).unwrap().map(|h| h.cookie()), Some(COOKIE_U64));
    let err = head(data[..20].to_vec(), 9, 1 << 20);
    assert_eq!(err, Err(Error::TooLong { what: "reply data", len: 10, max: 9 }));
    // ... and must hold its offset and at least one byte.
    assert_eq!(head(chunk_bytes(0, 1, &[0; 7]), 10, 10), Err(Error::Truncated("data offset")));
    let err = head(chunk_bytes(0, 1, &[0; 8]), 10, 10).unwrap_err();
    assert!(matches!(err, Error::Invalid { what: "OFFSET_DATA chunk", .. }), "{err:?}");
    // Other chunks: the chunk limit counts the whole payload.
    let err = head(chunk_bytes(1, 5, &[0; 12])[..20].to_vec(), 1 << 20, 11);
    assert_eq!(err, Err(Error::TooLong { what: "reply chunk", len: 12, max: 11 }));
    // A payload that is not as long as its header says.
    let chunk = ChunkHead { flags: 1, chunk_type: 2, cookie: 1, length: 12 };
    let err = chunk.parse_payload(Bytes::from_static(&[0; 11])).unwrap_err();
    assert!(matches!(err, Error::Invalid { what: "chunk payload", .. }), "{err:?}");
}

// ---------------------------------------------------------------------------------------
// A whole conversation from one buffer
// ---------------------------------------------------------------------------------------

#[test]
fn a_session_decodes_message_after_message() {
    // What a client sends: flags, STRUCTURED_REPLY, SET_META_CONTEXT, GO, then a READ, a
    // WRITE with its data, and DISC, all in one buffer as a pipelining client would.
    let mut wire = BytesMut::new();
    encode_client_flags(&mut wire, 1);
    Opt::StructuredReply.encode(&mut wire);
    let meta = MetaContextOpt { export: "d".into(), queries: vec![BASE_ALLOCATION.into()] };
    Opt::SetMetaContext(meta.clone()).encode(&mut wire);
    let go = ExportOpt { name: "d".into(), info_requests: vec![NBD_INFO_BLOCK_SIZE] };
    Opt::Go(go.clone()).encode(&mut wire);
    let read = request(0, Cmd::Read, 0, 4096);
    read.encode(&mut wire);
    let write = request(0, Cmd::Write, 4096, 3);
    write.encode(&mut wire);
    wire.put_slice(b"xyz");
    request(0, Cmd::Disc, 0, 0).encode(&mut wire);
    seeds::seed("nbd_handshake", &[], &wire);

    assert_eq!(decode_client_flags(&mut wire, 3), Ok(Some(1)));
    let mut opts = vec![];
    for _ in 0..3 {
        opts.push(Opt::parse(&decode_option(&mut wire).unwrap().unwrap()).unwrap());
    }
    assert_eq!(opts, [Opt::StructuredReply, Opt::SetMetaContext(meta), Opt::Go(go)]);
    let max = DEFAULT_MAX_PAYLOAD;
    let (got, _) = decode_request_with_payload(&mut wire, max).unwrap().unwrap();
    assert_eq!(got, read);
    let (got, data) = decode_request_with_payload(&mut wire, max).unwrap().unwrap();
    assert_eq!((got, &data[..]), (write, &b"xyz"[..]));
    assert_eq!(decode_request(&mut wire).unwrap().unwrap().cmd, Cmd::Disc);
    assert!(wire.is_empty());
}
