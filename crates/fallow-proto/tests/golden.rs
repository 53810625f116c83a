//! Golden bytes for every frame of the node protocol: each test writes the expected bytes
//! out by hand from `docs/protocol.md`, checks that the encoder produces exactly them, and
//! that the parser turns them back into the same value. A change that breaks one of these
//! breaks every deployed client: bump the protocol version instead.

use bytes::{Bytes, BytesMut};
use fallow_core::{
    DedupScope, HashPutOutcome, NotStored, PoolId, PoolSpec, PutOutcome, TrustDomain, PAGE_SIZE,
};
use fallow_proto::fallow::frame::decode;
use fallow_proto::fallow::{
    encode_pages_with, Hello, HelloReply, MemberInfo, MemberState, Op, PageRef, Reply, Request,
    Session, StatEntry, Status, SummaryChunk,
};

mod seeds;

/// A frame header: length, op, status, reserved, id.
fn header(body_len: usize, op: u8, status: u8, id: u64) -> Vec<u8> {
    let mut h = ((12 + body_len) as u32).to_le_bytes().to_vec();
    h.extend([op, status, 0, 0]);
    h.extend(id.to_le_bytes());
    h
}

fn frame(op: u8, status: u8, id: u64, body: &[u8]) -> Vec<u8> {
    let mut f = header(body.len(), op, status, id);
    f.extend_from_slice(body);
    f
}

fn check_request(request: Request, id: u64, expected: Vec<u8>) {
    seeds::seed("node_frame", &[0, 0], &expected);
    let mut buf = BytesMut::new();
    request.encode(id, &mut buf);
    assert_eq!(&buf[..], &expected[..], "encoding of {request:?}");
    let frame = decode(&mut buf).unwrap().unwrap();
    assert_eq!(frame.id, id);
    assert_eq!(Request::parse(frame).unwrap(), request);
}

fn check_reply(reply: Reply, op: Op, keys: usize, id: u64, expected: Vec<u8>) {
    seeds::seed("node_frame", &(keys as u16).to_le_bytes(), &expected);
    let mut buf = BytesMut::new();
    reply.encode(op, id, &mut buf);
    assert_eq!(&buf[..], &expected[..], "encoding of {reply:?}");
    let frame = decode(&mut buf).unwrap().unwrap();
    assert_eq!(Reply::parse(frame, op, keys).unwrap(), reply);
}

fn le_keys(keys: &[(u64, u64)]) -> Vec<u8> {
    keys.iter().flat_map(|(o, i)| o.to_le_bytes().into_iter().chain(i.to_le_bytes())).collect()
}

fn refs(keys: &[(u64, u64)]) -> Vec<PageRef> {
    keys.iter().map(|&(object, index)| PageRef { object, index }).collect()
}

#[test]
fn hello() {
    let mut body = b"FALLOWPP".to_vec();
    body.extend([1, 0, 1, 0]); // versions 1..=1
    body.extend([0x11; 16]); // client id
    body.extend([3, b'v', b'm', b'1']);
    let hello = Hello {
        version_min: 1,
        version_max: 1,
        client_id: u128::from_le_bytes([0x11; 16]),
        name: "vm1".into(),
        session: None,
    };
    check_request(Request::Hello(hello.clone()), 1, frame(0x01, 0, 1, &body));

    // A session after the name: id, epoch, fence_below.
    body.extend(0x0102_0304_0506_0708u64.to_le_bytes());
    body.extend([5, 0, 0, 0, 4, 0, 0, 0]);
    let session = Some(Session { id: 0x0102_0304_0506_0708, epoch: 5, fence_below: 4 });
    let with_session = Hello { session, ..hello.clone() };
    check_request(Request::Hello(with_session.clone()), 1, frame(0x01, 0, 1, &body));

    // Bytes after the session are a later version's fields: ignored. Fewer than a
    // session's 16 are no session.
    let mut longer = body.clone();
    longer.extend([0xee; 5]);
    let parsed = Request::parse(
        decode(&mut BytesMut::from(&frame(0x01, 0, 1, &longer)[..])).unwrap().unwrap(),
    );
    assert_eq!(parsed.unwrap(), Request::Hello(with_session));
    let short = &body[..body.len() - 1];
    let parsed = Request::parse(
        decode(&mut BytesMut::from(&frame(0x01, 0, 1, short)[..])).unwrap().unwrap(),
    );
    assert_eq!(parsed.unwrap(), Request::Hello(hello));
}

