//! Three members in one process, gossiping over 127.0.0.1 with OS-assigned ports:
//! convergence, capacity, failure detection of a member that stops without a word, a
//! restart that rejoins, a clean leave, and a stranger with another secret kept out.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fallow_cluster::{Cluster, ClusterConfig, Member, MemberEvent, MemberState};

const SECRET: &[u8] = b"membership-test-secret-0123456789";

/// The detection target of issue #5.
const DETECTION_TARGET: Duration = Duration::from_secs(1);

/// The tests here run one at a time: three clusters on two cores at once would measure
/// the scheduler, not the detector.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A member named `name`, advertising a made-up protocol port, seeded with `seeds`.
async fn member(name: &str, generation: u64, gossip: SocketAddr, seeds: &[SocketAddr]) -> Cluster {
    member_with(name, generation, gossip, seeds, SECRET).await
}

async fn member_with(
    name: &str,
    generation: u64,
    gossip: SocketAddr,
    seeds: &[SocketAddr],
    secret: &[u8],
) -> Cluster {
    let protocol: SocketAddr = format!("127.0.0.1:{}", 7400 + name.len() as u16).parse().unwrap();
    let config = ClusterConfig::builder(name, protocol, gossip, secret)
        .generation(generation)
        .seeds(seeds.iter().map(|s| s.to_string()))
        .build()
        .unwrap();
    Cluster::start(config).await.unwrap()
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn state_of(cluster: &Cluster, id: &str) -> Option<(MemberState, u64)> {
    cluster.members().into_iter().find(|m| m.id == id).map(|m| (m.state, m.generation))
}

/// Polls `done` every 10 ms until it holds; returns how long that took, or panics after
/// `limit` with `what` and the member lists.
async fn wait_for(
    what: &str,
    limit: Duration,
    watchers: &[&Cluster],
    mut done: impl FnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > limit {
            let lists: Vec<Vec<Member>> = watchers.iter().map(|c| c.members()).collect();
            panic!("{what}: not within {limit:?}; members: {lists:#?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_converge_detect_a_failure_and_take_a_restart_back() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let a = member("a", 1, any_port(), &[]).await;
    let seeds = [a.gossip_addr()];
    let b = member("bb", 1, any_port(), &seeds).await;
    let c = member("ccc", 1, any_port(), &seeds).await;
    a.update_capacity(8 << 30, 6 << 30);
    let all = [&a, &b, &c];

    let took = wait_for("three alive members everywhere", Duration::from_secs(5), &all, || {
        all.iter().all(|m| {
            let list = m.members();
            list.len() == 3 && list.iter().all(|x| x.state == MemberState::Alive)
        })
    })
    .await;
    println!("converged in {took:?}");
    wait_for("a's capacity reaches c", Duration::from_secs(2), &all, || {
        c.members().iter().any(|m| m.id == "a" && m.lendable == 8 << 30 && m.free == 6 << 30)
    })
    .await;
    let seen_by_c = c.members();
    let a_in_c = seen_by_c.iter().find(|m| m.id == "a").unwrap();
    assert_eq!(a_in_c.addr, "127.0.0.1:7401".parse().unwrap());
    assert_eq!(a_in_c.gossip_addr, a.gossip_addr());
    assert!(!a_in_c.local && seen_by_c.iter().any(|m| m.id == "ccc" && m.local));

    // Let the detector learn the pace of news before the failure.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b_gossip = b.gossip_addr();
    b.abort().await;
    let dead = |m: &Cluster| state_of(m, "bb").is_some_and(|(s, _)| s == MemberState::Dead);
    let detected = wait_for("bb declared dead by a and c", DETECTION_TARGET * 3, &[&a, &c], || {
        dead(&a) && dead(&c)
    })
    .await;
    println!("silent member declared dead in {detected:?}");
    assert!(detected <= DETECTION_TARGET, "detection took {detected:?}");
    assert_eq!(a.event_count(MemberEvent::Failed), 1);

    // It comes back on the same address with a larger generation.
    let b2 = member("bb", 2, b_gossip, &seeds).await;
    let back = |m: &Cluster| state_of(m, "bb") == Some((MemberState::Alive, 2));
    let rejoined =
        wait_for("bb generation 2 alive everywhere", Duration::from_secs(3), &all, || {
            back(&a) && back(&c) && b2.members().len() == 3
        })
        .await;
    println!("restarted member alive again in {rejoined:?}");
    assert_eq!(c.event_count(MemberEvent::Restarted), 1);
    assert!(a.members().iter().filter(|m| m.id == "bb").count() == 1, "one entry per name");

    // A clean leave is seen at once, not after the detection time.
    let left_at = Instant::now();
    b2.leave().await;
    wait_for("bb listed dead after leaving", Duration::from_secs(1), &[&a, &c], || {
        dead(&a) && dead(&c)
    })
    .await;
    println!("leave seen in {:?} (leave() itself included)", left_at.elapsed());
    assert_eq!(a.event_count(MemberEvent::Left), 1);

    let traffic = a.traffic();
    assert!(traffic.sent_bytes > 0 && traffic.received_bytes > 0);
    assert_eq!(traffic.rejected_datagrams, 0);
    a.abort().await;
    c.abort().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_another_secret_is_kept_out() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let a = member("a", 1, any_port(), &[]).await;
    let stranger =
        member_with("x", 1, any_port(), &[a.gossip_addr()], b"another-secret-0123456789").await;
    let friend = member("f", 1, any_port(), &[a.gossip_addr()]).await;
    wait_for("friend joins a", Duration::from_secs(5), &[&a], || {
        a.members().iter().any(|m| m.id == "f" && m.state == MemberState::Alive)
    })
    .await;
    wait_for("a drops the stranger's datagrams", Duration::from_secs(2), &[&a], || {
        a.traffic().rejected_datagrams > 0
    })
    .await;
    assert!(a.members().iter().all(|m| m.id != "x"), "{:?}", a.members());
    assert_eq!(stranger.members().len(), 1, "the stranger sees only itself");
    for m in [a, stranger, friend] {
        m.abort().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_hear_of_joins_but_not_of_mere_heartbeats() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let a = member("a", 1, any_port(), &[]).await;
    let mut news = a.subscribe();
    news.borrow_and_update();
    let b = member("b", 1, any_port(), &[a.gossip_addr()]).await;
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            news.changed().await.unwrap();
            if news.borrow_and_update().iter().any(|m| m.id == "b") {
                break;
            }
        }
    })
    .await
    .expect("a join is news");
    // Steady state: heartbeats alone publish nothing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    news.borrow_and_update();
    let quiet = tokio::time::timeout(Duration::from_millis(500), news.changed()).await;
    assert!(quiet.is_err(), "no news expected in a steady cluster");
    b.update_capacity(1 << 20, 1 << 19);
    tokio::time::timeout(Duration::from_secs(2), news.changed())
        .await
        .expect("a capacity change is news")
        .unwrap();
    a.abort().await;
    b.abort().await;
}
