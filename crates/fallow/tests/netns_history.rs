//! A Jepsen-style history check of a private persistent pool across a cluster. Three
//! `fallow node` processes (each with `--state-dir` under /dev/shm) gossip into a cluster,
//! each in a network namespace of its own (support::netns; the `loopback_` variant puts
//! them on 127.0.0.1). A helper, this test binary re-run in the client namespace, creates a
//! persistent pool through a `ClusterClient` and runs a few concurrent workers that put,
//! get and invalidate the pages of a small key space, each put's page stamped with a value
//! no other put writes, and records every operation's invocation, completion and result.
//! Meanwhile the test hurts one node per round and heals it before the next:
//!
//! * SIGKILL, then a restart on the same addresses and state directory;
//! * SIGSTOP, then SIGCONT (a pause);
//! * a partition by nft rules in the node's namespace that drop everything to and from the
//!   other hosts, then removed (namespaces only).
//!
//! Then the helper checks the history key by key against the pool's promises
//! (docs/semantics.md): see [`check`] for the rules. The test asserts that it found no
//! anomaly, and prints the counts and the first anomalies with their history.
//!
//! FALLOW_HISTORY_ROUNDS sets the number of fault rounds (3 by default;
//! `scripts/history-check.sh` runs more). Without namespaces or nft the namespace test
//! prints `skipped: REASON` and passes. Every process is stopped by its PID; the
//! namespaces, their nft tables and the state directories go when the test ends.

mod support;

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::UdpSocket;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::netns::Lab;
use support::{free_port, Daemon, Rng, TempDir};

const START: Duration = Duration::from_secs(30);
const SECRET: &str = "netns-history-test-secret-0123456789";
/// The node's protocol port in a namespace (gossip is the next one).
const NODE_PORT: u16 = 7400;
/// The nodes, by index; the client namespace is `client`.
const NODES: [&str; 3] = ["a", "b", "c"];
/// Keys (pages 0..KEYS of one object): few, so that the workers contend for them.
const KEYS: u64 = 12;
/// Concurrent workers in the helper.
const WORKERS: u64 = 4;
/// How long a fault is held while the workers run.
const HOLD: Duration = Duration::from_secs(3);
/// Fault rounds when FALLOW_HISTORY_ROUNDS is not set.
const DEFAULT_ROUNDS: usize = 3;
/// The nft table that partitions a node.
const PARTITION: &str = "fallowt_history";
/// Anomalies printed with their history.
const SHOWN: usize = 5;

// ---- the history and its checker ---------------------------------------------------

/// What an operation did. A put's value is in [`Op::value`].
#[derive(Debug, Clone, PartialEq)]
enum Res {
    /// A put `Stored`, an invalidation that returned `Ok`.
    Ok,
    /// A put `NotStored`: no copy is kept, and no older page either.
    Refused,
    /// A get that hit: the value stamped in the page.
    Hit(u64),
    /// A get that missed.
    Miss,
    /// A get whose page was not a stamped page of this key (torn, corrupt, misplaced).
    Corrupt(String),
    /// An error (connection lost, timeout, no copy readable): the effect is unknown.
    Error(String),
}

/// What was asked.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Put,
    Get,
    Invalidate,
}

/// One operation of the history; times in nanoseconds since the helper started.
#[derive(Debug, Clone)]
struct Op {
    worker: u64,
    key: u64,
    kind: Kind,
    /// The value a put wrote (worker << 32 | sequence number), else 0.
    value: u64,
    invoked: u64,
    completed: u64,
    res: Res,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |ns: u64| ns as f64 / 1e6;
        let what = match self.kind {
            Kind::Put => format!("put {}", show(self.value)),
            Kind::Get => "get".to_string(),
            Kind::Invalidate => "invalidate".to_string(),
        };
        let res = match &self.res {
            Res::Hit(v) => format!("hit {}", show(*v)),
            other => format!("{other:?}"),
        };
        write!(
            f,
            "[{:>10.3} ms .. {:>10.3} ms] worker {} key {}: {what} -> {res}",
            ms(self.invoked),
            ms(self.completed),
            self.worker,
            self.key
        )
    }
}

