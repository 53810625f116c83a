//! What a member looks like to the rest of fallow, and how chitchat's view (node states
//! keyed by name and generation, a live set) becomes that list.
//!
//! # Semantics
//! * One entry per member name: the newest generation heard of. A restarted member
//!   replaces its old self as soon as the new generation is live; until then the old
//!   generation is listed (dead).
//! * `Alive`: chitchat's detector says live and news of it came within `suspect_after`.
//!   `Suspect`: live, but silent for longer. `Dead`: the detector gave up on it, or it said
//!   it was leaving.
//! * A member never seen live is not listed yet: chitchat learns names from digests before
//!   their state arrives, and a member with no address is of no use to anyone.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Gossip keys of a member's state. Values are decimal text, as chitchat stores strings.
pub(crate) mod keys {
    /// The node-protocol address, `IP:PORT`.
    pub const ADDR: &str = "addr";
    /// Bytes the node lends (its budget).
    pub const LENDABLE: &str = "lendable";
    /// Bytes of the budget not holding pages.
    pub const FREE: &str = "free";
    /// Present when the member is stopping on purpose.
    pub const LEAVING: &str = "leaving";
}

pub use fallow_core::MemberState;

/// One member of the cluster, as this member sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The member's name, stable across restarts (a node's protocol address by default).
    pub id: String,
    /// Which run of the member this is: larger after a restart.
    pub generation: u64,
    /// Where clients reach it (the node protocol, TCP).
    pub addr: SocketAddr,
    /// Where it gossips (UDP).
    pub gossip_addr: SocketAddr,
    /// Alive, suspect or dead.
    pub state: MemberState,
    /// Bytes it lends: its budget, which follows its host's memory pressure.
    pub lendable: u64,
    /// Bytes of that budget not holding pages.
    pub free: u64,
    /// When this member last heard news of it (a newer heartbeat or state); for the local
    /// member, now.
    pub last_update: Instant,
    /// True for the member this list comes from.
    pub local: bool,
}

impl Member {
    /// True when anything but `last_update` differs: what subscribers are told about.
    pub(crate) fn same_news(&self, other: &Member) -> bool {
        Member { last_update: other.last_update, ..self.clone() } == *other
    }
}

/// One node state as chitchat holds it, reduced to what the list needs.
#[derive(Debug, Clone)]
pub(crate) struct Observed {
    pub id: String,
    pub generation: u64,
    pub gossip_addr: SocketAddr,
    /// The values of [`keys`] it has, if any.
    pub addr: Option<SocketAddr>,
    pub lendable: u64,
    pub free: u64,
    pub leaving: bool,
    /// In chitchat's live set.
    pub live: bool,
    /// Seen in the live set at some point.
    pub ever_live: bool,
    pub last_heard: Instant,
    pub local: bool,
}

/// The member list from chitchat's view at `now`, sorted by id.
pub(crate) fn members(
    observed: impl IntoIterator<Item = Observed>,
    now: Instant,
    suspect_after: Duration,
) -> Vec<Member> {
    let mut newest: BTreeMap<String, Member> = BTreeMap::new();
    for o in observed {
        let Some(addr) = o.addr else { continue };
        let state = if o.local {
            MemberState::Alive
        } else if o.leaving || !o.live {
            if !o.ever_live && !o.leaving {
                continue;
            }
            MemberState::Dead
        } else if now.saturating_duration_since(o.last_heard) > suspect_after {
            MemberState::Suspect
        } else {
            MemberState::Alive
        };
        let member = Member {
            id: o.id,
            generation: o.generation,
            addr,
            gossip_addr: o.gossip_addr,
            state,
            lendable: o.lendable,
            free: o.free,
            last_update: if o.local { now } else { o.last_heard },
            local: o.local,
        };
        match newest.get(&member.id) {
            Some(kept) if kept.generation >= member.generation => {}
            _ => {
                newest.insert(member.id.clone(), member);
            }
        }
    }
    newest.into_values().collect()
}

