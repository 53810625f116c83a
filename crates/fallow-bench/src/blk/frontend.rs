//! The vhost-user handshake, the part QEMU plays (the vhost-user spec, "Starting the
//! device"), through rust-vmm's `vhost::vhost_user::Frontend`:
//!
//! ```text
//!  connect (retried while the socket is missing or refuses, up to a timeout)
//!  SET_OWNER; GET_FEATURES
//!  GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES (CONFIG, MQ, REPLY_ACK of what is offered);
//!    with REPLY_ACK every later request asks for an acknowledgement, so a refusal shows
//!    at the step that caused it
//!  GET_QUEUE_NUM (MQ); GET_CONFIG (CONFIG): capacity, block size, queues
//!  SET_FEATURES: what the device offers and the driver understands (EVENT_IDX if asked)
//!  SET_MEM_TABLE: the memfd
//!  per queue: SET_VRING_NUM, SET_VRING_BASE 0, SET_VRING_ADDR (addresses in this
//!    process, which the backend translates through the memory table), SET_VRING_CALL,
//!    SET_VRING_KICK, SET_VRING_ENABLE 1
//!  … requests …
//!  GET_VRING_BASE per queue (the backend stops the queue), then the socket closes
//! ```
//!
//! The socket has read and write timeouts, so a backend that stops answering fails a step
//! instead of hanging the driver. A second handle on the socket watches for the backend
//! hanging up while requests run ([`VhostUserBlk::hung_up`]).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::memory::GuestMemory;
use super::notify::Event;
use super::request::{features, BlkConfig, CONFIG_LEN};
use super::ring::RingAddrs;
use super::BlkError;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserHeaderFlag};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::{VhostBackend, VringConfigData};

/// How long each vhost-user reply may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// A vhost-user-blk backend after the handshake.
pub struct VhostUserBlk {
    frontend: Frontend,
    /// The same socket, only polled: readable or hung up means the backend went away (it
    /// sends nothing unasked, as no backend channel is negotiated).
    watch: UnixStream,
    /// The virtio features agreed.
    features: u64,
    config: BlkConfig,
    /// The queues the backend has.
    max_queues: u16,
    /// Queues started, to stop at the end.
    started: Vec<u16>,
}

impl std::fmt::Debug for VhostUserBlk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserBlk")
            .field("features", &format_args!("{:#x}", self.features))
            .field("config", &self.config)
            .field("started", &self.started)
            .finish()
    }
}

impl VhostUserBlk {
    /// Connects to the backend at `path` (retrying for up to `timeout` while the socket is
    /// missing or refuses) and negotiates up to SET_FEATURES. `queues`: how many the driver
    /// will use; `event_idx`: whether to accept VIRTIO_RING_F_EVENT_IDX.
    pub fn connect(
        path: &Path,
        queues: u16,
        event_idx: bool,
        timeout: Duration,
    ) -> Result<VhostUserBlk, BlkError> {
        let sock = connect_socket(path, timeout)?;
        let watch = sock.try_clone().map_err(BlkError::Io)?;
        let mut frontend = Frontend::from_stream(sock, u64::from(queues));
        frontend.set_owner().map_err(step("SET_OWNER"))?;
        let offered = frontend.get_features().map_err(step("GET_FEATURES"))?;
        if offered & features::PROTOCOL_FEATURES == 0 {
            return Err(BlkError::Unsupported(
                "the backend offers no vhost-user protocol features (CONFIG is needed for the \
                 disk's size)"
                    .into(),
            ));
        }
        let protocol = negotiate_protocol(&mut frontend)?;
        let max_queues = if protocol.contains(VhostUserProtocolFeatures::MQ) {
            let n = frontend.get_queue_num().map_err(step("GET_QUEUE_NUM"))?;
            u16::try_from(n).unwrap_or(u16::MAX)
        } else {
            1
        };
        if queues > max_queues {
            return Err(BlkError::Unsupported(format!(
                "{queues} queues asked for; the backend has {max_queues}"
            )));
        }
        let mut wanted = features::UNDERSTOOD;
        if event_idx {
            wanted |= features::EVENT_IDX;
        }
        let agreed = offered & wanted;
        let config = read_config(&mut frontend, agreed)?;
        frontend.set_features(agreed).map_err(step("SET_FEATURES"))?;
        Ok(VhostUserBlk {
            frontend,
            watch,
            features: agreed,
            config,
            max_queues,
            started: Vec::new(),
        })
    }

    /// The virtio features agreed.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The device configuration read during the handshake.
    pub fn config(&self) -> BlkConfig {
        self.config
    }

    /// The queues the backend has.
    pub fn max_queues(&self) -> u16 {
        self.max_queues
    }

    /// Shares `mem` with the backend (SET_MEM_TABLE).
    pub fn set_mem_table(&self, mem: &GuestMemory) -> Result<(), BlkError> {
        let region = mem.region_info().map_err(BlkError::Io)?;
        self.frontend.set_mem_table(&[region]).map_err(step("SET_MEM_TABLE"))?;
        Ok(())
    }