/// A value as `worker.sequence`.
fn show(value: u64) -> String {
    format!("{}.{}", value >> 32, value & 0xffff_ffff)
}

/// One anomaly: what kind, the get that saw it, and the operations that prove it.
#[derive(Debug)]
struct Anomaly {
    kind: &'static str,
    get: Op,
    related: Vec<Op>,
}

/// The counts of a checked history.
#[derive(Debug, Default)]
struct Report {
    ops: usize,
    keys: usize,
    puts_ok: usize,
    puts_refused: usize,
    puts_failed: usize,
    gets_hit: usize,
    gets_miss: usize,
    gets_failed: usize,
    invalidates_ok: usize,
    invalidates_failed: usize,
    /// Each failed operation's kind and error.
    errors: Vec<String>,
    anomalies: Vec<Anomaly>,
}

impl Report {
    /// Anomalies by kind.
    fn by_kind(&self) -> Vec<(&'static str, usize)> {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        for a in &self.anomalies {
            match counts.iter_mut().find(|(k, _)| *k == a.kind) {
                Some((_, n)) => *n += 1,
                None => counts.push((a.kind, 1)),
            }
        }
        counts
    }
}

/// Whether `op` certainly replaced the key's page when it took effect: an acknowledged
/// put, a refused put (the older page goes too) or an acknowledged invalidation.
fn overwrites(op: &Op) -> bool {
    matches!((op.kind, &op.res), (Kind::Put, Res::Ok | Res::Refused) | (Kind::Invalidate, Res::Ok))
}

/// Whether `op` may have left the key empty: an invalidation (acknowledged or not), a
/// refused put, a put that failed (its caller must treat the page as not stored, and
/// the older page may be gone).
fn may_empty(op: &Op) -> bool {
    match op.kind {
        Kind::Invalidate => true,
        Kind::Put => matches!(op.res, Res::Refused | Res::Error(_)),
        Kind::Get => false,
    }
}

/// Checks a history key by key, each key a register with invalidation. Every operation
/// takes effect at one moment between its invocation and its completion; an operation
/// that failed (an error) may have taken effect or not. A get that returned a page must
/// have got:
///
/// * a page stamped for its key, whole (else `corrupt page`);
/// * a value some put wrote (else `value never written`), whose put was invoked before
///   the get completed (else `read from the future`);
/// * not the value of a put that was refused and completed before the get was invoked
///   (`refused put read back`: a refused put keeps no copy);
/// * not a value certainly overwritten: no acknowledged put, refused put or acknowledged
///   invalidation was invoked after the value's put completed and completed before the
///   get was invoked (else `stale read`).
///
/// A get that missed is a `lost acknowledged put` when an acknowledged put completed
/// before the get was invoked and no operation that may empty the key (an invalidation,
/// a refused or failed put) could have taken effect between that put and the get, i.e.
/// none completed after the put was invoked and was invoked before the get completed.
/// A put of the key in flight during the get changes nothing: the get must see the old
/// page or the new one (`miss during a put`). A get that failed is counted and checks
/// nothing.
fn check(history: &[Op]) -> Report {
    let mut report = Report { ops: history.len(), ..Report::default() };
    let mut writers: HashMap<u64, &Op> = HashMap::new();
    for op in history.iter().filter(|op| op.kind == Kind::Put) {
        writers.insert(op.value, op);
    }
    let mut by_key: HashMap<u64, Vec<&Op>> = HashMap::new();
    for op in history {
        by_key.entry(op.key).or_default().push(op);
        if let Res::Error(err) = &op.res {
            report.errors.push(format!("{:?}: {err}", op.kind));
        }
        match (op.kind, &op.res) {
            (Kind::Put, Res::Ok) => report.puts_ok += 1,
            (Kind::Put, Res::Refused) => report.puts_refused += 1,
            (Kind::Put, _) => report.puts_failed += 1,
            (Kind::Get, Res::Hit(_) | Res::Corrupt(_)) => report.gets_hit += 1,
            (Kind::Get, Res::Miss) => report.gets_miss += 1,
            (Kind::Get, _) => report.gets_failed += 1,
            (Kind::Invalidate, Res::Ok) => report.invalidates_ok += 1,
            (Kind::Invalidate, _) => report.invalidates_failed += 1,
        }
    }
    report.keys = by_key.len();
    let mut keys: Vec<u64> = by_key.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let ops = by_key.get_mut(&key).unwrap();
        ops.sort_by_key(|op| op.invoked);
        // The longest operation bounds how far back a scan must look.
        let longest = ops.iter().map(|op| op.completed - op.invoked).max().unwrap_or(0);
        for get in ops.iter().filter(|op| op.kind == Kind::Get) {
            if let Some(found) = check_get(ops, longest, &writers, get) {
                report.anomalies.push(found);
            }
        }
    }
    report.anomalies.sort_by_key(|a| a.get.invoked);
    report
}

