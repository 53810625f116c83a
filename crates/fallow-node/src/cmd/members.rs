//! MEMBERS: the cluster as this node sees it, from its gossip member's list. A node that
//! does not gossip answers with no entries. Any authenticated client may ask: every
//! holder of the secret may gossip anyway, so the list is no secret from it.

use fallow_proto::fallow::{MemberInfo, Reply};

use crate::node::Node;

pub(super) fn list(node: &Node) -> Reply {
    let Some(cluster) = node.cluster() else {
        return Reply::Members(Vec::new());
    };
    let members = cluster
        .members()
        .into_iter()
        .map(|m| MemberInfo {
            state: m.state,
            local: m.local,
            addr: m.addr,
            generation: m.generation,
            lendable_bytes: m.lendable,
            free_bytes: m.free,
            age_ms: match m.local {
                true => 0,
                false => u32::try_from(m.last_update.elapsed().as_millis()).unwrap_or(u32::MAX),
            },
            id: m.id,
        })
        .collect();
    Reply::Members(members)
}
