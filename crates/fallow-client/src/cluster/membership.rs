//! Keeping the view true: the refresh asks a node for the members (MEMBERS), adopts new
//! members (a connection and every pool), retires dead ones and ones restarted as new
//! nodes, keeps the slot of a node restarted with its node id, pings nodes this client
//! found unreachable, and creates pools that some node still lacks.
//!
//! A seed that does not gossip (it answers MEMBERS with no entries, or is too old to know
//! the request) makes the seeds themselves the cluster: each is a member, always "alive"
//! for membership, and only this client's own failed requests and pings say otherwise.

use std::sync::Arc;
use std::time::Instant;

use fallow_core::{PoolId, PoolSpec};
use fallow_proto::fallow::{MemberInfo, MemberState, Status};

use super::client::{unreachable, Inner, ORPHANS_KEPT};
use super::placement::node_seed;
use super::summary::Slot;
use super::view::{Kind, NodeEntry, NodeLink};
use crate::session::Numbering;
use crate::{Client, ClientError, Endpoint};

/// A member as the refresh needs it.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    id: String,
    endpoint: Endpoint,
    generation: u64,
    state: MemberState,
    capacity: Option<(u64, u64)>,
}

/// A newly connected node and the pools made on it (logical id, its id there).
type Adopted = (Member, Client, u128, Vec<(PoolId, PoolId)>);

/// Pools a node lacks: logical id and spec.
type Missing = Vec<(PoolId, PoolSpec)>;

/// What a node listed under a newer generation turned out to be ([`Inner::rejoin`]).
enum Rejoin {
    /// The same node id: restarted with its pools; it keeps its slot.
    SameNode,
    /// Another node id: a new node, retired and adopted afresh.
    NewNode,
    /// It did not answer: down until a ping finds it.
    Unreachable,
}

impl Inner {
    /// One refresh: members, adoptions and retirements, pings, missing pools.
    pub(crate) async fn refresh(&self) {
        let _admin = self.admin.lock().await;
        match self.fetch_members().await {
            Ok(members) => {
                self.reconcile(members).await;
            }
            Err(err) => tracing::debug!(%err, "no node or seed answered MEMBERS"),
        }
        self.probe_down().await;
        self.ensure_pools().await;
    }

