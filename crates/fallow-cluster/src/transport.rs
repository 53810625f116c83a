//! Gossip over UDP with every datagram authenticated by an HMAC keyed from the cluster
//! secret, so a host without the secret can neither join nor inject state. chitchat itself
//! checks only a cluster name sent in clear; this is the [`chitchat::transport::Transport`]
//! it runs on instead of its own UDP one.
//!
//! ```text
//!  datagram = message || tag          (message: chitchat's own encoding)
//!  key      = HMAC-SHA256(secret, "fallow-v1 gossip key\0")
//!  tag      = first 16 bytes of HMAC-SHA256(key, message)
//! ```
//!
//! Authenticated, not encrypted: anyone on the path reads member names, addresses and
//! capacities. A recorded datagram can be replayed, but chitchat ignores state older than
//! what it holds, so a replay delays nothing and changes nothing. A datagram whose tag is
//! wrong is dropped and counted (see [`GossipTraffic`]), never answered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use async_trait::async_trait;
use chitchat::transport::{Socket, Transport};
use chitchat::{ChitchatMessage, Deserializable, Serializable};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the tag appended to each datagram.
pub const TAG_LEN: usize = 16;

/// The largest UDP payload over IPv4.
const MAX_DATAGRAM: usize = 65_507;

const KEY_LABEL: &[u8] = b"fallow-v1 gossip key\0";

/// The gossip MAC key, derived from the secret so that the secret itself keys nothing
/// but the derivation (the node protocol uses it with other labels).
#[derive(Clone)]
pub(crate) struct GossipKey([u8; 32]);

impl GossipKey {
    pub(crate) fn derive(secret: &[u8]) -> Self {
        GossipKey(mac(secret).chain_update(KEY_LABEL).finalize().into_bytes().into())
    }

    /// The tag of `message`.
    fn tag(&self, message: &[u8]) -> [u8; TAG_LEN] {
        let full = mac(&self.0).chain_update(message).finalize().into_bytes();
        let mut tag = [0; TAG_LEN];
        tag.iter_mut().zip(full.iter()).for_each(|(t, f)| *t = *f);
        tag
    }

    /// Appends the tag of `buf`'s contents to `buf`.
    pub(crate) fn seal(&self, buf: &mut Vec<u8>) {
        let tag = self.tag(buf);
        buf.extend_from_slice(&tag);
    }

    /// The message of a datagram whose tag is right, else `None`. Constant time in the
    /// tag comparison.
    pub(crate) fn open<'a>(&self, datagram: &'a [u8]) -> Option<&'a [u8]> {
        let split = datagram.len().checked_sub(TAG_LEN)?;
        let (message, tag) = datagram.split_at(split);
        mac(&self.0).chain_update(message).verify_truncated_left(tag).ok()?;
        Some(message)
    }
}

impl std::fmt::Debug for GossipKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GossipKey(..)")
    }
}

#[expect(clippy::expect_used, reason = "HMAC takes keys of any length; this never fails")]
fn mac(key: &[u8]) -> Hmac<Sha256> {
    Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts any key")
}

/// Gossip traffic of one member since it started, datagram payloads only (no IP or UDP
/// headers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GossipTraffic {
    /// Datagrams sent.
    pub sent_datagrams: u64,
    /// Bytes sent.
    pub sent_bytes: u64,
    /// Authenticated datagrams received.
    pub received_datagrams: u64,
    /// Bytes of authenticated datagrams received.
    pub received_bytes: u64,
    /// Datagrams dropped: wrong or missing tag (another cluster, a stranger, corruption),
    /// or not a chitchat message.
    pub rejected_datagrams: u64,
}

/// The counters behind [`GossipTraffic`], shared by the socket and the handle.
#[derive(Debug, Default)]
pub(crate) struct TrafficCounters {
    sent_datagrams: AtomicU64,
    sent_bytes: AtomicU64,
    received_datagrams: AtomicU64,
    received_bytes: AtomicU64,
    rejected_datagrams: AtomicU64,
}

impl TrafficCounters {
    pub(crate) fn snapshot(&self) -> GossipTraffic {
        GossipTraffic {
            sent_datagrams: self.sent_datagrams.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
            received_datagrams: self.received_datagrams.load(Ordering::Relaxed),
            received_bytes: self.received_bytes.load(Ordering::Relaxed),
            rejected_datagrams: self.rejected_datagrams.load(Ordering::Relaxed),
        }
    }

    /// Counts a rejected datagram; true when this one should be logged (the 1st, 2nd,
    /// 4th, 8th, ...: a stranger flooding the port cannot flood the log).
    fn reject(&self) -> bool {
        let n = self.rejected_datagrams.fetch_add(1, Ordering::Relaxed) + 1;
        n.is_power_of_two()
    }
}

/// A [`Transport`] that hands chitchat one socket bound beforehand (so the member knows
/// its port before chitchat starts, even when the OS chose it).
pub(crate) struct AuthenticatedUdp {
    socket: Mutex<Option<tokio::net::UdpSocket>>,
    key: GossipKey,
    traffic: Arc<TrafficCounters>,
}

