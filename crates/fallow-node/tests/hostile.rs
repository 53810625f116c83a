//! Hostile and broken peers against a real node, over raw sockets: random bytes, bad
//! lengths, truncated frames, unknown ops, wrong page counts, requests before
//! authentication, a wrong secret, peers that never finish the handshake or never read
//! their replies. Each gets an error status or a closed connection, is counted, and the
//! node goes on serving everyone else. Connections their client gave up on are fenced by
//! its next one: whatever they send later never runs.

use fallow_testkit::node as support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use fallow_client::BlockingClient;
use fallow_core::{PageKey, PageStore, PoolId, PoolSpec, PAGE_SIZE};
use fallow_proto::fallow::auth::Transcript;
use fallow_proto::fallow::frame::{decode, encode};
use fallow_proto::fallow::{Hello, Op, PageRef, Reply, Request, Session, Status, VERSION};
use support::{page, Options, TestNode, SECRET};

/// A connection that speaks raw frames.
struct Raw {
    stream: TcpStream,
    input: BytesMut,
}

impl Raw {
    fn connect(node: &TestNode) -> Raw {
        let stream = TcpStream::connect(node.addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw { stream, input: BytesMut::new() }
    }

    /// Connects and authenticates with `secret`.
    fn authenticated(node: &TestNode) -> Raw {
        Raw::authenticated_in(node, None)
    }

    /// Connects and authenticates, as a connection of `session` if given.
    fn authenticated_in(node: &TestNode, session: Option<Session>) -> Raw {
        let mut raw = Raw::authenticating(node, session);
        assert!(matches!(raw.reply(Op::Auth, 0).1, Reply::Auth { .. }));
        raw
    }

    /// Connects, as a connection of `session` if given, and sends HELLO and AUTH; the
    /// AUTH reply is left to read.
    fn authenticating(node: &TestNode, session: Option<Session>) -> Raw {
        let mut raw = Raw::connect(node);
        let name = "raw".into();
        let hello =
            Hello { version_min: VERSION, version_max: VERSION, client_id: 77, name, session };
        raw.send(&Request::Hello(hello), 1);
        let Reply::Hello(reply) = raw.reply(Op::Hello, 0).1 else { panic!("no hello reply") };
        let transcript = Transcript {
            version: VERSION,
            challenge: reply.challenge,
            client_nonce: [5; 32],
            client_id: 77,
        };
        raw.send(
            &Request::Auth { client_nonce: [5; 32], proof: transcript.client_proof(SECRET) },
            2,
        );
        raw
    }

    fn send(&mut self, request: &Request, id: u64) {
        let mut buf = BytesMut::new();
        request.encode(id, &mut buf);
        self.stream.write_all(&buf).unwrap();
    }

    fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// The next frame, or None when the node closed the connection.
    fn frame(&mut self) -> Option<fallow_proto::fallow::Frame> {
        loop {
            if let Some(frame) = decode(&mut self.input).unwrap() {
                return Some(frame);
            }
            let mut chunk = [0u8; 65536];
            match self.stream.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.input.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("read failed: {e}"),
            }
        }
    }

    fn reply(&mut self, op: Op, keys: usize) -> (u64, Reply) {
        let frame = self.frame().expect("a reply, not a closed connection");
        let id = frame.id;
        (id, Reply::parse(frame, op, keys).unwrap())
    }

    /// True when the node closes the connection (after any replies already sent) within
    /// the read timeout; false if it keeps the connection open.
    fn closed(&mut self) -> bool {
        let mut chunk = [0u8; 65536];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return true,
                Ok(_) => {} // replies sent before closing
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return false
                }
                Err(e) => panic!("read failed: {e}"),
            }
        }
    }
}

fn status_of(reply: &Reply) -> Status {
    match reply {
        Reply::Error { status, .. } => *status,
        Reply::VersionMismatch { .. } => Status::UnsupportedVersion,
        _ => Status::Ok,
    }
}

/// A well-behaved client still works: the node survived whatever came before.
fn node_still_serves(node: &TestNode) {
    let client = BlockingClient::connect(node.config()).unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    let _ = client.put(PageKey::new(pool, 0, 0), &page(1)).unwrap();
    let mut out = vec![0u8; PAGE_SIZE];
    assert!(client.get(PageKey::new(pool, 0, 0), &mut out).unwrap().is_hit());
}

