//! Gossip over UDP with every datagram sealed (encrypted and authenticated) with a key
//! derived from the cluster secret, so a host without the secret learns nothing from the
//! datagrams (members, addresses, memory sizes) and can neither join nor inject state;
//! replays are dropped at the door. chitchat itself checks only a cluster name sent in
//! clear; this is the [`chitchat::transport::Transport`] it runs on instead of its own UDP
//! one.
//!
//! ```text
//!  datagram  = nonce (24 bytes, random) || XChaCha20-Poly1305(key, nonce, aad, plaintext)
//!  plaintext = version (1 byte, 2) || sender (le64) || counter (le64) || sent_ms (le64)
//!              || message (chitchat's own encoding)
//!  aad       = "fallow gossip"
//!  key       = HMAC-SHA256(secret, "fallow-v2 gossip seal key\0")
//! ```
//!
//! `sender` is drawn at random when the member starts, `counter` counts its datagrams from
//! 1, `sent_ms` is its clock (ms since the Unix epoch). A receiver drops a datagram whose
//! seal does not open, one sent more than [`MAX_AGE`] before or after its own clock, and
//! one whose sender and counter it has seen (a window of the last 64 counters of each
//! sender, kept for [`MAX_AGE`]): a recorded datagram replayed later is refused. Members'
//! clocks must agree within [`MAX_AGE`]. Every drop is counted (see [`GossipTraffic`]) and
//! never answered.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use async_trait::async_trait;
use chacha20poly1305::aead::rand_core::RngCore;
use chacha20poly1305::aead::{AeadCore, AeadInPlace, KeyInit, OsRng};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use chitchat::transport::{Socket, Transport};
use chitchat::{ChitchatMessage, Deserializable, Serializable};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the Poly1305 tag that ends each datagram.
pub const TAG_LEN: usize = 16;

/// Bytes of the random nonce that starts each datagram.
pub const NONCE_LEN: usize = 24;

/// Bytes of the sealed header before the message: version, sender, counter, clock.
const HEADER_LEN: usize = 1 + 8 + 8 + 8;

/// Bytes a seal adds to a message.
pub const SEAL_OVERHEAD: usize = NONCE_LEN + HEADER_LEN + TAG_LEN;

/// The largest UDP payload over IPv4.
const MAX_DATAGRAM: usize = 65_507;

/// The version byte of the sealed header.
const VERSION: u8 = 2;

const KEY_LABEL: &[u8] = b"fallow-v2 gossip seal key\0";

const AAD: &[u8] = b"fallow gossip";

/// How far a datagram's clock may be from the receiver's; also how long a sender's seen
/// counters are kept (an older datagram is refused by its age anyway).
pub const MAX_AGE: Duration = Duration::from_secs(60);

/// Counters of each sender remembered behind its highest: a datagram further behind is
/// refused (gossip takes its loss).
const WINDOW: u64 = 64;

/// Senders remembered at most; beyond, the ones heard from longest ago are forgotten.
const MAX_SENDERS: usize = 4096;

/// The gossip seal key, derived from the secret so that the secret itself keys nothing
/// but the derivation (the node protocol uses it with other labels).
#[derive(Clone)]
pub(crate) struct GossipKey(XChaCha20Poly1305);

/// What a member puts in the header of the datagrams it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sender {
    /// Random, drawn at start.
    pub(crate) id: u64,
    /// The last counter used.
    pub(crate) counter: u64,
}

impl Sender {
    pub(crate) fn random() -> Sender {
        Sender { id: OsRng.next_u64(), counter: 0 }
    }
}

/// An opened datagram: who sent it, its counter and clock, the message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Opened<'a> {
    pub(crate) sender: u64,
    pub(crate) counter: u64,
    pub(crate) sent_ms: u64,
    pub(crate) message: &'a [u8],
}

impl GossipKey {
    pub(crate) fn derive(secret: &[u8]) -> Self {
        let key: [u8; 32] = mac(secret).chain_update(KEY_LABEL).finalize().into_bytes().into();
        GossipKey(XChaCha20Poly1305::new(&key.into()))
    }

    /// Seals `message` from `sender` (its counter advanced) at `now_ms` into `out`, with a
    /// fresh random nonce.
    pub(crate) fn seal(&self, sender: &mut Sender, now_ms: u64, message: &[u8], out: &mut Vec<u8>) {
        self.seal_with(&XChaCha20Poly1305::generate_nonce(&mut OsRng), sender, now_ms, message, out)
    }