impl AuthenticatedUdp {
    pub(crate) fn new(
        socket: tokio::net::UdpSocket,
        key: GossipKey,
        traffic: Arc<TrafficCounters>,
    ) -> Self {
        Self { socket: Mutex::new(Some(socket)), key, traffic }
    }
}

#[async_trait]
impl Transport for AuthenticatedUdp {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let socket = self
            .socket
            .lock()
            .map_err(|_| anyhow::anyhow!("gossip socket lock poisoned"))?
            .take()
            .context("the gossip socket was already opened")?;
        anyhow::ensure!(
            socket.local_addr()? == listen_addr,
            "chitchat asked for {listen_addr}, the socket is bound to {:?}",
            socket.local_addr()
        );
        Ok(Box::new(AuthenticatedSocket {
            socket,
            key: self.key.clone(),
            traffic: self.traffic.clone(),
            send_buf: Vec::with_capacity(MAX_DATAGRAM),
            recv_buf: vec![0; MAX_DATAGRAM + 1].into_boxed_slice(),
        }))
    }
}

struct AuthenticatedSocket {
    socket: tokio::net::UdpSocket,
    key: GossipKey,
    traffic: Arc<TrafficCounters>,
    send_buf: Vec<u8>,
    recv_buf: Box<[u8]>,
}

#[async_trait]
impl Socket for AuthenticatedSocket {
    async fn send(&mut self, to: SocketAddr, message: ChitchatMessage) -> anyhow::Result<()> {
        self.send_buf.clear();
        message.serialize(&mut self.send_buf);
        self.key.seal(&mut self.send_buf);
        if self.send_buf.len() > MAX_DATAGRAM {
            // Only a cluster of thousands of members makes chitchat fill a datagram; the tag
            // then pushes it over. Dropped like a lost datagram; gossip goes on.
            tracing::warn!(len = self.send_buf.len(), %to, "gossip message too large; dropped");
            return Ok(());
        }
        // A send that fails (no route, a full buffer) is a lost datagram, which gossip
        // tolerates; chitchat would log each one as a warning, every round.
        match self.socket.send_to(&self.send_buf, to).await {
            Ok(n) => {
                self.traffic.sent_datagrams.fetch_add(1, Ordering::Relaxed);
                self.traffic.sent_bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(err) => tracing::debug!(%to, %err, "gossip send failed"),
        }
        Ok(())
    }

    async fn recv(&mut self) -> anyhow::Result<(SocketAddr, ChitchatMessage)> {
        loop {
            let (len, from) = match self.socket.recv_from(&mut self.recv_buf).await {
                Ok(got) => got,
                // An ICMP error for an earlier send to a stopped member surfaces here.
                Err(err) if is_transient(&err) => continue,
                Err(err) => return Err(err).context("gossip socket failed"),
            };
            let datagram = &self.recv_buf[..len];
            let Some(mut message) = self.key.open(datagram) else {
                if self.traffic.reject() {
                    tracing::warn!(
                        %from, len,
                        rejected = self.traffic.rejected_datagrams.load(Ordering::Relaxed),
                        "gossip datagram with a wrong tag dropped (another cluster's secret?)"
                    );
                }
                continue;
            };
            match ChitchatMessage::deserialize(&mut message) {
                Ok(decoded) => {
                    self.traffic.received_datagrams.fetch_add(1, Ordering::Relaxed);
                    self.traffic.received_bytes.fetch_add(len as u64, Ordering::Relaxed);
                    return Ok((from, decoded));
                }
                Err(err) => {
                    // Authentic but undecodable: a member running another chitchat format.
                    if self.traffic.reject() {
                        tracing::warn!(%from, %err, "gossip message not understood; dropped");
                    }
                }
            }
        }
    }
}

fn is_transient(err: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        err.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset | ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_messages_open_only_with_the_same_secret() {
        let key = GossipKey::derive(b"0123456789abcdef");
        let mut datagram = b"hello members".to_vec();
        key.seal(&mut datagram);
        assert_eq!(datagram.len(), 13 + TAG_LEN);
        assert_eq!(key.open(&datagram), Some(&b"hello members"[..]));
        let other = GossipKey::derive(b"0123456789abcdeX");
        assert_eq!(other.open(&datagram), None);
        let mut flipped = datagram.clone();
        flipped[0] ^= 1;
        assert_eq!(key.open(&flipped), None);
        assert_eq!(key.open(&datagram[..TAG_LEN - 1]), None, "shorter than a tag");
        assert_eq!(key.open(&[]), None);
    }

    #[test]
    fn rejections_are_logged_sparsely() {
        let counters = TrafficCounters::default();
        let logged: Vec<u64> = (1..=20).filter(|_| counters.reject()).collect();
        assert_eq!(logged.len(), 5, "1, 2, 4, 8, 16");
        assert_eq!(counters.snapshot().rejected_datagrams, 20);
    }
}
