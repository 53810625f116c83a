//! `fallow nbd` killed under a client's writes, trims, flushes and reads: the history
//! kept, the checker, and the loops over a file and over a `pool:` export.

use super::*;

/// Pages of the NBD test disks (2 MiB).
const PAGES: u64 = 512;
/// Requests in flight at once.
const IN_FLIGHT: usize = 16;
/// Requests per batch sent to the client coprocess.
const BATCH: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    Through,
    Back,
}

impl Policy {
    fn flag(self) -> &'static str {
        match self {
            Policy::Through => "through",
            Policy::Back => "back",
        }
    }
}

/// What a write-like request put in its pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    /// `stamp(page, gen)` in each page.
    Gen(u32),
    /// Zeros (a trim).
    Zero,
}

/// One write or trim of an iteration: its pages, what it wrote, when it was submitted and
/// seen complete (the client's monotonic nanoseconds), and whether it was acknowledged.
#[derive(Debug, Clone)]
struct Change {
    pages: Range<u64>,
    value: Written,
    fua: bool,
    t0: u64,
    t1: u64,
    ok: bool,
}

/// One iteration's history: changes, FLUSHes (submitted at, acknowledged) and reads.
#[derive(Default)]
struct History {
    changes: Vec<Change>,
    flushes: Vec<(u64, bool)>,
    reads: Vec<(u64, Outcome)>,
}

impl History {
    /// Whether `c` must survive a crash: acknowledged, and written through, with FUA, or
    /// acknowledged before a FLUSH that succeeded was sent.
    fn durable(&self, c: &Change, policy: Policy) -> bool {
        c.ok && (policy == Policy::Through
            || c.fua
            || self.flushes.iter().any(|&(t0, ok)| ok && c.t1 < t0))
    }

    /// The changes of each page.
    fn by_page(&self) -> HashMap<u64, Vec<&Change>> {
        let mut map: HashMap<u64, Vec<&Change>> = HashMap::new();
        for c in &self.changes {
            for p in c.pages.clone() {
                map.entry(p).or_default().push(c);
            }
        }
        map
    }
}

/// What the history says of a page's content.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Written to the page (or held before the iteration), and not replaced since by a
    /// change that must be seen.
    Allowed,
    /// Written to the page, but replaced by a change that must be seen: a lost write, or
    /// a stale read.
    Replaced,
    /// Never written to the page.
    NeverWritten,
}

/// Judges `held`, the content of `page`, which held `base` before the iteration and had
/// `changes`: it must match one of them that `visible` admits (or the base), which no
/// change that `binds` came strictly after (submitted after it was seen complete).
fn judge(
    page: u64,
    held: Content,
    base: Content,
    changes: &[&Change],
    visible: impl Fn(&Change) -> bool,
    binds: impl Fn(&Change) -> bool,
) -> Verdict {
    let is = |c: &Change| match (held, c.value) {
        (Content::Stamp(p, g), Written::Gen(w)) => p == page && g == w,
        (Content::Zero, Written::Zero) => true,
        _ => false,
    };
    let replaced_after =
        |t1: Option<u64>| changes.iter().any(|d| binds(d) && t1.is_none_or(|t1| d.t0 > t1));
    let mut written = false;
    if held == base {
        written = true;
        if !replaced_after(None) {
            return Verdict::Allowed;
        }
    }
    for c in changes.iter().filter(|c| is(c) && visible(c)) {
        written = true;
        if !replaced_after(Some(c.t1)) {
            return Verdict::Allowed;
        }
    }
    if written {
        Verdict::Replaced
    } else {
        Verdict::NeverWritten
    }
}