#[test]
fn hello_reply_and_version_mismatch() {
    let mut body = vec![1, 0, 0, 0]; // version 1, reserved
    body.extend(256u32.to_le_bytes());
    body.extend([0x22; 16]);
    body.extend([0x33; 32]);
    let reply = HelloReply {
        version: 1,
        max_batch: 256,
        node_id: u128::from_le_bytes([0x22; 16]),
        challenge: [0x33; 32],
    };
    check_reply(Reply::Hello(reply), Op::Hello, 0, 1, frame(0x01, 0, 1, &body));
    check_reply(
        Reply::VersionMismatch { min: 1, max: 2 },
        Op::Hello,
        0,
        1,
        frame(0x01, 6, 1, &[1, 0, 2, 0]),
    );
}

#[test]
fn auth_and_reply() {
    let mut body = vec![0x44; 32];
    body.extend([0x55; 32]);
    check_request(
        Request::Auth { client_nonce: [0x44; 32], proof: [0x55; 32] },
        2,
        frame(0x02, 0, 2, &body),
    );
    check_reply(Reply::Auth { proof: [0x66; 32] }, Op::Auth, 0, 2, frame(0x02, 0, 2, &[0x66; 32]));
    check_reply(
        Reply::Error { status: Status::AuthFailed, message: "no".into() },
        Op::Auth,
        0,
        2,
        frame(0x02, 5, 2, b"no"),
    );
}

#[test]
fn ping_and_stats_requests_have_no_body() {
    check_request(Request::Ping, 9, frame(0x03, 0, 9, &[]));
    check_request(Request::Stats, 10, frame(0x30, 0, 10, &[]));
    check_reply(Reply::Empty, Op::Ping, 0, 9, frame(0x03, 0, 9, &[]));
}

#[test]
fn create_pool() {
    // Persistent, shared, dedup in domain 7, compress + quota 1000.
    let uuid = 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10u128;
    let spec = PoolSpec::persistent()
        .shared(uuid)
        .dedup(DedupScope::Domain(TrustDomain(7)))
        .compress(true)
        .quota_pages(1000);
    let mut body = vec![1, 1, 1, 0b11, 0, 0, 0, 0];
    body.extend(1000u64.to_le_bytes());
    body.extend(7u64.to_le_bytes());
    body.extend(uuid.to_le_bytes());
    assert_eq!(body.len(), 40);
    check_request(Request::CreatePool(spec), 3, frame(0x10, 0, 3, &body));

    // The plainest pool: ephemeral, private, dedup off.
    let mut body = vec![0; 40];
    body[2] = 0;
    check_request(
        Request::CreatePool(PoolSpec::ephemeral().dedup(DedupScope::Off)),
        4,
        frame(0x10, 0, 4, &body),
    );
    check_reply(Reply::Pool(PoolId(5)), Op::CreatePool, 0, 4, frame(0x10, 0, 4, &[5, 0, 0, 0]));
}

#[test]
fn create_cluster_pool() {
    // Flag bit 2 (0x04): spread over the cluster by the receiving node (peer forwarding).
    // Ephemeral, shared, dedup in domain 0, no compression or quota.
    let uuid = 0x0a0b_0c0d_u128;
    let mut body = vec![0, 1, 1, 0x04, 0, 0, 0, 0];
    body.extend(0u64.to_le_bytes());
    body.extend(0u64.to_le_bytes());
    body.extend(uuid.to_le_bytes());
    assert_eq!(body.len(), 40);
    let spec = PoolSpec::ephemeral().shared(uuid);
    check_request(Request::CreateClusterPool(spec), 7, frame(0x10, 0, 7, &body));
    assert_eq!(Request::CreateClusterPool(spec).op(), Op::CreatePool);

    // With the other flags: persistent, private, compress + quota 9.
    let mut body = vec![1, 0, 1, 0x07, 0, 0, 0, 0];
    body.extend(9u64.to_le_bytes());
    body.extend([0; 24]);
    let spec = PoolSpec::persistent().compress(true).quota_pages(9);
    check_request(Request::CreateClusterPool(spec), 8, frame(0x10, 0, 8, &body));

    // Bit 3 and above are still reserved.
    let mut body = vec![0; 40];
    body[3] = 0x08;
    let mut buf = BytesMut::from(&frame(0x10, 0, 9, &body)[..]);
    let parsed = Request::parse(decode(&mut buf).unwrap().unwrap());
    assert_eq!(parsed.unwrap_err().status(), Status::Malformed);
}