/// What changed for one member between two lists, for the log and the event counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberEvent {
    /// A name not listed before, alive (never the local member).
    Joined,
    /// A newer generation of a listed name: the member restarted.
    Restarted,
    /// Alive → suspect.
    Suspected,
    /// Suspect → alive, or dead → alive in the same generation (a healed partition).
    Recovered,
    /// Alive or suspect → dead, detected by silence.
    Failed,
    /// Alive or suspect → dead, announced by the member as it stopped.
    Left,
    /// No longer listed: dead for longer than `dead_member_ttl`.
    Forgotten,
}

impl MemberEvent {
    /// Every event, in code order.
    pub const ALL: [MemberEvent; 7] = [
        MemberEvent::Joined,
        MemberEvent::Restarted,
        MemberEvent::Suspected,
        MemberEvent::Recovered,
        MemberEvent::Failed,
        MemberEvent::Left,
        MemberEvent::Forgotten,
    ];

    /// A lower-case name for logs and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            MemberEvent::Joined => "joined",
            MemberEvent::Restarted => "restarted",
            MemberEvent::Suspected => "suspected",
            MemberEvent::Recovered => "recovered",
            MemberEvent::Failed => "failed",
            MemberEvent::Left => "left",
            MemberEvent::Forgotten => "forgotten",
        }
    }
}

