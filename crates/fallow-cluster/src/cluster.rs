//! The running member: chitchat's gossip task on the authenticated socket, and a watcher
//! task that turns chitchat's state into the member list, logs what changed and applies
//! capacity updates.
//!
//! ```text
//!  chitchat task ── UDP (sealed) ─ peers        every gossip interval: SYN to ≤ 3 members
//!     ▲ Arc<tokio Mutex<Chitchat>>
//!  watcher task (every gossip interval): capacity → own state; state → Vec<Member>
//!     │                                   events → tracing + counters
//!     ▼
//!  latest list (std Mutex) ── members()     watch::Sender ── subscribe()  (on news only)
//! ```
//!
//! # Locking
//! `Shared::latest` is a `std::sync::Mutex` held only to copy or replace the list. The
//! chitchat state is behind chitchat's `tokio::sync::Mutex`; the watcher holds it for one
//! snapshot per tick and never together with `latest`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chitchat::{
    spawn_chitchat, Chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig,
    Heartbeat,
};
use tokio::sync::watch;

use crate::member::{self, keys, Member, MemberEvent, Observed};
use crate::transport::{AuthenticatedUdp, GossipKey, GossipTraffic, TrafficCounters};
use crate::{ClusterConfig, ClusterError};

/// chitchat's cluster name. Not a defence: the seal of every datagram is.
const CLUSTER_ID: &str = "fallow";

/// A running cluster member. Cheap to clone; every clone is the same member. The member
/// stops when [`Cluster::leave`] or [`Cluster::abort`] is called, or when the last clone
/// is dropped (then without announcing it).
#[derive(Clone, Debug)]
pub struct Cluster {
    inner: Arc<Inner>,
}

struct Inner {
    config: ClusterConfig,
    gossip_addr: SocketAddr,
    shared: Arc<Shared>,
    chitchat: Arc<tokio::sync::Mutex<Chitchat>>,
    /// `None` once stopped. A std mutex: held only to take the handle out.
    handle: Mutex<Option<ChitchatHandle>>,
    capacity: watch::Sender<Capacity>,
    /// Dropping it (or sending) stops the watcher.
    stop: watch::Sender<bool>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("node_id", &self.config.node_id)
            .field("generation", &self.config.generation)
            .field("gossip_addr", &self.gossip_addr)
            .finish_non_exhaustive()
    }
}

/// What the watcher publishes and the handle reads.
#[derive(Debug)]
struct Shared {
    /// The list as of the last tick (`last_update` fresh). Lock: see the module doc.
    latest: Mutex<Vec<Member>>,
    /// Sent when a member's state, generation, address or capacity changed.
    news: watch::Sender<Vec<Member>>,
    /// One counter per [`MemberEvent`], indexed by its discriminant (`MemberEvent::ALL`
    /// order).
    events: [AtomicU64; MemberEvent::ALL.len()],
    traffic: Arc<TrafficCounters>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Capacity {
    lendable: u64,
    free: u64,
}

impl Cluster {
    /// Binds the gossip socket, starts gossiping (contacting the seeds) and returns the
    /// handle. The member lists only itself until the first exchange with a peer.
    pub async fn start(config: ClusterConfig) -> Result<Cluster, ClusterError> {
        let socket = tokio::net::UdpSocket::bind(config.gossip_addr)
            .await
            .map_err(|source| ClusterError::Bind { addr: config.gossip_addr, source })?;
        let gossip_addr = socket
            .local_addr()
            .map_err(|source| ClusterError::Bind { addr: config.gossip_addr, source })?;
        let traffic = Arc::new(TrafficCounters::default());
        let transport =
            AuthenticatedUdp::new(socket, GossipKey::derive(&config.secret), traffic.clone());
        let chitchat_config = chitchat_config(&config, gossip_addr);
        let initial = vec![
            (keys::ADDR.to_string(), config.protocol_addr.to_string()),
            (keys::LENDABLE.to_string(), "0".to_string()),
            (keys::FREE.to_string(), "0".to_string()),
        ];
        let handle = spawn_chitchat(chitchat_config, initial, &transport)
            .await
            .map_err(|e| ClusterError::Start(format!("{e:#}")))?;
        let chitchat = handle.chitchat();
        let (news, _) = watch::channel(Vec::new());
        let shared = Arc::new(Shared {
            latest: Mutex::new(Vec::new()),
            news,
            events: Default::default(),
            traffic,
        });
        let (capacity, capacity_rx) = watch::channel(Capacity::default());
        let (stop, stop_rx) = watch::channel(false);
        let mut watcher = Watcher {
            chitchat: chitchat.clone(),
            shared: shared.clone(),
            suspect_after: config.suspect_after,
            interval: config.gossip_interval,
            capacity: capacity_rx,
            stop: stop_rx,
            heard: HashMap::new(),
            ever_live: HashSet::new(),
        };
        // The first list (just this member) is there before `start` returns.
        watcher.tick().await;
        tokio::spawn(watcher.run());
        tracing::info!(
            node = %config.node_id,
            generation = config.generation,
            gossip = %gossip_addr,
            seeds = %config.seeds.join(","),
            "gossiping"
        );
        let inner = Inner {
            config,
            gossip_addr,
            shared,
            chitchat,
            handle: Mutex::new(Some(handle)),
            capacity,
            stop,
        };
        Ok(Cluster { inner: Arc::new(inner) })
    }

