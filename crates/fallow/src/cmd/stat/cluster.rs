//! `fallow stat --cluster`: the cluster's members as one node sees them, asked with the
//! MEMBERS request (`docs/protocol.md` §4.6), as a table or JSON.
//!
//! Asking a node rather than joining the gossip as an observer keeps the command a plain
//! client: an observer would appear in every member's list, and then linger there as a
//! dead member after the command exits.

use anyhow::Context;
use fallow_client::{Client, ClientConfig, MemberInfo, MemberState};
use serde_json::{json, Value};

use super::human;

/// Asks the node at `node` for its member list and prints it.
pub fn run(
    runtime: &tokio::runtime::Runtime,
    config: ClientConfig,
    node: &str,
    as_json: bool,
) -> anyhow::Result<()> {
    let members = runtime
        .block_on(async { Client::connect(config).await?.members().await })
        .with_context(|| format!("asking {node} for the cluster's members"))?;
    if as_json {
        println!("{}", to_json(node, &members));
    } else {
        print!("{}", table(node, &members));
    }
    Ok(())
}

fn count(members: &[MemberInfo], state: MemberState) -> usize {
    members.iter().filter(|m| m.state == state).count()
}

/// One JSON object: the node asked, counts by state, and one object per member.
fn to_json(node: &str, members: &[MemberInfo]) -> Value {
    let list: Vec<Value> = members
        .iter()
        .map(|m| {
            json!({
                "id": m.id,
                "state": m.state.name(),
                "addr": m.addr.to_string(),
                "generation": m.generation,
                "lendable_bytes": m.lendable_bytes,
                "used_bytes": m.lendable_bytes.saturating_sub(m.free_bytes),
                "free_bytes": m.free_bytes,
                "age_ms": m.age_ms,
                "local": m.local,
            })
        })
        .collect();
    json!({
        "node": node,
        "in_cluster": !members.is_empty(),
        "alive": count(members, MemberState::Alive),
        "suspect": count(members, MemberState::Suspect),
        "dead": count(members, MemberState::Dead),
        "members": list,
    })
}

/// The human-readable table; `*` marks the node asked.
fn table(node: &str, members: &[MemberInfo]) -> String {
    if members.is_empty() {
        return format!("{node} is not in a cluster (started without --join or --gossip)\n");
    }
    let usable = members.iter().filter(|m| m.state != MemberState::Dead);
    let (lent, free) = usable.fold((0, 0), |(l, f), m| (l + m.lendable_bytes, f + m.free_bytes));
    let mut out = format!(
        "cluster seen from {node}: {} members ({} alive, {} suspect, {} dead); \
         {} lent, {} free on live members\n",
        members.len(),
        count(members, MemberState::Alive),
        count(members, MemberState::Suspect),
        count(members, MemberState::Dead),
        human(lent),
        human(free),
    );
    let rows: Vec<[String; 7]> = members
        .iter()
        .map(|m| {
            [
                format!("{}{}", if m.local { "* " } else { "  " }, m.id),
                m.state.name().to_string(),
                m.addr.to_string(),
                human(m.lendable_bytes),
                human(m.lendable_bytes.saturating_sub(m.free_bytes)),
                human(m.free_bytes),
                heard(m),
            ]
        })
        .collect();
    let header = ["  member", "state", "address", "lent", "used", "free", "heard"];
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0))
        .collect();
    for row in std::iter::once(header.map(String::from)).chain(rows) {
        let cells: Vec<String> =
            row.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// How long ago the node heard of the member.
fn heard(m: &MemberInfo) -> String {
    match m.age_ms {
        _ if m.local => "-".to_string(),
        ms if ms < 1000 => format!("{ms} ms ago"),
        ms if ms < 120_000 => format!("{:.1} s ago", ms as f64 / 1000.0),
        ms => format!("{} min ago", ms / 60_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, state: MemberState, local: bool, age_ms: u32) -> MemberInfo {
        MemberInfo {
            id: id.into(),
            state,
            local,
            addr: id.parse().unwrap(),
            generation: 7,
            lendable_bytes: 8 << 30,
            free_bytes: 6 << 30,
            age_ms,
        }
    }

    #[test]
    fn the_table_marks_the_node_asked_and_sums_live_members() {
        let members = [
            member("127.0.0.1:7400", MemberState::Alive, true, 0),
            member("127.0.0.1:7410", MemberState::Dead, false, 2500),
            member("127.0.0.1:7420", MemberState::Alive, false, 40),
        ];
        let text = table("127.0.0.1:7400", &members);
        assert!(text.contains("3 members (2 alive, 0 suspect, 1 dead)"), "{text}");
        assert!(text.contains("16.0 GiB lent, 12.0 GiB free"), "{text}");
        assert!(text.contains("* 127.0.0.1:7400  alive"), "{text}");
        assert!(text.contains("dead   127.0.0.1:7410"), "{text}");
        assert!(text.contains("2.0 GiB  6.0 GiB  2.5 s ago"), "{text}");
        assert!(text.contains("40 ms ago"), "{text}");
    }

    #[test]
    fn json_lists_every_member_with_used_bytes() {
        let members = [member("127.0.0.1:7400", MemberState::Suspect, false, 400)];
        let value = to_json("n", &members);
        assert_eq!(value["suspect"], 1);
        assert_eq!(value["members"][0]["state"], "suspect");
        assert_eq!(value["members"][0]["used_bytes"], 2u64 << 30);
        assert_eq!(to_json("n", &[])["in_cluster"], false);
        assert!(table("n", &[]).contains("not in a cluster"));
    }
}
