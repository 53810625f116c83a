//! The client against a scripted fake node built from the same sans-io codec: replies out
//! of order, late replies, a node that hangs or hangs up, and a node that cannot prove it
//! holds the secret.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fallow_client::{Client, ClientConfig, ClientError, NodeRestart};
use fallow_core::{PageKey, PoolId, PAGE_SIZE};
use fallow_proto::fallow::auth::Transcript;
use fallow_proto::fallow::frame::decode;
use fallow_proto::fallow::{HelloReply, Op, Reply, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SECRET: &[u8] = b"fake-node-secret-0123456789";

/// Reads one request frame.
async fn next(stream: &mut TcpStream, input: &mut BytesMut) -> Option<(u64, Request)> {
    loop {
        if let Some(frame) = decode(input).unwrap() {
            let id = frame.id;
            return Some((id, Request::parse(frame).unwrap()));
        }
        if stream.read_buf(input).await.unwrap() == 0 {
            return None;
        }
    }
}

/// Answers HELLO and AUTH like a node holding `secret`.
async fn handshake(stream: &mut TcpStream, input: &mut BytesMut, secret: &[u8]) {
    handshake_as(stream, input, secret, 5).await;
}

/// [`handshake`] as the node run `node_id`.
async fn handshake_as(stream: &mut TcpStream, input: &mut BytesMut, secret: &[u8], node_id: u128) {
    let (id, Request::Hello(hello)) = next(stream, input).await.unwrap() else {
        panic!("no hello")
    };
    let challenge = [9u8; 32];
    let mut out = BytesMut::new();
    Reply::Hello(HelloReply { version: 1, max_batch: 4, node_id, challenge }).encode(
        Op::Hello,
        id,
        &mut out,
    );
    stream.write_all(&out).await.unwrap();
    let (id, Request::Auth { client_nonce, proof: _ }) = next(stream, input).await.unwrap() else {
        panic!("no auth")
    };
    let t = Transcript { version: 1, challenge, client_nonce, client_id: hello.client_id };
    out.clear();
    Reply::Auth { proof: t.node_proof(secret) }.encode(Op::Auth, id, &mut out);
    stream.write_all(&out).await.unwrap();
}

async fn fake_node<F, Fut>(script: F) -> (String, tokio::task::JoinHandle<()>)
where
    F: FnOnce(TcpStream, BytesMut) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut input = BytesMut::new();
        handshake(&mut stream, &mut input, SECRET).await;
        script(stream, input).await;
    });
    (addr, task)
}

fn config(addr: &str) -> ClientConfig {
    ClientConfig::new(addr, SECRET.to_vec()).unwrap().timeout(Duration::from_secs(5))
}

#[tokio::test]
async fn replies_in_reverse_order_reach_the_right_callers() {
    let (addr, node) = fake_node(|mut stream, mut input| async move {
        // Collect 8 single-page GETs, then answer them last first, each page filled with
        // its own index.
        let mut requests = Vec::new();
        while requests.len() < 8 {
            let (id, request) = next(&mut stream, &mut input).await.unwrap();
            let Request::Get { pages, .. } = request else { panic!("{request:?}") };
            requests.push((id, pages[0].index));
        }
        let mut out = BytesMut::new();
        for (id, index) in requests.into_iter().rev() {
            let data = Bytes::from(vec![index as u8; PAGE_SIZE]);
            Reply::Pages { found: vec![true], data }.encode(Op::Get, id, &mut out);
        }
        // A reply nobody asked for is ignored.
        Reply::Empty.encode(Op::Ping, 999_999, &mut out);
        stream.write_all(&out).await.unwrap();
        let _ = next(&mut stream, &mut input).await;
    })
    .await;
    let client = Client::connect(config(&addr)).await.unwrap();
    let gets = (0..8u64).map(|i| {
        let client = client.clone();
        async move { (i, client.get(PageKey::new(PoolId(1), 0, i)).await.unwrap()) }
    });
    for (i, page) in futures::future::join_all(gets).await {
        assert_eq!(page.unwrap(), vec![i as u8; PAGE_SIZE], "page {i}");
    }
    drop(client);
    node.await.unwrap();
}