/// The checker itself: a flushed write that is gone, a page of a generation never written
/// to it and a stale read are caught; an unflushed write in write-back, and a write cut
/// short by the kill, may be there or not; a torn page is allowed only from a read that
/// overlapped a change of the page.
#[test]
fn the_history_checker_catches_lost_writes_and_stale_reads() {
    let change = |value, t0, t1, ok| Change { pages: 0..2, value, fua: false, t0, t1, ok };
    let mut history = History::default();
    history.changes.push(change(Written::Gen(5), 10, 20, true));
    history.flushes.push((30, true));
    history.changes.push(change(Written::Gen(6), 40, 50, true));
    history.changes.push(change(Written::Gen(7), 60, u64::MAX, false));
    let by_page = history.by_page();
    let changes = &by_page[&1];
    let base = Content::Stamp(1, 0);
    let after_restart =
        |held, policy| judge(1, held, base, changes, |_| true, |d| history.durable(d, policy));
    for policy in [Policy::Back, Policy::Through] {
        assert_eq!(after_restart(Content::Stamp(1, 0), policy), Verdict::Replaced, "lost");
        assert_eq!(after_restart(Content::Stamp(1, 6), policy), Verdict::Allowed);
        assert_eq!(after_restart(Content::Stamp(1, 7), policy), Verdict::Allowed, "cut short");
        assert_eq!(after_restart(Content::Stamp(0, 6), policy), Verdict::NeverWritten);
        assert_eq!(after_restart(Content::Zero, policy), Verdict::NeverWritten);
    }
    // Generation 6 was never flushed: write-back may lose it, write-through may not.
    assert_eq!(after_restart(Content::Stamp(1, 5), Policy::Back), Verdict::Allowed);
    assert_eq!(after_restart(Content::Stamp(1, 5), Policy::Through), Verdict::Replaced);
    // A read that began after generation 6 was acknowledged cannot return 5.
    let read = |held, t0, t1| judge(1, held, base, changes, |c| c.t0 < t1, |d| d.ok && d.t1 < t0);
    assert_eq!(read(Content::Stamp(1, 5), 55, 58), Verdict::Replaced);
    assert_eq!(read(Content::Stamp(1, 5), 45, 58), Verdict::Allowed);
    assert_eq!(read(Content::Stamp(1, 6), 15, 45), Verdict::Allowed);
    assert_eq!(read(Content::Stamp(1, 7), 45, 58), Verdict::NeverWritten, "not sent yet");
    // A torn page only from a read that overlapped a change of the page.
    assert!(overlaps_a_change(changes, 45, 58), "6 ended at 50");
    assert!(overlaps_a_change(changes, 59, 61), "7 was cut short");
    assert!(!overlaps_a_change(changes, 51, 58));
    let torn = |stamps: &[u32], t0, t1| Outcome {
        error: None,
        data: Some(Content::Other),
        torn: Some(faulty::Torn {
            stamps: stamps.iter().map(|&g| (1, g, 128)).collect(),
            zeros: 0,
        }),
        t0,
        t1,
    };
    history.reads.push((1, torn(&[5, 6], 45, 58)));
    let mut tally = NbdTally::default();
    check_reads(&[base, base], &history, &mut tally, "a torn read");
    assert_eq!((tally.reads_checked, tally.torn), (1, 1));
}

/// What one NBD kill loop counts.
#[derive(Default)]
struct NbdTally {
    iterations: u32,
    writes: u64,
    trims: u64,
    flushes: u64,
    cut_short: u64,
    durable: u64,
    dirty_at_kill: u32,
    pages_checked: u64,
    reads_checked: u64,
    torn: u64,
}

/// The flags of a start, by policy, some drawn at random.
type StartArgs = Box<dyn Fn(Policy, &mut Rng) -> Vec<String>>;

/// The server under test in an NBD loop: how it is started, what its disk held first.
struct NbdTarget {
    /// What the counts line calls it.
    name: &'static str,
    /// The export's backing, as `--export d=…` takes it.
    backing: String,
    /// Each page's content before the first write.
    initial: fn(u64) -> Content,
    /// The policy of each iteration.
    policy: fn(u32) -> Policy,
    /// The flags of a start besides the export, the socket and the metrics.
    args: StartArgs,
}

/// Starts `fallow nbd` in `dir` for `target`.
fn start_nbd(dir: &Path, target: &NbdTarget, policy: Policy, rng: &mut Rng) -> faulty::Fallow {
    let args = (target.args)(policy, rng);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    faulty::Fallow::start(dir, &target.backing, &args)
}

/// A batch of the load: reads, writes of 1 to 8 pages, FUA writes, trims and FLUSHes,
/// half of them in the first 64 pages, each write of a generation of its own.
fn load_batch(rng: &mut Rng, gen: &mut u32) -> Vec<Op> {
    (0..BATCH)
        .map(|_| {
            let page = if rng.below(2) == 0 { rng.below(64) } else { rng.below(PAGES) };
            *gen += 1;
            match rng.below(100) {
                0..25 => Op::Read(page),
                25..81 => {
                    let len = (1 + rng.below(8)).min(PAGES - page);
                    Op::WriteBytes(page * PAGE, len * PAGE, *gen)
                }
                81..88 => Op::WriteFua(page, *gen),
                88..94 => Op::Trim(page),
                _ => Op::Flush,
            }
        })
        .collect()
}

