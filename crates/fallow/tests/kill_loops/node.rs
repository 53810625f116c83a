//! `fallow node --state-dir` killed under clients that put, take and invalidate
//! persistent pages: every key checked after each restart.

use super::*;

pub(super) const NODE_SECRET: &str = "kill-loop-node-secret-0123456789";
/// The clients' one id: their pools outlive their connections, and the restarted node's.
const CLIENT: u128 = 0x6b69_6c6c_6c6f_6f70_0000_0000_0000_0031;
/// Client threads, each with an object of its own in the persistent pool.
const WORKERS: u64 = 4;
/// Keys per object.
const KEYS: u64 = 512;

/// Page `index` of `object` at generation `gen`: (object, index, gen, b"kill") as
/// little-endian u32s, repeated; every 16th generation a fill page instead (one 8-byte
/// word repeated, which the node keeps as a fill word, not a frame).
pub(super) fn node_page(object: u64, index: u64, gen: u32) -> Vec<u8> {
    if gen.is_multiple_of(16) {
        let word = (index << 32) | u64::from(gen);
        return word.to_le_bytes().repeat(PAGE_SIZE / 8);
    }
    let mut unit = Vec::with_capacity(16);
    for n in [object as u32, index as u32, gen] {
        unit.extend_from_slice(&n.to_le_bytes());
    }
    unit.extend_from_slice(b"kill");
    unit.repeat(PAGE_SIZE / 16)
}

/// The generation of `bytes` if they are a page of that key, else `None`.
fn generation_of(object: u64, index: u64, bytes: &[u8]) -> Option<u32> {
    let word = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let gen = if word >> 32 == index && (word as u32).is_multiple_of(16) {
        word as u32
    } else {
        u32::from_le_bytes(bytes[8..12].try_into().unwrap())
    };
    (bytes == node_page(object, index, gen)).then_some(gen)
}

/// What a key holds: a page of a generation, or nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Held {
    Page(u32),
    Absent,
}

/// What the node must give for a key: what the last acknowledged request left, or, for
/// a request the kill cut short, what it found or what it would have left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Known(Held),
    Either(Held, Held),
}

impl Expect {
    fn known(self) -> Held {
        match self {
            Expect::Known(held) => held,
            Expect::Either(..) => panic!("a key with a request cut short is used again"),
        }
    }
}

/// Counts of the requests a worker saw acknowledged.
#[derive(Debug, Default, Clone, Copy)]
struct NodeCounts {
    puts: u64,
    invalidations: u64,
    takes: u64,
    gets: u64,
    cut_short: u64,
}

impl std::ops::AddAssign for NodeCounts {
    fn add_assign(&mut self, o: NodeCounts) {
        self.puts += o.puts;
        self.invalidations += o.invalidations;
        self.takes += o.takes;
        self.gets += o.gets;
        self.cut_short += o.cut_short;
    }
}

/// What `got` (a read of key `index` of `object`) is, as a `Held`; panics on a page of
/// another key or generation pattern.
pub(super) fn held_of(object: u64, index: u64, got: Option<&Bytes>, context: &str) -> Held {
    match got {
        None => Held::Absent,
        Some(bytes) => match generation_of(object, index, bytes) {
            Some(gen) => Held::Page(gen),
            None => panic!("{context}: key {object}/{index} holds bytes never put under it"),
        },
    }
}

fn node_config(addr: &str) -> ClientConfig {
    ClientConfig::new(addr, NODE_SECRET).unwrap().client_id(CLIENT)
}

/// A request of a node worker.
#[derive(Debug, Clone)]
enum NodeOp {
    /// Puts of these generations.
    Put(Vec<u32>),
    Get,
    Take,
    Invalidate,
    InvalidateObject,
}