/// The events that turn `before` into `after` (both sorted by id), with the member each
/// is about (for `Forgotten`, the last entry of it).
pub(crate) fn events<'a>(
    before: &'a [Member],
    after: &'a [Member],
    left: impl Fn(&Member) -> bool,
) -> Vec<(MemberEvent, &'a Member)> {
    let mut out = Vec::new();
    for new in after {
        let old = before.iter().find(|m| m.id == new.id);
        let event = match old {
            // Neither a dead stranger nor this member itself joining is news.
            None if new.state == MemberState::Dead || new.local => None,
            None => Some(MemberEvent::Joined),
            Some(old) if old.generation != new.generation => Some(MemberEvent::Restarted),
            Some(old) => match (old.state, new.state) {
                (MemberState::Alive, MemberState::Suspect) => Some(MemberEvent::Suspected),
                (MemberState::Suspect | MemberState::Dead, MemberState::Alive) => {
                    Some(MemberEvent::Recovered)
                }
                (MemberState::Alive | MemberState::Suspect, MemberState::Dead) if left(new) => {
                    Some(MemberEvent::Left)
                }
                (MemberState::Alive | MemberState::Suspect, MemberState::Dead) => {
                    Some(MemberEvent::Failed)
                }
                _ => None,
            },
        };
        if let Some(event) = event {
            out.push((event, new));
        }
    }
    for old in before {
        if !after.iter().any(|m| m.id == old.id) {
            out.push((MemberEvent::Forgotten, old));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(
        id: &str,
        generation: u64,
        live: bool,
        heard_ms_ago: u64,
        now: Instant,
    ) -> Observed {
        Observed {
            id: id.into(),
            generation,
            gossip_addr: "127.0.0.1:7401".parse().unwrap(),
            addr: Some("127.0.0.1:7400".parse().unwrap()),
            lendable: 1 << 30,
            free: 1 << 29,
            leaving: false,
            live,
            ever_live: live,
            last_heard: now - Duration::from_millis(heard_ms_ago),
            local: false,
        }
    }

    const SUSPECT: Duration = Duration::from_millis(300);

    #[test]
    fn live_members_are_alive_or_suspect_by_silence() {
        let now = Instant::now();
        let list = members(
            [observed("a", 1, true, 10, now), observed("b", 1, true, 400, now)],
            now,
            SUSPECT,
        );
        let states: Vec<_> = list.iter().map(|m| (m.id.as_str(), m.state)).collect();
        assert_eq!(states, [("a", MemberState::Alive), ("b", MemberState::Suspect)]);
        assert_eq!(list[0].lendable, 1 << 30);
    }

    #[test]
    fn the_local_member_is_always_alive_and_fresh() {
        let now = Instant::now();
        let mut me = observed("me", 1, false, 5000, now);
        me.local = true;
        let list = members([me], now, SUSPECT);
        assert_eq!(list[0].state, MemberState::Alive);
        assert_eq!(list[0].last_update, now);
    }

    #[test]
    fn never_live_and_addressless_members_are_not_listed() {
        let now = Instant::now();
        let mut no_addr = observed("x", 1, true, 0, now);
        no_addr.addr = None;
        let list = members([observed("new", 1, false, 0, now), no_addr], now, SUSPECT);
        assert!(list.is_empty(), "{list:?}");
    }

    #[test]
    fn the_newest_generation_wins_once_it_is_live() {
        let now = Instant::now();
        let mut old = observed("a", 1, false, 900, now);
        old.ever_live = true;
        let young = observed("a", 2, false, 0, now); // not live yet
        let list = members([old.clone(), young], now, SUSPECT);
        assert_eq!((list[0].generation, list[0].state), (1, MemberState::Dead));
        let list = members([observed("a", 2, true, 0, now), old], now, SUSPECT);
        assert_eq!((list[0].generation, list[0].state), (2, MemberState::Alive));
    }

    #[test]
    fn a_leaving_member_is_dead_at_once() {
        let now = Instant::now();
        let mut leaving = observed("a", 1, true, 0, now);
        leaving.leaving = true;
        assert_eq!(members([leaving], now, SUSPECT)[0].state, MemberState::Dead);
    }

    #[test]
    fn events_name_each_transition() {
        let now = Instant::now();
        let list = |specs: &[(&str, u64, bool, u64)]| {
            members(
                specs.iter().map(|&(id, g, live, ago)| observed(id, g, live, ago, now)),
                now,
                SUSPECT,
            )
        };
        let mut dead_b = observed("b", 1, false, 900, now);
        dead_b.ever_live = true;
        let before = list(&[("a", 1, true, 0), ("c", 1, true, 0), ("d", 1, true, 0)]);
        let after = {
            let mut v = members(
                [
                    observed("a", 1, true, 400, now),
                    dead_b,
                    observed("c", 2, true, 0, now),
                    observed("e", 1, true, 0, now),
                ],
                now,
                SUSPECT,
            );
            v.sort_by(|x, y| x.id.cmp(&y.id));
            v
        };
        let got: Vec<_> =
            events(&before, &after, |_| false).iter().map(|(e, m)| (*e, m.id.clone())).collect();
        assert_eq!(
            got,
            [
                (MemberEvent::Suspected, "a".to_string()),
                (MemberEvent::Restarted, "c".to_string()),
                (MemberEvent::Joined, "e".to_string()),
                (MemberEvent::Forgotten, "d".to_string()),
            ],
            "b was never listed before, so its death is not news"
        );
        let failed = [Member { state: MemberState::Dead, ..before[0].clone() }];
        let got: Vec<_> =
            events(&before[..1], &failed[..], |_| false).iter().map(|(e, _)| *e).collect();
        assert_eq!(got, [MemberEvent::Failed]);
        let got: Vec<_> =
            events(&before[..1], &failed[..], |_| true).iter().map(|(e, _)| *e).collect();
        assert_eq!(got, [MemberEvent::Left]);
        let got: Vec<_> =
            events(&failed[..], &before[..1], |_| false).iter().map(|(e, _)| *e).collect();
        assert_eq!(got, [MemberEvent::Recovered]);
    }

    #[test]
    fn news_ignores_the_timestamp() {
        let now = Instant::now();
        let a = members([observed("a", 1, true, 10, now)], now, SUSPECT);
        let b = members([observed("a", 1, true, 20, now)], now, SUSPECT);
        assert!(a[0].same_news(&b[0]));
        let c = members([observed("a", 1, true, 400, now)], now, SUSPECT);
        assert!(!a[0].same_news(&c[0]));
    }
}