/// Adds a batch and its outcomes to `history`.
fn record(history: &mut History, ops: &[Op], outcomes: &[Outcome]) {
    for (op, o) in ops.iter().zip(outcomes) {
        let change = |pages: Range<u64>, value, fua| Change {
            pages,
            value,
            fua,
            t0: o.t0,
            t1: o.t1,
            ok: o.ok(),
        };
        match *op {
            Op::Read(p) => {
                if o.ok() {
                    history.reads.push((p, o.clone()));
                }
            }
            Op::WriteBytes(offset, len, g) => history.changes.push(change(
                offset / PAGE..(offset + len) / PAGE,
                Written::Gen(g),
                false,
            )),
            Op::Write(p, g) => history.changes.push(change(p..p + 1, Written::Gen(g), false)),
            Op::WriteFua(p, g) => history.changes.push(change(p..p + 1, Written::Gen(g), true)),
            Op::Trim(p) => history.changes.push(change(p..p + 1, Written::Zero, false)),
            Op::Flush => history.flushes.push((o.t0, o.ok())),
        }
    }
}

/// The history of `page`, for a failure message.
fn page_story(page: u64, base: Content, changes: &[&Change], history: &History, policy: Policy) {
    eprintln!("page {page}: held {base:?} before the iteration; its changes:");
    for c in changes {
        eprintln!("  {c:?} durable={}", history.durable(c, policy));
    }
}

/// Reads every page after a restart and judges it against the last iteration's history
/// (the changes that bind: the durable ones). Returns the pages' contents, the next base.
fn check_after_restart(
    client: &mut faulty::Client,
    base: &[Content],
    history: &History,
    policy: Policy,
    tally: &mut NbdTally,
    context: &str,
) -> Vec<Content> {
    let reads: Vec<Op> = (0..PAGES).map(Op::Read).collect();
    let out = client.batch(&reads, IN_FLIGHT);
    let by_page = history.by_page();
    let none = Vec::new();
    let mut held = Vec::with_capacity(PAGES as usize);
    let mut bad = Vec::new();
    for (p, o) in (0..PAGES).zip(&out) {
        assert!(o.ok(), "{context}: page {p} could not be read after the restart: {o:?}");
        let content = o.data.expect("a read has data");
        let changes = by_page.get(&p).unwrap_or(&none);
        tally.durable += changes.iter().filter(|c| history.durable(c, policy)).count() as u64;
        let verdict =
            judge(p, content, base[p as usize], changes, |_| true, |d| history.durable(d, policy));
        if verdict != Verdict::Allowed {
            page_story(p, base[p as usize], changes, history, policy);
            bad.push(format!("page {p} holds {content:?}: {verdict:?}"));
        }
        held.push(content);
    }
    assert!(bad.is_empty(), "{context}: after the restart (lost: Replaced) {bad:?}");
    held
}

/// Whether a change of the page was under way while a read of it (sent at `t0`, seen
/// complete at `t1`) was: the read may then return part of each version. NBD promises no
/// atomicity between concurrent requests, and a file store's `pread` and `pwrite` of one
/// page run on different threads, through the page cache.
fn overlaps_a_change(changes: &[&Change], t0: u64, t1: u64) -> bool {
    changes.iter().any(|c| c.t0 < t1 && t0 < c.t1)
}

