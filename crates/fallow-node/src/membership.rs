//! Joining the cluster: which addresses the node gossips on and advertises, starting its
//! [`Cluster`] member, and publishing its capacity (the lent budget and the part of it
//! not holding pages) once a second. The member logs joins, failures and departures; the
//! MEMBERS request (`cmd/members.rs`) and the metrics read its list.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use fallow_cluster::{Cluster, ClusterConfig};
use fallow_core::{ListenAddr, PAGE_SIZE};
use fallow_pool::Engine;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ClusterSettings;
use crate::node::Node;

/// How often the node publishes its capacity. Only a changed value costs gossip.
const CAPACITY_EVERY: Duration = Duration::from_secs(1);

/// Starts the member if the node's config asks for one: `configured` and `bound` are the
/// listen addresses before and after binding, in the same order.
pub(crate) async fn start(
    node: &Arc<Node>,
    configured: &[ListenAddr],
    bound: &[ListenAddr],
    shutdown: CancellationToken,
    tasks: &TaskTracker,
) -> io::Result<()> {
    let Some(settings) = &node.config().cluster else {
        return Ok(());
    };
    let tcp = configured.iter().zip(bound).find_map(|pair| match pair {
        (ListenAddr::Tcp(configured), ListenAddr::Tcp(bound)) => Some((*configured, *bound)),
        _ => None,
    });
    let (protocol, gossip) = addresses(settings, tcp).map_err(io::Error::other)?;
    let config = ClusterConfig::builder(
        protocol.to_string(),
        protocol,
        gossip,
        node.config().secret.clone(),
    )
    .seeds(settings.join.iter().cloned())
    .build()
    .map_err(io::Error::other)?;
    let cluster = Cluster::start(config).await.map_err(io::Error::other)?;
    let (lendable, free) = capacity(node.engine());
    cluster.update_capacity(lendable, free);
    node.set_cluster(cluster.clone());
    tasks.spawn(publish_capacity(node.clone(), cluster, shutdown));
    Ok(())
}

/// The advertised protocol address and the gossip address, from the settings and the
/// first TCP listen address (as configured, and as bound).
fn addresses(
    settings: &ClusterSettings,
    tcp: Option<(SocketAddr, SocketAddr)>,
) -> Result<(SocketAddr, SocketAddr), String> {
    let Some((configured, bound)) = tcp else {
        return Err("cluster membership needs a TCP --listen address: clients reach the \
                    members over TCP"
            .to_string());
    };
    let gossip = match settings.gossip {
        Some(gossip) => gossip,
        // Port 0 (tests) stays 0: the OS chooses, as it did for the listener.
        None if configured.port() == 0 => SocketAddr::new(configured.ip(), 0),
        None => {
            let port = configured.port().checked_add(1).ok_or_else(|| {
                format!("--listen {configured}: no port above it for gossip; give --gossip")
            })?;
            SocketAddr::new(configured.ip(), port)
        }
    };
    if gossip.ip().is_unspecified() {
        return Err(format!(
            "gossip address {gossip}: a wildcard cannot be advertised to peers; give \
             --gossip IP:PORT with the address they reach this host at"
        ));
    }
    if let Some(advertise) = settings.advertise {
        if advertise.ip().is_unspecified() || advertise.port() == 0 {
            return Err(format!(
                "--advertise {advertise}: give the IP:PORT clients reach this node at, \
                 not a wildcard or port 0"
            ));
        }
        return Ok((advertise, gossip));
    }
    // A node listening on every interface advertises the gossip IP, which peers reach.
    let protocol = match bound.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(gossip.ip(), bound.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(gossip.ip(), bound.port()),
        _ => bound,
    };
    Ok((protocol, gossip))
}

/// Bytes lent, and those of them not holding pages (frames in use and compressed data
/// count as used).
fn capacity(engine: &Engine) -> (u64, u64) {
    let memory = engine.memory();
    let used = memory.frames_used * PAGE_SIZE + memory.compressed_space_bytes;
    (memory.budget_bytes as u64, memory.budget_bytes.saturating_sub(used) as u64)
}

async fn publish_capacity(node: Arc<Node>, cluster: Cluster, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(CAPACITY_EVERY) => {}
        }
        let (lendable, free) = capacity(node.engine());
        cluster.update_capacity(lendable, free);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(gossip: Option<&str>) -> ClusterSettings {
        ClusterSettings { gossip: gossip.map(|g| g.parse().unwrap()), ..Default::default() }
    }

    #[test]
    fn an_advertised_address_replaces_the_listen_address() {
        let mut s = settings(None);
        s.advertise = Some("203.0.113.7:17400".parse().unwrap());
        let (protocol, gossip) = addresses(&s, pair("10.0.0.5:7400", "10.0.0.5:7400")).unwrap();
        assert_eq!(protocol.to_string(), "203.0.113.7:17400");
        assert_eq!(gossip.to_string(), "10.0.0.5:7401", "gossip stays where it listens");
        for bad in ["0.0.0.0:7400", "203.0.113.7:0"] {
            s.advertise = Some(bad.parse().unwrap());
            let err = addresses(&s, pair("10.0.0.5:7400", "10.0.0.5:7400")).unwrap_err();
            assert!(err.contains("--advertise"), "{err}");
        }
    }

    fn pair(configured: &str, bound: &str) -> Option<(SocketAddr, SocketAddr)> {
        Some((configured.parse().unwrap(), bound.parse().unwrap()))
    }

    #[test]
    fn gossip_defaults_to_the_port_after_the_listen_port() {
        let (protocol, gossip) =
            addresses(&settings(None), pair("127.0.0.1:7400", "127.0.0.1:7400")).unwrap();
        assert_eq!(protocol.to_string(), "127.0.0.1:7400");
        assert_eq!(gossip.to_string(), "127.0.0.1:7401");
    }

    #[test]
    fn an_os_chosen_listen_port_means_an_os_chosen_gossip_port() {
        let (protocol, gossip) =
            addresses(&settings(None), pair("127.0.0.1:0", "127.0.0.1:41234")).unwrap();
        assert_eq!(protocol.port(), 41234);
        assert_eq!(gossip.to_string(), "127.0.0.1:0");
    }

    #[test]
    fn a_wildcard_listener_advertises_the_gossip_ip() {
        let err = addresses(&settings(None), pair("0.0.0.0:7400", "0.0.0.0:7400")).unwrap_err();
        assert!(err.contains("--gossip IP:PORT"), "{err}");
        let (protocol, gossip) =
            addresses(&settings(Some("10.1.2.3:7401")), pair("0.0.0.0:7400", "0.0.0.0:7400"))
                .unwrap();
        assert_eq!(protocol.to_string(), "10.1.2.3:7400");
        assert_eq!(gossip.to_string(), "10.1.2.3:7401");
    }

    #[test]
    fn a_unix_only_node_cannot_join() {
        assert!(addresses(&settings(None), None).unwrap_err().contains("TCP --listen"));
        assert!(addresses(&settings(None), pair("127.0.0.1:65535", "127.0.0.1:65535"))
            .unwrap_err()
            .contains("no port above"));
    }
}