#[tokio::test]
async fn batches_are_split_at_the_nodes_limit() {
    let (addr, node) = fake_node(|mut stream, mut input| async move {
        // max_batch is 4: ten keys arrive as 4 + 4 + 2.
        let mut sizes = Vec::new();
        let mut out = BytesMut::new();
        while sizes.len() < 3 {
            let (id, Request::Get { pages, .. }) = next(&mut stream, &mut input).await.unwrap()
            else {
                panic!()
            };
            sizes.push(pages.len());
            let found = vec![false; pages.len()];
            Reply::Pages { found, data: Bytes::new() }.encode(Op::Get, id, &mut out);
        }
        assert_eq!(sizes, vec![4, 4, 2]);
        stream.write_all(&out).await.unwrap();
        let _ = next(&mut stream, &mut input).await;
    })
    .await;
    let client = Client::connect(config(&addr)).await.unwrap();
    let keys: Vec<PageKey> = (0..10).map(|i| PageKey::new(PoolId(1), 0, i)).collect();
    let pages = client.get_many(&keys).await.unwrap();
    assert_eq!(pages, vec![None; 10]);
    drop(client);
    node.await.unwrap();
}

#[tokio::test]
async fn a_node_that_hangs_up_or_never_answers() {
    let (addr, node) = fake_node(|mut stream, mut input| async move {
        let _ = next(&mut stream, &mut input).await;
        // Hang up with the request in flight.
    })
    .await;
    let client = Client::connect(config(&addr)).await.unwrap();
    let err = client.take(PageKey::new(PoolId(1), 0, 0)).await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected), "{err}");
    node.await.unwrap();

    let (addr, node) = fake_node(|mut stream, mut input| async move {
        // Read and never answer.
        while next(&mut stream, &mut input).await.is_some() {}
    })
    .await;
    let client = Client::connect(config(&addr).timeout(Duration::from_millis(200))).await.unwrap();
    let err = client.take(PageKey::new(PoolId(1), 0, 0)).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout(_)), "{err}");
    drop(client);
    node.await.unwrap();
}

#[tokio::test]
async fn a_node_without_the_secret_is_not_trusted() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let node = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut input = BytesMut::new();
        // It accepts any proof and answers with a proof made from another secret.
        handshake(&mut stream, &mut input, b"some-other-secret-entirely").await;
    });
    let err = Client::connect(config(&addr)).await.unwrap_err();
    assert!(matches!(err, ClientError::NodeNotAuthenticated), "{err}");
    node.await.unwrap();
}

#[tokio::test]
async fn garbage_from_the_node_is_a_protocol_error_not_a_panic() {
    let (addr, node) = fake_node(|mut stream, mut input| async move {
        let (id, _) = next(&mut stream, &mut input).await.unwrap();
        // A GET reply whose found flag is 7.
        let mut out = BytesMut::new();
        fallow_proto::fallow::frame::encode(&mut out, Op::Get as u8, 0, id, &[7]);
        stream.write_all(&out).await.unwrap();
        let _ = next(&mut stream, &mut input).await;
    })
    .await;
    let client = Client::connect(config(&addr)).await.unwrap();
    let err = client.take(PageKey::new(PoolId(1), 0, 0)).await.unwrap_err();
    assert!(matches!(err, ClientError::Protocol(_)), "{err}");
    drop(client);
    node.await.unwrap();
}

#[tokio::test]
async fn a_restarted_node_is_refused_when_the_config_says_so() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // Each client meets run 5, which hangs up, then run 6 (a restart), which answers.
    let node = tokio::spawn(async move {
        for node_id in [5, 6, 5, 6] {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut input = BytesMut::new();
            handshake_as(&mut stream, &mut input, SECRET, node_id).await;
            if node_id == 5 {
                continue;
            }
            let Some((id, Request::Ping)) = next(&mut stream, &mut input).await else { continue };
            let mut out = BytesMut::new();
            Reply::Empty.encode(Op::Ping, id, &mut out);
            stream.write_all(&out).await.unwrap();
            let _ = next(&mut stream, &mut input).await;
        }
    });
    let refusing = Client::connect(config(&addr).on_restart(NodeRestart::Refuse)).await.unwrap();
    let err = refusing.ping().await.unwrap_err();
    assert!(matches!(err, ClientError::NodeRestarted { expected: 5, found: 6 }), "{err}");
    drop(refusing);
    let client = Client::connect(config(&addr)).await.unwrap();
    client.ping().await.unwrap();
    assert_eq!(client.node_id().await.unwrap(), 6);
    drop(client);
    node.await.unwrap();
}
