//! The memcached side of the comparison: a strict codec for the replies of the text
//! protocol (`protocol.txt` in memcached's sources), and a connection that pipelines up to
//! a queue depth of requests over one socket.
//!
//! A get of a batch is one multi-get, `get p1 p2 …\r\n`, answered by a `VALUE` block for
//! each key found, in request order, then `END`. A put of a batch is that many pipelined
//! `set pK 0 0 4096\r\n<page>\r\n`, answered by one `STORED` each. Keys are `p` followed by
//! the key id in decimal.
//!
//! The decoder is total: any byte string yields a reply, `Ok(None)` (need more bytes) or a
//! [`ProtocolError`]; it never panics and never waits for more than
//! [`MAX_LINE`] bytes of a line or [`MAX_VALUE`] bytes of a value.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};

use super::report::Stats;
use super::workload::{Op, RequestGen, Values, PAGE};
use super::PagesError;

/// The longest reply line accepted, CRLF excluded. memcached's longest is a `VALUE` line
/// with a 250-byte key: anything longer is not memcached.
pub const MAX_LINE: usize = 1024;
/// The largest value accepted: 2 MiB, memcached's item size limit under `-I 2m`.
pub const MAX_VALUE: usize = 2 << 20;
/// How long a connection waits for the next reply byte before giving up on the server.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// One reply unit of the text protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `VALUE <key> <flags> <bytes> [<cas>]\r\n<data>\r\n`: one hit of a get.
    Value {
        /// The key, as sent.
        key: Bytes,
        /// The client flags stored with the item.
        flags: u32,
        /// The value.
        data: Bytes,
    },
    /// `END`: the last line of a get's reply.
    End,
    /// `STORED`: a set succeeded.
    Stored,
    /// `NOT_STORED`: a conditional store's condition failed.
    NotStored,
    /// `SERVER_ERROR <msg>`: the server failed this one command (for example out of memory
    /// for a set) and carries on.
    ServerError(String),
}

/// A reply this client does not accept. Each one ends the connection's run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// No CRLF within [`MAX_LINE`] bytes.
    #[error("reply line longer than {MAX_LINE} bytes")]
    LineTooLong,
    /// A line ended by a bare LF.
    #[error("reply line {0:?} ends in LF without CR")]
    BareNewline(String),
    /// A `VALUE` line without exactly a key, flags, a length and an optional CAS.
    #[error("malformed VALUE line {0:?}")]
    BadValueLine(String),
    /// A `VALUE` longer than [`MAX_VALUE`].
    #[error("VALUE of {0} bytes, above the {MAX_VALUE}-byte limit")]
    ValueTooLarge(u64),
    /// The data block of a `VALUE` is not followed by CRLF.
    #[error("VALUE data not followed by CRLF")]
    MissingDataTerminator,
    /// A line that is no reply of the text protocol.
    #[error("unknown reply line {0:?}")]
    UnknownLine(String),
    /// `ERROR`: the server did not understand the command.
    #[error("server answered ERROR (unknown command)")]
    UnknownCommand,
    /// `CLIENT_ERROR <msg>`: the server rejected the command's form.
    #[error("CLIENT_ERROR {0}")]
    ClientError(String),
    /// A valid reply, but not one the request in flight can get.
    #[error("{got} in reply to a {request}")]
    UnexpectedReply {
        /// `get` or `set`.
        request: &'static str,
        /// What arrived.
        got: String,
    },
    /// A `VALUE` for a key that the multi-get did not ask for at that point.
    #[error("VALUE for key {0:?}, which the get did not ask for there")]
    UnrequestedKey(String),
    /// The server closed the connection with requests in flight.
    #[error("connection closed with requests in flight")]
    Closed,
}

/// Up to 80 bytes of `bytes`, printable.
fn show(bytes: &[u8]) -> String {
    let cut = bytes.get(..80).unwrap_or(bytes);
    let mut s = cut.escape_ascii().to_string();
    if cut.len() < bytes.len() {
        s.push('…');
    }
    s
}