#[test]
fn destroy_and_invalidate() {
    check_request(Request::DestroyPool(PoolId(258)), 5, frame(0x11, 0, 5, &[2, 1, 0, 0]));
    check_request(Request::InvalidatePool(PoolId(1)), 6, frame(0x12, 0, 6, &[1, 0, 0, 0]));
    let mut body = vec![1, 0, 0, 0, 0, 0, 0, 0];
    body.extend(0xdead_beefu64.to_le_bytes());
    check_request(
        Request::InvalidateObject { pool: PoolId(1), object: 0xdead_beef },
        7,
        frame(0x13, 0, 7, &body),
    );
    let keys = [(1, 2), (3, 4)];
    let mut body = vec![1, 0, 0, 0, 2, 0, 0, 0];
    body.extend(le_keys(&keys));
    check_request(
        Request::InvalidatePages { pool: PoolId(1), pages: refs(&keys) },
        8,
        frame(0x14, 0, 8, &body),
    );
    check_reply(
        Reply::Count(3),
        Op::InvalidateObject,
        0,
        7,
        frame(0x13, 0, 7, &3u64.to_le_bytes()),
    );
    check_reply(Reply::Empty, Op::DestroyPool, 0, 5, frame(0x11, 0, 5, &[]));
}

#[test]
fn put_and_reply() {
    let keys = [(9, 0), (9, 1)];
    let data: Vec<u8> = (0..2 * PAGE_SIZE).map(|i| (i / PAGE_SIZE) as u8 + 1).collect();
    let mut body = vec![4, 0, 0, 0, 2, 0, 0, 0];
    body.extend(le_keys(&keys));
    body.extend(&data);
    check_request(
        Request::Put { pool: PoolId(4), pages: refs(&keys), data: Bytes::from(data) },
        11,
        frame(0x20, 0, 11, &body),
    );
    check_reply(
        Reply::Put(vec![
            PutOutcome::Stored,
            PutOutcome::NotStored(NotStored::Full),
            PutOutcome::NotStored(NotStored::OverQuota),
        ]),
        Op::Put,
        3,
        11,
        frame(0x20, 0, 11, &[0, 1, 2]),
    );
}

#[test]
fn get_take_and_pages_reply() {
    let keys = [(1, 1), (1, 2), (1, 3)];
    let mut body = vec![4, 0, 0, 0, 3, 0, 0, 0];
    body.extend(le_keys(&keys));
    check_request(
        Request::Get { pool: PoolId(4), pages: refs(&keys) },
        12,
        frame(0x21, 0, 12, &body),
    );
    check_request(
        Request::Take { pool: PoolId(4), pages: refs(&keys) },
        13,
        frame(0x22, 0, 13, &body),
    );
    // Keys 0 and 2 hit: flags, then their two pages only.
    let mut data = vec![0xa0; PAGE_SIZE];
    data.extend(vec![0xa2; PAGE_SIZE]);
    let mut reply_body = vec![1, 0, 1];
    reply_body.extend(&data);
    let expected = frame(0x21, 0, 12, &reply_body);
    check_reply(
        Reply::Pages { found: vec![true, false, true], data: Bytes::from(data) },
        Op::Get,
        3,
        12,
        expected.clone(),
    );
    // The in-place writer produces the same bytes.
    let mut buf = BytesMut::new();
    encode_pages_with::<()>(&mut buf, Op::Get, 12, 3, |out| {
        out[..PAGE_SIZE].fill(0xa0);
        out[PAGE_SIZE..2 * PAGE_SIZE].fill(0xee); // a miss: must not reach the wire
        out[2 * PAGE_SIZE..].fill(0xa2);
        Ok(vec![true, false, true])
    })
    .unwrap();
    assert_eq!(&buf[..], &expected[..]);
}

#[test]
fn stats_reply() {
    let mut body = vec![2, 0];
    body.push(5);
    body.extend(b"pages");
    body.extend(10u64.to_le_bytes());
    body.push(11);
    body.extend(b"pool.3.hits");
    body.extend(7u64.to_le_bytes());
    check_reply(
        Reply::Stats(vec![
            StatEntry { name: "pages".into(), value: 10 },
            StatEntry { name: "pool.3.hits".into(), value: 7 },
        ]),
        Op::Stats,
        0,
        14,
        frame(0x30, 0, 14, &body),
    );
}

