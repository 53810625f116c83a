//! Faults across real network boundaries. Three `fallow node` processes, each in a network
//! namespace of its own on one bridge (support::netns), gossip into one cluster; a fourth
//! namespace, the client, runs `fallow nbd --pool fallow://A,B,C` and fio's nbd engine with
//! `verify=crc32c` against it, round after round (a write+verify pass, then a verify-only
//! pass on new connections), while the test hurts node b:
//!
//! * SIGKILL, then a restart on the same addresses;
//! * its link cut (`ip link set eth0 down` in its namespace), then brought up;
//! * a partition by nft rules in its namespace that drop everything to and from the
//!   others, then removed;
//! * 5 ms more latency each way through `fallow bench delay-proxy`, which an nft
//!   redirect in b's namespace puts between the client and b.
//!
//! Every fio pass must succeed (no I/O error, no wrong byte), no pool error may reach the
//! NBD cache, the pool must have served reads, and membership (`fallow stat --cluster
//! --json`, run inside the client namespace) must see b dead during the fault and every
//! node alive once it healed. Another test writes a persistent pool through the cluster
//! client (this test binary, re-run inside the client namespace as a helper), SIGKILLs b,
//! and reads back every page, before and after the client re-created the lost copies; a
//! third cuts b off from its peers but not from the client, and checks that the client
//! keeps b and its copies (none re-created), reading a's pages from b once a is killed.
//!
//! Without namespaces (not root, a container) the namespace tests print `skipped:
//! REASON` and pass; the SIGKILL and the latency tests also run on 127.0.0.1 only (the
//! `loopback_` tests), which any machine can. Without fio or nft the tests that need them
//! skip the same way.
//! Every process is stopped by its PID; the namespaces, and with them the links, the
//! bridge and the nft tables, are removed when a test ends, also when it fails.

mod support;

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::UdpSocket;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::netns::Lab;
use support::{free_port, Daemon, TempDir};

const START: Duration = Duration::from_secs(30);
const SECRET: &str = "netns-faults-test-secret-0123456789";
/// The node's protocol port in a namespace (gossip is the next one): every node has an
/// address of its own there, so fixed ports cannot collide.
const NODE_PORT: u16 = 7400;
/// Where the delay proxy listens inside b's namespace.
const PROXY_PORT: u16 = 7500;
/// The nodes, by index; the client namespace is `client`.
const NODES: [&str; 3] = ["a", "b", "c"];
/// The node every test hurts.
const B: usize = 1;

/// Where a test's processes run and how they reach each other.
enum Net {
    /// Everything in the root namespace, on 127.0.0.1.
    Loopback,
    /// Hosts `a`, `b`, `c` and `client`, each in its own namespace.
    Netns(Lab),
}

impl Net {
    /// A lab of namespaces for the test `tag` on 10.213.`subnet`.0/24, or `None` after
    /// printing why the test is skipped (also when a tool in `tools` is missing).
    fn netns(tag: &str, subnet: u8, tools: &[(&str, &str)]) -> Option<Net> {
        for (tool, package) in [("fio", "fio")].iter().chain(tools) {
            if !support::have(tool) {
                eprintln!("skipped: {tool} is not installed (Debian package {package})");
                return None;
            }
        }
        if !support::command_works("fio", &["--enghelp=nbd"]) {
            eprintln!("skipped: this fio was built without the nbd engine");
            return None;
        }
        match Lab::new(tag, subnet, &["a", "b", "c", "client"]) {
            Ok(lab) => Some(Net::Netns(lab)),
            Err(reason) => {
                eprintln!("skipped: no network namespaces here: {reason}");
                None
            }
        }
    }

    /// The loopback variant, or `None` after printing why it is skipped.
    fn loopback() -> Option<Net> {
        if !support::command_works("fio", &["--enghelp=nbd"]) {
            eprintln!("skipped: fio with the nbd engine is not installed (Debian package fio)");
            return None;
        }
        Some(Net::Loopback)
    }

    /// The lab (panics on loopback: only the namespace tests ask).
    fn lab(&self) -> &Lab {
        match self {
            Net::Netns(lab) => lab,
            Net::Loopback => panic!("this step needs network namespaces"),
        }
    }

    /// What runs a program on `host`: nothing on loopback, `ip netns exec NETNS` in a lab.
    /// Plain strings, so that the workload thread can build its own commands.
    fn prefix(&self, host: &str) -> Vec<String> {
        match self {
            Net::Loopback => Vec::new(),
            Net::Netns(lab) => {
                ["ip", "netns", "exec", &lab.host(host).netns].map(String::from).to_vec()
            }
        }
    }