/// One client thread's load on object `object` (keys `0..KEYS`, whose expectations are
/// `expect`) until a request fails, which must come after `killed` is set: puts of one
/// and of up to 64 pages, gets, takes, invalidations of one and of several pages and, now
/// and then, of the whole object; each read is checked against `expect` as it goes.
/// Returns the expectations, those the failed request touched made `Either`.
#[allow(clippy::too_many_arguments)]
fn node_worker(
    addr: String,
    pool: PoolId,
    object: u64,
    mut expect: Vec<Expect>,
    gen: Arc<AtomicU32>,
    killed: Arc<AtomicBool>,
    seed: u64,
    context: String,
) -> (Vec<Expect>, NodeCounts) {
    let mut rng = Rng(seed | 1);
    let mut counts = NodeCounts::default();
    let client = match BlockingClient::connect(node_config(&addr)) {
        Ok(client) => client,
        // Killed before this thread connected: nothing was sent.
        Err(_) if killed.load(Ordering::SeqCst) => return (expect, counts),
        Err(err) => panic!("{context}: connecting failed before the kill: {err}"),
    };
    let c = client.client();
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < LOAD_LIMIT, "{context}: the kill never ended the load");
        let first = rng.below(KEYS);
        let (op, span) = match rng.below(1000) {
            0..300 => (NodeOp::Put(Vec::new()), 1),
            300..550 => (NodeOp::Put(Vec::new()), 2 + rng.below(63)),
            550..700 => (NodeOp::Get, 1 + rng.below(32)),
            700..800 => (NodeOp::Invalidate, 1),
            800..860 => (NodeOp::Invalidate, 2 + rng.below(7)),
            860..999 => (NodeOp::Take, 1),
            _ => (NodeOp::InvalidateObject, KEYS),
        };
        let keys: Vec<u64> = match op {
            NodeOp::InvalidateObject => (0..KEYS).collect(),
            _ => (first..(first + span).min(KEYS)).collect(),
        };
        let op = match op {
            NodeOp::Put(_) => {
                NodeOp::Put(keys.iter().map(|_| gen.fetch_add(1, Ordering::Relaxed) + 1).collect())
            }
            other => other,
        };
        let page_keys: Vec<PageKey> = keys.iter().map(|&i| PageKey::new(pool, object, i)).collect();
        let before: Vec<Held> = keys.iter().map(|&i| expect[i as usize].known()).collect();
        // What the request leaves if it is done whole; `None` for a read.
        let whole: Option<Vec<Held>> = match &op {
            NodeOp::Put(gens) => Some(gens.iter().map(|&g| Held::Page(g)).collect()),
            NodeOp::Get => None,
            _ => Some(vec![Held::Absent; keys.len()]),
        };
        let check = |got: &[Option<Bytes>]| {
            for ((&i, g), b) in keys.iter().zip(got).zip(&before) {
                let held = held_of(object, i, g.as_ref(), &context);
                assert_eq!(held, *b, "{context}: {op:?} read key {object}/{i}");
            }
        };
        let result: Result<Vec<Held>, fallow_client::ClientError> = match &op {
            NodeOp::Put(gens) => {
                let data: Vec<u8> =
                    keys.iter().zip(gens).flat_map(|(&i, &g)| node_page(object, i, g)).collect();
                client.block_on(c.put_many(&page_keys, Bytes::from(data))).map(|outcomes| {
                    counts.puts += keys.len() as u64;
                    let left = outcomes.iter().zip(gens).map(|(o, &g)| match o {
                        PutOutcome::Stored => Held::Page(g),
                        // A refused put leaves no older page behind.
                        PutOutcome::NotStored(_) => Held::Absent,
                    });
                    left.collect()
                })
            }
            NodeOp::Get => client.block_on(c.get_many(&page_keys)).map(|got| {
                check(&got);
                counts.gets += keys.len() as u64;
                before.clone()
            }),
            NodeOp::Take => client.block_on(c.take(page_keys[0])).map(|got| {
                check(&[got]);
                counts.takes += 1;
                vec![Held::Absent]
            }),
            NodeOp::Invalidate => client.block_on(c.invalidate_pages(&page_keys)).map(|()| {
                counts.invalidations += keys.len() as u64;
                vec![Held::Absent; keys.len()]
            }),
            NodeOp::InvalidateObject => {
                client.block_on(c.invalidate_object(pool, object)).map(|_| {
                    counts.invalidations += keys.len() as u64;
                    vec![Held::Absent; keys.len()]
                })
            }
        };
        match result {
            Ok(left) => {
                for (&i, held) in keys.iter().zip(left) {
                    expect[i as usize] = Expect::Known(held);
                }
            }
            Err(err) => {
                assert!(killed.load(Ordering::SeqCst), "{context}: {op:?} failed: {err}");
                // Cut short by the kill: done or not, page by page.
                if let Some(whole) = whole {
                    for ((&i, b), w) in keys.iter().zip(before).zip(whole) {
                        expect[i as usize] = Expect::Either(b, w);
                    }
                }
                counts.cut_short += 1;
                return (expect, counts);
            }
        }
    }
}