    /// Every member known, this one included, sorted by id; `last_update` is at most one
    /// gossip interval old.
    pub fn members(&self) -> Vec<Member> {
        lock(&self.inner.shared.latest).clone()
    }

    /// A receiver that sees a new list whenever a member joins, restarts, changes state or
    /// capacity, or is forgotten (not when only `last_update` moves).
    pub fn subscribe(&self) -> watch::Receiver<Vec<Member>> {
        self.inner.shared.news.subscribe()
    }

    /// Publishes this member's capacity: `lendable` bytes lent, `free` of them not holding
    /// pages. Applied at the next tick (within one gossip interval); only a changed value
    /// costs gossip.
    pub fn update_capacity(&self, lendable: u64, free: u64) {
        self.inner.capacity.send_replace(Capacity { lendable, free });
    }

    /// This member's name.
    pub fn local_id(&self) -> &str {
        &self.inner.config.node_id
    }

    /// This run's generation.
    pub fn generation(&self) -> u64 {
        self.inner.config.generation
    }

    /// The UDP address gossip is bound to (with the port the OS chose for port 0).
    pub fn gossip_addr(&self) -> SocketAddr {
        self.inner.gossip_addr
    }

    /// The settings it runs with.
    pub fn config(&self) -> &ClusterConfig {
        &self.inner.config
    }

    /// Gossip datagrams and bytes since start.
    pub fn traffic(&self) -> GossipTraffic {
        self.inner.shared.traffic.snapshot()
    }

    /// How many times `event` happened since start.
    pub fn event_count(&self, event: MemberEvent) -> u64 {
        self.inner.shared.events.get(event as usize).map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// Leaves the cluster: tells the others (they list this member dead at once instead
    /// of after the detection time), gossips for two more intervals so that they hear it,
    /// then stops. Does nothing if already stopped.
    pub async fn leave(&self) {
        if lock(&self.inner.handle).is_none() {
            return;
        }
        self.inner.chitchat.lock().await.self_node_state().set(keys::LEAVING, "1");
        tokio::time::sleep(self.inner.config.gossip_interval * 2).await;
        self.stop().await;
        tracing::info!(node = %self.inner.config.node_id, "left the cluster");
    }

    /// Stops gossiping without a word, as a crash would look to the others: they declare
    /// this member dead after the detection time.
    pub async fn abort(&self) {
        self.stop().await;
    }

    async fn stop(&self) {
        let handle = lock(&self.inner.handle).take();
        if let Some(handle) = handle {
            if let Err(err) = handle.shutdown().await {
                tracing::warn!(error = %format!("{err:#}"), "gossip task ended with an error");
            }
        }
        self.inner.stop.send_replace(true);
    }
}

/// chitchat's settings for `config`, gossiping on the bound `gossip_addr`.
fn chitchat_config(config: &ClusterConfig, gossip_addr: SocketAddr) -> ChitchatConfig {
    ChitchatConfig {
        chitchat_id: ChitchatId::new(config.node_id.clone(), config.generation, gossip_addr),
        cluster_id: CLUSTER_ID.to_string(),
        gossip_interval: config.gossip_interval,
        listen_addr: gossip_addr,
        seed_nodes: config.seeds.clone(),
        failure_detector_config: FailureDetectorConfig {
            phi_threshold: config.phi_threshold,
            // Some eight seconds of news at three members: the mean follows a changed
            // pace quickly.
            sampling_window_size: 200,
            // A longer gap (the rounds before a join settles, a stall, a partition) is
            // not a sample: it would inflate the mean and slow the next detection.
            max_interval: config.gossip_interval * 3,
            // The prior of the mean, weighted as 5 samples. News of a member arrives
            // about twice per round even at two members (its SYN, its SYN-ACK), so a
            // half interval keeps the prior from slowing detection after a join.
            initial_interval: config.gossip_interval / 2,
            dead_node_grace_period: config.dead_member_ttl,
        },
        marked_for_deletion_grace_period: Duration::from_secs(3600),
        catchup_callback: None,
        extra_liveness_predicate: None,
    }
}

/// Locks a std mutex; a poisoned one still holds a consistent list (every writer replaces
/// it whole), so the poison is ignored.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The task that keeps [`Shared`] current.
struct Watcher {
    chitchat: Arc<tokio::sync::Mutex<Chitchat>>,
    shared: Arc<Shared>,
    suspect_after: Duration,
    interval: Duration,
    capacity: watch::Receiver<Capacity>,
    stop: watch::Receiver<bool>,
    /// Per chitchat id: the newest heartbeat and version seen, and when they last grew.
    heard: HashMap<ChitchatId, (Heartbeat, u64, Instant)>,
    /// Chitchat ids seen in the live set at least once.
    ever_live: HashSet<ChitchatId>,
}

impl Watcher {
    async fn run(mut self) {
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = self.stop.changed() => {
                    if changed.is_err() || *self.stop.borrow() {
                        return;
                    }
                }
                _ = ticks.tick() => self.tick().await,
            }
        }
    }