    fn seal_with(
        &self,
        nonce: &XNonce,
        sender: &mut Sender,
        now_ms: u64,
        message: &[u8],
        out: &mut Vec<u8>,
    ) {
        sender.counter += 1;
        out.clear();
        out.extend_from_slice(nonce);
        out.push(VERSION);
        out.extend_from_slice(&sender.id.to_le_bytes());
        out.extend_from_slice(&sender.counter.to_le_bytes());
        out.extend_from_slice(&now_ms.to_le_bytes());
        out.extend_from_slice(message);
        let (_, plaintext) = out.split_at_mut(NONCE_LEN);
        match self.0.encrypt_in_place_detached(nonce, AAD, plaintext) {
            Ok(tag) => out.extend_from_slice(&tag),
            // Only a message over 256 GiB fails; a datagram holds 64 KiB.
            Err(_) => out.clear(),
        }
    }

    /// Opens a datagram in place: its header and message, or `None` when the seal does
    /// not open (another secret, a stranger, corruption) or the header is not ours.
    pub(crate) fn open<'a>(&self, datagram: &'a mut [u8]) -> Option<Opened<'a>> {
        if datagram.len() < SEAL_OVERHEAD {
            return None;
        }
        let (nonce, rest) = datagram.split_at_mut(NONCE_LEN);
        let (body, tag) = rest.split_at_mut(rest.len() - TAG_LEN);
        let nonce = XNonce::from_slice(nonce);
        self.0.decrypt_in_place_detached(nonce, AAD, body, (&*tag).into()).ok()?;
        let (header, message) = body.split_at(HEADER_LEN);
        let (&version, fields) = header.split_first()?;
        let mut words =
            fields.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()));
        let (sender, counter, sent_ms) = (words.next()?, words.next()?, words.next()?);
        (version == VERSION).then_some(Opened { sender, counter, sent_ms, message })
    }
}

impl std::fmt::Debug for GossipKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GossipKey(..)")
    }
}

#[expect(clippy::expect_used, reason = "HMAC takes keys of any length; this never fails")]
fn mac(key: &[u8]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key")
}

/// Milliseconds since the Unix epoch by this host's clock.
fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Why an authentic datagram was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Sent more than [`MAX_AGE`] before or after the receiver's clock.
    Stale,
    /// Its sender and counter were seen (a replay), or fell behind the window.
    Replayed,
}

/// The counters each sender has used lately.
#[derive(Debug, Default)]
pub(crate) struct ReplayGuard {
    /// Sender → (highest counter, bitmap of the [`WINDOW`] counters below it seen, when
    /// last heard from in ms).
    senders: HashMap<u64, (u64, u64, u64)>,
}

impl ReplayGuard {
    /// Admits an opened datagram received at `now_ms`, or says why not.
    pub(crate) fn admit(&mut self, d: &Opened<'_>, now_ms: u64) -> Result<(), Refusal> {
        let age = MAX_AGE.as_millis() as u64;
        if d.sent_ms.saturating_add(age) < now_ms || d.sent_ms > now_ms.saturating_add(age) {
            return Err(Refusal::Stale);
        }
        if self.senders.len() >= MAX_SENDERS && !self.senders.contains_key(&d.sender) {
            self.forget_before(now_ms.saturating_sub(age));
            if self.senders.len() >= MAX_SENDERS {
                let oldest = self.senders.iter().min_by_key(|(_, s)| s.2).map(|(id, _)| *id);
                oldest.map(|id| self.senders.remove(&id));
            }
        }
        let Some((highest, seen, heard)) = self.senders.get_mut(&d.sender) else {
            self.senders.insert(d.sender, (d.counter, 0, now_ms));
            return Ok(());
        };
        if d.counter > *highest {
            // Bit i of `seen` is counter `highest - 1 - i`: the window slides up by `shift`,
            // and the old highest joins it as bit (shift - 1).
            let shift = d.counter - *highest;
            *seen = match shift {
                // At most 64, so the shift amount fits; a shift by 64 empties the window.
                1..=WINDOW => seen.checked_shl(shift as u32).unwrap_or(0) | 1 << (shift - 1),
                _ => 0,
            };
            *highest = d.counter;
        } else {
            let behind = *highest - d.counter;
            if behind == 0 || behind > WINDOW || *seen & (1 << (behind - 1)) != 0 {
                return Err(Refusal::Replayed);
            }
            *seen |= 1 << (behind - 1);
        }
        *heard = now_ms;
        Ok(())
    }