/// Decodes one reply from the front of `buf`, consuming it only on success.
///
/// `Ok(None)`: the reply is not complete yet (read more and call again).
pub fn decode(buf: &mut BytesMut) -> Result<Option<Reply>, ProtocolError> {
    let window = buf.get(..MAX_LINE + 2).unwrap_or(buf);
    let Some(lf) = window.iter().position(|&b| b == b'\n') else {
        return if window.len() >= MAX_LINE + 2 {
            Err(ProtocolError::LineTooLong)
        } else {
            Ok(None)
        };
    };
    let (upto_lf, _) = window.split_at(lf);
    let Some(line) = upto_lf.strip_suffix(b"\r") else {
        return Err(ProtocolError::BareNewline(show(upto_lf)));
    };
    let reply = match line {
        b"END" => Reply::End,
        b"STORED" => Reply::Stored,
        b"NOT_STORED" => Reply::NotStored,
        b"ERROR" => return Err(ProtocolError::UnknownCommand),
        _ => {
            if let Some(msg) = line.strip_prefix(b"SERVER_ERROR ") {
                Reply::ServerError(show(msg))
            } else if let Some(msg) = line.strip_prefix(b"CLIENT_ERROR ") {
                return Err(ProtocolError::ClientError(show(msg)));
            } else if let Some(rest) = line.strip_prefix(b"VALUE ") {
                let head = parse_value_line(rest)?;
                return take_value(buf, lf + 1, head);
            } else {
                return Err(ProtocolError::UnknownLine(show(line)));
            }
        }
    };
    buf.advance(lf + 1);
    Ok(Some(reply))
}

/// What a `VALUE` line says.
struct ValueHead {
    key_len: usize,
    flags: u32,
    data_len: usize,
}

/// Parses `<key> <flags> <bytes> [<cas>]`, the part of a `VALUE` line after `VALUE `.
fn parse_value_line(rest: &[u8]) -> Result<ValueHead, ProtocolError> {
    let bad = || ProtocolError::BadValueLine(show(rest));
    let number = |field: &[u8]| std::str::from_utf8(field).ok().and_then(|s| s.parse::<u64>().ok());
    let fields: Vec<&[u8]> = rest.split(|&b| b == b' ').collect();
    let (key, flags, len, cas) = match fields[..] {
        [key, flags, len] => (key, flags, len, None),
        [key, flags, len, cas] => (key, flags, len, Some(cas)),
        _ => return Err(bad()),
    };
    if key.is_empty() || cas.is_some_and(|c| number(c).is_none()) {
        return Err(bad());
    }
    let flags = number(flags).and_then(|f| u32::try_from(f).ok()).ok_or_else(bad)?;
    let len = number(len).ok_or_else(bad)?;
    let data_len = usize::try_from(len)
        .ok()
        .filter(|&l| l <= MAX_VALUE)
        .ok_or(ProtocolError::ValueTooLarge(len))?;
    Ok(ValueHead { key_len: key.len(), flags, data_len })
}

