//! `NbdStore` against real and scripted NBD servers.
//!
//! Against nbdkit (skipped when it is missing): the conformance model (`support/mod.rs`)
//! over one and several connections, many requests in flight with their data checked,
//! `base:allocation` passed through, `NBD_ESHUTDOWN` from the server (nbdkit's error
//! filter), and nbdkit stopped and started again on the same Unix socket.
//!
//! Against [`Fake`], a scripted server written from the spec with `fallow-proto`: replies a
//! real server seldom sends (data and hole chunks out of order, missing data, unknown chunk
//! types, error chunks), `NBD_ESHUTDOWN` followed by a soft disconnect and a retry on a new
//! connection, requests that must not be retried, a FLUSH after a connection was lost with
//! writes on it, and a server that reads slowly, so that requests pile up and go out in
//! shared `writev`s, partial writes included.

use fallow_backing::{Durability, Zeroing};
use fallow_testkit::backing_model as support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use fallow_backing::{BackingStore, NbdStore};
use fallow_proto::nbd::handshake::{decode_client_flags, encode_greeting};
use fallow_proto::nbd::*;
use proptest::prelude::*;
use support::{check, op, Geometry, SIZE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn have_nbdkit() -> bool {
    let found = Command::new("nbdkit").arg("--version").stdout(Stdio::null()).status().is_ok();
    if !found {
        eprintln!("skipped: nbdkit is needed (Debian package nbdkit)");
    }
    found
}

/// A directory of its own under the temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        use std::hash::{BuildHasher, RandomState};
        let id = RandomState::new().hash_one(Instant::now());
        let dir =
            std::env::temp_dir().join(format!("fallow-nbd-{name}-{}-{id:x}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// nbdkit on a Unix socket, stopped (by its PID) on drop.
struct Nbdkit {
    child: Child,
    socket: PathBuf,
}

impl Nbdkit {
    /// `nbdkit -f -U SOCKET ARGS…`, once the socket accepts connections.
    fn start(socket: &Path, args: &[&str]) -> Nbdkit {
        let _ = std::fs::remove_file(socket);
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(socket)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nbdkit starts");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            assert!(Instant::now() < deadline, "nbdkit did not open {}", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Nbdkit { child, socket: socket.to_path_buf() }
    }

    fn uri(&self, params: &str) -> String {
        format!("nbd+unix:///?socket={}{params}", self.socket.display())
    }

    /// SIGTERM, and wait for it to exit.
    fn stop(mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lines of nbdkit's log filter that mention `what` (`Connect`, `Disconnect`, `Read`…).
fn log_count(log: &Path, what: &str) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter(|l| l.split_whitespace().any(|w| w == what)).count()
}

fn pattern(seed: u64, len: usize) -> Bytes {
    (0..len).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) >> 3) as u8).collect()
}

// ---------------------------------------------------------------------------------------
// Against nbdkit
// ---------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn nbd_store_matches_the_model(
        ops in prop::collection::vec(op(Geometry::SMALL), 1..40),
        conns in 1usize..=3,
    ) {
        if !have_nbdkit() {
            return Ok(());
        }
        let dir = TempDir::new("model");
        let nbdkit = Nbdkit::start(&dir.path("s"), &["memory", &SIZE.to_string()]);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = NbdStore::connect(&nbdkit.uri(&format!("&conns={conns}"))).await.unwrap();
            check(&store, &ops).await;
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_keep_their_data() {
    if !have_nbdkit() {
        return;
    }
    let dir = TempDir::new("flight");
    let nbdkit = Nbdkit::start(&dir.path("s"), &["memory", "64M"]);
    for conns in [1, 2] {
        let store =
            Arc::new(NbdStore::connect(&nbdkit.uri(&format!("&conns={conns}"))).await.unwrap());
        // 64 writers at once, each on its own region, sizes from a few bytes to 256 KiB,
        // each reading back what it wrote while the others write.
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    for round in 0..8u64 {
                        let len =
                            [7, 512, 4096, 4096 * 3 + 5, 65536, 262144][(i + round) as usize % 6];
                        let offset = i * (1 << 20) + round * 1000;
                        let data = pattern(i * 100 + round + conns, len);
                        store.write(offset, data.clone(), Durability::AtFlush).await.unwrap();
                        let got = store.read(offset, len as u32).await.unwrap();
                        assert!(got == data, "task {i} round {round}: data differs");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_comes_from_the_upstream() {
    if !have_nbdkit() {
        return;
    }
    let dir = TempDir::new("extents");
    let nbdkit = Nbdkit::start(&dir.path("s"), &["memory", "16M"]);
    let store = NbdStore::connect(&nbdkit.uri("")).await.unwrap();
    assert!(store.capabilities().block_status);
    store.write(4 << 20, pattern(1, 1 << 20), Durability::AtFlush).await.unwrap();
    let extents = store.block_status(0, 8 << 20).await.unwrap();
    let total: u64 = extents.iter().map(|e| e.length).sum();
    assert!(total > 0 && total <= 8 << 20, "{extents:?}");
    assert!(extents[0].hole && extents[0].zero && extents[0].length == 4 << 20, "{extents:?}");
    let data = &extents[1];
    assert!(!data.hole && !data.zero && data.length == 1 << 20, "{extents:?}");
    // Zeroing with trimming allowed punches the data out again.
    store.write_zeroes(4 << 20, 1 << 20, Zeroing::MayDeallocate).await.unwrap();
    let extents = store.block_status(4 << 20, 1 << 20).await.unwrap();
    assert!(extents.iter().all(|e| e.zero), "{extents:?}");
    // Ranges are checked before anything is sent.
    assert!(store.block_status(16 << 20, 1).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_block_status_still_serves() {
    if !have_nbdkit() {
        return;
    }
    let dir = TempDir::new("noextents");
    let nbdkit = Nbdkit::start(&dir.path("s"), &["--filter=noextents", "memory", "1M"]);
    let store = NbdStore::connect(&nbdkit.uri("")).await.unwrap();
    // nbdkit still offers base:allocation (all data, no holes) through the filter.
    if store.capabilities().block_status {
        let extents = store.block_status(0, 1 << 20).await.unwrap();
        assert!(extents.iter().all(|e| !e.hole), "{extents:?}");
    }
    store.write(0, pattern(3, 4096), Durability::Immediate).await.unwrap();
    assert_eq!(store.read(0, 4096).await.unwrap(), pattern(3, 4096));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eshutdown_from_nbdkit_moves_to_a_new_connection() {
    if !have_nbdkit() {
        return;
    }
    let dir = TempDir::new("eshutdown");
    let (log, trigger) = (dir.path("log"), dir.path("trigger"));
    let nbdkit = Nbdkit::start(
        &dir.path("s"),
        &[
            "--filter=log",
            "--filter=error",
            "memory",
            "1M",
            &format!("logfile={}", log.display()),
            "error=ESHUTDOWN",
            "error-pread-rate=100%",
            &format!("error-file={}", trigger.display()),
        ],
    );
    let store = NbdStore::connect(&nbdkit.uri("")).await.unwrap();
    store.write(0, pattern(5, 8192), Durability::AtFlush).await.unwrap();
    assert_eq!(store.read(0, 8192).await.unwrap(), pattern(5, 8192));
    assert_eq!(log_count(&log, "Connect"), 1);
    // Every read fails with ESHUTDOWN: the store hangs up softly (DISC), retries once on
    // a new connection, gets ESHUTDOWN again there, and reports the error.
    std::fs::write(&trigger, b"").unwrap();
    let err = store.read(0, 4096).await.unwrap_err();
    assert!(err.to_string().contains("108"), "{err}");
    // A write is not refused by the filter; it goes to a third connection.
    store.write(8192, pattern(6, 4096), Durability::AtFlush).await.unwrap();
    std::fs::remove_file(&trigger).unwrap();
    assert_eq!(store.read(0, 8192).await.unwrap(), pattern(5, 8192));
    assert_eq!(store.read(8192, 4096).await.unwrap(), pattern(6, 4096));
    let deadline = Instant::now() + Duration::from_secs(5);
    while log_count(&log, "Disconnect") < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(log_count(&log, "Connect"), 3, "{}", std::fs::read_to_string(&log).unwrap());
    assert_eq!(log_count(&log, "Disconnect"), 2, "both closing connections were let go");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdkit_restarted_on_the_same_socket_is_found_again() {
    if !have_nbdkit() {
        return;
    }
    let dir = TempDir::new("restart");
    let (socket, image) = (dir.path("s"), dir.path("image"));
    std::fs::write(&image, vec![0u8; 4 << 20]).unwrap();
    let file = format!("file={}", image.display());
    let nbdkit = Nbdkit::start(&socket, &["file", &file]);
    let store = NbdStore::connect(&nbdkit.uri("&conns=2")).await.unwrap();
    store.write(0, pattern(7, 65536), Durability::Immediate).await.unwrap();
    nbdkit.stop();
    // While it is down, requests fail (and do not hang).
    assert!(store.read(0, 4096).await.is_err());
    let nbdkit = Nbdkit::start(&socket, &["file", &file]);
    assert_eq!(store.read(0, 65536).await.unwrap(), pattern(7, 65536));
    store.write(65536, pattern(8, 4096), Durability::AtFlush).await.unwrap();
    store.flush().await.unwrap();
    assert_eq!(store.read(65536, 4096).await.unwrap(), pattern(8, 4096));
    // In flight while nbdkit stops: every read either completes or fails, none hangs, and
    // the store works once nbdkit is back.
    let delayed = ["--filter=delay", "file", &file, "rdelay=300ms"];
    nbdkit.stop();
    let nbdkit = Nbdkit::start(&socket, &delayed);
    let store = Arc::new(store);
    let reads: Vec<_> = (0..8u64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.read(i * 4096, 4096).await.map(|_| ()) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    nbdkit.stop();
    for read in reads {
        let _ = tokio::time::timeout(Duration::from_secs(10), read).await.expect("no read hangs");
    }
    let _nbdkit = Nbdkit::start(&socket, &["file", &file]);
    assert_eq!(store.read(0, 65536).await.unwrap(), pattern(7, 65536));
}

// ---------------------------------------------------------------------------------------
// Against a scripted server
// ---------------------------------------------------------------------------------------

/// What the scripted server does with one request.
enum Action {
    /// What a plain server does: the data, or an empty success.
    Serve,
    /// These bytes instead (replies the server would not send on its own).
    Send(Vec<u8>),
    /// Closes the connection without a reply.
    HangUp,
}

/// One request the scripted server received: its connection, then the request.
type Seen = (usize, Request);

type Script = dyn Fn(usize, &Request) -> Action + Send + Sync;

/// A scripted NBD server on a Unix socket: fixed newstyle, structured replies,
/// `base:allocation` (context id 7), an in-memory disk; each request is handed to a
/// script first.
struct Fake {
    socket: PathBuf,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
    _dir: TempDir,
}

struct FakeConfig {
    size: u64,
    flags: u16,
    /// Pauses before each read of the socket: requests pile up in the client.
    slow: Option<Duration>,
}

impl Default for FakeConfig {
    fn default() -> Self {
        let flags = NBD_FLAG_HAS_FLAGS
            | NBD_FLAG_SEND_FLUSH
            | NBD_FLAG_SEND_FUA
            | NBD_FLAG_SEND_TRIM
            | NBD_FLAG_SEND_WRITE_ZEROES
            | NBD_FLAG_CAN_MULTI_CONN;
        FakeConfig { size: 1 << 20, flags, slow: None }
    }
}

const CONTEXT_ID: u32 = 7;

impl Fake {
    fn start(
        config: FakeConfig,
        script: impl Fn(usize, &Request) -> Action + Send + Sync + 'static,
    ) -> Fake {
        let dir = TempDir::new("fake");
        let socket = dir.path("s");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let disk = Arc::new(Mutex::new(vec![0u8; config.size as usize]));
        let script: Arc<Script> = Arc::new(script);
        let config = Arc::new(config);
        let (seen2, connections2) = (seen.clone(), connections.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let index = connections2.fetch_add(1, Ordering::SeqCst);
                let served = serve(
                    stream,
                    index,
                    config.clone(),
                    disk.clone(),
                    seen2.clone(),
                    script.clone(),
                );
                tokio::spawn(served);
            }
        });
        Fake { socket, seen, connections, task, _dir: dir }
    }

    fn uri(&self, params: &str) -> String {
        format!("nbd+unix:///?socket={}{params}", self.socket.display())
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn next<T>(
    r: &mut tokio::net::unix::OwnedReadHalf,
    input: &mut BytesMut,
    slow: Option<Duration>,
    mut decode: impl FnMut(&mut BytesMut) -> Result<Option<T>, Error>,
) -> Option<T> {
    loop {
        if let Some(value) = decode(input).expect("the client sends valid messages") {
            return Some(value);
        }
        if let Some(pause) = slow {
            tokio::time::sleep(pause).await;
        }
        input.reserve(4096);
        if r.read_buf(input).await.ok()? == 0 {
            return None;
        }
    }
}

async fn serve(
    stream: tokio::net::UnixStream,
    index: usize,
    config: Arc<FakeConfig>,
    disk: Arc<Mutex<Vec<u8>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    script: Arc<Script>,
) -> Option<()> {
    let (mut r, mut w) = stream.into_split();
    let mut input = BytesMut::new();
    let mut out = BytesMut::new();
    encode_greeting(&mut out, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
    w.write_all(&out).await.ok()?;
    next(&mut r, &mut input, None, |b| decode_client_flags(b, 3)).await?;
    let mut structured = false;
    loop {
        let raw = next(&mut r, &mut input, None, decode_option).await?;
        let mut out = BytesMut::new();
        let mut go = false;
        match Opt::parse(&raw).unwrap() {
            Opt::StructuredReply => {
                structured = true;
                OptionReply::Ack.encode(raw.option, &mut out);
            }
            Opt::SetMetaContext(meta) => {
                assert!(structured, "SET_META_CONTEXT before STRUCTURED_REPLY");
                if meta.queries.iter().any(|q| q == BASE_ALLOCATION) {
                    let name = BASE_ALLOCATION.to_string();
                    OptionReply::MetaContext { id: CONTEXT_ID, name }.encode(raw.option, &mut out);
                }
                OptionReply::Ack.encode(raw.option, &mut out);
            }
            Opt::Go(_) => {
                let export = Info::Export { size: config.size, flags: config.flags };
                OptionReply::Info(export).encode(raw.option, &mut out);
                OptionReply::Ack.encode(raw.option, &mut out);
                go = true;
            }
            _ => {
                let error = RepError::Unsup;
                OptionReply::Error { error, message: String::new() }.encode(raw.option, &mut out);
            }
        }
        w.write_all(&out).await.ok()?;
        if go {
            break;
        }
    }
    loop {
        let (request, payload) =
            next(&mut r, &mut input, config.slow, |b| decode_request_with_payload(b, 1 << 25))
                .await?;
        seen.lock().unwrap().push((index, request));
        if request.cmd == Cmd::Disc {
            return Some(());
        }
        let reply = match script(index, &request) {
            Action::Serve => plain_reply(&request, payload, &disk, structured),
            Action::Send(bytes) => bytes,
            Action::HangUp => return Some(()),
        };
        w.write_all(&reply).await.ok()?;
    }
}

/// What a plain server answers: READ data as one OFFSET_DATA chunk, BLOCK_STATUS as one
/// extent of data, everything else a simple success (WRITE and WRITE_ZEROES change the disk).
fn plain_reply(
    request: &Request,
    payload: Bytes,
    disk: &Mutex<Vec<u8>>,
    structured: bool,
) -> Vec<u8> {
    let mut disk = disk.lock().unwrap();
    let range = request.offset as usize..request.offset as usize + request.length as usize;
    let mut out = BytesMut::new();
    match request.cmd {
        Cmd::Read if structured => {
            let data = Bytes::copy_from_slice(&disk[range]);
            let body = ChunkBody::OffsetData { offset: request.offset, data };
            Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: request.cookie, body }.encode(&mut out);
        }
        Cmd::Read => {
            SimpleReply { error: 0, cookie: request.cookie }.encode(&mut out);
            out.put_slice(&disk[range]);
        }
        Cmd::BlockStatus => {
            let extents = vec![Extent { length: request.length, flags: 0 }];
            let body = ChunkBody::BlockStatus { context_id: CONTEXT_ID, extents };
            Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: request.cookie, body }.encode(&mut out);
        }
        cmd => {
            match cmd {
                Cmd::Write => disk[range].copy_from_slice(&payload),
                Cmd::WriteZeroes => disk[range].fill(0),
                _ => {}
            }
            SimpleReply { error: 0, cookie: request.cookie }.encode(&mut out);
        }
    }
    out.to_vec()
}

fn chunk(flags: u16, cookie: u64, body: ChunkBody) -> Vec<u8> {
    let mut out = BytesMut::new();
    Chunk { flags, cookie, body }.encode(&mut out);
    out.to_vec()
}

fn simple_error(cookie: u64, error: u32) -> Vec<u8> {
    let mut out = BytesMut::new();
    SimpleReply { error, cookie }.encode(&mut out);
    out.to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_put_together_from_chunks_in_any_order() {
    // 8 KiB: a hole for the last 4 KiB first, then the first 4 KiB as two data chunks in
    // reverse order, then NONE.
    let fake = Fake::start(FakeConfig::default(), |_, r| {
        if r.cmd != Cmd::Read || r.length != 8192 {
            return Action::Serve;
        }
        let (o, c) = (r.offset, r.cookie);
        let data = |at: u64, len: usize| Bytes::from(vec![(at / 1024) as u8 + 1; len]);
        let mut out = chunk(0, c, ChunkBody::OffsetHole { offset: o + 4096, length: 4096 });
        out.extend(chunk(0, c, ChunkBody::OffsetData { offset: o + 1024, data: data(1024, 3072) }));
        out.extend(chunk(0, c, ChunkBody::OffsetData { offset: o, data: data(0, 1024) }));
        out.extend(chunk(NBD_REPLY_FLAG_DONE, c, ChunkBody::None));
        Action::Send(out)
    });
    let store = NbdStore::connect(&fake.uri("")).await.unwrap();
    let got = store.read(65536, 8192).await.unwrap();
    assert!(got[..1024].iter().all(|b| *b == 1));
    assert!(got[1024..4096].iter().all(|b| *b == 2));
    assert!(got[4096..].iter().all(|b| *b == 0));
    // The connection is fine afterwards.
    store.write(0, pattern(1, 100), Durability::AtFlush).await.unwrap();
    assert_eq!(store.read(0, 100).await.unwrap(), pattern(1, 100));
    assert_eq!(fake.connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_missing_data_or_with_an_error_chunk_fails_alone() {
    let fake = Fake::start(FakeConfig::default(), |_, r| match (r.cmd, r.offset) {
        // Half the data, then DONE.
        (Cmd::Read, 0) => {
            let data = Bytes::from(vec![9; 2048]);
            Action::Send(chunk(
                NBD_REPLY_FLAG_DONE,
                r.cookie,
                ChunkBody::OffsetData { offset: 0, data },
            ))
        }
        // Data, then an error at an offset.
        (Cmd::Read, 4096) => {
            let data = Bytes::from(vec![9; 4096]);
            let mut out = chunk(0, r.cookie, ChunkBody::OffsetData { offset: 4096, data });
            let body = ChunkBody::ErrorOffset {
                error: NBD_EIO,
                message: "bad sector".into(),
                offset: 4096,
            };
            out.extend(chunk(NBD_REPLY_FLAG_DONE, r.cookie, body));
            Action::Send(out)
        }
        (Cmd::Write, 8192) => Action::Send(simple_error(r.cookie, NBD_ENOSPC)),
        _ => Action::Serve,
    });
    let store = NbdStore::connect(&fake.uri("")).await.unwrap();
    let err = store.read(0, 4096).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
    let err = store.read(4096, 4096).await.unwrap_err();
    assert!(err.to_string().contains("bad sector"), "{err}");
    let err = store.write(8192, pattern(1, 10), Durability::AtFlush).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::StorageFull, "{err}");
    // None of that is worth a retry or a new connection.
    store.write(12288, pattern(2, 10), Durability::AtFlush).await.unwrap();
    assert_eq!(store.read(12288, 10).await.unwrap(), pattern(2, 10));
    assert_eq!(fake.connections(), 1);
    let reads = fake.seen().iter().filter(|(_, r)| r.cmd == Cmd::Read).count();
    assert_eq!(reads, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eshutdown_means_disc_then_one_retry_elsewhere() {
    // The first read on connection 0 is refused with ESHUTDOWN (structured), as is the
    // first flush anywhere; the rest is served.
    let flushes = AtomicUsize::new(0);
    let fake = Fake::start(FakeConfig::default(), move |conn, r| {
        let shut = match r.cmd {
            Cmd::Read => conn == 0,
            Cmd::Flush => flushes.fetch_add(1, Ordering::SeqCst) == 0,
            _ => false,
        };
        if !shut {
            return Action::Serve;
        }
        let body = ChunkBody::Error { error: NBD_ESHUTDOWN, message: "going away".into() };
        Action::Send(chunk(NBD_REPLY_FLAG_DONE, r.cookie, body))
    });
    let store = NbdStore::connect(&fake.uri("")).await.unwrap();
    store.write(0, pattern(4, 4096), Durability::AtFlush).await.unwrap();
    assert_eq!(store.read(0, 4096).await.unwrap(), pattern(4, 4096));
    // Connection 0 got the read, then DISC; the read was answered on connection 1. The
    // DISC goes out as connection 0 is let go, which may finish after the read returned:
    // wait for it (bounded), then check the exact order.
    let on = |conn: usize| -> Vec<Cmd> {
        fake.seen().iter().filter(|(c, _)| *c == conn).map(|(_, r)| r.cmd).collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while on(0).len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(on(0), [Cmd::Write, Cmd::Read, Cmd::Disc]);
    assert_eq!(on(1), [Cmd::Read]);
    // A flush is not retried: a new connection's flush would not cover the old one's
    // writes. The next one works.
    let err = store.flush().await.unwrap_err();
    assert!(err.to_string().contains("going away"), "{err}");
    store.flush().await.unwrap();
    let flushes: Vec<usize> =
        fake.seen().iter().filter(|(_, r)| r.cmd == Cmd::Flush).map(|(c, _)| *c).collect();
    assert_eq!(flushes, [1, 2], "the refused flush's connection was replaced, not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_retried_once_for_reads_and_writes() {
    // Connection 0 hangs up on its first read; every connection hangs up on writes at
    // offset 4096.
    let fake = Fake::start(FakeConfig::default(), |conn, r| match (r.cmd, r.offset) {
        (Cmd::Read, _) if conn == 0 => Action::HangUp,
        (Cmd::Write, 4096) => Action::HangUp,
        _ => Action::Serve,
    });
    let store = NbdStore::connect(&fake.uri("")).await.unwrap();
    store.read(0, 4096).await.unwrap();
    assert_eq!(fake.connections(), 2);
    let err = store.write(4096, pattern(1, 4096), Durability::AtFlush).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionAborted, "{err}");
    // Tried twice (connections 1 and 2), then reported.
    let writes: Vec<usize> =
        fake.seen().iter().filter(|(_, r)| r.cmd == Cmd::Write).map(|(c, _)| *c).collect();
    assert_eq!(writes, [1, 2]);
    store.write(0, pattern(2, 10), Durability::AtFlush).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_after_a_lost_connection_owns_up_to_what_it_cannot_cover() {
    // Connection N hangs up on a read at 8 KiB × (N + 1); the read is retried elsewhere.
    let fake = Fake::start(FakeConfig::default(), |conn, r| {
        if r.cmd == Cmd::Read && r.offset == 8192 * (conn as u64 + 1) {
            Action::HangUp
        } else {
            Action::Serve
        }
    });
    let store = NbdStore::connect(&fake.uri("")).await.unwrap();
    // Written, flushed, then the connection is lost: nothing to report.
    store.write(0, pattern(1, 4096), Durability::AtFlush).await.unwrap();
    store.flush().await.unwrap();
    store.read(8192, 4096).await.unwrap();
    store.flush().await.unwrap();
    // Written, not flushed, lost: the next flush says so, once.
    store.write(0, pattern(2, 4096), Durability::AtFlush).await.unwrap();
    store.read(16384, 4096).await.unwrap();
    let err = store.flush().await.unwrap_err();
    assert!(err.to_string().contains("may be lost"), "{err}");
    store.flush().await.unwrap();
    // Written with FUA, lost: durable already.
    store.write(0, pattern(3, 4096), Durability::Immediate).await.unwrap();
    store.read(24576, 4096).await.unwrap();
    store.flush().await.unwrap();
    assert_eq!(fake.connections(), 4);
    // Every flush reached the server, the failed one included.
    let flushes = fake.seen().iter().filter(|(_, r)| r.cmd == Cmd::Flush).count();
    assert_eq!(flushes, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_is_passed_through_and_checked() {
    let fake = Fake::start(FakeConfig::default(), |_, r| {
        if r.cmd != Cmd::BlockStatus {
            return Action::Serve;
        }
        let c = r.cookie;
        match r.offset {
            // Another context's chunk (ignored), then ours: a hole and data.
            0 => {
                let other = vec![Extent { length: 512, flags: 0 }];
                let mut out =
                    chunk(0, c, ChunkBody::BlockStatus { context_id: 99, extents: other });
                let extents = vec![
                    Extent { length: 4096, flags: NBD_STATE_HOLE | NBD_STATE_ZERO },
                    Extent { length: 8192, flags: 0 },
                ];
                let body = ChunkBody::BlockStatus { context_id: CONTEXT_ID, extents };
                out.extend(chunk(NBD_REPLY_FLAG_DONE, c, body));
                Action::Send(out)
            }
            // Longer than asked: refused.
            _ => {
                let extents = vec![Extent { length: r.length + 512, flags: 0 }];
                let body = ChunkBody::BlockStatus { context_id: CONTEXT_ID, extents };
                Action::Send(chunk(NBD_REPLY_FLAG_DONE, c, body))
            }
        }
    });
    let store = NbdStore::connect(&fake.uri("")).await.unwrap();
    assert!(store.capabilities().block_status);
    let extents = store.block_status(0, 65536).await.unwrap();
    assert_eq!(extents.len(), 2);
    assert!(extents[0].hole && extents[0].zero && extents[0].length == 4096);
    assert!(!extents[1].hole && !extents[1].zero && extents[1].length == 8192);
    let err = store.block_status(4096, 4096).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_chunk_type_ends_the_connection() {
    let fake = Fake::start(FakeConfig::default(), |conn, r| match (r.cmd, conn) {
        (Cmd::Read, 0) => {
            let body = ChunkBody::Unknown { chunk_type: 6, data: Bytes::from_static(&[0; 4]) };
            Action::Send(chunk(NBD_REPLY_FLAG_DONE, r.cookie, body))
        }
        _ => Action::Serve,
    });
    let store = NbdStore::connect(&fake.uri("")).await.unwrap();
    // Hung up on; the read is retried on a new connection, which serves it.
    store.read(0, 4096).await.unwrap();
    assert_eq!(fake.connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_full_socket_go_out_together_intact() {
    // The server pauses before each read of its socket, so the client's socket fills and
    // requests wait in its queue, then leave in shared writes, some of them partial.
    let config = FakeConfig {
        size: 64 << 20,
        slow: Some(Duration::from_millis(2)),
        ..FakeConfig::default()
    };
    let fake = Fake::start(config, |_, _| Action::Serve);
    let store = Arc::new(NbdStore::connect(&fake.uri("")).await.unwrap());
    let tasks: Vec<_> = (0..48u64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                for round in 0..4u64 {
                    let len = [1, 4096, 100_000, 1 << 20][((i + round) % 4) as usize];
                    let offset = i * (1 << 20) + round * 17;
                    let data = pattern(i * 10 + round, len);
                    store.write(offset, data.clone(), Durability::AtFlush).await.unwrap();
                    assert!(store.read(offset, len as u32).await.unwrap() == data, "task {i}");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(fake.connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_structured_replies_gets_simple_ones() {
    // Read replies as simple replies: the fake answers that way when the client did not
    // ask; here it refuses STRUCTURED_REPLY by answering every option but GO with UNSUP.
    let dir = TempDir::new("simple");
    let socket = dir.path("s");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let (mut r, mut w) = stream.into_split();
        let (mut input, mut out) = (BytesMut::new(), BytesMut::new());
        encode_greeting(&mut out, NBD_FLAG_FIXED_NEWSTYLE);
        w.write_all(&out).await.unwrap();
        next(&mut r, &mut input, None, |b| decode_client_flags(b, 1)).await.unwrap();
        loop {
            let raw = next(&mut r, &mut input, None, decode_option).await.unwrap();
            let mut out = BytesMut::new();
            let go = raw.option == NBD_OPT_GO;
            if go {
                let export = Info::Export { size: 1 << 20, flags: NBD_FLAG_HAS_FLAGS };
                OptionReply::Info(export).encode(raw.option, &mut out);
                OptionReply::Ack.encode(raw.option, &mut out);
            } else {
                let error = RepError::Unsup;
                OptionReply::Error { error, message: String::new() }.encode(raw.option, &mut out);
            }
            w.write_all(&out).await.unwrap();
            if go {
                break;
            }
        }
        let disk = Mutex::new(vec![0u8; 1 << 20]);
        while let Some((request, payload)) =
            next(&mut r, &mut input, None, |b| decode_request_with_payload(b, 1 << 25)).await
        {
            if request.cmd == Cmd::Disc {
                break;
            }
            let reply = plain_reply(&request, payload, &disk, false);
            w.write_all(&reply).await.unwrap();
        }
    });
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    let store = NbdStore::connect(&uri).await.unwrap();
    assert!(!store.capabilities().block_status);
    assert_eq!(
        store.block_status(0, 4096).await.unwrap_err().kind(),
        std::io::ErrorKind::Unsupported
    );
    store.write(1000, pattern(9, 300_000), Durability::AtFlush).await.unwrap();
    assert_eq!(store.read(1000, 300_000).await.unwrap(), pattern(9, 300_000));
    // Dropping the store disconnects softly: the server sees DISC and ends.
    drop(store);
    tokio::time::timeout(Duration::from_secs(5), server).await.unwrap().unwrap();
}