/// Checks the reads made under load (a torn page, made of parts of versions the read
/// could have returned whole, only from a read that overlapped a change of the page): each returned a change visible to it (submitted
/// before the read was seen complete) that no change acknowledged before the read was
/// submitted came strictly after.
fn check_reads(base: &[Content], history: &History, tally: &mut NbdTally, context: &str) {
    let by_page = history.by_page();
    let none = Vec::new();
    for (p, r) in &history.reads {
        let content = r.data.expect("a read has data");
        let changes = by_page.get(p).unwrap_or(&none);
        let judge_read = |held| {
            judge(*p, held, base[*p as usize], changes, |c| c.t0 < r.t1, |d| d.ok && d.t1 < r.t0)
        };
        if let (Content::Other, Some(torn)) = (content, &r.torn) {
            // Every part must be one the read could have returned whole.
            let mut parts: Vec<Content> =
                torn.stamps.iter().map(|&(page, gen, _)| Content::Stamp(page, gen)).collect();
            if torn.zeros > 0 {
                parts.push(Content::Zero);
            }
            let wrong: Vec<_> = parts
                .iter()
                .map(|&part| (part, judge_read(part)))
                .filter(|(_, verdict)| *verdict != Verdict::Allowed)
                .collect();
            assert!(
                overlaps_a_change(changes, r.t0, r.t1) && wrong.is_empty(),
                "{context}: a read of page {p} (submitted {}, done {}) returned a torn page \
                 {torn:?}, wrong parts {wrong:?}; its changes: {changes:#?}",
                r.t0,
                r.t1
            );
            tally.torn += 1;
            continue;
        }
        let verdict = judge_read(content);
        assert_eq!(
            verdict,
            Verdict::Allowed,
            "{context}: a read of page {p} (submitted {}, done {}) returned {content:?}; \
             its changes: {changes:#?}",
            r.t0,
            r.t1
        );
    }
    tally.reads_checked += history.reads.len() as u64;
}

/// The NBD kill loop: start, check every page against the last iteration, run the load
/// until a kill at a random moment, again and again; then a last start, check and clean
/// stop.
fn nbd_kill_loop(target: NbdTarget, dir: &Path) -> NbdTally {
    let seed = seed();
    let mut rng = Rng(seed);
    let mut tally = NbdTally::default();
    let mut gen = 0u32;
    let mut base: Vec<Content> = (0..PAGES).map(target.initial).collect();
    let mut last: Option<(History, Policy)> = None;
    let started = Instant::now();
    for i in 0..=iterations() {
        let context = format!("{}, seed {seed}, iteration {i}", target.name);
        let policy = (target.policy)(i);
        let mut fallow = start_nbd(dir, &target, policy, &mut rng);
        let mut client = faulty::Client::connect(&fallow.uri);
        base = match &last {
            Some((history, was)) => {
                tally.pages_checked += PAGES;
                check_after_restart(&mut client, &base, history, *was, &mut tally, &context)
            }
            None => {
                // Nothing written yet: the disk holds its first contents.
                let empty = History::default();
                check_after_restart(&mut client, &base, &empty, policy, &mut tally, &context)
            }
        };
        if i == iterations() {
            client.close();
            fallow.daemon.signal("TERM");
            let status = fallow.daemon.wait_timeout(START);
            assert!(status.is_some_and(|s| s.success()), "{context}: {status:?}");
            break;
        }

        let killed = Arc::new(AtomicBool::new(false));
        let metrics = fallow.metrics.clone();
        let pid = fallow.daemon.pid();
        let killer = Killer::after(pid, rng.up_to_ms(500), killed.clone(), move || {
            faulty::Metrics(support::scrape(&metrics)).dirty_bytes()
        });
        let mut history = History::default();
        let load = Instant::now();
        loop {
            let ops = load_batch(&mut rng, &mut gen);
            let out = client.batch(&ops, IN_FLIGHT);
            record(&mut history, &ops, &out);
            if let Some(failed) = out.iter().find(|o| !o.ok()) {
                assert!(
                    killed.load(Ordering::SeqCst),
                    "{context}: a request failed before the kill: {failed:?}\n{}",
                    fallow.daemon.log_so_far()
                );
                break;
            }
            assert!(load.elapsed() < LOAD_LIMIT, "{context}: the kill never ended the load");
        }
        let dirty = killer.join();
        drop(client);
        fallow.daemon.wait_timeout(START).expect("the killed server is reaped");
        check_reads(&base, &history, &mut tally, &context);

        tally.iterations += 1;
        tally.dirty_at_kill += u32::from(dirty > 0);
        tally.writes +=
            history.changes.iter().filter(|c| c.ok && c.value != Written::Zero).count() as u64;
        tally.trims +=
            history.changes.iter().filter(|c| c.ok && c.value == Written::Zero).count() as u64;
        tally.flushes += history.flushes.iter().filter(|f| f.1).count() as u64;
        tally.cut_short += history.changes.iter().filter(|c| !c.ok).count() as u64
            + history.flushes.iter().filter(|f| !f.1).count() as u64;
        last = Some((history, policy));
    }
    println!(
        "kill loop {}: {} iterations in {:.1} s (seed {seed}); acknowledged: {} writes, {} \
         trims, {} flushes; {} requests cut short by the kill; {} kills with dirty data; \
         durable page-writes checked: {}, pages read back after restarts: {}, lost: 0; \
         reads under load checked: {} ({} torn by a write of the page under way), stale: 0, \
         never written: 0",
        target.name,
        tally.iterations,
        started.elapsed().as_secs_f64(),
        tally.writes,
        tally.trims,
        tally.flushes,
        tally.cut_short,
        tally.dirty_at_kill,
        tally.durable,
        tally.pages_checked,
        tally.reads_checked,
        tally.torn,
    );
    tally
}