/// Takes a whole `VALUE` reply, whose line is `line_len` bytes with its CRLF, off `buf`.
fn take_value(
    buf: &mut BytesMut,
    line_len: usize,
    head: ValueHead,
) -> Result<Option<Reply>, ProtocolError> {
    let total = line_len + head.data_len + 2;
    if buf.len() < total {
        // Make room for the whole value at once rather than growing step by step.
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    if buf.get(line_len + head.data_len..total) != Some(b"\r\n".as_slice()) {
        return Err(ProtocolError::MissingDataTerminator);
    }
    let mut data = buf.split_to(total).freeze();
    // "VALUE " is 6 bytes: the key follows it.
    let key = data.slice(6..6 + head.key_len);
    data.advance(line_len);
    data.truncate(head.data_len);
    Ok(Some(Reply::Value { key, flags: head.flags, data }))
}

/// Appends the memcached key of key id `id` to `buf`.
fn put_key(id: u64, buf: &mut BytesMut) {
    // Writing to a `BytesMut` cannot fail: it grows.
    let _ = write!(buf, "p{id}");
}

/// The key id of a memcached key, if it is one of ours.
fn parse_key(key: &[u8]) -> Option<u64> {
    let digits = key.strip_prefix(b"p")?;
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Appends a multi-get of `keys`.
pub fn encode_get(keys: &[u64], buf: &mut BytesMut) {
    buf.extend_from_slice(b"get");
    for &k in keys {
        buf.extend_from_slice(b" ");
        put_key(k, buf);
    }
    buf.extend_from_slice(b"\r\n");
}

/// Appends one `set` of `page` under key id `key` (flags 0, no expiry).
pub fn encode_set(key: u64, page: &[u8], buf: &mut BytesMut) {
    encode_set_header(key, page.len(), buf);
    buf.extend_from_slice(page);
    buf.extend_from_slice(b"\r\n");
}

/// Appends the command line of a `set` of `len` bytes under key id `key`; the caller
/// appends the value and CRLF.
fn encode_set_header(key: u64, len: usize, buf: &mut BytesMut) {
    buf.extend_from_slice(b"set ");
    put_key(key, buf);
    let _ = write!(buf, " 0 0 {len}\r\n");
}

/// One request written and not yet answered.
struct InFlight {
    op: Op,
    keys: Vec<u64>,
    start: Instant,
}

/// One TCP connection to memcached.
#[derive(Debug)]
pub(crate) struct Connection {
    stream: TcpStream,
}

impl Connection {
    /// Connects to `addr` (`HOST:PORT`), with Nagle off as every latency client does.
    pub(crate) async fn connect(addr: &str) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self { stream })
    }

    /// Runs `gen`'s requests with up to `queue_depth` in flight until `stop` is set or
    /// `gen` runs out, and returns what they measured.
    pub(crate) async fn drive(
        &mut self,
        gen: RequestGen,
        queue_depth: usize,
        stats: Stats,
        stop: &AtomicBool,
    ) -> Result<Stats, PagesError> {
        let (rd, wr) = self.stream.split();
        let window = Semaphore::new(queue_depth);
        let (tx, rx) = mpsc::unbounded_channel();
        let checker = gen.values.clone();
        // Both halves run in this one task: the writer never blocks the reader, so a full
        // socket in one direction cannot deadlock the other.
        let (_, stats) = tokio::try_join!(
            write_requests(wr, gen, &window, tx, stop),
            read_replies(rd, rx, &window, checker, stats),
        )?;
        Ok(stats)
    }
}

/// The most request bytes gathered into one write.
const MAX_WRITE: usize = 256 << 10;

