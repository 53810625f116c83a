//! A real node for integration tests: an engine and a server on 127.0.0.1 with an
//! OS-assigned port, running on its own thread and runtime until dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fallow_client::ClientConfig;
use fallow_node::{ClusterSettings, ListenAddr, Node, NodeConfig, Server};
use fallow_pool::{Engine, EngineBuilder};

/// The secret every test node uses.
pub const SECRET: &[u8] = b"integration-test-secret-0123456789";

/// A node serving on 127.0.0.1:0 (and a Unix socket, if asked).
pub struct TestNode {
    /// Its TCP address.
    pub addr: SocketAddr,
    /// Its `/metrics` address, if asked for.
    pub metrics: Option<SocketAddr>,
    /// Its Unix socket, if asked for.
    pub unix: Option<std::path::PathBuf>,
    /// The node itself, for looking at its state.
    pub node: Arc<Node>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Settings a test may change.
pub struct Options {
    /// Bytes the node lends.
    pub budget: usize,
    /// How long a reply may wait for a client that does not read.
    pub write_timeout: Duration,
    /// How long a connection may take to authenticate.
    pub handshake_timeout: Duration,
    /// How long a client's pools outlive its last connection.
    pub client_lease: Duration,
    /// Listen on a Unix socket too.
    pub unix: bool,
    /// Pools one client may create.
    pub max_pools_per_client: usize,
    /// Serve `/metrics` on 127.0.0.1:0.
    pub metrics: bool,
    /// Gossip settings; `None` runs the node alone.
    pub cluster: Option<ClusterSettings>,
    /// How long a forwarded request may wait for another node: long, because a loaded
    /// test machine can stall a debug build for longer than the 250 ms default.
    pub forward_timeout: Duration,
    /// The content summary (cross-node dedup).
    pub summary: fallow_node::summary::SummarySettings,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            budget: 64 << 20,
            write_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            client_lease: Duration::from_secs(300),
            unix: false,
            max_pools_per_client: 1024,
            metrics: false,
            cluster: None,
            forward_timeout: Duration::from_secs(5),
            summary: Default::default(),
        }
    }
}

impl TestNode {
    /// A node with the default [`Options`].
    pub fn start() -> TestNode {
        Self::with(Options::default())
    }