#[test]
fn random_bytes_are_answered_or_cut_off_and_the_node_survives() {
    let node = TestNode::start();
    let mut seed = 0x1234_5678_u64;
    for round in 0..40 {
        let mut raw = Raw::connect(&node);
        let len = 1 + (seed % 700) as usize;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let _ = raw.stream.write_all(&bytes);
        let _ = raw.stream.shutdown(std::net::Shutdown::Write);
        // Whatever the node answers, it must end the connection, not hang.
        let started = Instant::now();
        while let Some(frame) = raw.frame() {
            assert_ne!(frame.status, 0, "round {round}: random bytes got an OK reply");
        }
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    node_still_serves(&node);
}

#[test]
fn bad_lengths_close_the_connection_with_bad_frame() {
    let node = TestNode::start();
    for len in [0u32, 5, u32::MAX, (fallow_proto::fallow::MAX_FRAME_LEN + 1) as u32] {
        let mut raw = Raw::authenticated(&node);
        raw.send_bytes(&len.to_le_bytes());
        raw.send_bytes(&[0u8; 12]);
        let frame = raw.frame().expect("a BAD_FRAME reply");
        assert_eq!((frame.id, frame.status), (0, Status::BadFrame as u8), "length {len}");
        assert!(raw.closed());
    }
    assert!(node.node.metrics().rejections("bad_frame") >= 4);
    node_still_serves(&node);
}

#[test]
fn before_authentication_frames_must_be_small() {
    let node = TestNode::start();
    let mut raw = Raw::connect(&node);
    raw.send_bytes(&1000u32.to_le_bytes());
    let frame = raw.frame().expect("a BAD_FRAME reply");
    assert_eq!(frame.status, Status::BadFrame as u8);
    assert!(raw.closed());
}

#[test]
fn a_truncated_frame_then_close_is_counted() {
    let node = TestNode::start();
    let mut raw = Raw::authenticated(&node);
    let mut buf = BytesMut::new();
    Request::Get { pool: PoolId(1), pages: vec![PageRef { object: 1, index: 1 }] }
        .encode(9, &mut buf);
    raw.send_bytes(&buf[..buf.len() - 3]);
    raw.stream.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(raw.closed());
    let deadline = Instant::now() + Duration::from_secs(5);
    while node.node.metrics().rejections("truncated_frame") == 0 {
        assert!(Instant::now() < deadline, "truncated frame not counted");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn unknown_ops_and_malformed_bodies_keep_the_connection_usable() {
    let node = TestNode::start();
    let mut raw = Raw::authenticated(&node);
    // Unknown op 0x7f: UNKNOWN_OP, echoing the raw code.
    let mut buf = BytesMut::new();
    encode(&mut buf, 0x7f, 0, 10, b"whatever");
    raw.send_bytes(&buf);
    let frame = raw.frame().unwrap();
    assert_eq!((frame.op, frame.id, frame.status), (0x7f, 10, Status::UnknownOp as u8));
    // A PUT announcing two pages but carrying one: MALFORMED ("wrong page sizes").
    let mut body = Vec::new();
    body.extend(1u32.to_le_bytes());
    body.extend(2u32.to_le_bytes());
    body.extend([0u8; 32]);
    body.extend(vec![1u8; PAGE_SIZE]);
    buf.clear();
    encode(&mut buf, Op::Put as u8, 0, 11, &body);
    raw.send_bytes(&buf);
    let (id, reply) = raw.reply(Op::Put, 2);
    assert_eq!((id, status_of(&reply)), (11, Status::Malformed));
    // A batch over the limit: TOO_LARGE.
    let mut body = Vec::new();
    body.extend(1u32.to_le_bytes());
    body.extend(100_000u32.to_le_bytes());
    buf.clear();
    encode(&mut buf, Op::Get as u8, 0, 12, &body);
    raw.send_bytes(&buf);
    let (id, reply) = raw.reply(Op::Get, 0);
    assert_eq!((id, status_of(&reply)), (12, Status::TooLarge));
    // A pool this client never created: UNKNOWN_POOL.
    raw.send(&Request::Get { pool: PoolId(999), pages: vec![PageRef { object: 0, index: 0 }] }, 13);
    assert_eq!(status_of(&raw.reply(Op::Get, 1).1), Status::UnknownPool);
    // HELLO again after authentication: MALFORMED, connection stays.
    let hello =
        Hello { version_min: 1, version_max: 1, client_id: 1, name: String::new(), session: None };
    raw.send(&Request::Hello(hello), 14);
    assert_eq!(status_of(&raw.reply(Op::Hello, 0).1), Status::Malformed);
    // And the connection still works.
    raw.send(&Request::Ping, 15);
    assert_eq!(raw.reply(Op::Ping, 0), (15, Reply::Empty));
    let metrics = node.node.metrics();
    assert_eq!(metrics.rejections("unknown_op"), 1);
    assert_eq!(metrics.rejections("malformed"), 1);
    assert_eq!(metrics.rejections("too_large"), 1);
}

#[test]
fn requests_before_authentication_close_the_connection() {
    let node = TestNode::start();
    let mut raw = Raw::connect(&node);
    raw.send(&Request::Stats, 1);
    let (_, reply) = raw.reply(Op::Stats, 0);
    assert_eq!(status_of(&reply), Status::NotAuthenticated);
    assert!(raw.closed());

    // After HELLO, anything but AUTH closes too.
    let mut raw = Raw::connect(&node);
    let hello =
        Hello { version_min: 1, version_max: 1, client_id: 3, name: "x".into(), session: None };
    raw.send(&Request::Hello(hello), 1);
    let _ = raw.reply(Op::Hello, 0);
    raw.send(&Request::Get { pool: PoolId(0), pages: vec![PageRef { object: 0, index: 0 }] }, 2);
    assert_eq!(status_of(&raw.reply(Op::Get, 1).1), Status::NotAuthenticated);
    assert!(raw.closed());
}

#[test]
fn a_wrong_proof_or_version_is_refused_and_closed() {
    let node = TestNode::start();
    let mut raw = Raw::connect(&node);
    let hello =
        Hello { version_min: 1, version_max: 1, client_id: 3, name: "x".into(), session: None };
    raw.send(&Request::Hello(hello), 1);
    let _ = raw.reply(Op::Hello, 0);
    raw.send(&Request::Auth { client_nonce: [1; 32], proof: [2; 32] }, 2);
    assert_eq!(status_of(&raw.reply(Op::Auth, 0).1), Status::AuthFailed);
    assert!(raw.closed());

    let mut raw = Raw::connect(&node);
    let hello = Hello {
        version_min: 7,
        version_max: 9,
        client_id: 3,
        name: "future".into(),
        session: None,
    };
    raw.send(&Request::Hello(hello), 1);
    assert_eq!(raw.reply(Op::Hello, 0).1, Reply::VersionMismatch { min: VERSION, max: VERSION });
    assert!(raw.closed());

    // Not a fallow client at all (an HTTP request): a version mismatch, then closed.
    let mut raw = Raw::connect(&node);
    raw.send_bytes(b"GET / HTTP/1.1\r\n\r\n");
    assert!(raw.closed());
    assert!(node.node.metrics().rejections("auth_failed") >= 1);
}

#[test]
fn a_peer_that_never_finishes_the_handshake_is_dropped() {
    let node = TestNode::with(Options {
        handshake_timeout: Duration::from_millis(300),
        ..Options::default()
    });
    let mut raw = Raw::connect(&node);
    let started = Instant::now();
    assert!(raw.closed());
    assert!(started.elapsed() >= Duration::from_millis(250));
    // Counted just after the socket closes.
    let deadline = Instant::now() + Duration::from_secs(5);
    while node.node.metrics().rejections("handshake_timeout") == 0 {
        assert!(Instant::now() < deadline, "handshake timeout not counted");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_client_that_stops_reading_is_dropped_while_others_are_served() {
    let node =
        TestNode::with(Options { write_timeout: Duration::from_millis(500), ..Options::default() });
    // A pool with 256 pages, and a raw client that asks for them over and over without
    // reading: the replies fill the socket buffers, the node's write stalls, and after
    // the write timeout the node drops that connection.
    let client = BlockingClient::connect(node.config().client_id(77)).unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    let keys: Vec<PageKey> = (0..256).map(|i| PageKey::new(pool, 0, i)).collect();
    let data: Vec<u8> = (0..256).flat_map(page).collect();
    let _ = client.put_many(&keys, &data).unwrap();
    let mut raw = Raw::authenticated(&node); // same client id 77: reaches the pool
    let pages: Vec<PageRef> = (0..256).map(|index| PageRef { object: 0, index }).collect();
    let mut burst = BytesMut::new();
    for id in 0..64 {
        Request::Get { pool, pages: pages.clone() }.encode(100 + id, &mut burst);
    }
    raw.stream.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = raw.stream.write_all(&burst);
    // Meanwhile a well-behaved client is served promptly.
    let started = Instant::now();
    let mut out = vec![0u8; PAGE_SIZE];
    for _ in 0..50 {
        assert!(client.get(keys[0], &mut out).unwrap().is_hit());
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.node.metrics().rejections("write_timeout") == 0 {
        assert!(Instant::now() < deadline, "the stalled client was never dropped");
        std::thread::sleep(Duration::from_millis(20));
    }
    node_still_serves(&node);
}

#[test]
fn slow_requests_complete_out_of_order_behind_fast_ones() {
    let node = TestNode::with(Options { budget: 512 << 20, ..Options::default() });
    let client = BlockingClient::connect(node.config().client_id(77)).unwrap();
    let pool = client.create_pool(&PoolSpec::persistent()).unwrap();
    // Enough pages that invalidating them takes a while.
    for chunk in 0..200u64 {
        let keys: Vec<PageKey> = (0..64).map(|i| PageKey::new(pool, chunk, i)).collect();
        let data: Vec<u8> = (0..64u64).flat_map(|i| page(chunk * 64 + i)).collect();
        let _ = client.put_many(&keys, &data).unwrap();
    }
    let probe = PageKey::new(pool, 1_000_000, 0);
    let _ = client.put(probe, &page(42)).unwrap();
    let mut raw = Raw::authenticated(&node);
    // One write: STATS, 200 INVALIDATE_OBJECTs (slow: they run on blocking threads), then
    // a GET of a page in another object, pipelined.
    let mut burst = BytesMut::new();
    Request::Stats.encode(1, &mut burst);
    for object in 0..200u64 {
        Request::InvalidateObject { pool, object }.encode(10 + object, &mut burst);
    }
    Request::Get { pool, pages: vec![PageRef { object: 1_000_000, index: 0 }] }
        .encode(5000, &mut burst);
    raw.send_bytes(&burst);
    let mut order = Vec::new();
    for _ in 0..202 {
        let frame = raw.frame().expect("every request is answered");
        order.push(frame.id);
        if frame.id == 5000 {
            let reply = Reply::parse(frame, Op::Get, 1).unwrap();
            let Reply::Pages { found, data } = reply else { panic!("{reply:?}") };
            assert_eq!((found, data), (vec![true], Bytes::from(page(42))));
        }
    }
    let mut sorted = order.clone();
    sorted.sort_unstable();
    let mut expected: Vec<u64> = vec![1, 5000];
    expected.extend(10..210);
    expected.sort_unstable();
    assert_eq!(sorted, expected, "each request answered exactly once");
    // The GET was sent last but is not answered last: the slow requests ran beside it.
    let get_at = order.iter().position(|id| *id == 5000).unwrap();
    assert!(get_at < order.len() - 1, "reply order {order:?}");
}

#[test]
fn a_half_closed_client_still_gets_the_replies_of_slow_requests() {
    let node = TestNode::start();
    let client = BlockingClient::connect(node.config().client_id(77)).unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    let keys: Vec<PageKey> = (0..256).map(|i| PageKey::new(pool, 0, i)).collect();
    let data: Vec<u8> = (0..256).flat_map(page).collect();
    let _ = client.put_many(&keys, &data).unwrap();
    let mut raw = Raw::authenticated(&node);
    let mut burst = BytesMut::new();
    Request::InvalidatePool(pool).encode(20, &mut burst);
    Request::Ping.encode(21, &mut burst);
    raw.send_bytes(&burst);
    raw.stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut ids = Vec::new();
    while let Some(frame) = raw.frame() {
        if frame.id == 20 {
            assert_eq!(
                Reply::parse(frame.clone(), Op::InvalidatePool, 0).unwrap(),
                Reply::Count(256)
            );
        }
        ids.push(frame.id);
    }
    ids.sort_unstable();
    assert_eq!(ids, vec![20, 21], "both replies arrive before the node closes");
}

#[test]
fn a_hello_with_fields_from_a_later_version_is_still_understood() {
    let node = TestNode::start();
    let mut raw = Raw::connect(&node);
    let mut buf = BytesMut::new();
    let hello = Hello {
        version_min: 1,
        version_max: 3,
        client_id: 9,
        name: "future".into(),
        session: None,
    };
    Request::Hello(hello).encode(1, &mut buf);
    // Append 8 bytes a later version might define, and patch the length.
    buf.extend_from_slice(&[0xee; 8]);
    let len = (buf.len() - 4) as u32;
    buf[..4].copy_from_slice(&len.to_le_bytes());
    raw.send_bytes(&buf);
    let (_, reply) = raw.reply(Op::Hello, 0);
    assert!(matches!(reply, Reply::Hello(h) if h.version == VERSION), "{reply:?}");
}

#[test]
fn a_first_frame_that_is_not_hello_is_not_authenticated_and_echoes_its_op() {
    let node = TestNode::start();
    let mut raw = Raw::connect(&node);
    let mut buf = BytesMut::new();
    encode(&mut buf, 0x55, 0, 4, b"??");
    raw.send_bytes(&buf);
    let frame = raw.frame().unwrap();
    assert_eq!((frame.op, frame.id, frame.status), (0x55, 4, Status::NotAuthenticated as u8));
    assert!(raw.closed());
}

/// A connection of a session that a newer one fences: what it sends afterwards never
/// runs and it is closed; the session's other connections above the fence, and the
/// client's connections outside the session, go on; a connection that joins below the
/// fence is refused.
#[test]
fn a_fenced_connection_runs_nothing_more() {
    let node = TestNode::start();
    let session = |epoch, fence_below| Some(Session { id: 41, epoch, fence_below });
    let authenticated = |session| Raw::authenticated_in(&node, session);
    let (mut old, mut outside) = (authenticated(session(1, 0)), authenticated(None));
    let pages = vec![PageRef { object: 1, index: 2 }];
    let put = |seed| Request::Put {
        pool: PoolId(0),
        pages: pages.clone(),
        data: Bytes::from(page(seed)),
    };
    old.send(&Request::CreatePool(PoolSpec::persistent()), 3);
    assert_eq!(old.reply(Op::CreatePool, 0).1, Reply::Pool(PoolId(0)));
    old.send(&put(1), 4);
    assert!(matches!(old.reply(Op::Put, 1).1, Reply::Put(_)));

    let mut new = authenticated(session(2, 2));
    old.send(&put(2), 5);
    assert!(old.closed(), "a fenced connection is closed");
    // Counted once the connection's task has ended, just after the close.
    let counted = || node.node.metrics().fenced_connections.get() == 1;
    assert!(fallow_testkit::process::poll_until(Duration::from_secs(5), counted));
    for (raw, id) in [(&mut new, 6), (&mut outside, 7)] {
        raw.send(&Request::Get { pool: PoolId(0), pages: pages.clone() }, id);
        let Reply::Pages { found, data } = raw.reply(Op::Get, 1).1 else { panic!("no pages") };
        assert_eq!(found, [true]);
        assert!(data[..] == page(1)[..], "the put sent after the fence ran");
    }

    let mut stale = Raw::authenticating(&node, session(1, 0));
    assert_eq!(status_of(&stale.reply(Op::Auth, 0).1), Status::NotAuthenticated);
    assert!(stale.closed(), "a connection below the fence is refused");
    node_still_serves(&node);
}