    /// Starts queue `q` on the rings at `ring` (in `mem`), with its eventfds.
    pub fn start_queue(
        &mut self,
        q: u16,
        mem: &GuestMemory,
        ring: RingAddrs,
        kick: &Event,
        call: &Event,
    ) -> Result<(), BlkError> {
        let i = usize::from(q);
        let host = |gpa: u64| mem.host_address(gpa).map_err(BlkError::Memory);
        let addrs = VringConfigData {
            queue_max_size: ring.size,
            queue_size: ring.size,
            flags: 0,
            desc_table_addr: host(ring.desc)?,
            used_ring_addr: host(ring.used)?,
            avail_ring_addr: host(ring.avail)?,
            log_addr: None,
        };
        self.frontend.set_vring_num(i, ring.size).map_err(step("SET_VRING_NUM"))?;
        self.frontend.set_vring_base(i, 0).map_err(step("SET_VRING_BASE"))?;
        self.frontend.set_vring_addr(i, &addrs).map_err(step("SET_VRING_ADDR"))?;
        // The call fd before the kick fd: a backend may start serving the queue as soon as
        // it has the kick fd, and must be able to signal by then.
        self.frontend.set_vring_call(i, call.eventfd()).map_err(step("SET_VRING_CALL"))?;
        self.frontend.set_vring_kick(i, kick.eventfd()).map_err(step("SET_VRING_KICK"))?;
        self.started.push(q);
        // With protocol features, a ring starts disabled until SET_VRING_ENABLE.
        self.frontend.set_vring_enable(i, true).map_err(step("SET_VRING_ENABLE"))?;
        Ok(())
    }

    /// Stops every started queue (GET_VRING_BASE: the backend finishes with the ring and
    /// lets go of it). The first failure is returned after trying all.
    pub fn stop(&mut self) -> Result<(), BlkError> {
        let mut result = Ok(());
        for q in std::mem::take(&mut self.started) {
            if let Err(e) = self.frontend.get_vring_base(usize::from(q)) {
                if result.is_ok() {
                    result = Err(step("GET_VRING_BASE")(e));
                }
            }
        }
        result
    }

    /// Whether the backend has hung up (or sent something unasked, which it never does
    /// while healthy).
    pub fn hung_up(&self) -> bool {
        use std::os::fd::AsFd;
        // A failed poll of a socket we hold open says nothing about the backend.
        super::notify::wait_readable(&[self.watch.as_fd()], Duration::ZERO)
            .is_ok_and(|ready| ready.contains(&true))
    }

    /// The socket, to wait on beside the call eventfds: readable once the backend hangs up.
    pub fn watch(&self) -> &UnixStream {
        &self.watch
    }
}

/// A failure of the handshake step `name`.
fn step(name: &'static str) -> impl Fn(vhost::Error) -> BlkError {
    move |e| BlkError::Handshake { step: name, message: e.to_string() }
}

/// Connects, retrying while the socket does not exist yet or refuses (the backend is
/// starting), until `timeout`. The socket gets read and write timeouts.
fn connect_socket(path: &Path, timeout: Duration) -> Result<UnixStream, BlkError> {
    let deadline = Instant::now() + timeout;
    loop {
        match UnixStream::connect(path) {
            Ok(sock) => {
                sock.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(BlkError::Io)?;
                sock.set_write_timeout(Some(REPLY_TIMEOUT)).map_err(BlkError::Io)?;
                return Ok(sock);
            }
            // A backend that is starting has not made its socket yet, or not listening
            // on it; a directory that does not exist will not get one.
            Err(e)
                if Instant::now() < deadline
                    && (e.kind() == std::io::ErrorKind::ConnectionRefused
                        || e.kind() == std::io::ErrorKind::NotFound
                            && path.parent().is_some_and(Path::is_dir)) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(BlkError::Connect { target: path.display().to_string(), source })
            }
        }
    }
}

/// GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES: CONFIG (required), MQ and REPLY_ACK when
/// offered. Returns what was agreed.
fn negotiate_protocol(frontend: &mut Frontend) -> Result<VhostUserProtocolFeatures, BlkError> {
    let offered = frontend.get_protocol_features().map_err(step("GET_PROTOCOL_FEATURES"))?;
    if !offered.contains(VhostUserProtocolFeatures::CONFIG) {
        return Err(BlkError::Unsupported(
            "the backend does not offer the CONFIG protocol feature (needed for the disk's size)"
                .into(),
        ));
    }
    let wanted = VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK;
    let agreed = offered & wanted;
    frontend.set_protocol_features(agreed).map_err(step("SET_PROTOCOL_FEATURES"))?;
    if agreed.contains(VhostUserProtocolFeatures::REPLY_ACK) {
        frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    }
    Ok(agreed)
}

/// GET_CONFIG of the first [`CONFIG_LEN`] bytes, read as `agreed` says.
fn read_config(frontend: &mut Frontend, agreed: u64) -> Result<BlkConfig, BlkError> {
    let buf = [0u8; CONFIG_LEN as usize];
    let (_, bytes) = frontend
        .get_config(0, CONFIG_LEN, VhostUserConfigFlags::empty(), &buf)
        .map_err(step("GET_CONFIG"))?;
    BlkConfig::parse(&bytes, agreed).ok_or_else(|| BlkError::Handshake {
        step: "GET_CONFIG",
        message: format!("{} bytes of configuration, {CONFIG_LEN} expected", bytes.len()),
    })
}