/// The value of the unlabelled metric `name` in `text`, 0 if absent.
fn plain_metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// What a node kill-loop check counts.
#[derive(Debug, Default)]
struct NodeCheck {
    /// Keys that must hold the page last put.
    pages: u64,
    /// Keys that must be absent (invalidated, taken, or never put).
    absent: u64,
    /// Keys a request cut short left either way.
    either: u64,
}

/// Reads every key of the persistent pool through a new connection with the clients' id
/// and checks it against `expect`, which it then makes what was read; checks the node id
/// and that both pools are still there under their ids.
fn check_node(
    addr: &str,
    pools: (PoolId, PoolId),
    id: u128,
    expect: &mut [Vec<Expect>],
    context: &str,
) -> NodeCheck {
    let (persistent, ephemeral) = pools;
    let client = BlockingClient::connect(node_config(addr)).unwrap();
    let c = client.client();
    assert_eq!(client.block_on(c.node_id()).unwrap(), id, "{context}: the node id changed");
    let probe = [PageKey::new(ephemeral, 0, 0)];
    client
        .block_on(c.get_many(&probe))
        .unwrap_or_else(|err| panic!("{context}: the ephemeral pool is gone: {err}"));
    let mut check = NodeCheck::default();
    let mut wrong = Vec::new();
    for (w, expect) in expect.iter_mut().enumerate() {
        let object = w as u64 + 1;
        let keys: Vec<PageKey> = (0..KEYS).map(|i| PageKey::new(persistent, object, i)).collect();
        let got = client
            .block_on(c.get_many(&keys))
            .unwrap_or_else(|err| panic!("{context}: the persistent pool is gone: {err}"));
        for (i, g) in got.iter().enumerate() {
            let held = held_of(object, i as u64, g.as_ref(), context);
            let fine = match expect[i] {
                Expect::Known(h) => {
                    match h {
                        Held::Page(_) => check.pages += 1,
                        Held::Absent => check.absent += 1,
                    }
                    h == held
                }
                Expect::Either(a, b) => {
                    check.either += 1;
                    held == a || held == b
                }
            };
            if !fine {
                wrong.push(format!("{object}/{i}: expected {:?}, holds {held:?}", expect[i]));
            }
            expect[i] = Expect::Known(held);
        }
    }
    assert!(wrong.is_empty(), "{context}: after the restart: {wrong:#?}");
    check
}