    /// A command that runs `program` on `host`.
    fn command(&self, host: &str, program: &str) -> Command {
        command_with(&self.prefix(host), program)
    }
}

/// `program` after `prefix` (see [`Net::prefix`]).
fn command_with(prefix: &[String], program: &str) -> Command {
    match prefix.split_first() {
        None => Command::new(program),
        Some((first, rest)) => {
            let mut cmd = Command::new(first);
            cmd.args(rest).arg(program);
            cmd
        }
    }
}

/// Three nodes (joined by gossip, or not: then the client's seeds are the cluster) and
/// the scratch directory with the secret. Fields drop in order: the nodes are stopped
/// before the namespaces go.
struct Cluster {
    nodes: Vec<Option<Daemon>>,
    /// Each node's TCP address, which is also its member id.
    listen: Vec<String>,
    /// Each node's gossip address (UDP), if the nodes gossip.
    gossip: Option<Vec<String>>,
    lend: String,
    secret: PathBuf,
    dir: TempDir,
    net: Net,
}

impl Cluster {
    /// Starts the three nodes, lending `lend` each; with `gossip`, waits until every one
    /// sees all three alive.
    fn start(net: Net, tag: &str, lend: &str, gossip: bool) -> Cluster {
        let dir = TempDir::new(&format!("netns-{tag}"));
        let secret = dir.path().join("secret");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        let (listen, udp): (Vec<String>, Vec<String>) = NODES
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
        let mut cluster = Cluster {
            nodes: Vec::new(),
            listen,
            gossip: gossip.then_some(udp),
            lend: lend.to_string(),
            secret,
            dir,
            net,
        };
        for i in 0..NODES.len() {
            let node = cluster.spawn_node(i);
            cluster.nodes.push(Some(node));
        }
        if gossip {
            cluster.wait_members(&[0, 1, 2], "three alive members", Duration::from_secs(20), |l| {
                l["alive"] == 3
            });
        }
        cluster
    }

    /// Starts node `i` on its addresses.
    fn spawn_node(&self, i: usize) -> Daemon {
        let secret = self.secret.to_str().unwrap();
        let peers = |gossip: &Vec<String>| {
            let others: Vec<&str> =
                (0..NODES.len()).filter(|j| *j != i).map(|j| gossip[j].as_str()).collect();
            others.join(",")
        };
        let join = self.gossip.as_ref().map(peers);
        let mut args = vec!["--listen", &self.listen[i], "--lend", &self.lend];
        args.extend(["--secret-file", secret]);
        if let (Some(gossip), Some(join)) = (&self.gossip, &join) {
            args.extend(["--gossip", &gossip[i], "--join", join]);
        }
        support::start_node_with(self.net.command(NODES[i], support::BIN), &args, START).0
    }

    /// Starts node `i` again (after [`Cluster::kill`]).
    fn restart(&mut self, i: usize) {
        let node = self.spawn_node(i);
        self.nodes[i] = Some(node);
    }

    /// SIGKILLs node `i`.
    fn kill(&mut self, i: usize) {
        let mut node = self.nodes[i].take().expect("node already killed");
        node.kill();
    }