async fn write_requests(
    mut wr: impl AsyncWrite + Unpin,
    mut gen: RequestGen,
    window: &Semaphore,
    tx: mpsc::UnboundedSender<InFlight>,
    stop: &AtomicBool,
) -> Result<(), PagesError> {
    let mut buf = BytesMut::with_capacity(64 << 10);
    let mut batch = Vec::new();
    loop {
        // The semaphore is never closed, so `acquire` only fails if it were; stop then.
        let Ok(permit) = window.acquire().await else { return Ok(()) };
        permit.forget();
        // Gather every request the window allows into one write.
        let mut done = false;
        loop {
            if stop.load(Ordering::Relaxed) {
                done = true;
                break;
            }
            let mut keys = Vec::new();
            let Some(op) = gen.next(&mut keys) else {
                done = true;
                break;
            };
            match op {
                Op::Get => encode_get(&keys, &mut buf),
                Op::Put => {
                    // The page is written straight into the request: one copy, as on
                    // the fallow side.
                    for &k in &keys {
                        encode_set_header(k, PAGE, &mut buf);
                        gen.values.write(k, &mut buf);
                        buf.extend_from_slice(b"\r\n");
                    }
                }
            }
            batch.push((op, keys));
            if buf.len() >= MAX_WRITE {
                break;
            }
            match window.try_acquire() {
                Ok(p) => p.forget(),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            let start = Instant::now();
            for (op, keys) in batch.drain(..) {
                // The reader outlives the writer inside `try_join!`, so the send succeeds.
                let _ = tx.send(InFlight { op, keys, start });
            }
            wr.write_all(&buf).await?;
            buf.clear();
        }
        if done {
            return Ok(());
        }
    }
}

async fn read_replies(
    mut rd: impl AsyncRead + Unpin,
    mut rx: mpsc::UnboundedReceiver<InFlight>,
    window: &Semaphore,
    checker: Values,
    mut stats: Stats,
) -> Result<Stats, PagesError> {
    let mut buf = BytesMut::with_capacity(256 << 10);
    while let Some(req) = rx.recv().await {
        match req.op {
            Op::Get => {
                let (hits, wrong) = read_get(&mut rd, &mut buf, &req.keys, &checker).await?;
                let misses = req.keys.len() as u64 - hits;
                stats.get(req.start, hits, misses, wrong);
            }
            Op::Put => {
                let mut stored = 0;
                for _ in &req.keys {
                    match next_reply(&mut rd, &mut buf).await? {
                        Reply::Stored => stored += 1,
                        Reply::NotStored | Reply::ServerError(_) => {}
                        other => return Err(unexpected("set", &other)),
                    }
                }
                stats.put(req.start, stored, req.keys.len() as u64 - stored);
            }
        }
        window.add_permits(1);
    }
    Ok(stats)
}

/// Reads one multi-get's reply; returns (hits, wrong pages).
async fn read_get(
    rd: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    keys: &[u64],
    checker: &Values,
) -> Result<(u64, u64), PagesError> {
    let (mut next, mut hits, mut wrong) = (0, 0, 0);
    loop {
        match next_reply(rd, buf).await? {
            Reply::End => return Ok((hits, wrong)),
            Reply::Value { key, data, .. } => {
                // Hits come in request order, misses are left out: find this key at or
                // after the last hit.
                let id = parse_key(&key);
                let rest = keys.get(next..).unwrap_or_default();
                let at = rest.iter().position(|&k| Some(k) == id);
                let at = at.ok_or_else(|| ProtocolError::UnrequestedKey(show(&key)))?;
                next += at + 1;
                hits += 1;
                if !id.is_some_and(|id| checker.check(id, &data)) {
                    wrong += 1;
                }
            }
            other => return Err(unexpected("get", &other)),
        }
    }
}

fn unexpected(request: &'static str, got: &Reply) -> PagesError {
    let got = match got {
        Reply::Value { key, .. } => format!("VALUE {}", show(key)),
        Reply::End => "END".into(),
        Reply::Stored => "STORED".into(),
        Reply::NotStored => "NOT_STORED".into(),
        Reply::ServerError(msg) => format!("SERVER_ERROR {msg}"),
    };
    ProtocolError::UnexpectedReply { request, got }.into()
}

/// The next reply from `rd`, reading as needed.
async fn next_reply(
    rd: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
) -> Result<Reply, PagesError> {
    loop {
        if let Some(reply) = decode(buf)? {
            return Ok(reply);
        }
        buf.reserve(64 << 10);
        let read = tokio::time::timeout(REPLY_TIMEOUT, rd.read_buf(buf)).await;
        match read {
            Err(_) => return Err(PagesError::Stalled(REPLY_TIMEOUT)),
            Ok(Ok(0)) => return Err(ProtocolError::Closed.into()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(bytes: &[u8]) -> Result<Vec<Reply>, ProtocolError> {
        let mut buf = BytesMut::from(bytes);
        let mut out = Vec::new();
        while let Some(r) = decode(&mut buf)? {
            out.push(r);
        }
        assert!(buf.is_empty(), "left over: {:?}", show(&buf));
        Ok(out)
    }

    fn value(key: &str, flags: u32, data: &[u8]) -> Reply {
        Reply::Value {
            key: Bytes::copy_from_slice(key.as_bytes()),
            flags,
            data: Bytes::copy_from_slice(data),
        }
    }

    #[test]
    fn encodes_requests() {
        let mut buf = BytesMut::new();
        encode_get(&[1, 22], &mut buf);
        encode_set(7, b"abc", &mut buf);
        assert_eq!(&buf[..], b"get p1 p22\r\nset p7 0 0 3\r\nabc\r\n");
    }

    #[test]
    fn decodes_golden_replies() {
        let golden =
            b"VALUE p1 0 3\r\nabc\r\nVALUE p22 5 2 99\r\n\r\n\r\nEND\r\nSTORED\r\nNOT_STORED\r\n\
                       SERVER_ERROR out of memory storing object\r\n";
        let replies = decode_all(golden).unwrap();
        assert_eq!(
            replies,
            vec![
                value("p1", 0, b"abc"),
                value("p22", 5, b"\r\n"),
                Reply::End,
                Reply::Stored,
                Reply::NotStored,
                Reply::ServerError("out of memory storing object".into()),
            ]
        );
    }

    #[test]
    fn a_value_of_a_full_page_is_zero_copy_and_exact() {
        let mut bytes = b"VALUE p9 0 4096\r\n".to_vec();
        bytes.extend((0..4096).map(|i| i as u8));
        bytes.extend_from_slice(b"\r\nEND\r\n");
        let replies = decode_all(&bytes).unwrap();
        let Reply::Value { data, .. } = &replies[0] else { panic!("{replies:?}") };
        assert_eq!(data.len(), 4096);
        assert_eq!(data[4095], 255);
    }

    #[test]
    fn every_truncation_waits_for_more() {
        let golden = b"VALUE p1 0 3\r\nabc\r\nEND\r\nSTORED\r\n";
        for cut in 0..golden.len() {
            let mut buf = BytesMut::from(&golden[..cut]);
            let mut n = 0;
            while let Some(_r) = decode(&mut buf).unwrap() {
                n += 1;
            }
            assert!(n <= 3, "cut {cut}");
            // Feeding the rest completes exactly the remaining replies.
            buf.extend_from_slice(&golden[cut..]);
            while decode(&mut buf).unwrap().is_some() {
                n += 1;
            }
            assert_eq!(n, 3, "cut {cut}");
        }
    }

    #[test]
    fn garbage_is_an_error() {
        let cases: &[(&[u8], ProtocolError)] = &[
            (b"ERROR\r\n", ProtocolError::UnknownCommand),
            (
                b"CLIENT_ERROR bad data chunk\r\n",
                ProtocolError::ClientError("bad data chunk".into()),
            ),
            (b"HTTP/1.1 200 OK\r\n", ProtocolError::UnknownLine("HTTP/1.1 200 OK".into())),
            (b"STORED\n", ProtocolError::BareNewline("STORED".into())),
            (b"VALUE p1 0\r\n", ProtocolError::BadValueLine("p1 0".into())),
            (b"VALUE p1 0 x\r\n", ProtocolError::BadValueLine("p1 0 x".into())),
            (b"VALUE p1 -1 3\r\n", ProtocolError::BadValueLine("p1 -1 3".into())),
            (b"VALUE p1 0 3 c\r\n", ProtocolError::BadValueLine("p1 0 3 c".into())),
            (b"VALUE p1 0 3 1 2\r\n", ProtocolError::BadValueLine("p1 0 3 1 2".into())),
            (b"VALUE  0 3\r\n", ProtocolError::BadValueLine(" 0 3".into())),
            (
                b"VALUE p1 0 99999999999999999999\r\n",
                ProtocolError::BadValueLine("p1 0 99999999999999999999".into()),
            ),
            (b"VALUE p1 0 3000000\r\n", ProtocolError::ValueTooLarge(3_000_000)),
            (b"VALUE p1 0 3\r\nabcd\r\n", ProtocolError::MissingDataTerminator),
            (b"\xff\xfe\x00\r\n", ProtocolError::UnknownLine("\\xff\\xfe\\x00".into())),
        ];
        for (bytes, want) in cases {
            assert_eq!(decode_all(bytes).as_ref(), Err(want), "{}", show(bytes));
        }
        let long = vec![b'x'; MAX_LINE + 2];
        assert_eq!(decode(&mut BytesMut::from(&long[..])), Err(ProtocolError::LineTooLong));
        let long_but_short_enough = vec![b'x'; MAX_LINE + 1];
        assert_eq!(decode(&mut BytesMut::from(&long_but_short_enough[..])), Ok(None));
    }

    #[test]
    fn random_bytes_never_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        let alphabet = b"VALUE p0123456789 \r\nENDSTORED_";
        for _ in 0..20_000 {
            let len = rng.gen_range(0..40);
            let bytes: Vec<u8> =
                (0..len).map(|_| alphabet[rng.gen_range(0..alphabet.len())]).collect();
            let mut buf = BytesMut::from(&bytes[..]);
            for _ in 0..50 {
                match decode(&mut buf) {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }

    #[test]
    fn keys_round_trip() {
        let mut buf = BytesMut::new();
        put_key(12345, &mut buf);
        assert_eq!(parse_key(&buf), Some(12345));
        for bad in [&b"p"[..], b"q1", b"p1x", b"p+1", b"p99999999999999999999999"] {
            assert_eq!(parse_key(bad), None, "{}", show(bad));
        }
    }
}