/// The anomaly `get` shows, if any; `ops` are its key's operations by invocation.
fn check_get(ops: &[&Op], longest: u64, writers: &HashMap<u64, &Op>, get: &Op) -> Option<Anomaly> {
    let anomaly = |kind, related: Vec<&Op>| Anomaly {
        kind,
        get: get.clone(),
        related: related.into_iter().cloned().collect(),
    };
    match &get.res {
        Res::Corrupt(_) => Some(anomaly("corrupt page", Vec::new())),
        Res::Hit(value) => {
            let Some(put) = writers.get(value).copied() else {
                return Some(anomaly("value never written", Vec::new()));
            };
            if put.key != get.key {
                return Some(anomaly("page of another key", vec![put]));
            }
            if put.invoked > get.completed {
                return Some(anomaly("read from the future", vec![put]));
            }
            if put.res == Res::Refused && put.completed < get.invoked {
                return Some(anomaly("refused put read back", vec![put]));
            }
            let from = ops.partition_point(|op| op.invoked <= put.completed);
            let newer = ops[from..]
                .iter()
                .take_while(|op| op.invoked < get.invoked)
                .find(|op| overwrites(op) && op.completed < get.invoked);
            newer.map(|newer| anomaly("stale read", vec![put, newer]))
        }
        Res::Miss => {
            // The acknowledged put completed before the get that was invoked last.
            let before = ops.partition_point(|op| op.invoked < get.invoked);
            let mut last: Option<&Op> = None;
            for op in ops[..before].iter().rev() {
                if last.is_some_and(|p| op.invoked < p.invoked) {
                    break;
                }
                if op.kind == Kind::Put && op.res == Res::Ok && op.completed < get.invoked {
                    last = Some(op);
                }
            }
            let put = last?;
            let from = ops.partition_point(|op| op.invoked + longest < put.invoked);
            let window: Vec<&Op> = ops[from..]
                .iter()
                .copied()
                .take_while(|op| op.invoked < get.completed)
                .filter(|op| !std::ptr::eq(*op, put))
                .collect();
            let emptied = window.iter().any(|op| may_empty(op) && op.completed > put.invoked);
            if emptied {
                return None;
            }
            // A put of the key in flight during the get: the get had to see the old page
            // or the new one.
            let during =
                window.iter().find(|op| op.kind == Kind::Put && op.completed > get.invoked);
            if let Some(during) = during {
                return Some(anomaly("miss during a put", vec![put, during]));
            }
            Some({
                let mut related = vec![put];
                related.extend(window.iter().filter(|op| op.completed > put.invoked));
                anomaly("lost acknowledged put", related)
            })
        }
        Res::Ok | Res::Refused | Res::Error(_) => None,
    }
}