    /// `fallow stat ARGS --json` from the client host, parsed; `None` if it failed (a
    /// node cut off does not answer).
    fn stat(&self, args: &[&str]) -> Option<Value> {
        let out = self
            .net
            .command("client", support::BIN)
            .arg("stat")
            .args(args)
            .args(["--json", "--timeout", "2"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
    }

    /// `fallow stat --cluster --json` asked of node `i`.
    fn members(&self, i: usize) -> Option<Value> {
        let secret = self.secret.to_str().unwrap();
        self.stat(&["--cluster", "--node", &self.listen[i], "--secret-file", secret])
    }

    /// The state and generation of node `j` in a `stat --cluster` answer.
    fn member(&self, list: &Value, j: usize) -> Option<(String, u64)> {
        let m = list["members"].as_array()?.iter().find(|m| m["id"] == self.listen[j])?;
        Some((m["state"].as_str()?.to_string(), m["generation"].as_u64()?))
    }

    /// Polls `stat --cluster` on each node of `on` until `done` holds for its answer;
    /// panics after `limit` with the last answers. Returns how long it took.
    fn wait_members(
        &self,
        on: &[usize],
        what: &str,
        limit: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Duration {
        let start = Instant::now();
        let mut last: HashMap<usize, Option<Value>> = HashMap::new();
        let ok = support::poll_until(limit, || {
            on.iter().all(|&i| {
                let list = self.members(i);
                let ok = list.as_ref().is_some_and(&done);
                last.insert(i, list);
                ok
            })
        });
        assert!(ok, "{what}: not within {limit:?}; the last answers by node: {last:#?}");
        println!("{what}: {:?}", start.elapsed());
        start.elapsed()
    }

    /// `fallow://` with every node as a seed, or with `replace` in place of node b.
    fn seeds(&self, replace_b: Option<&str>) -> String {
        let list: Vec<&str> = (0..NODES.len())
            .map(|i| if i == B { replace_b.unwrap_or(&self.listen[i]) } else { &self.listen[i] })
            .collect();
        format!("fallow://{}", list.join(","))
    }

    /// Starts `fallow nbd` on the client host with a 64 MiB file export `fio` caching in
    /// the cluster through `seeds`, no local tier (every read that hits, hits the pool),
    /// and metrics on the client's loopback.
    fn start_nbd(&self, seeds: &str) -> Nbd {
        let export = format!("fio=file:{},size=64M", self.dir.path().join("fio.img").display());
        let mut daemon = Daemon::spawn(
            "fallow nbd",
            self.net
                .command("client", support::BIN)
                .args(["nbd", "--listen", "127.0.0.1:0", "--export", &export, "--pool", seeds])
                .args(["--secret-file", self.secret.to_str().unwrap(), "--local-tier", "0"])
                .args(["--metrics", "127.0.0.1:0"])
                .env("FALLOW_LOG", "info")
                .stdin(Stdio::null()),
        );
        let metrics = daemon.wait_for_line("metrics address", START, support::metrics_addr);
        let uri = daemon.wait_for_line("`serving` line", START, support::nbd_serving_uri);
        let log = daemon.log_so_far();
        assert!(log.contains("caching in a cluster") && log.contains("nodes=3"), "{log}");
        Nbd { daemon, uri, metrics }
    }

    /// The export's counters, from `fallow stat --nbd --json` on the client host.
    fn nbd_stats(&self, nbd: &Nbd) -> Value {
        let stats = self.stat(&["--nbd", &nbd.metrics]).expect("fallow stat --nbd failed");
        stats["exports"]["fio"].clone()
    }

    /// Runs fio rounds against `nbd` from the client host until stopped.
    fn workload(&self, nbd: &Nbd) -> Workload {
        Workload::start(self.net.prefix("client"), self.dir.path().join("fio"), &nbd.uri)
    }
}

/// A running `fallow nbd`: the export's URI and the metrics address.
struct Nbd {
    daemon: Daemon,
    uri: String,
    metrics: String,
}

/// The fio job: 4 jobs x 4 MiB of random 4 KiB writes at depth 8, each block checked by
/// crc32c; `{VERIFY}` is `do_verify=1` (read back after writing) or `verify_only=1` (read
/// back what the last write pass wrote, on new connections: same seeds, same blocks).
const FIO_JOB: &str = "\
[global]
ioengine=nbd
uri={URI}
rw=randwrite
bs=4k
iodepth=8
verify=crc32c
verify_fatal=1
{VERIFY}
verify_state_save=0
group_reporting=1
runtime=15

[region]
size=4m
numjobs=4
offset_increment=4m
";

/// One fio run.
struct Pass {
    kind: &'static str,
    ok: bool,
    took: Duration,
    /// fio's report (and its stderr).
    output: String,
}

/// fio rounds on a thread: a write+verify pass, then a verify-only pass, again and again
/// until [`Workload::finish`], or until a pass fails, or for at most two minutes.
struct Workload {
    stop: Arc<AtomicBool>,
    /// Passes finished so far.
    done: Arc<AtomicUsize>,
    failed: Arc<AtomicBool>,
    passes: Arc<Mutex<Vec<Pass>>>,
    thread: Option<JoinHandle<()>>,
}

impl Workload {
    fn start(prefix: Vec<String>, dir: PathBuf, uri: &str) -> Workload {
        std::fs::create_dir_all(&dir).unwrap();
        let jobs: Vec<(&'static str, PathBuf)> =
            [("write+verify", "do_verify=1"), ("verify only", "verify_only=1")]
                .into_iter()
                .map(|(kind, verify)| {
                    let path = dir.join(format!("{}.fio", kind.replace([' ', '+'], "-")));
                    let job = FIO_JOB.replace("{URI}", uri).replace("{VERIFY}", verify);
                    std::fs::write(&path, job).unwrap();
                    (kind, path)
                })
                .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicBool::new(false));
        let passes = Arc::new(Mutex::new(Vec::new()));
        let (s, d, f, p) = (stop.clone(), done.clone(), failed.clone(), passes.clone());
        let thread = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !s.load(Ordering::SeqCst) && Instant::now() < deadline {
                for (kind, job) in &jobs {
                    let pass = run_fio(&prefix, &dir, kind, job);
                    let ok = pass.ok;
                    p.lock().unwrap().push(pass);
                    d.fetch_add(1, Ordering::SeqCst);
                    if !ok {
                        f.store(true, Ordering::SeqCst);
                        return;
                    }
                }
            }
        });
        Workload { stop, done, failed, passes, thread: Some(thread) }
    }

    /// Passes finished so far.
    fn done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }

    /// Waits until `n` passes have finished (or one failed, which [`Workload::finish`]
    /// then reports); panics after `limit`.
    fn wait_passes(&self, n: usize, limit: Duration) {
        let ok =
            support::poll_until(limit, || self.done() >= n || self.failed.load(Ordering::SeqCst));
        assert!(ok, "fio finished {} passes, not {n}, within {limit:?}", self.done());
    }

    /// Lets the current round end and returns every pass; panics, with fio's report, if
    /// one failed.
    fn finish(mut self) -> Vec<Pass> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("the fio thread panicked");
        }
        let passes = std::mem::take(&mut *self.passes.lock().unwrap());
        for pass in &passes {
            println!(
                "fio {}: {} in {:?}",
                pass.kind,
                if pass.ok { "ok" } else { "FAILED" },
                pass.took
            );
        }
        if let Some(bad) = passes.iter().find(|p| !p.ok) {
            panic!("fio {} failed:\n{}", bad.kind, bad.output);
        }
        passes
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        // A test that fails early: the thread ends after its current pass (fio bounds
        // itself with runtime=15 and `timeout`), and dies with the namespaces sooner.
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Runs one fio pass with job file `job` on the host `prefix` names.
fn run_fio(
    prefix: &[String],
    dir: &std::path::Path,
    kind: &'static str,
    job: &std::path::Path,
) -> Pass {
    let report = dir.join("fio.out");
    let start = Instant::now();
    // fio writes its state files into the working directory.
    let mut fio = support::ProcessGroup::spawn(
        command_with(prefix, "timeout")
            .args(["60", "fio", "--output"])
            .arg(&report)
            .arg(job)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("fio.err")).unwrap()),
    );
    let status = fio.wait_until(start + Duration::from_secs(90));
    let output = format!(
        "{}{}",
        std::fs::read_to_string(&report).unwrap_or_default(),
        std::fs::read_to_string(dir.join("fio.err")).unwrap_or_default()
    );
    // Every job's `err=` must be 0, besides the exit status.
    let errors = output.match_indices("err=").any(|(i, _)| {
        !output[i + 4..].trim_start().starts_with("0:")
            && !output[i + 4..].trim_start().starts_with("0 ")
    });
    let ok = status.is_some_and(|s| s.success()) && !errors && output.contains("err=");
    Pass { kind, ok, took: start.elapsed(), output }
}

/// The checks after every fault: fio passed every pass (at least `min` of them), the
/// pool served reads and no pool error reached the cache, and the NBD server still runs.
fn check_export(cluster: &Cluster, nbd: &mut Nbd, passes: &[Pass], min: usize) {
    assert!(passes.len() >= min, "only {} fio passes", passes.len());
    let stats = cluster.nbd_stats(nbd);
    println!("the export after the fault: {stats}");
    assert!(
        stats["pages_read"]["pool"].as_u64().is_some_and(|n| n > 0),
        "the pool served nothing: {stats}"
    );
    assert_eq!(stats["pool_errors"], 0, "a pool error reached the NBD cache: {stats}");
    assert!(nbd.daemon.is_running(), "fallow nbd exited:\n{}", nbd.daemon.log_so_far());
    assert!(!nbd.daemon.log_so_far().contains("panicked"), "{}", nbd.daemon.log_so_far());
}

// ---- 1. SIGKILL ----------------------------------------------------------------------

fn node_killed_mid_workload(net: Net, tag: &str) {
    let mut cluster = Cluster::start(net, tag, "64M", true);
    let generation = cluster.members(0).and_then(|l| cluster.member(&l, B)).unwrap().1;
    let mut nbd = cluster.start_nbd(&cluster.seeds(None));
    let work = cluster.workload(&nbd);
    // The first write+verify pass filled the pool; kill b in the middle of the next one.
    work.wait_passes(1, Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(300));
    cluster.kill(B);
    let at_kill = work.done();
    cluster.wait_members(&[0, 2], "b seen dead by a and c", Duration::from_secs(10), |l| {
        cluster.member(l, B).is_some_and(|(state, _)| state == "dead")
    });
    // A whole round (write+verify, verify only) after the kill, then the restart.
    work.wait_passes(at_kill + 3, Duration::from_secs(60));
    cluster.restart(B);
    cluster.wait_members(&[0, 1, 2], "b alive again everywhere", Duration::from_secs(15), |l| {
        l["alive"] == 3 && cluster.member(l, B).is_some_and(|(s, g)| s == "alive" && g > generation)
    });
    let at_restart = work.done();
    work.wait_passes(at_restart + 2, Duration::from_secs(60));
    let passes = work.finish();
    check_export(&cluster, &mut nbd, &passes, 5);
}