#[test]
fn members_request_and_reply() {
    check_request(Request::Members, 16, frame(0x31, 0, 16, &[]));
    let mut body = vec![2, 0]; // two entries
                               // Entry 0: the answering node, alive, IPv4.
    body.extend([0, 1, 4, 1]); // state alive, flags local, family 4, id length 1
    body.extend([127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    body.extend(7400u16.to_le_bytes());
    body.extend([0, 0]); // reserved
    body.extend(0x0102_0304_0506_0708u64.to_le_bytes()); // generation
    body.extend((8u64 << 30).to_le_bytes()); // lendable
    body.extend((6u64 << 30).to_le_bytes()); // free
    body.extend(0u32.to_le_bytes()); // age
    body.extend([0, 0, 0, 0]); // reserved
    body.extend(b"a");
    // Entry 1: dead, IPv6, heard of 1500 ms ago.
    body.extend([2, 0, 6, 2]);
    body.extend([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    body.extend(7410u16.to_le_bytes());
    body.extend([0, 0]);
    body.extend(5u64.to_le_bytes());
    body.extend(4096u64.to_le_bytes());
    body.extend(0u64.to_le_bytes());
    body.extend(1500u32.to_le_bytes());
    body.extend([0, 0, 0, 0]);
    body.extend(b"bb");
    let members = vec![
        MemberInfo {
            id: "a".into(),
            state: MemberState::Alive,
            local: true,
            addr: "127.0.0.1:7400".parse().unwrap(),
            generation: 0x0102_0304_0506_0708,
            lendable_bytes: 8 << 30,
            free_bytes: 6 << 30,
            age_ms: 0,
        },
        MemberInfo {
            id: "bb".into(),
            state: MemberState::Dead,
            local: false,
            addr: "[fd00::2]:7410".parse().unwrap(),
            generation: 5,
            lendable_bytes: 4096,
            free_bytes: 0,
            age_ms: 1500,
        },
    ];
    check_reply(Reply::Members(members), Op::Members, 0, 16, frame(0x31, 0, 16, &body));
    // Not in a cluster: no entries.
    check_reply(Reply::Members(vec![]), Op::Members, 0, 17, frame(0x31, 0, 17, &[0, 0]));
}

#[test]
fn members_replies_with_bad_fields_are_refused() {
    let entry = |state: u8, flags: u8, family: u8, ip_tail: u8, id_len: u8| {
        let mut body = vec![1, 0, state, flags, family, id_len, 10, 0, 0, 1];
        body.extend([0; 11]);
        body.push(ip_tail);
        body.extend([0; 36]); // port, reserved, generation, lendable, free, age, reserved
        body.extend(vec![b'x'; id_len as usize]);
        body
    };
    let parse = |body: Vec<u8>| {
        let mut buf = BytesMut::from(&frame(0x31, 0, 1, &body)[..]);
        Reply::parse(decode(&mut buf).unwrap().unwrap(), Op::Members, 0)
    };
    assert!(parse(entry(0, 0, 4, 0, 1)).is_ok());
    assert!(parse(entry(3, 0, 4, 0, 1)).is_err(), "unknown state");
    assert!(parse(entry(0, 2, 4, 0, 1)).is_err(), "unknown flag");
    assert!(parse(entry(0, 0, 5, 0, 1)).is_err(), "unknown family");
    assert!(parse(entry(0, 0, 4, 9, 1)).is_err(), "IPv4 with a tail");
    assert!(parse(entry(0, 0, 4, 0, 0)).is_err(), "empty id");
    let mut short = entry(0, 0, 4, 0, 3);
    short.pop();
    assert!(parse(short).is_err(), "truncated id");
}

#[test]
fn error_replies_carry_a_message() {
    for status in Status::ALL {
        if matches!(status, Status::Ok | Status::UnsupportedVersion) {
            continue;
        }
        check_reply(
            Reply::Error { status, message: "why".into() },
            Op::Get,
            1,
            15,
            frame(0x21, status as u8, 15, b"why"),
        );
    }
}

/// The frame a TLS node sends, in the clear, to a client that began without TLS: op 0,
/// status 13, id 0, then the message.
#[test]
fn tls_required_frame() {
    let mut buf = bytes::BytesMut::new();
    fallow_proto::fallow::encode_error(&mut buf, 0, 0, Status::TlsRequired, "tls");
    let mut expected = vec![15, 0, 0, 0, 0x00, 13, 0, 0];
    expected.extend([0; 8]);
    expected.extend(b"tls");
    assert_eq!(&buf[..], &expected[..]);
}

#[test]
fn put_hashes_and_reply() {
    // pool 9, two keys, then per key: hash (16 bytes, little-endian u128), CRC-32C.
    let mut body = vec![9, 0, 0, 0, 2, 0, 0, 0];
    body.extend(le_keys(&[(1, 2), (3, 4)]));
    body.extend([0x11; 16]);
    body.extend([0x44, 0x33, 0x22, 0x11]);
    body.extend((0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10u128).to_le_bytes());
    body.extend([0, 0, 0, 0x80]);
    assert_eq!(body.len(), 8 + 36 * 2);
    let request = Request::PutHashes {
        pool: PoolId(9),
        pages: refs(&[(1, 2), (3, 4)]),
        contents: vec![
            (u128::from_le_bytes([0x11; 16]), 0x1122_3344),
            (0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10, 0x8000_0000),
        ],
    };
    check_request(request, 21, frame(0x23, 0, 21, &body));
    let outcomes = vec![
        HashPutOutcome::Stored,
        HashPutOutcome::NotStored(NotStored::Full),
        HashPutOutcome::NotStored(NotStored::OverQuota),
        HashPutOutcome::NotHeld,
    ];
    check_reply(
        Reply::PutHashes(outcomes),
        Op::PutHashes,
        4,
        21,
        frame(0x23, 0, 21, &[0, 1, 2, 3]),
    );
}

#[test]
fn put_hashes_bodies_must_fit_their_count() {
    // One key but no content record: truncated.
    let mut body = vec![9, 0, 0, 0, 1, 0, 0, 0];
    body.extend(le_keys(&[(1, 2)]));
    let mut buf = BytesMut::from(&frame(0x23, 0, 5, &body)[..]);
    assert!(Request::parse(decode(&mut buf).unwrap().unwrap()).is_err());
    // "Not held" (3) is no PUT outcome.
    let mut buf = BytesMut::from(&frame(0x20, 0, 5, &[3])[..]);
    assert!(Reply::parse(decode(&mut buf).unwrap().unwrap(), Op::Put, 1).is_err());
    let mut buf = BytesMut::from(&frame(0x23, 0, 5, &[4])[..]);
    assert!(Reply::parse(decode(&mut buf).unwrap().unwrap(), Op::PutHashes, 1).is_err());
}

#[test]
fn content_summary_request_and_reply() {
    check_request(
        Request::ContentSummary { offset: 1 << 20 },
        30,
        frame(0x32, 0, 30, &[0, 0, 0x10, 0, 0, 0, 0, 0]),
    );
    let mut body = Vec::new();
    body.extend(7u64.to_le_bytes()); // generation
    body.extend(1000u64.to_le_bytes()); // entries
    body.extend(1216u64.to_le_bytes()); // total_len
    body.push(7); // hashes
    body.extend([0; 7]); // reserved
    body.extend(1208u64.to_le_bytes()); // offset
    body.extend([0xa5; 8]); // the filter's last 8 bytes
    let chunk = SummaryChunk {
        generation: 7,
        entries: 1000,
        total_len: 1216,
        hashes: 7,
        offset: 1208,
        data: Bytes::from_static(&[0xa5; 8]),
    };
    check_reply(Reply::Summary(chunk), Op::ContentSummary, 0, 30, frame(0x32, 0, 30, &body));
}

#[test]
fn content_summary_bad_fields_are_refused() {
    // An offset that is not a multiple of 8.
    let mut buf = BytesMut::from(&frame(0x32, 0, 1, &[3, 0, 0, 0, 0, 0, 0, 0])[..]);
    assert!(Request::parse(decode(&mut buf).unwrap().unwrap()).is_err());
    // A piece that runs past the filter's end, and a reserved byte set.
    let reply = |total: u64, reserved: u8| {
        let mut body = Vec::new();
        body.extend(1u64.to_le_bytes());
        body.extend(1u64.to_le_bytes());
        body.extend(total.to_le_bytes());
        body.push(3);
        body.extend([reserved, 0, 0, 0, 0, 0, 0]);
        body.extend(0u64.to_le_bytes());
        body.extend([0xff; 16]);
        let mut buf = BytesMut::from(&frame(0x32, 0, 1, &body)[..]);
        Reply::parse(decode(&mut buf).unwrap().unwrap(), Op::ContentSummary, 0)
    };
    assert!(reply(16, 0).is_ok());
    assert!(reply(8, 0).is_err());
    assert!(reply(16, 1).is_err());
}