/// The report as lines: the counts, the anomalies by kind, the first few in full.
fn describe(report: &Report) -> Vec<String> {
    let mut lines = vec![format!(
        "history: {} operations on {} keys: puts {} stored, {} refused, {} failed; \
         gets {} hit, {} missed, {} failed; \
         invalidations {} ok, {} failed; anomalies {}",
        report.ops,
        report.keys,
        report.puts_ok,
        report.puts_refused,
        report.puts_failed,
        report.gets_hit,
        report.gets_miss,
        report.gets_failed,
        report.invalidates_ok,
        report.invalidates_failed,
        report.anomalies.len()
    )];
    let mut errors: Vec<(String, usize)> = Vec::new();
    for a in &report.errors {
        match errors.iter_mut().find(|(e, _)| e == a) {
            Some((_, n)) => *n += 1,
            None => errors.push((a.clone(), 1)),
        }
    }
    for (error, n) in errors {
        lines.push(format!("history: failed operations: {n} x `{error}`"));
    }
    for (kind, n) in report.by_kind() {
        lines.push(format!("history: anomaly kind `{kind}`: {n}"));
    }
    for a in report.anomalies.iter().take(SHOWN) {
        lines.push(format!("history: ANOMALY {}: {}", a.kind, a.get));
        for op in &a.related {
            lines.push(format!("history:     {op}"));
        }
    }
    lines
}

/// A put's page: 32-byte records of (a magic word, the key, the value, the three
/// mixed), repeated, so that a page torn, from another key or from nowhere is caught.
fn stamped_page(key: u64, value: u64) -> Vec<u8> {
    let words = [0xfa11_0e57_0000_0001u64, key, value, key.rotate_left(29) ^ value];
    let record: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    record.iter().copied().cycle().take(fallow_core::PAGE_SIZE).collect()
}

/// The value a page read from `key` holds, or why it is not a page a put wrote there.
fn read_stamp(key: u64, page: &[u8]) -> Result<u64, String> {
    let word = |i: usize| u64::from_le_bytes(page[i * 8..i * 8 + 8].try_into().unwrap());
    let value = word(2);
    if page.len() != fallow_core::PAGE_SIZE || page != stamped_page(key, value).as_slice() {
        return Err(format!(
            "not a stamped page of key {key}: words {:x} {} {} {:x}",
            word(0),
            word(1),
            show(value),
            word(3)
        ));
    }
    Ok(value)
}

// ---- the helper: workers recording a history ---------------------------------------

/// One worker: operations on random keys until `stop`, each appended to `history`.
async fn worker(
    id: u64,
    cluster: fallow_client::ClusterClient,
    pool: fallow_core::PoolId,
    start: Instant,
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<Vec<Op>>>,
) {
    use fallow_core::{PageKey, PutOutcome};
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (id + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    let now = || start.elapsed().as_nanos() as u64;
    // Beyond the client's own timeouts, so an operation never hangs the run.
    let bound = Duration::from_secs(20);
    let mut seq = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let key = rng.below(KEYS);
        let page_key = PageKey::new(pool, 7, key);
        let roll = rng.below(100);
        let kind = match roll {
            0..=44 => Kind::Put,
            45..=89 => Kind::Get,
            _ => Kind::Invalidate,
        };
        let mut value = 0;
        let invoked = now();
        let res = match kind {
            Kind::Put => {
                seq += 1;
                value = id << 32 | seq;
                let page = bytes::Bytes::from(stamped_page(key, value));
                match tokio::time::timeout(bound, cluster.put_many(&[page_key], page)).await {
                    Ok(Ok(out)) if out == [PutOutcome::Stored] => Res::Ok,
                    Ok(Ok(out)) if matches!(out[..], [PutOutcome::NotStored(_)]) => Res::Refused,
                    Ok(Ok(out)) => Res::Error(format!("outcomes {out:?}")),
                    Ok(Err(err)) => Res::Error(err.to_string()),
                    Err(_) => Res::Error("no answer within 20 s".to_string()),
                }
            }
            Kind::Get => match tokio::time::timeout(bound, cluster.get_many(&[page_key])).await {
                Ok(Ok(mut got)) => match got.pop().flatten() {
                    Some(page) => match read_stamp(key, &page) {
                        Ok(v) => Res::Hit(v),
                        Err(why) => Res::Corrupt(why),
                    },
                    None => Res::Miss,
                },
                Ok(Err(err)) => Res::Error(err.to_string()),
                Err(_) => Res::Error("no answer within 20 s".to_string()),
            },
            Kind::Invalidate => {
                match tokio::time::timeout(bound, cluster.invalidate_pages(&[page_key])).await {
                    Ok(Ok(())) => Res::Ok,
                    Ok(Err(err)) => Res::Error(err.to_string()),
                    Err(_) => Res::Error("no answer within 20 s".to_string()),
                }
            }
        };
        let op = Op { worker: id, key, kind, value, invoked, completed: now(), res };
        history.lock().unwrap().push(op);
        // A little think time, so that the history stays a few thousand operations a
        // minute per worker and the checker's scans short.
        tokio::time::sleep(Duration::from_micros(rng.below(4000))).await;
    }
}