#[test]
fn netns_a_sigkilled_node_costs_fio_nothing_and_rejoins() {
    if let Some(net) = Net::netns("kill", 1, &[]) {
        node_killed_mid_workload(net, "kill");
    }
}

#[test]
fn loopback_a_sigkilled_node_costs_fio_nothing_and_rejoins() {
    if let Some(net) = Net::loopback() {
        node_killed_mid_workload(net, "loop-kill");
    }
}

// ---- 2. a cut link, 3. an nft partition -----------------------------------------------

/// Cuts b off (`cut`) in the middle of the workload, checks that a and c see it dead,
/// lets fio run a round, heals (`heal`) and checks that all three see each other alive.
fn cut_off_and_heal(
    tag: &str,
    subnet: u8,
    tools: &[(&str, &str)],
    cut: impl Fn(&Lab),
    heal: impl Fn(&Lab),
) {
    let Some(net) = Net::netns(tag, subnet, tools) else { return };
    let cluster = Cluster::start(net, tag, "64M", true);
    let mut nbd = cluster.start_nbd(&cluster.seeds(None));
    let work = cluster.workload(&nbd);
    work.wait_passes(1, Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(300));
    cut(cluster.net.lab());
    let at_cut = work.done();
    cluster.wait_members(&[0, 2], "b seen dead by a and c", Duration::from_secs(10), |l| {
        cluster.member(l, B).is_some_and(|(state, _)| state == "dead")
    });
    assert!(cluster.members(B).is_none(), "b still answers the client while cut off");
    work.wait_passes(at_cut + 3, Duration::from_secs(60));
    heal(cluster.net.lab());
    cluster.wait_members(&[0, 1, 2], "all three alive again", Duration::from_secs(20), |l| {
        l["alive"] == 3
    });
    let at_heal = work.done();
    work.wait_passes(at_heal + 2, Duration::from_secs(60));
    let passes = work.finish();
    check_export(&cluster, &mut nbd, &passes, 5);
}

#[test]
fn netns_a_cut_link_costs_fio_nothing_and_heals() {
    cut_off_and_heal(
        "link",
        2,
        &[],
        |lab| lab.set_link("b", false).unwrap(),
        |lab| lab.set_link("b", true).unwrap(),
    );
}

/// The nft table that cuts b off from the other hosts of the lab.
const PARTITION: &str = "fallowt_partition";

/// An nft table for b's namespace that drops everything between b and `hosts`.
fn partition_rules(lab: &Lab, hosts: &[&str]) -> String {
    let others: Vec<String> = hosts.iter().map(|h| lab.host(h).ip.to_string()).collect();
    let set = others.join(", ");
    let chain = |name: &str, hook: &str, dir: &str| {
        format!(
            "\tchain {name} {{\n\t\ttype filter hook {hook} priority 0; policy accept;\n\
             \t\tip {dir} {{ {set} }} counter drop\n\t}}\n"
        )
    };
    format!(
        "table inet {PARTITION} {{\n{}{}}}\n",
        chain("input", "input", "saddr"),
        chain("output", "output", "daddr")
    )
}

#[test]
fn netns_an_nft_partition_costs_fio_nothing_and_heals() {
    cut_off_and_heal(
        "part",
        3,
        &[("nft", "nftables")],
        |lab| {
            lab.nft("b", &partition_rules(lab, &["a", "c", "client"])).unwrap();
        },
        |lab| {
            // The rules did drop traffic, else the partition was not what cut b off.
            let listing = lab.nft("b", &format!("list table inet {PARTITION}\n")).unwrap();
            assert!(!listing.contains("counter packets 0 "), "a rule dropped nothing:\n{listing}");
            lab.nft("b", &format!("delete table inet {PARTITION}\n")).unwrap();
        },
    );
}

// ---- 4. persistent pages --------------------------------------------------------------

/// Persistent pages the helper writes.
const PERSISTENT_PAGES: u64 = 2000;