    /// Forgets the senders not heard from since `since_ms`.
    fn forget_before(&mut self, since_ms: u64) {
        self.senders.retain(|_, s| s.2 >= since_ms);
    }
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
    /// Datagrams dropped: a seal that does not open (another cluster, a stranger,
    /// corruption), a replay or a stale clock, or not a chitchat message.
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
            sender: Sender::random(),
            replays: ReplayGuard::default(),
            message_buf: Vec::with_capacity(MAX_DATAGRAM),
            send_buf: Vec::with_capacity(MAX_DATAGRAM),
            recv_buf: vec![0; MAX_DATAGRAM + 1].into_boxed_slice(),
        }))
    }
}

struct AuthenticatedSocket {
    socket: tokio::net::UdpSocket,
    key: GossipKey,
    traffic: Arc<TrafficCounters>,
    sender: Sender,
    replays: ReplayGuard,
    message_buf: Vec<u8>,
    send_buf: Vec<u8>,
    recv_buf: Box<[u8]>,
}

#[async_trait]
impl Socket for AuthenticatedSocket {
    async fn send(&mut self, to: SocketAddr, message: ChitchatMessage) -> anyhow::Result<()> {
        self.message_buf.clear();
        message.serialize(&mut self.message_buf);
        self.key.seal(&mut self.sender, now_ms(), &self.message_buf, &mut self.send_buf);
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
            let Some(datagram) = self.recv_buf.get_mut(..len) else { continue };
            let Some(opened) = self.key.open(datagram) else {
                if self.traffic.reject() {
                    tracing::warn!(
                        %from, len,
                        rejected = self.traffic.rejected_datagrams.load(Ordering::Relaxed),
                        "gossip datagram whose seal does not open dropped (another cluster's \
                         secret?)"
                    );
                }
                continue;
            };
            if let Err(why) = self.replays.admit(&opened, now_ms()) {
                if self.traffic.reject() {
                    tracing::warn!(%from, ?why, "gossip datagram replayed or out of time; dropped");
                }
                continue;
            }
            let mut message = opened.message;
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

    fn sealed(key: &GossipKey, sender: &mut Sender, now: u64, message: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        key.seal(sender, now, message, &mut out);
        out
    }

    #[test]
    fn sealed_messages_open_only_with_the_same_secret_and_hide_their_text() {
        let key = GossipKey::derive(b"0123456789abcdef");
        let mut sender = Sender { id: 7, counter: 0 };
        let mut datagram = sealed(&key, &mut sender, 1000, b"hello members");
        assert_eq!(datagram.len(), 13 + SEAL_OVERHEAD);
        assert!(!datagram.windows(5).any(|w| w == b"hello"), "the message is not in clear");
        let other = GossipKey::derive(b"0123456789abcdeX");
        assert_eq!(other.open(&mut datagram.clone()), None);
        for at in [0, NONCE_LEN, NONCE_LEN + 3, datagram.len() - 1] {
            let mut flipped = datagram.clone();
            flipped[at] ^= 1;
            assert_eq!(key.open(&mut flipped), None, "a bit flipped at {at}");
        }
        assert_eq!(key.open(&mut datagram[..SEAL_OVERHEAD - 1].to_vec()), None, "too short");
        assert_eq!(key.open(&mut []), None);
        let opened = key.open(&mut datagram).unwrap();
        assert_eq!(
            opened,
            Opened { sender: 7, counter: 1, sent_ms: 1000, message: b"hello members" }
        );
        // Two seals of one message differ (fresh nonces), and count on.
        let again = sealed(&key, &mut sender, 1000, b"hello members");
        assert_ne!(again[..NONCE_LEN], datagram[..NONCE_LEN]);
        assert_eq!(key.open(&mut again.clone()).unwrap().counter, 2);
    }

    /// The datagram's layout, byte for byte, for a fixed secret, nonce, sender and clock.
    #[test]
    fn golden_datagram() {
        let key = GossipKey::derive(b"golden-secret-0123456789");
        let nonce = XNonce::from_slice(&[0x42; NONCE_LEN]).to_owned();
        let mut sender = Sender { id: 0x1122_3344_5566_7788, counter: 4 };
        let mut out = Vec::new();
        key.seal_with(&nonce, &mut sender, 1_700_000_000_000, b"syn", &mut out);
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(&hex[..2 * NONCE_LEN], "42".repeat(NONCE_LEN), "the nonce, in clear");
        assert_eq!(out.len(), SEAL_OVERHEAD + 3);
        assert_eq!(hex, GOLDEN, "the sealed bytes changed: a wire format change");
        let opened = key.open(&mut out).unwrap();
        assert_eq!(
            (opened.sender, opened.counter, opened.message),
            (0x1122_3344_5566_7788, 5, &b"syn"[..])
        );
    }

    /// The same bytes come out of libsodium's `crypto_aead_xchacha20poly1305_ietf_encrypt`
    /// (PyNaCl) with the key HMAC-SHA256(secret, label), the nonce and the header above.
    const GOLDEN: &str = "424242424242424242424242424242424242424242424242\
                          69468f627f233aaaee679e1554c80f28e9212ef21ccb9a19b6bbc584b53c334e\
                          00e691646a38e09aee23f032";

    #[test]
    fn replays_and_stale_datagrams_are_refused() {
        let key = GossipKey::derive(b"0123456789abcdef");
        let mut guard = ReplayGuard::default();
        let mut sender = Sender { id: 9, counter: 0 };
        let now = 10_000_000;
        let first = sealed(&key, &mut sender, now, b"a");
        let second = sealed(&key, &mut sender, now, b"b");
        let admit = |guard: &mut ReplayGuard, d: &[u8], at: u64| {
            guard.admit(&key.open(&mut d.to_vec()).unwrap(), at)
        };
        // Out of order is fine; twice is not.
        assert_eq!(admit(&mut guard, &second, now), Ok(()));
        assert_eq!(admit(&mut guard, &first, now), Ok(()));
        assert_eq!(admit(&mut guard, &first, now + 5), Err(Refusal::Replayed));
        assert_eq!(admit(&mut guard, &second, now + 5), Err(Refusal::Replayed));
        // Another sender with the same counters is another sender.
        let mut other = Sender { id: 10, counter: 0 };
        assert_eq!(admit(&mut guard, &sealed(&key, &mut other, now, b"a"), now), Ok(()));
        // Far behind the window: refused, as a replay would be.
        for _ in 0..WINDOW + 1 {
            sealed(&key, &mut sender, now, b"x");
        }
        let latest = sealed(&key, &mut sender, now, b"c");
        assert_eq!(admit(&mut guard, &latest, now), Ok(()));
        let mut old = Sender { id: 9, counter: 2 };
        assert_eq!(
            admit(&mut guard, &sealed(&key, &mut old, now, b"d"), now),
            Err(Refusal::Replayed)
        );
        // A jump of exactly the window keeps the old highest as its last bit.
        let mut edge = Sender { id: 12, counter: 0 };
        let first_of_edge = sealed(&key, &mut edge, now, b"g");
        assert_eq!(admit(&mut guard, &first_of_edge, now), Ok(()));
        for _ in 1..WINDOW {
            sealed(&key, &mut edge, now, b"h");
        }
        assert_eq!(admit(&mut guard, &sealed(&key, &mut edge, now, b"i"), now), Ok(()));
        assert_eq!(admit(&mut guard, &first_of_edge, now), Err(Refusal::Replayed));
        // Out of time, either way: refused however new its counter.
        let age = MAX_AGE.as_millis() as u64;
        let mut fresh = Sender { id: 11, counter: 0 };
        let stale = sealed(&key, &mut fresh, now - age - 1, b"e");
        assert_eq!(admit(&mut guard, &stale, now), Err(Refusal::Stale));
        let future = sealed(&key, &mut fresh, now + age + 1, b"f");
        assert_eq!(admit(&mut guard, &future, now), Err(Refusal::Stale));
        // The same datagram replayed after its age is refused by its age.
        assert_eq!(admit(&mut guard, &latest, now + age + 1), Err(Refusal::Stale));
    }

    #[test]
    fn senders_are_remembered_within_bounds() {
        let key = GossipKey::derive(b"0123456789abcdef");
        let mut guard = ReplayGuard::default();
        for id in 0..(MAX_SENDERS as u64 + 10) {
            let mut sender = Sender { id, counter: 0 };
            let d = sealed(&key, &mut sender, 5_000_000 + id, b"m");
            assert_eq!(guard.admit(&key.open(&mut d.clone()).unwrap(), 5_000_000 + id), Ok(()));
        }
        assert!(guard.senders.len() <= MAX_SENDERS);
    }

    #[test]
    fn rejections_are_logged_sparsely() {
        let counters = TrafficCounters::default();
        let logged: Vec<u64> = (1..=20).filter(|_| counters.reject()).collect();
        assert_eq!(logged.len(), 5, "1, 2, 4, 8, 16");
        assert_eq!(counters.snapshot().rejected_datagrams, 20);
    }
}
