//! The handshake over a real socket, for the clients the NBD spec lets a server treat
//! specially: one that does not set `NBD_FLAG_C_FIXED_NEWSTYLE` (served plain newstyle:
//! EXPORT_NAME only) and one that sets an unknown client flag (the connection is closed).
//! The byte-exact cases are the unit tests in `src/handshake.rs`; these check that what
//! the server decides reaches the socket, and that libnbd, told to leave out the fixed
//! newstyle flag, really gets a working export.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use fallow_backing::MemStore;
use fallow_cache::{CacheConfig, CacheLayer};
use fallow_core::ListenAddr;
use fallow_nbd::{Export, NbdServer};
use fallow_proto::nbd::handshake::{encode_client_flags, GREETING_LEN};
use fallow_proto::nbd::{Cmd, Opt, Request, NBD_FLAG_C_FIXED_NEWSTYLE, NBD_SIMPLE_REPLY_MAGIC};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SIZE: u64 = 8 << 20;

/// A server with one 8 MiB RAM export, `m`, on 127.0.0.1.
async fn server() -> NbdServer {
    let cache = CacheLayer::new(Arc::new(MemStore::new(SIZE)), None, CacheConfig::default());
    let export =
        Arc::new(Export { name: "m".into(), description: String::new(), cache, read_only: false });
    let listen = [ListenAddr::Tcp("127.0.0.1:0".parse().unwrap())];
    NbdServer::start(&listen, vec![export], None).await.unwrap()
}

/// Connects and reads the 18-byte greeting.
async fn connect(server: &NbdServer) -> TcpStream {
    let mut stream = TcpStream::connect(server.tcp_addr().unwrap()).await.unwrap();
    let mut greeting = [0u8; GREETING_LEN];
    stream.read_exact(&mut greeting).await.unwrap();
    stream
}

/// Reads until the server closes; returns what it sent meanwhile. Fails if it has not
/// closed within 10 s.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest))
        .await
        .expect("the server closes the connection")
        .unwrap();
    rest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_newstyle_client_reads_after_export_name() {
    let server = server().await;
    let mut stream = connect(&server).await;
    let mut out = BytesMut::new();
    encode_client_flags(&mut out, 0);
    Opt::ExportName("m".into()).encode(&mut out);
    stream.write_all(&out).await.unwrap();
    let mut reply = [0u8; 8 + 2 + 124];
    stream.read_exact(&mut reply).await.unwrap();
    assert_eq!(reply[..8], SIZE.to_be_bytes());
    // Transmission works as for anyone: read the first page of the (zeroed) RAM disk.
    out.clear();
    Request { flags: 0, cmd: Cmd::Read, cookie: 7, offset: 0, length: 4096 }.encode(&mut out);
    stream.write_all(&out).await.unwrap();
    let mut header = [0u8; 16];
    stream.read_exact(&mut header).await.unwrap();
    assert_eq!(header[..4], NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
    assert_eq!(header[4..8], [0; 4], "no error");
    assert_eq!(header[8..], 7u64.to_be_bytes());
    let mut data = vec![1u8; 4096];
    stream.read_exact(&mut data).await.unwrap();
    assert!(data.iter().all(|b| *b == 0));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_newstyle_client_is_closed_on_for_another_option() {
    let server = server().await;
    let mut stream = connect(&server).await;
    let mut out = BytesMut::new();
    encode_client_flags(&mut out, 0);
    Opt::List.encode(&mut out);
    stream.write_all(&out).await.unwrap();
    assert_eq!(read_until_closed(&mut stream).await, b"", "no option reply");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_client_flags_close_the_connection() {
    let server = server().await;
    let mut stream = connect(&server).await;
    let mut out = BytesMut::new();
    encode_client_flags(&mut out, NBD_FLAG_C_FIXED_NEWSTYLE | 1 << 7);
    stream.write_all(&out).await.unwrap();
    assert_eq!(read_until_closed(&mut stream).await, b"");
    server.shutdown().await;
}

/// libnbd with its handshake flags cleared (no fixed newstyle, with and without
/// NO_ZEROES) falls back to EXPORT_NAME and must still write and read. Skips without
/// nbdsh and its Python module.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libnbd_without_fixed_newstyle_writes_and_reads() {
    // Debian's python3 has the `nbd` module; a pyenv python3 earlier on PATH does not.
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let have = std::process::Command::new("nbdsh")
        .args(["-c", "pass"])
        .env("PATH", &path)
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        eprintln!("skipped: nbdsh with python3-libnbd is needed");
        return;
    }
    let server = server().await;
    let uri = format!("nbd://{}/m", server.tcp_addr().unwrap());
    let script = format!(
        "for flags in (0, nbd.HANDSHAKE_FLAG_NO_ZEROES):\n\
         \x20   h = nbd.NBD()\n\
         \x20   h.set_handshake_flags(flags)\n\
         \x20   h.connect_uri('{uri}')\n\
         \x20   assert h.get_handshake_flags() == flags, h.get_handshake_flags()\n\
         \x20   assert not h.get_structured_replies_negotiated()\n\
         \x20   assert h.get_size() == {SIZE}\n\
         \x20   h.pwrite(b'\\x5a' * 8192, 4096 * (1 + flags))\n\
         \x20   assert h.pread(8192, 4096 * (1 + flags)) == b'\\x5a' * 8192\n\
         \x20   h.shutdown()\n"
    );
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("timeout")
            .args(["60", "nbdsh", "-n", "-c", &script])
            .env("PATH", &path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    server.shutdown().await;
}