/// Page `i` of the persistent pool: its index in every 8-byte word, mixed with the
/// word's position, so that a page from the wrong index or offset is caught.
fn persistent_page(i: u64) -> Vec<u8> {
    (0..fallow_core::PAGE_SIZE as u64 / 8)
        .flat_map(|w| (i.rotate_left(17) ^ w.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes())
        .collect()
}

/// A helper's cluster client through `seeds` (1 s request timeout) with all three nodes,
/// and a persistent pool it wrote [`PERSISTENT_PAGES`] pages to, each stored.
async fn write_persistent(seeds: &str) -> (fallow_client::ClusterClient, fallow_core::PoolId) {
    use fallow_client::{ClusterClient, ClusterClientConfig};
    use fallow_core::{PageKey, PoolSpec, PutOutcome};
    let config = ClusterClientConfig::new(seeds, SECRET)
        .unwrap()
        .per_node(|c| c.timeout(Duration::from_secs(1)));
    let cluster = ClusterClient::connect(config).await.unwrap();
    assert_eq!(cluster.nodes().len(), 3, "{:#?}", cluster.nodes());
    let pool = cluster.create_pool(&PoolSpec::persistent()).await.unwrap();
    let all: Vec<u64> = (0..PERSISTENT_PAGES).collect();
    for chunk in all.chunks(250) {
        let keys: Vec<PageKey> = chunk.iter().map(|&i| PageKey::new(pool, 7, i)).collect();
        let data: Vec<u8> = chunk.iter().flat_map(|&i| persistent_page(i)).collect();
        let outcomes = cluster.put_many(&keys, data.into()).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored), "{outcomes:?}");
    }
    (cluster, pool)
}

