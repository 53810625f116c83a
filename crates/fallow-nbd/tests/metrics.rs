//! The NBD server's `/metrics` follow the traffic of a real client (qemu-io).

use std::io::{Read, Write};
use std::sync::Arc;

use fallow_backing::MemStore;
use fallow_cache::{CacheConfig, CacheLayer};
use fallow_core::ListenAddr;
use fallow_nbd::{Export, NbdServer};

fn scrape(addr: std::net::SocketAddr) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_and_cache_tiers() {
    let have = std::process::Command::new("sh").args(["-c", "command -v qemu-io"]).output();
    if !have.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let cache = CacheLayer::new(
        Arc::new(MemStore::new(8 << 20)),
        None,
        CacheConfig { local_pages: 1024, ..CacheConfig::default() },
    );
    let export =
        Arc::new(Export { name: "m".into(), description: String::new(), cache, read_only: false });
    let listen = [ListenAddr::Tcp("127.0.0.1:0".parse().unwrap())];
    let server = NbdServer::start(&listen, vec![export], Some("127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    let uri = format!("nbd://{}/m", server.tcp_addr().unwrap());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("timeout")
            .args([
                "60",
                "qemu-io",
                "-f",
                "raw",
                "-c",
                "write -P 1 0 64k",
                "-c",
                "read -P 1 0 64k",
                "-c",
                "read -P 0 1M 4k",
                "-c",
                "flush",
            ])
            .arg(&uri)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = scrape(server.metrics_addr().unwrap());
    assert_eq!(value(&text, "fallow_nbd_requests_total{cmd=\"write\",result=\"ok\"}"), 1.0);
    assert!(value(&text, "fallow_nbd_requests_total{cmd=\"read\",result=\"ok\"}") >= 2.0);
    // qemu-io also flushes when it closes the image.
    assert!(value(&text, "fallow_nbd_requests_total{cmd=\"flush\",result=\"ok\"}") >= 1.0);
    assert_eq!(value(&text, "fallow_nbd_bytes_total{cmd=\"write\"}"), 65536.0);
    // The 16 written pages are read from the local tier, the one never written from the store.
    assert_eq!(
        value(&text, "fallow_nbd_cache_pages_read_total{export=\"m\",tier=\"local\"}"),
        16.0
    );
    assert_eq!(
        value(&text, "fallow_nbd_cache_pages_read_total{export=\"m\",tier=\"backing\"}"),
        1.0
    );
    assert_eq!(value(&text, "fallow_nbd_connections_accepted_total"), 1.0);
    assert_eq!(value(&text, "fallow_nbd_pool_trusted{export=\"m\"}"), 1.0);
    server.shutdown().await;
}