#[test]
fn a_node_comes_back_with_every_acknowledged_persistent_page() {
    let seed = seed();
    let mut rng = Rng(seed);
    let dir = ShmDir::new("kill-node");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, NODE_SECRET).unwrap();
    let state = dir.path().join("state");
    let listen = format!("127.0.0.1:{}", support::free_port());
    let args: Vec<String> = [
        "--listen",
        &listen,
        "--lend",
        "64M",
        "--secret-file",
        secret.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
        "--metrics",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // A start, and how long it took to serve.
    let start = || {
        let t = Instant::now();
        (support::start_node(&args, START).0, t.elapsed())
    };

    let started = Instant::now();
    let (mut node, mut took) = start();
    let client = BlockingClient::connect(node_config(&listen)).unwrap();
    let c = client.client();
    let persistent = client.block_on(c.create_pool(&PoolSpec::persistent())).unwrap();
    let ephemeral = client.block_on(c.create_pool(&PoolSpec::ephemeral())).unwrap();
    let id = client.block_on(c.node_id()).unwrap();
    drop(client);

    let mut expect = vec![vec![Expect::Known(Held::Absent); KEYS as usize]; WORKERS as usize];
    let gen = Arc::new(AtomicU32::new(0));
    let mut counts = NodeCounts::default();
    let mut checked = NodeCheck::default();
    let (mut records, mut compactions, mut replayed) = (0, 0, 0);
    let (mut recovery_kills, mut mid_replay) = (0, 0);
    for i in 0..iterations() {
        let context = format!("node, seed {seed}, iteration {i}");
        let killed = Arc::new(AtomicBool::new(false));
        let metrics = node.log_lines().iter().find_map(|l| support::metrics_addr(l)).unwrap();
        // Every fifth iteration runs long enough for the journals to compact.
        let delay = if i % 5 == 4 { 2000 + rng.below(4000) } else { rng.below(1000) };
        let delay = Duration::from_millis(delay);
        let killer = Killer::after(node.pid(), delay, killed.clone(), move || {
            let text = support::scrape(&metrics);
            let records = plain_metric(&text, "fallow_node_journal_records_total");
            (records, plain_metric(&text, "fallow_node_journal_compactions_total"))
        });
        let workers: Vec<_> = (0..WORKERS)
            .zip(std::mem::take(&mut expect))
            .map(|(w, keys)| {
                let (addr, gen, killed) = (listen.clone(), gen.clone(), killed.clone());
                let (worker_seed, context) = (rng.below(u64::MAX), context.clone());
                std::thread::spawn(move || {
                    node_worker(addr, persistent, w + 1, keys, gen, killed, worker_seed, context)
                })
            })
            .collect();
        for worker in workers {
            let (keys, seen) = worker.join().unwrap();
            expect.push(keys);
            counts += seen;
        }
        let (r, c) = killer.join();
        records += r;
        compactions += c;
        node.wait_timeout(START).expect("the killed node is reaped");

        // One restart in four is killed while it recovers (or just after): at a moment
        // up to 1.2 times as long as the last start took.
        if rng.below(4) == 0 {
            let mut early = Daemon::spawn(
                "fallow node, killed while it recovers",
                support::fallow()
                    .arg("node")
                    .args(&args)
                    .env("FALLOW_LOG", "info")
                    .stdin(Stdio::null()),
            );
            std::thread::sleep(rng.up_to_ms(took.as_millis() as u64 * 6 / 5));
            early.kill();
            recovery_kills += 1;
            // Killed between setting the old journal aside and removing it: mid-replay.
            mid_replay += u32::from(state.join("journal.replay").exists());
        }
        (node, took) = start();
        let log = node.log_so_far();
        let line = log
            .lines()
            .find(|l| l.contains("restored the state and the journaled persistent pages"))
            .unwrap_or_else(|| panic!("{context}: no recovery in the log:\n{log}"));
        let pages = line.split_once(" pages=").and_then(|(_, r)| r.split(' ').next());
        replayed += pages.and_then(|p| p.parse::<u64>().ok()).unwrap_or(0);
        let check = check_node(&listen, (persistent, ephemeral), id, &mut expect, &context);
        checked.pages += check.pages;
        checked.absent += check.absent;
        checked.either += check.either;
    }
    node.signal("TERM");
    assert!(node.wait_timeout(START).is_some_and(|s| s.success()), "{}", node.log_so_far());
    println!(
        "kill loop node --state-dir: {} iterations in {:.1} s (seed {seed}); {} more kills \
         while recovering ({} of them mid-replay); acknowledged: {} page puts, {} page \
         invalidations, {} takes, {} page gets (each checked); {} requests cut short by the \
         kill; journal: {} records, {} compactions, {} pages replayed; after restarts: {} \
         keys with an acknowledged page checked, {} absent keys checked, {} keys cut short; \
         node id and pool ids unchanged; lost: 0, stale: 0, come back: 0",
        iterations(),
        started.elapsed().as_secs_f64(),
        recovery_kills,
        mid_replay,
        counts.puts,
        counts.invalidations,
        counts.takes,
        counts.gets,
        counts.cut_short,
        records,
        compactions,
        replayed,
        checked.pages,
        checked.absent,
        checked.either,
    );
    assert!(checked.pages > 0);
}