/// Whether the NBD loops can run: nbdkit is not needed, libnbd's Python binding is.
fn have_libnbd() -> bool {
    let ok = support::command_works("/usr/bin/python3", &["-c", "import nbd"]);
    if !ok {
        eprintln!("skipped: libnbd's Python binding is needed (Debian package python3-libnbd)");
    }
    ok
}

/// Flags of a file export: a small local tier and local pool, so that pages move
/// between the tiers; in write-back, a flusher age and dirty limit drawn per start.
fn file_args(policy: Policy, rng: &mut Rng) -> Vec<String> {
    let mut args = vec!["--pool", "local:8M", "--local-tier", "256K", "--write-policy"];
    args.push(policy.flag());
    if policy == Policy::Back {
        args.extend(["--max-dirty", ["256K", "64M"][rng.below(2) as usize]]);
        args.extend(["--max-dirty-age", ["10", "100", "1000"][rng.below(3) as usize]]);
    }
    args.into_iter().map(str::to_string).collect()
}

fn file_target(dir: &Path, name: &'static str, policy: fn(u32) -> Policy) -> NbdTarget {
    let image = dir.join("disk.img");
    faulty::make_image(&image, PAGES);
    NbdTarget {
        name,
        backing: format!("file:{}", image.display()),
        initial: |p| Content::Stamp(p, 0),
        policy,
        args: Box::new(file_args),
    }
}

#[test]
fn write_back_over_a_file_loses_no_flushed_write() {
    if !have_libnbd() {
        return;
    }
    let dir = TempDir::new("kill-nbd-back");
    let target = file_target(dir.path(), "nbd write-back, file", |_| Policy::Back);
    let tally = nbd_kill_loop(target, dir.path());
    assert!(tally.durable > 0 && tally.dirty_at_kill > 0, "the kills never hit dirty data");
}

#[test]
fn write_through_over_a_file_loses_no_acknowledged_write() {
    if !have_libnbd() {
        return;
    }
    let dir = TempDir::new("kill-nbd-through");
    let target = file_target(dir.path(), "nbd write-through, file", |_| Policy::Through);
    let tally = nbd_kill_loop(target, dir.path());
    assert!(tally.durable > 0);
}

#[test]
fn a_pool_export_keeps_its_disk_on_the_node_across_kills() {
    if !have_libnbd() {
        return;
    }
    let dir = TempDir::new("kill-nbd-pool");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "kill-loop-pool-export-secret-0123\n").unwrap();
    let s = secret.to_str().unwrap().to_string();
    let (_node, addr) = support::start_node(
        &["--listen", "127.0.0.1:0", "--lend", "64M", "--secret-file", &s],
        START,
    );
    let pool = format!("fallow://{addr}");
    let target = NbdTarget {
        name: "nbd pool: export on a node, write-through and write-back in turn",
        backing: format!("pool:{},uuid=6b696c6c2d6c6f6f70732d706f6f6c21", PAGES * PAGE),
        initial: |_| Content::Zero,
        policy: |i| if i % 2 == 0 { Policy::Through } else { Policy::Back },
        args: Box::new(move |policy, rng| {
            let mut args = vec!["--pool", pool.as_str(), "--secret-file", s.as_str()];
            args.extend(["--local-tier", "256K"]);
            args.extend(["--write-policy", policy.flag()]);
            if policy == Policy::Back {
                args.extend(["--max-dirty-age", ["10", "100", "1000"][rng.below(3) as usize]]);
            }
            args.into_iter().map(str::to_string).collect()
        }),
    };
    let tally = nbd_kill_loop(target, dir.path());
    assert!(tally.durable > 0);
}