    async fn tick(&mut self) {
        let now = Instant::now();
        let observed = {
            let shared_state = self.chitchat.clone();
            let mut chitchat = shared_state.lock().await;
            if self.capacity.has_changed().unwrap_or(false) {
                let c = *self.capacity.borrow_and_update();
                let own = chitchat.self_node_state();
                own.set(keys::LENDABLE, c.lendable);
                own.set(keys::FREE, c.free);
            }
            self.observe(&chitchat, now)
        };
        let leaving: HashSet<(String, u64)> =
            observed.iter().filter(|o| o.leaving).map(|o| (o.id.clone(), o.generation)).collect();
        let list = member::members(observed, now, self.suspect_after);
        let before = std::mem::replace(&mut *lock(&self.shared.latest), list.clone());
        let changed =
            before.len() != list.len() || before.iter().zip(&list).any(|(a, b)| !a.same_news(b));
        if changed {
            let left = |m: &Member| leaving.contains(&(m.id.clone(), m.generation));
            for (event, member) in member::events(&before, &list, left) {
                if let Some(count) = self.shared.events.get(event as usize) {
                    count.fetch_add(1, Ordering::Relaxed);
                }
                log_event(event, member);
            }
            self.shared.news.send_replace(list);
        }
    }

    /// chitchat's view reduced to [`Observed`], updating when each member was last heard of.
    fn observe(&mut self, chitchat: &Chitchat, now: Instant) -> Vec<Observed> {
        let own = chitchat.self_chitchat_id().clone();
        let live: HashSet<&ChitchatId> = chitchat.live_nodes().collect();
        let states = chitchat.node_states();
        self.heard.retain(|id, _| states.contains_key(id));
        self.ever_live.retain(|id| states.contains_key(id));
        let mut out = Vec::with_capacity(states.len());
        for (id, state) in states {
            let (heartbeat, version) = (state.heartbeat(), state.max_version());
            let heard = self.heard.entry(id.clone()).or_insert((heartbeat, version, now));
            if heartbeat > heard.0 || version > heard.1 {
                *heard = (heartbeat, version, now);
            }
            let is_live = live.contains(id);
            if is_live {
                self.ever_live.insert(id.clone());
            }
            let number = |key| state.get(key).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            out.push(Observed {
                id: id.node_id.to_string(),
                generation: id.generation_id,
                gossip_addr: id.gossip_advertise_addr,
                addr: state.get(keys::ADDR).and_then(|a| a.parse().ok()),
                lendable: number(keys::LENDABLE),
                free: number(keys::FREE),
                leaving: state.get(keys::LEAVING).is_some(),
                live: is_live,
                ever_live: self.ever_live.contains(id),
                last_heard: heard.2,
                local: *id == own,
            });
        }
        out
    }
}

fn log_event(event: MemberEvent, m: &Member) {
    let (id, addr, generation) = (&m.id, m.addr, m.generation);
    match event {
        MemberEvent::Joined => tracing::info!(member = %id, %addr, generation, "member joined"),
        MemberEvent::Restarted => {
            tracing::info!(member = %id, %addr, generation, "member restarted and rejoined")
        }
        MemberEvent::Suspected => tracing::info!(member = %id, %addr, "member suspected: silent"),
        MemberEvent::Recovered => tracing::info!(member = %id, %addr, "member alive again"),
        MemberEvent::Failed => tracing::warn!(member = %id, %addr, "member failed: declared dead"),
        MemberEvent::Left => tracing::info!(member = %id, %addr, "member left"),
        MemberEvent::Forgotten => tracing::info!(member = %id, %addr, "dead member forgotten"),
    }
}