    /// A node with `options`; panics if it cannot start.
    pub fn with(options: Options) -> TestNode {
        let engine = Arc::new(Engine::new(
            EngineBuilder::new(options.budget).compress_interval(None).build().unwrap(),
        ));
        let mut listen = vec![ListenAddr::Tcp("127.0.0.1:0".parse().unwrap())];
        let unix = options.unix.then(|| {
            let path = std::env::temp_dir().join(format!(
                "fallow-test-{}-{}.sock",
                std::process::id(),
                rand::random::<u32>()
            ));
            listen.push(ListenAddr::Unix(path.clone()));
            path
        });
        let mut config = NodeConfig::new(listen, SECRET.to_vec());
        config.write_timeout = options.write_timeout;
        config.handshake_timeout = options.handshake_timeout;
        config.client_lease = options.client_lease;
        config.max_pools_per_client = options.max_pools_per_client;
        if options.metrics {
            config.metrics = Some("127.0.0.1:0".parse().unwrap());
        }
        config.cluster = options.cluster;
        config.forward_timeout = options.forward_timeout;
        config.summary = options.summary;
        let node = Arc::new(Node::new(engine, config, None));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let serving = node.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let server = Server::start(serving).await.unwrap();
                ready_tx.send((server.tcp_addr().unwrap(), server.metrics_addr())).unwrap();
                let _ = stop_rx.await;
                server.shutdown().await;
            });
        });
        let (addr, metrics) = ready_rx.recv_timeout(Duration::from_secs(10)).expect("node started");
        TestNode { addr, metrics, unix, node, stop: Some(stop_tx), thread: Some(thread) }
    }

    /// A client config for this node with the right secret.
    pub fn config(&self) -> ClientConfig {
        ClientConfig::new(&self.addr.to_string(), SECRET.to_vec())
            .unwrap()
            .timeout(Duration::from_secs(10))
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A page whose bytes all derive from `seed`, so different seeds give different pages.
pub fn page(seed: u64) -> Vec<u8> {
    crate::pages::unique_page(seed)
}

/// The keys of pages 0..n of one object.
pub fn keys(pool: fallow_core::PoolId, object: u64, n: u64) -> Vec<fallow_core::PageKey> {
    (0..n).map(|i| fallow_core::PageKey::new(pool, object, i)).collect()
}

/// `n` pages made from `seed`, one after the other.
pub fn pages(seed: u64, n: u64) -> bytes::Bytes {
    bytes::Bytes::from((0..n).flat_map(|i| page(seed * 1_000_003 + i)).collect::<Vec<u8>>())
}

/// Checks that `got` holds exactly the pages of `data`.
pub fn assert_pages(got: &[Option<bytes::Bytes>], data: &bytes::Bytes, what: &str) {
    use fallow_core::PAGE_SIZE;
    for (i, page) in got.iter().enumerate() {
        let want = &data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
        assert_eq!(page.as_deref(), Some(want), "{what}: page {i}");
    }
}

/// A TCP proxy's accept loop on 127.0.0.1, shared by the proxies below: each client gets a
/// connection of its own to the target, both ends with TCP_NODELAY and kept so that they
/// can be cut, handed to the proxy's `serve`. Dropped, it stops and cuts them all.
struct Listening {
    addr: SocketAddr,
    streams: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Listening {
    fn start(
        target: SocketAddr,
        serve: impl Fn(std::net::TcpStream, std::net::TcpStream) + Send + 'static,
    ) -> Listening {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let listening = Listening {
            addr: listener.local_addr().unwrap(),
            streams: Arc::default(),
            stop: Arc::default(),
        };
        let (streams, stop) = (listening.streams.clone(), listening.stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(upstream) = std::net::TcpStream::connect(target) else { continue };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                streams
                    .lock()
                    .unwrap()
                    .extend([client.try_clone().unwrap(), upstream.try_clone().unwrap()]);
                serve(client, upstream);
            }
        });
        listening
    }

    /// Closes every connection made so far (new ones still work).
    fn cut(&self) {
        for stream in self.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.cut();
        // Wake the accept loop so it sees the stop flag.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}

/// A TCP proxy on 127.0.0.1 in front of a node, whose connections a test can cut.
pub struct CutProxy {
    /// Where clients connect to reach the node.
    pub addr: SocketAddr,
    listening: Listening,
}

impl CutProxy {
    /// A proxy to `target` on a free port.
    pub fn start(target: SocketAddr) -> CutProxy {
        let listening = Listening::start(target, |client, upstream| {
            for (mut from, mut to) in
                [(client.try_clone().unwrap(), upstream.try_clone().unwrap()), (upstream, client)]
            {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        CutProxy { addr: listening.addr, listening }
    }

    /// Closes every connection open through the proxy (new ones still work).
    pub fn cut(&self) {
        self.listening.cut();
    }
}

/// A TCP proxy on 127.0.0.1 in front of a node that can hold back what clients send, as a
/// stalled network or a starved node would: bytes sent while it holds stay in the proxy
/// (their connection's close too) until [`HoldProxy::release`] delivers them late.
pub struct HoldProxy {
    /// Where clients connect to reach the node.
    pub addr: SocketAddr,
    holding: Arc<std::sync::atomic::AtomicBool>,
    held: Arc<std::sync::Mutex<Vec<Arc<std::sync::Mutex<HeldConnection>>>>>,
    _listening: Listening,
}

/// What one connection sent while the proxy held it.
struct HeldConnection {
    upstream: std::net::TcpStream,
    bytes: Vec<u8>,
    /// The client closed its side meanwhile.
    closed: bool,
    /// Delivered: later bytes go straight through.
    released: bool,
    /// Signalled when the node closes its side.
    node_closed: std::sync::mpsc::Receiver<()>,
}

impl HoldProxy {
    /// A proxy to `target` on a free port, passing everything through.
    pub fn start(target: SocketAddr) -> HoldProxy {
        let holding: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let held: Arc<std::sync::Mutex<Vec<_>>> = Arc::default();
        let (hold, keep) = (holding.clone(), held.clone());
        let listening = Listening::start(target, move |client, upstream| {
            let (node_closed_tx, node_closed) = std::sync::mpsc::channel();
            let (mut down_from, mut down_to) =
                (upstream.try_clone().unwrap(), client.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut down_from, &mut down_to);
                let _ = down_to.shutdown(std::net::Shutdown::Both);
                let _ = node_closed_tx.send(());
            });
            let (hold, keep) = (hold.clone(), keep.clone());
            std::thread::spawn(move || {
                hold_or_forward(client, upstream, node_closed, &hold, &keep)
            });
        });
        HoldProxy { addr: listening.addr, holding, held, _listening: listening }
    }

    /// From now on, bytes clients send are held back.
    pub fn hold(&self) {
        self.holding.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Bytes sent from now on pass; those held stay held.
    pub fn pass(&self) {
        self.holding.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Delivers what was held (and the closes that came after it), then waits until the
    /// node has closed each of those connections (at most 10 s each). Returns how many
    /// connections had bytes held.
    pub fn release(&self) -> usize {
        self.pass();
        let held: Vec<_> = self.held.lock().unwrap().drain(..).collect();
        for connection in &held {
            let mut connection = connection.lock().unwrap();
            use std::io::Write;
            let bytes = std::mem::take(&mut connection.bytes);
            // The node may have closed this connection already: then the bytes are lost.
            let _ = connection.upstream.write_all(&bytes);
            if connection.closed {
                let _ = connection.upstream.shutdown(std::net::Shutdown::Write);
            }
            connection.released = true;
        }
        for connection in &held {
            let connection = connection.lock().unwrap();
            let _ = connection.node_closed.recv_timeout(Duration::from_secs(10));
        }
        held.len()
    }
}

/// Copies one connection's client bytes to the node, or holds them (see [`HoldProxy`]).
fn hold_or_forward(
    mut client: std::net::TcpStream,
    mut upstream: std::net::TcpStream,
    node_closed: std::sync::mpsc::Receiver<()>,
    holding: &std::sync::atomic::AtomicBool,
    held: &std::sync::Mutex<Vec<Arc<std::sync::Mutex<HeldConnection>>>>,
) {
    use std::io::{Read, Write};
    let mut node_closed = Some(node_closed);
    let mut mine: Option<Arc<std::sync::Mutex<HeldConnection>>> = None;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = client.read(&mut buf).unwrap_or(0);
        if mine.is_none() && n > 0 && holding.load(std::sync::atomic::Ordering::SeqCst) {
            let connection = HeldConnection {
                upstream: upstream.try_clone().unwrap(),
                bytes: Vec::new(),
                closed: false,
                released: false,
                node_closed: node_closed.take().unwrap(),
            };
            let connection = Arc::new(std::sync::Mutex::new(connection));
            held.lock().unwrap().push(connection.clone());
            mine = Some(connection);
        }
        if let Some(connection) = &mine {
            let mut connection = connection.lock().unwrap();
            if !connection.released {
                match n {
                    0 => connection.closed = true,
                    n => connection.bytes.extend_from_slice(&buf[..n]),
                }
                if n == 0 {
                    return;
                }
                continue;
            }
        }
        if n == 0 || upstream.write_all(&buf[..n]).is_err() {
            let _ = upstream.shutdown(std::net::Shutdown::Write);
            return;
        }
    }
}

/// A node that gossips, joining `join` (gossip addresses).
pub fn gossiping(join: Vec<String>) -> TestNode {
    gossiping_with(join, Default::default())
}

/// A node that gossips, joining `join`, with these content summary settings.
pub fn gossiping_with(
    join: Vec<String>,
    summary: fallow_node::summary::SummarySettings,
) -> TestNode {
    TestNode::with(Options {
        cluster: Some(ClusterSettings { join, ..Default::default() }),
        budget: 32 << 20,
        summary,
        ..Options::default()
    })
}

/// The gossip address of a node that gossips.
pub fn gossip_addr(node: &TestNode) -> String {
    node.node.cluster().expect("it gossips").gossip_addr().to_string()
}

/// Three gossiping nodes that all list each other alive.
pub async fn three_nodes() -> Vec<TestNode> {
    three_nodes_with(Default::default()).await
}

/// Three gossiping nodes with these content summary settings, all listing each other alive.
pub async fn three_nodes_with(summary: fallow_node::summary::SummarySettings) -> Vec<TestNode> {
    let a = gossiping_with(vec![], summary);
    let b = gossiping_with(vec![gossip_addr(&a)], summary);
    let c = gossiping_with(vec![gossip_addr(&a), gossip_addr(&b)], summary);
    let nodes = vec![a, b, c];
    for node in &nodes {
        wait_for_members(node, 3).await;
    }
    nodes
}

/// Waits (at most 10 s) until `node` lists `alive` members alive.
pub async fn wait_for_members(node: &TestNode, alive: usize) {
    let client = fallow_client::Client::connect(node.config()).await.unwrap();
    let start = std::time::Instant::now();
    loop {
        let members = client.members().await.unwrap();
        if members.iter().filter(|m| m.state == fallow_client::MemberState::Alive).count() == alive
        {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{members:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
