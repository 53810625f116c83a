//! What a run through the cluster client adds to the report: snapshots of the client
//! (its nodes, the size of its summary of placed pages) and a timeline
//! of node state changes as the client saw them.
//!
//! The watcher polls [`ClusterClient::nodes`] every [`WATCH_EVERY`] and records each
//! change, so a node killed mid-run shows when the client first found it unreachable
//! (`down`: a request to it failed) and when membership dropped it (`suspect`, or `gone`
//! from the client's view). Polling costs one read lock and a few small allocations per
//! tick, on the load generator's runtime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fallow_client::{ClusterClient, ClusterNode, NodeState};
use tokio::task::JoinHandle;

/// How often the watcher looks at the client's nodes.
const WATCH_EVERY: Duration = Duration::from_millis(2);
/// The most events kept: a flapping node cannot grow the report without bound.
const MAX_EVENTS: usize = 10_000;

/// One node as the cluster client sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NodeReport {
    /// The member's name (its protocol address).
    pub id: String,
    /// `alive`, `suspect` or `down`.
    pub state: String,
    /// Its placement weight.
    pub weight: f64,
    /// Bytes it lends, as gossiped (`None`: a node outside a cluster).
    pub lendable: Option<u64>,
    /// Of these, bytes free, as gossiped.
    pub free: Option<u64>,
    /// Pages this client's summary places there.
    pub pages: u64,
}

/// The client at one moment of the run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClusterSnapshot {
    /// Pages in the summary (entries of nodes that evicted them included, until a get
    /// misses).
    pub summary_pages: u64,
    /// Objects with at least one page in the summary.
    pub summary_objects: usize,
    /// Heap bytes of the summary, by its own accounting.
    pub summary_heap_bytes: usize,
    /// Every node the client knows.
    pub nodes: Vec<NodeReport>,
}

/// A node's state changed (or it appeared or left the client's view).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeEvent {
    /// When the watcher saw it, in ns since the Unix epoch (up to [`WATCH_EVERY`] late).
    pub unix_ns: u64,
    /// The node.
    pub node: String,
    /// `alive`, `suspect`, `down`, or `gone` (no longer in the client's view).
    pub state: String,
}

/// What a cluster run adds to [`super::PagesReport`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClusterReport {
    /// Right after connecting (the pool created, nothing put).
    pub connected: ClusterSnapshot,
    /// After the warm-up, if there was one.
    pub after_warmup: Option<ClusterSnapshot>,
    /// After the measured phase.
    pub end: ClusterSnapshot,
    /// Node state changes from connecting to the end, oldest first.
    pub events: Vec<NodeEvent>,
}

fn state_name(state: NodeState) -> &'static str {
    match state {
        NodeState::Alive => "alive",
        NodeState::Suspect => "suspect",
        NodeState::Down => "down",
    }
}

fn node_report(n: &ClusterNode) -> NodeReport {
    NodeReport {
        id: n.id.clone(),
        state: state_name(n.state).to_string(),
        weight: n.weight,
        lendable: n.capacity.map(|c| c.0),
        free: n.capacity.map(|c| c.1),
        pages: n.pages,
    }
}

/// The client now.
pub(crate) fn snapshot(client: &ClusterClient) -> ClusterSnapshot {
    let summary = client.summary();
    ClusterSnapshot {
        summary_pages: summary.pages,
        summary_objects: summary.objects,
        summary_heap_bytes: summary.heap_bytes,
        nodes: client.nodes().iter().map(node_report).collect(),
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Records the client's node state changes until stopped.
#[derive(Debug)]
pub(crate) struct Watcher {
    events: Arc<Mutex<Vec<NodeEvent>>>,
    task: JoinHandle<()>,
}

impl Watcher {
    /// Starts watching `client` (within a tokio runtime); the first look records every
    /// node's state.
    pub(crate) fn start(client: ClusterClient) -> Self {
        let events = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn(watch(client, events.clone()));
        Watcher { events, task }
    }

    /// The events so far, oldest first.
    pub(crate) fn events(&self) -> Vec<NodeEvent> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn watch(client: ClusterClient, events: Arc<Mutex<Vec<NodeEvent>>>) {
    let mut known: HashMap<String, &'static str> = HashMap::new();
    let mut ticks = tokio::time::interval(WATCH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let now = unix_ns();
        let nodes = client.nodes();
        let mut seen = Vec::new();
        for n in &nodes {
            let state = state_name(n.state);
            if known.insert(n.id.clone(), state) != Some(state) {
                seen.push(NodeEvent { unix_ns: now, node: n.id.clone(), state: state.into() });
            }
        }
        known.retain(|id, _| {
            let present = nodes.iter().any(|n| &n.id == id);
            if !present {
                seen.push(NodeEvent { unix_ns: now, node: id.clone(), state: "gone".into() });
            }
            present
        });
        if !seen.is_empty() {
            let Ok(mut events) = events.lock() else { return };
            let room = MAX_EVENTS.saturating_sub(events.len());
            events.extend(seen.into_iter().take(room));
        }
    }
}
