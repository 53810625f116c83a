//! MEMBERS over the node protocol: two in-process nodes that gossip (ports chosen by the
//! OS) list each other with their capacity, a node alone lists nobody, the metrics count
//! members by state, and a node that stops cleanly is listed dead at once.

use fallow_testkit::node as support;

use std::time::{Duration, Instant};

use fallow_client::{Client, MemberInfo, MemberState};
use support::{gossiping, TestNode};

/// Asks `node` for its members until `done` holds (or panics after 5 s).
async fn wait_for(node: &TestNode, what: &str, done: impl Fn(&[MemberInfo]) -> bool) {
    let client = Client::connect(node.config()).await.unwrap();
    let start = Instant::now();
    loop {
        let members = client.members().await.unwrap();
        if done(&members) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{what}: {members:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn gossiping_nodes_list_each_other_and_a_lone_node_lists_nobody() {
    let a = gossiping(vec![]);
    let a_gossip = a.node.cluster().expect("a gossips").gossip_addr();
    assert_ne!(a_gossip.port(), 0, "an OS-chosen port beside an OS-chosen listen port");
    let b = gossiping(vec![a_gossip.to_string()]);
    wait_for(&b, "two alive members with a's capacity", |list| {
        list.len() == 2
            && list.iter().all(|m| m.state == MemberState::Alive)
            && list.iter().any(|m| m.addr == a.addr && m.lendable_bytes == 32 << 20 && !m.local)
    })
    .await;
    let members = Client::connect(b.config()).await.unwrap().members().await.unwrap();
    let me = members.iter().find(|m| m.local).expect("b lists itself");
    assert_eq!((me.addr, me.id.as_str(), me.age_ms), (b.addr, b.addr.to_string().as_str(), 0));
    wait_for(&a, "a sees b alive too", |list| {
        list.iter().filter(|m| m.state == MemberState::Alive).count() == 2
    })
    .await;
    let text = a.node.metrics().render(&a.node);
    assert!(text.contains("fallow_node_cluster_members{state=\"alive\"} 2"), "{text}");

    let alone = TestNode::start();
    let list = Client::connect(alone.config()).await.unwrap().members().await.unwrap();
    assert!(list.is_empty(), "{list:?}");

    let b_addr = b.addr;
    let stopped = Instant::now();
    drop(b); // a clean shutdown: b tells the cluster it leaves
    wait_for(&a, "b dead on a", |list| {
        list.iter().any(|m| m.addr == b_addr && m.state == MemberState::Dead)
    })
    .await;
    assert!(stopped.elapsed() < Duration::from_millis(900), "a leave is not a detection");
}