/// What the helper reads back: every page present and right, or the first that is not.
async fn read_back(
    cluster: &fallow_client::ClusterClient,
    pool: fallow_core::PoolId,
) -> Result<(), String> {
    let all: Vec<u64> = (0..PERSISTENT_PAGES).collect();
    for chunk in all.chunks(250) {
        let keys: Vec<_> = chunk.iter().map(|&i| fallow_core::PageKey::new(pool, 7, i)).collect();
        let got = cluster.get_many(&keys).await.map_err(|e| format!("a read failed: {e}"))?;
        for (i, page) in chunk.iter().zip(got) {
            match page {
                None => return Err(format!("page {i} missing")),
                Some(bytes) if bytes[..] != persistent_page(*i)[..] => {
                    return Err(format!("page {i}: wrong bytes"))
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

/// The helper of [`netns_persistent_pages_survive_a_node_loss`], run by it inside the
/// client namespace (this same test binary, with FALLOW_NETNS_SEEDS set): writes the
/// persistent pool, says `written` on stderr, waits for a line on stdin (b was killed),
/// reads every page back (`read after the kill`), waits until the client re-created the
/// lost copies (`repaired`), and reads every page again (`read after the repair`).
/// Without FALLOW_NETNS_SEEDS it does nothing.
#[test]
#[ignore = "a helper that netns_persistent_pages_survive_a_node_loss runs in a namespace"]
fn persistent_pages_helper() {
    let Ok(seeds) = std::env::var("FALLOW_NETNS_SEEDS") else {
        eprintln!("not run: only netns_persistent_pages_survive_a_node_loss runs this helper");
        return;
    };
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let (cluster, pool) = write_persistent(&seeds).await;
        let spread: Vec<(String, u64)> =
            cluster.nodes().iter().map(|n| (n.id.clone(), n.pages)).collect();
        eprintln!("helper: written {PERSISTENT_PAGES} pages, copies by node {spread:?}");
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        read_back(&cluster, pool).await.unwrap_or_else(|e| panic!("right after the kill: {e}"));
        eprintln!("helper: read after the kill");
        let start = Instant::now();
        loop {
            let stats = cluster.replication();
            if cluster.nodes().len() == 2
                && stats.at_risk == 0
                && stats.lost == 0
                && stats.re_replicated > 0
            {
                eprintln!("helper: repaired {stats:?} in {:?}", start.elapsed());
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no repair: {stats:?} {:#?}",
                cluster.nodes()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        read_back(&cluster, pool).await.unwrap_or_else(|e| panic!("after the repair: {e}"));
        eprintln!("helper: read after the repair");
    });
}

#[test]
fn netns_persistent_pages_survive_a_node_loss() {
    let Some(net) = Net::netns("pers", 4, &[]) else { return };
    let mut cluster = Cluster::start(net, "pers", "32M", true);
    let exe = std::env::current_exe().unwrap();
    let mut helper = Daemon::spawn(
        "the persistent-pool helper",
        cluster
            .net
            .command("client", exe.to_str().unwrap())
            .args(["persistent_pages_helper", "--exact", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("FALLOW_NETNS_SEEDS", cluster.seeds(None))
            .stdin(Stdio::piped()),
    );
    let spread = helper.wait_for_line("`written` line", Duration::from_secs(60), |l| {
        l.strip_prefix("helper: written ").map(str::to_string)
    });
    println!("persistent pool written: {spread}");
    // b must hold copies, or killing it proves nothing.
    assert!(spread.contains(&format!("(\"{}\", ", cluster.listen[B])), "{spread}");
    assert!(!spread.contains(&format!("(\"{}\", 0)", cluster.listen[B])), "no copy on b: {spread}");
    cluster.kill(B);
    let mut stdin = helper.child().stdin.take().unwrap();
    writeln!(stdin, "killed").unwrap();
    drop(stdin);
    for what in ["read after the kill", "repaired", "read after the repair"] {
        let line = helper.wait_for_line(what, Duration::from_secs(60), |l| {
            l.strip_prefix("helper: ").filter(|rest| rest.starts_with(what)).map(str::to_string)
        });
        println!("{line}");
    }
    let status = helper.wait_timeout(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "the helper: {status:?}\n{}", helper.log_so_far());
    // Membership converges after the loss: b comes back and every node sees three.
    cluster.wait_members(&[0, 2], "b seen dead", Duration::from_secs(10), |l| {
        cluster.member(l, B).is_some_and(|(state, _)| state == "dead")
    });
    cluster.restart(B);
    cluster.wait_members(&[0, 1, 2], "b alive again", Duration::from_secs(15), |l| l["alive"] == 3);
}

/// The helper of [`netns_a_node_its_peers_lose_keeps_its_persistent_copies`], run inside
/// the client namespace: writes the persistent pool and says `written`; then, for each
/// line on stdin, reads every page back and says `read NAME {stats}` with the client's
/// replication counters and node count. Without FALLOW_NETNS_SEEDS it does nothing.
#[test]
#[ignore = "a helper that netns_a_node_its_peers_lose_keeps_its_persistent_copies runs"]
fn partition_helper() {
    let Ok(seeds) = std::env::var("FALLOW_NETNS_SEEDS") else {
        eprintln!(
            "not run: only netns_a_node_its_peers_lose_keeps_its_persistent_copies runs this"
        );
        return;
    };
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let (cluster, pool) = write_persistent(&seeds).await;
        eprintln!("helper: written");
        for line in std::io::stdin().lock().lines() {
            let name = line.unwrap();
            read_back(&cluster, pool).await.unwrap_or_else(|e| panic!("{name}: {e}"));
            let stats = cluster.replication();
            let nodes = cluster.nodes().len();
            eprintln!(
                "helper: read {name} {{\"nodes\": {nodes}, \"re_replicated\": {}, \"lost\": {}}}",
                stats.re_replicated, stats.lost
            );
        }
    });
}

/// A partition that cuts b off from a and c but not from the client: the nodes list each
/// other dead, while the client still reaches all three. The client keeps every node and
/// every copy: none is re-created (nothing was lost) and every page reads back. Then a is
/// SIGKILLed, still during the partition: its pages are read from their copies on c and
/// on b, which its peers list dead; and again once the partition heals. Retiring a node
/// the client reaches would forget its copies, and destroy its pools once it came back.
#[test]
fn netns_a_node_its_peers_lose_keeps_its_persistent_copies() {
    let Some(net) = Net::netns("lose", 7, &[("nft", "nftables")]) else { return };
    let mut cluster = Cluster::start(net, "lose", "32M", true);
    let exe = std::env::current_exe().unwrap();
    let mut helper = Daemon::spawn(
        "the partition helper",
        cluster
            .net
            .command("client", exe.to_str().unwrap())
            .args(["partition_helper", "--exact", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("FALLOW_NETNS_SEEDS", cluster.seeds(None))
            .stdin(Stdio::piped()),
    );
    helper.wait_for_line("`written` line", Duration::from_secs(60), |l| {
        (l == "helper: written").then_some(())
    });
    let mut stdin = helper.child().stdin.take().unwrap();
    let mut read = |name: &str| -> Value {
        writeln!(stdin, "{name}").unwrap();
        let prefix = format!("helper: read {name} ");
        let line = helper.wait_for_line(name, Duration::from_secs(60), |l| {
            l.strip_prefix(&prefix).map(str::to_string)
        });
        println!("{name}: {line}");
        serde_json::from_str(&line).unwrap()
    };
    let lab = cluster.net.lab();
    lab.nft("b", &partition_rules(lab, &["a", "c"])).unwrap();
    cluster.wait_members(&[0, 2], "b seen dead by a and c", Duration::from_secs(10), |l| {
        cluster.member(l, B).is_some_and(|(state, _)| state == "dead")
    });
    cluster.wait_members(&[1], "a and c seen dead by b", Duration::from_secs(10), |l| {
        [0, 2].iter().all(|&j| cluster.member(l, j).is_some_and(|(state, _)| state == "dead"))
    });
    // Long enough for the client to have asked every node for its list (every 250 ms).
    std::thread::sleep(Duration::from_secs(2));
    let during = read("during the partition");
    assert_eq!((during["nodes"].as_u64(), during["re_replicated"].as_u64()), (Some(3), Some(0)));
    // a's pages whose other copy is on b are now read from b, which its peers list dead.
    cluster.kill(0);
    let killed = read("with a killed during the partition");
    assert_eq!(killed["lost"].as_u64(), Some(0), "{killed}");
    cluster.net.lab().nft("b", &format!("delete table inet {PARTITION}\n")).unwrap();
    cluster.wait_members(&[1, 2], "b and c alive again", Duration::from_secs(20), |l| {
        [1, 2].iter().all(|&j| cluster.member(l, j).is_some_and(|(state, _)| state == "alive"))
    });
    std::thread::sleep(Duration::from_secs(1));
    let after = read("after the partition");
    assert_eq!(after["lost"].as_u64(), Some(0), "{after}");
    drop(stdin);
    let status = helper.wait_timeout(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "the helper: {status:?}\n{}", helper.log_so_far());
}

// ---- 5. added latency -----------------------------------------------------------------

/// Starts `fallow bench delay-proxy` on `host` adding 5 ms each way; returns it and the
/// address it listens on.
fn start_delay_proxy(net: &Net, host: &str, listen: &str, to: &str) -> (Daemon, String) {
    Daemon::start(
        "fallow bench delay-proxy",
        net.command(host, support::BIN)
            .args(["bench", "delay-proxy", "--listen", listen, "--to", to, "--delay", "5ms"])
            .stdin(Stdio::null()),
        "`listening on` line",
        START,
        |l| {
            let rest = l.split_once("listening on ")?.1;
            Some(rest.split(',').next()?.to_string())
        },
    )
}

/// fio rounds through the cluster while every request to b and its reply wait 5 ms more
/// each; b must hold pages at the end, so the traffic did go through the proxy.
fn fio_with_a_slow_node(cluster: &Cluster, seeds: &str) {
    let mut nbd = cluster.start_nbd(seeds);
    let work = cluster.workload(&nbd);
    work.wait_passes(4, Duration::from_secs(90));
    let passes = work.finish();
    check_export(cluster, &mut nbd, &passes, 4);
    let secret = cluster.secret.to_str().unwrap();
    let b =
        cluster.stat(&["--node", &cluster.listen[B], "--secret-file", secret]).expect("stat of b");
    println!("b, behind the proxy: {b}");
    let pages = b
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == "pages" || k.as_str() == "stored_pages");
    assert!(pages.is_some_and(|(_, v)| v.as_u64().is_some_and(|n| n > 0)), "b holds no page: {b}");
}

#[test]
fn netns_fio_passes_with_a_slow_node_behind_a_delay_proxy() {
    let Some(net) = Net::netns("delay", 5, &[("nft", "nftables")]) else { return };
    let cluster = Cluster::start(net, "delay", "64M", true);
    let lab = cluster.net.lab();
    let (b, client) = (lab.host("b").ip, lab.host("client").ip);
    // In b's namespace: the proxy forwards to the node, and an nft redirect sends the
    // client's connections to the node's port to the proxy instead. The proxy's own
    // connection starts inside b's namespace, which prerouting does not see.
    let (_proxy, _) =
        start_delay_proxy(&cluster.net, "b", &format!("{b}:{PROXY_PORT}"), &cluster.listen[B]);
    let rules = format!(
        "table ip fallowt_delay {{\n\
         \tchain prerouting {{ type nat hook prerouting priority dstnat; policy accept; \
         ip saddr {client} tcp dport {NODE_PORT} counter redirect to :{PROXY_PORT}; }}\n\
         }}\n"
    );
    lab.nft("b", &rules).unwrap();
    fio_with_a_slow_node(&cluster, &cluster.seeds(None));
    let listing = lab.nft("b", "list table ip fallowt_delay\n").unwrap();
    assert!(!listing.contains("counter packets 0 "), "nothing was redirected:\n{listing}");
}

#[test]
fn loopback_fio_passes_with_a_slow_node_behind_a_delay_proxy() {
    let Some(net) = Net::loopback() else { return };
    // Without gossip the seeds are the cluster: the client reaches b only at the proxy.
    let cluster = Cluster::start(net, "loop-delay", "64M", false);
    let (_proxy, proxy) =
        start_delay_proxy(&cluster.net, "client", "127.0.0.1:0", &cluster.listen[B]);
    fio_with_a_slow_node(&cluster, &cluster.seeds(Some(&proxy)));
}