/// The helper of the history tests, run by them (this same test binary, with
/// FALLOW_HISTORY_SEEDS set, inside the client namespace): creates a persistent pool,
/// says `ready`, runs the workers until a line arrives on stdin, then checks the history
/// and prints the report (`history: …` lines). Without FALLOW_HISTORY_SEEDS it does
/// nothing.
#[test]
#[ignore = "a helper that the history tests run, in the client namespace"]
fn history_helper() {
    let Ok(seeds) = std::env::var("FALLOW_HISTORY_SEEDS") else {
        eprintln!("not run: only the history tests run this helper");
        return;
    };
    // FALLOW_HISTORY_LOG=FILTER (e.g. `fallow_client=debug`) logs the client's view of the
    // cluster, with times since the workers began, to match an anomaly's.
    if let Ok(filter) = std::env::var("FALLOW_HISTORY_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_timer(tracing_subscriber::fmt::time::uptime())
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let history = Arc::new(Mutex::new(Vec::new()));
    runtime.block_on(async {
        use fallow_client::{ClusterClient, ClusterClientConfig};
        let config = ClusterClientConfig::new(&seeds, SECRET)
            .unwrap()
            .per_node(|c| c.timeout(Duration::from_secs(1)));
        let cluster = ClusterClient::connect(config).await.unwrap();
        assert_eq!(cluster.nodes().len(), 3, "{:#?}", cluster.nodes());
        let pool = cluster.create_pool(&fallow_core::PoolSpec::persistent()).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        tracing::info!("the workers begin: operation times count from here");
        let workers: Vec<_> = (0..WORKERS)
            .map(|id| {
                let (c, s, h) = (cluster.clone(), stop.clone(), history.clone());
                tokio::spawn(worker(id, c, pool, start, s, h))
            })
            .collect();
        eprintln!("helper: ready, {WORKERS} workers on {KEYS} keys");
        let line = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line).map(|_| line)
        });
        let _ = line.await;
        stop.store(true, Ordering::SeqCst);
        for w in workers {
            w.await.unwrap();
        }
        eprintln!(
            "helper: stopped; replication {:?}; dedup {:?}",
            cluster.replication(),
            cluster.dedup()
        );
    });
    let history = std::mem::take(&mut *history.lock().unwrap());
    let report = check(&history);
    for line in describe(&report) {
        eprintln!("{line}");
    }
    eprintln!("helper: anomalies={}", report.anomalies.len());
}

// ---- the test: a cluster, faults in rounds ----------------------------------------

/// Where the processes run.
enum Net {
    /// Everything in the root namespace, on 127.0.0.1.
    Loopback,
    /// Hosts `a`, `b`, `c` and `client`, each in its own namespace.
    Netns(Lab),
}

impl Net {
    /// A command that runs `program` on `host`: `ip netns exec NETNS PROGRAM` in a lab.
    fn command(&self, host: &str, program: &str) -> Command {
        match self {
            Net::Loopback => Command::new(program),
            Net::Netns(lab) => lab.command(host, program),
        }
    }
}

/// A directory under /dev/shm (else the temporary directory), removed when dropped.
struct ShmDir(PathBuf);