    /// The members, from the first usable node or seed that answers.
    pub(crate) async fn fetch_members(&self) -> Result<Vec<Member>, ClientError> {
        let links: Vec<Arc<NodeLink>> = {
            let view = self.view.read();
            view.nodes.iter().filter(|n| n.usable()).map(|n| n.link.clone()).collect()
        };
        let mut last = None;
        for link in links {
            match self.members_from(link.client.members().await) {
                Ok(members) => return Ok(members),
                Err(err) => {
                    if unreachable(&err) {
                        self.absorb(&link, &err);
                    }
                    last = Some(err);
                }
            }
        }
        for seed in &self.config.seeds {
            let answer = match Client::connect(self.config.node(seed.clone())).await {
                Ok(client) => client.members().await,
                Err(err) => Err(err),
            };
            match self.members_from(answer) {
                Ok(members) => return Ok(members),
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or(ClientError::Disconnected))
    }

    /// A MEMBERS answer as members: the seeds, when the node does not gossip.
    fn members_from(
        &self,
        answer: Result<Vec<MemberInfo>, ClientError>,
    ) -> Result<Vec<Member>, ClientError> {
        let list = match answer {
            Ok(list) => list,
            Err(ClientError::Refused { status: Status::UnknownOp, .. }) => Vec::new(),
            Err(err) => return Err(err),
        };
        if list.is_empty() {
            return Ok(self
                .config
                .seeds
                .iter()
                .map(|seed| Member {
                    id: seed.to_string(),
                    endpoint: seed.clone(),
                    generation: 0,
                    state: MemberState::Alive,
                    capacity: None,
                })
                .collect());
        }
        Ok(list
            .into_iter()
            .map(|m| Member {
                endpoint: Endpoint::Tcp(m.addr.to_string()),
                id: m.id,
                generation: m.generation,
                state: m.state,
                capacity: Some((m.lendable_bytes, m.free_bytes)),
            })
            .collect())
    }

    /// Brings the view in line with `members`; returns the first error met connecting to
    /// a new member, if any.
    ///
    /// A member list is one node's view, and it may lag: a node restarted a moment ago
    /// has not heard from its peers yet, and another may still list the restarted node
    /// under its old generation. So a node is retired only on evidence: the list says it
    /// is dead (at the generation this client uses, or later) and this client cannot
    /// reach it either, or it is absent from the list and unreachable. A node listed under a newer
    /// generation has restarted: if it answers with the node id this client knows, it
    /// came back from its state directory with its pools and persistent pages, and keeps
    /// its slot ([`Inner::rejoin`]); with another id it is a new node, retired here and
    /// adopted afresh.
    pub(crate) async fn reconcile(&self, members: Vec<Member>) -> Option<ClientError> {
        let (mut retire, mut restarted, listed_dead) = {
            let view = self.view.read();
            let mut retire = Vec::new();
            let mut restarted = Vec::new();
            let mut listed_dead = Vec::new();
            for entry in &view.nodes {
                match members.iter().find(|m| m.id == entry.link.id) {
                    // Older news of it (the answering node has not heard of the restart).
                    Some(m) if m.generation < entry.generation => {}
                    // Dead in the list, but this client still reaches it: it may be back
                    // already under a newer generation that the list does not know yet.
                    Some(m) if m.state == MemberState::Dead && !entry.link.is_down() => {
                        listed_dead.push(entry.link.clone())
                    }
                    Some(m) if m.state == MemberState::Dead => retire.push(entry.link.slot),
                    Some(m) if m.generation > entry.generation => {
                        restarted.push((entry.link.clone(), m.clone()))
                    }
                    Some(_) => {}
                    None if entry.link.is_down() => retire.push(entry.link.slot),
                    // Not heard of by the node that answered, but this client reaches it.
                    None => {}
                }
            }
            (retire, restarted, listed_dead)
        };
        // Its own view of itself decides: a newer generation is a restart (checked below
        // like any other). The same one is a node its peers lost sight of (a partition,
        // or a host too busy to gossip in time) that still runs and answers this client:
        // it stays, listed dead, so out of placement, until gossip hears from it again;
        // its persistent copies are still read. Retiring it would forget those copies
        // and destroy its pools once it is back, and two holders falsely declared dead
        // at once would lose the page. No answer, or a node that says it is leaving:
        // retired.
        let own = listed_dead.iter().map(|link| self.own_entry(link));
        for (link, own) in listed_dead.iter().zip(futures::future::join_all(own).await) {
            let known = self.view.read().node(link.slot).map(|n| n.generation);
            match own {
                Some(me) if known.is_some_and(|g| me.generation > g) => {
                    restarted.push((link.clone(), me))
                }
                Some(_) => {}
                None => retire.push(link.slot),
            }
        }
        let checks = restarted.iter().map(|(link, _)| self.rejoin(link));
        let mut new_runs = Vec::new();
        for ((link, member), rejoined) in
            restarted.iter().zip(futures::future::join_all(checks).await)
        {
            match rejoined {
                Rejoin::SameNode => tracing::info!(
                    node = %link.id, generation = member.generation,
                    "node restarted with its pools and persistent pages (same node id)"
                ),
                Rejoin::NewNode => new_runs.push(link.slot),
                // Skipped until it answers a ping; its generation is looked at again then.
                Rejoin::Unreachable => continue,
            }
            if let Some(entry) =
                self.view.write().nodes.iter_mut().find(|n| n.link.slot == link.slot)
            {
                entry.generation = member.generation;
            }
        }
        self.retire(&new_runs, "restarted as a new node");
        {
            let mut view = self.view.write();
            for entry in &mut view.nodes {
                if let Some(m) = members
                    .iter()
                    .find(|m| m.id == entry.link.id && m.generation == entry.generation)
                {
                    entry.state = m.state;
                    entry.capacity = m.capacity;
                }
            }
        }
        self.retire(&retire, "dead, or gone and unreachable");
        let adopt: Vec<Member> = {
            let view = self.view.read();
            members
                .iter()
                .filter(|m| m.state != MemberState::Dead)
                .filter(|m| !view.nodes.iter().any(|n| n.link.id == m.id))
                .cloned()
                .collect()
        };
        let joined = futures::future::join_all(adopt.into_iter().map(|m| self.adopt(m))).await;
        let mut first_error = None;
        let mut view = self.view.write();
        let mut summary = self.summary.lock();
        for result in joined {
            let (member, client, node_id, pools) = match result {
                Ok(adopted) => adopted,
                Err((id, err)) => {
                    tracing::debug!(node = %id, %err, "cannot reach a member yet");
                    first_error = first_error.or(Some(err));
                    continue;
                }
            };
            let Some(slot) = summary.allocate_slot() else {
                tracing::warn!(node = %member.id, "every node slot is taken; not using the node");
                continue;
            };
            let link = Arc::new(NodeLink::new(slot, member.id.clone(), client, node_id));
            for (logical, id) in pools {
                match view.pools.get_mut(&logical) {
                    Some(pool) => {
                        pool.on.insert(slot, id);
                    }
                    None => link.orphans.lock().push(id),
                }
            }
            tracing::info!(node = %member.id, slot, "node joined the placement");
            view.nodes.push(NodeEntry {
                link,
                generation: member.generation,
                seed: node_seed(&member.id),
                state: member.state,
                capacity: member.capacity,
            });
        }
        first_error
    }

    /// Connects to a new member and creates every ephemeral pool there.
    async fn adopt(&self, member: Member) -> Result<Adopted, (String, ClientError)> {
        let failed = |err| (member.id.clone(), err);
        let session = self.retired_sessions.lock().get(&member.id).map(|(_, n)| n.clone());
        let numbering = session.unwrap_or_else(|| Arc::new(Numbering::new()));
        let config = self.config.node(member.endpoint.clone());
        let client = Client::connect_in(config, numbering).await.map_err(failed)?;
        let node_id = client.node_id().await.map_err(failed)?;
        // A node this client retired, seen again with the same node id (a healed
        // partition, or a restart from its state directory after it was declared dead):
        // the pools it had go first, as the summary no longer points into them.
        let old = self.orphans.lock().remove(&node_id);
        for pool in old.map(|(_, pools)| pools).unwrap_or_default() {
            let _ = client.destroy_pool(pool).await;
        }
        let specs: Vec<(PoolId, PoolSpec)> = {
            let view = self.view.read();
            view.pools
                .iter()
                .filter(|(_, p)| p.home.is_none())
                .map(|(id, p)| (*id, p.spec))
                .collect()
        };
        let mut pools = Vec::new();
        for (logical, spec) in specs {
            match client.create_pool(&spec).await {
                Ok(id) => pools.push((logical, id)),
                // The next refresh tries again.
                Err(err) => tracing::debug!(node = %member.id, %err, "creating a pool failed"),
            }
        }
        Ok((member, client, node_id, pools))
    }

    /// Takes nodes out of the view: their summary entries read as misses from now on,
    /// and their pools are remembered in case the same run of the node comes back. The
    /// repair is woken to re-create the persistent copies they held.
    pub(crate) fn retire(&self, slots: &[Slot], why: &str) {
        if slots.is_empty() {
            return;
        }
        let mut view = self.view.write();
        let mut summary = self.summary.lock();
        let mut orphans = self.orphans.lock();
        orphans.retain(|_, (since, _)| since.elapsed() < ORPHANS_KEPT);
        let mut sessions = self.retired_sessions.lock();
        sessions.retain(|_, (since, _)| since.elapsed() < ORPHANS_KEPT);
        for &slot in slots {
            let Some(at) = view.nodes.iter().position(|n| n.link.slot == slot) else { continue };
            let entry = view.nodes.remove(at);
            summary.retire(slot);
            let mut pools: Vec<PoolId> = std::mem::take(&mut *entry.link.orphans.lock());
            pools.extend(view.pools.values_mut().filter_map(|p| p.on.remove(&slot)));
            orphans.insert(entry.link.node_id, (Instant::now(), pools));
            let numbering = entry.link.client.numbering().clone();
            sessions.insert(entry.link.id.clone(), (Instant::now(), numbering));
            tracing::info!(node = %entry.link.id, slot, why, "node left the placement");
        }
        self.repair_wake.notify_one();
    }

    /// Pings every node found unreachable; one that answers as the same node is used
    /// again ([`Inner::welcome_back`]), one that answers with another node id is retired.
    async fn probe_down(&self) {
        let down: Vec<Arc<NodeLink>> = {
            let view = self.view.read();
            view.nodes
                .iter()
                .filter(|n| n.link.is_down() && n.state != MemberState::Dead)
                .map(|n| n.link.clone())
                .collect()
        };
        let probes = down.iter().map(|link| async move {
            match link.client.ping().await {
                Ok(_) => {}
                Err(ClientError::NodeRestarted { .. }) => return Some(link.slot),
                Err(_) => return None,
            }
            if self.welcome_back(link).await {
                tracing::info!(node = %link.id, "node answers again");
            }
            None
        });
        let restarted: Vec<Slot> =
            futures::future::join_all(probes).await.into_iter().flatten().collect();
        self.retire(&restarted, "restarted as a new node");
    }

    /// A node's entry for itself in its own MEMBERS answer, if it gives one.
    async fn own_entry(&self, link: &NodeLink) -> Option<Member> {
        let answer = link.client.members().await;
        let members = self.members_from(answer).ok()?;
        members.into_iter().find(|m| m.id == link.id && m.state != MemberState::Dead)
    }

    /// Whether a node gossip lists under a newer generation is still the node this client
    /// knows: a ping reconnects, and a connection refuses a node id other than the one
    /// its first connection saw ([`crate::NodeRestart::Refuse`]). A node restarted from
    /// its state directory keeps its node id, its pool ids and its persistent pages.
    async fn rejoin(&self, link: &NodeLink) -> Rejoin {
        match link.client.ping().await {
            Ok(_) => {}
            Err(ClientError::NodeRestarted { .. }) => return Rejoin::NewNode,
            Err(err) => {
                self.absorb(link, &err);
                return Rejoin::Unreachable;
            }
        }
        match self.welcome_back(link).await {
            true => Rejoin::SameNode,
            false => Rejoin::Unreachable,
        }
    }

    /// Makes a node that was away usable again; false if it could not be done (it
    /// failed again). Pools destroyed while it was away are destroyed there, and its
    /// shared ephemeral pools are emptied: other clients may have written keys meanwhile
    /// that it holds older copies of (from before it was cut off, or from the snapshot a
    /// clean restart loaded), and could not invalidate them there.
    async fn welcome_back(&self, link: &NodeLink) -> bool {
        let shared: Vec<PoolId> = {
            let view = self.view.read();
            view.pools
                .values()
                .filter(|p| p.kind() == Kind::Shared)
                .filter_map(|p| p.on.get(&link.slot).copied())
                .collect()
        };
        let orphans = std::mem::take(&mut *link.orphans.lock());
        for pool in orphans {
            let _ = link.client.destroy_pool(pool).await;
        }
        for pool in shared {
            if let Err(err) = link.client.invalidate_pool(pool).await {
                self.absorb(link, &err);
                return false;
            }
        }
        link.mark_up();
        true
    }

    /// Creates every ephemeral pool on the usable nodes that lack it (creation failed
    /// there earlier, or the node lost it).
    async fn ensure_pools(&self) {
        let work: Vec<(Arc<NodeLink>, Missing)> = {
            let view = self.view.read();
            view.nodes
                .iter()
                .filter(|n| n.usable())
                .map(|n| {
                    let missing = view
                        .pools
                        .iter()
                        .filter(|(_, p)| p.home.is_none() && !p.on.contains_key(&n.link.slot))
                        .map(|(id, p)| (*id, p.spec))
                        .collect::<Vec<_>>();
                    (n.link.clone(), missing)
                })
                .filter(|(_, missing)| !missing.is_empty())
                .collect()
        };
        let creations = work.iter().map(|(link, missing)| async move {
            let mut made = Vec::new();
            for (logical, spec) in missing {
                match link.client.create_pool(spec).await {
                    Ok(id) => made.push((*logical, id)),
                    Err(err) => {
                        self.absorb(link, &err);
                        break;
                    }
                }
            }
            made
        });
        let results = futures::future::join_all(creations).await;
        let mut view = self.view.write();
        for ((link, _), made) in work.iter().zip(results) {
            for (logical, id) in made {
                match view.pools.get_mut(&logical) {
                    Some(pool) if !pool.on.contains_key(&link.slot) => {
                        pool.on.insert(link.slot, id);
                    }
                    _ => link.orphans.lock().push(id),
                }
            }
        }
    }
}