impl ShmDir {
    fn new(name: &str) -> ShmDir {
        let base = match std::path::Path::new("/dev/shm").is_dir() {
            true => PathBuf::from("/dev/shm"),
            false => std::env::temp_dir(),
        };
        let path = base.join(format!("fallow-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        ShmDir(path)
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The faults a round applies.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Kill,
    Pause,
    Partition,
}

/// Three gossiping nodes with state directories. Fields drop in order: the nodes are
/// stopped before the namespaces go.
struct Nodes {
    nodes: Vec<Option<Daemon>>,
    listen: Vec<String>,
    gossip: Vec<String>,
    state: ShmDir,
    /// The scratch directory, with the secret file.
    dir: TempDir,
    net: Net,
}

impl Nodes {
    fn start(net: Net, tag: &str) -> Nodes {
        let dir = TempDir::new(&format!("history-{tag}"));
        let state = ShmDir::new(&format!("history-{tag}"));
        std::fs::write(dir.path().join("secret"), format!("{SECRET}\n")).unwrap();
        let (listen, gossip) = NODES
            .iter()
            .map(|name| match &net {
                Net::Netns(lab) => {
                    let ip = lab.host(name).ip;
                    (format!("{ip}:{NODE_PORT}"), format!("{ip}:{}", NODE_PORT + 1))
                }
                Net::Loopback => {
                    let udp = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
                    (format!("127.0.0.1:{}", free_port()), udp.to_string())
                }
            })
            .unzip();
        let mut nodes = Nodes { nodes: Vec::new(), listen, gossip, state, dir, net };
        for i in 0..NODES.len() {
            let node = nodes.spawn_node(i);
            nodes.nodes.push(Some(node));
        }
        nodes.wait_healthy("three alive members");
        nodes
    }

    /// Starts node `i` on its addresses, over its state directory.
    fn spawn_node(&self, i: usize) -> Daemon {
        let join: Vec<&str> =
            (0..NODES.len()).filter(|j| *j != i).map(|j| self.gossip[j].as_str()).collect();
        let join = join.join(",");
        let state = self.state.0.join(NODES[i]);
        let secret = self.secret();
        let args = [
            "--listen",
            &self.listen[i],
            "--lend",
            "32M",
            "--secret-file",
            secret.to_str().unwrap(),
            "--gossip",
            &self.gossip[i],
            "--join",
            &join,
            "--state-dir",
            state.to_str().unwrap(),
        ];
        support::start_node_with(self.net.command(NODES[i], support::BIN), &args, START).0
    }

    /// The secret file every node and client uses.
    fn secret(&self) -> PathBuf {
        self.dir.path().join("secret")
    }

    fn node(&self, i: usize) -> &Daemon {
        self.nodes[i].as_ref().expect("node not running")
    }

    /// `fallow stat --cluster --json` asked of node `i` from the client host.
    fn members(&self, i: usize) -> Option<Value> {
        let out = self
            .net
            .command("client", support::BIN)
            .args(["stat", "--cluster", "--node", &self.listen[i]])
            .args(["--secret-file", self.secret().to_str().unwrap()])
            .args(["--json", "--timeout", "2"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
    }

    /// Waits until every node answers and sees three alive members; panics after 30 s.
    fn wait_healthy(&self, what: &str) -> Duration {
        let start = Instant::now();
        let mut last = HashMap::new();
        let ok = support::poll_until(Duration::from_secs(30), || {
            (0..NODES.len()).all(|i| {
                let list = self.members(i);
                let ok = list.as_ref().is_some_and(|l| l["alive"] == 3);
                last.insert(i, list);
                ok
            })
        });
        assert!(ok, "{what}: not within 30 s; the last answers: {last:#?}");
        start.elapsed()
    }

    /// Applies `fault` to node `i`.
    fn hurt(&mut self, fault: Fault, i: usize) {
        match fault {
            Fault::Kill => self.nodes[i].take().expect("node not running").kill(),
            Fault::Pause => assert!(self.node(i).signal("STOP").success()),
            Fault::Partition => {
                let Net::Netns(lab) = &self.net else { panic!("a partition needs namespaces") };
                let others: Vec<String> = ["a", "b", "c", "client"]
                    .iter()
                    .filter(|h| **h != NODES[i])
                    .map(|h| lab.host(h).ip.to_string())
                    .collect();
                let set = others.join(", ");
                let chain = |name: &str, dir: &str| {
                    format!(
                        "\tchain {name} {{\n\t\ttype filter hook {name} priority 0; \
                         policy accept;\n\t\tip {dir} {{ {set} }} counter drop\n\t}}\n"
                    )
                };
                let rules = format!(
                    "table inet {PARTITION} {{\n{}{}}}\n",
                    chain("input", "saddr"),
                    chain("output", "daddr")
                );
                lab.nft(NODES[i], &rules).unwrap();
            }
        }
    }

    /// Undoes `fault` on node `i`.
    fn heal(&mut self, fault: Fault, i: usize) {
        match fault {
            Fault::Kill => {
                let node = self.spawn_node(i);
                self.nodes[i] = Some(node);
            }
            Fault::Pause => assert!(self.node(i).signal("CONT").success()),
            Fault::Partition => {
                let Net::Netns(lab) = &self.net else { unreachable!() };
                let listing = lab.nft(NODES[i], &format!("list table inet {PARTITION}\n")).unwrap();
                assert!(!listing.contains("counter packets 0 "), "nothing dropped:\n{listing}");
                lab.nft(NODES[i], &format!("delete table inet {PARTITION}\n")).unwrap();
            }
        }
    }
}

/// The number of fault rounds: FALLOW_HISTORY_ROUNDS, else [`DEFAULT_ROUNDS`].
fn rounds() -> usize {
    std::env::var("FALLOW_HISTORY_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(DEFAULT_ROUNDS)
}

/// Runs the helper against the nodes through `rounds` faults (kinds from `faults` in
/// turn, on a, b and c in turn), then asserts that its history has no anomaly.
fn history_under_faults(net: Net, tag: &str, faults: &[Fault]) {
    let rounds = rounds();
    let started = Instant::now();
    let mut nodes = Nodes::start(net, tag);
    let exe = std::env::current_exe().unwrap();
    let seeds = format!("fallow://{}", nodes.listen.join(","));
    let mut helper = Daemon::spawn(
        "the history helper",
        nodes
            .net
            .command("client", exe.to_str().unwrap())
            .args(["history_helper", "--exact", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("FALLOW_HISTORY_SEEDS", &seeds)
            .env("FALLOW_LOG", "warn")
            .stdin(Stdio::piped()),
    );
    helper.wait_for_line("`ready` line", START, |l| l.strip_prefix("helper: ready").map(drop));
    std::thread::sleep(Duration::from_secs(1));
    let mut applied: HashMap<String, usize> = HashMap::new();
    for round in 0..rounds {
        let fault = faults[round % faults.len()];
        let i = (round + round / faults.len()) % NODES.len();
        assert!(helper.is_running(), "the helper exited:\n{}", helper.log_so_far());
        nodes.hurt(fault, i);
        std::thread::sleep(HOLD);
        nodes.heal(fault, i);
        let took = nodes.wait_healthy(&format!("round {round}: healthy after {fault:?}"));
        println!("round {round}: {fault:?} node {} for {HOLD:?}, healthy {took:?} later", NODES[i]);
        *applied.entry(format!("{fault:?}")).or_default() += 1;
        // Let the client see the node again (and repair) before the next round hurts one.
        std::thread::sleep(Duration::from_secs(1));
    }
    let mut stdin = helper.child().stdin.take().unwrap();
    writeln!(stdin, "stop").unwrap();
    drop(stdin);
    let anomalies: usize = helper.wait_for_line("the report", Duration::from_secs(120), |l| {
        l.strip_prefix("helper: anomalies=").and_then(|n| n.trim().parse().ok())
    });
    let status = helper.wait_timeout(Duration::from_secs(20));
    let log = helper.log_so_far();
    for line in log.lines().filter(|l| l.starts_with("history:") || l.starts_with("helper:")) {
        println!("{line}");
    }
    println!(
        "fault rounds: {rounds} ({applied:?}), {} nodes, whole run {:?}",
        NODES.len(),
        started.elapsed()
    );
    assert!(status.is_some_and(|s| s.success()), "the helper: {status:?}\n{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(anomalies, 0, "the history has anomalies:\n{log}");
}

#[test]
fn netns_persistent_history_under_kills_pauses_and_partitions() {
    if !support::have("nft") {
        eprintln!("skipped: nft is not installed (Debian package nftables)");
        return;
    }
    match Lab::new("hist", 6, &["a", "b", "c", "client"]) {
        Ok(lab) => history_under_faults(
            Net::Netns(lab),
            "netns",
            &[Fault::Kill, Fault::Pause, Fault::Partition],
        ),
        Err(reason) => eprintln!("skipped: no network namespaces here: {reason}"),
    }
}

#[test]
fn loopback_persistent_history_under_kills_and_pauses() {
    history_under_faults(Net::Loopback, "loopback", &[Fault::Kill, Fault::Pause]);
}

// ---- the checker on histories made up -----------------------------------------------

/// An operation of a made-up history on key 0.
fn op(kind: Kind, value: u64, invoked: u64, completed: u64, res: Res) -> Op {
    Op { worker: 0, key: 0, kind, value, invoked, completed, res }
}

#[test]
fn the_checker_accepts_a_linearizable_history_with_indeterminate_operations() {
    let history = vec![
        op(Kind::Put, 1, 0, 10, Res::Ok),
        op(Kind::Get, 0, 11, 12, Res::Hit(1)),
        // A get concurrent with the put of 2 may see either value.
        op(Kind::Put, 2, 20, 30, Res::Ok),
        op(Kind::Get, 0, 21, 22, Res::Hit(1)),
        op(Kind::Get, 0, 25, 26, Res::Hit(2)),
        // A failed put may have been applied; a failed invalidation may have emptied it.
        op(Kind::Put, 3, 40, 50, Res::Error("timeout".into())),
        op(Kind::Get, 0, 51, 52, Res::Hit(3)),
        op(Kind::Invalidate, 0, 60, 70, Res::Error("gone".into())),
        op(Kind::Get, 0, 71, 72, Res::Miss),
        // A refused put leaves nothing.
        op(Kind::Put, 4, 80, 90, Res::Ok),
        op(Kind::Put, 5, 91, 95, Res::Refused),
        op(Kind::Get, 0, 96, 97, Res::Miss),
    ];
    let report = check(&history);
    assert!(report.anomalies.is_empty(), "{:#?}", report.anomalies);
    assert_eq!((report.ops, report.puts_ok, report.gets_miss), (12, 3, 2));
}

#[test]
fn the_checker_finds_stale_reads_lost_puts_and_values_never_written() {
    let history = vec![
        op(Kind::Put, 1, 0, 10, Res::Ok),
        op(Kind::Put, 2, 20, 30, Res::Ok),
        op(Kind::Get, 0, 31, 32, Res::Hit(1)),
        op(Kind::Get, 0, 33, 34, Res::Miss),
        op(Kind::Get, 0, 35, 36, Res::Hit(9)),
        op(Kind::Put, 3, 40, 50, Res::Refused),
        op(Kind::Get, 0, 51, 52, Res::Hit(3)),
        op(Kind::Get, 0, 53, 54, Res::Corrupt("torn".into())),
        op(Kind::Invalidate, 0, 60, 61, Res::Ok),
        op(Kind::Get, 0, 62, 63, Res::Hit(2)),
        op(Kind::Get, 0, 64, 65, Res::Hit(7)),
        op(Kind::Put, 7, 70, 80, Res::Ok),
        // A put in flight does not excuse a miss: the get sees the old page or the new.
        op(Kind::Put, 10, 100, 110, Res::Ok),
        op(Kind::Put, 11, 120, 130, Res::Ok),
        op(Kind::Get, 0, 121, 122, Res::Miss),
    ];
    let report = check(&history);
    let kinds: Vec<&str> = report.anomalies.iter().map(|a| a.kind).collect();
    assert_eq!(
        kinds,
        [
            "stale read",
            "lost acknowledged put",
            "value never written",
            "refused put read back",
            "corrupt page",
            "stale read",
            "read from the future",
            "miss during a put"
        ]
    );
    assert!(describe(&report).iter().any(|l| l.contains("anomalies 8")));
}
