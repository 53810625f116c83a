//! A userspace TCP proxy that adds a fixed latency, for tests and benchmarks on machines
//! whose kernel has no netem (`fallow bench delay-proxy`).
//!
//! Every accepted connection gets a connection of its own to the target. Each direction is
//! a reader and a writer joined by a bounded queue: the reader stamps every chunk it reads
//! with the time it arrived, the writer sleeps until that time plus the delay and then
//! forwards it. So the delay is added once per direction (a request and its reply cost
//! twice the delay), and chunks in flight overlap instead of queueing behind each other's
//! delays: a stream keeps its throughput, as over a long link. An end of stream is passed
//! on (after the data before it) as a half-close; an error on either side closes both.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The most bytes one read takes from a socket.
const CHUNK: usize = 64 * 1024;
/// Chunks queued per direction; a full queue stops the reader, so a fast sender meets
/// backpressure and the proxy holds at most this many chunks per direction.
const QUEUE: usize = 256;
/// How long connecting to the target may take before the client's connection is closed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the proxy does: where it forwards to and the delay it adds in each direction.
#[derive(Debug, Clone)]
pub struct DelayProxy {
    /// The target, `HOST:PORT`, resolved anew for each connection.
    pub to: String,
    /// Added to every byte in each direction.
    pub delay: Duration,
}

impl DelayProxy {
    /// Accepts connections on `listener` and proxies each, until an accept fails for a
    /// reason other than a transient one (the error is returned). A connection that fails
    /// is closed on its own; the others go on.
    pub async fn serve(self, listener: TcpListener) -> io::Result<()> {
        loop {
            let (client, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                // Out of descriptors, or a connection reset before it was accepted: the
                // listener itself is fine; wait a little rather than spin.
                Err(err) if is_transient(&err) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                Err(err) => return Err(err),
            };
            let (to, delay) = (self.to.clone(), self.delay);
            tokio::spawn(async move {
                if let Err(err) = proxy_one(client, &to, delay).await {
                    // A proxy between a test's processes: a dropped connection is part of
                    // what it tests, worth a line, not a stop.
                    eprintln!("delay-proxy: connection from {peer} to {to}: {err}");
                }
            });
        }
    }
}

/// Accept errors after which the listener still works.
fn is_transient(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    ) || err.raw_os_error().is_some_and(|code| code == 23 || code == 24) // ENFILE, EMFILE
}

/// Binds `listen` and serves [`DelayProxy`] there; `bound` is called with the bound
/// address (`:0` chooses a port) before the first accept.
pub async fn run(
    listen: SocketAddr,
    proxy: DelayProxy,
    bound: impl FnOnce(SocketAddr),
) -> io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    bound(listener.local_addr()?);
    proxy.serve(listener).await
}

/// Proxies one client connection: connects to `to`, then pumps both directions until
/// both have ended.
async fn proxy_one(client: TcpStream, to: &str, delay: Duration) -> io::Result<()> {
    let target = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(to))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting timed out"))??;
    // Small messages must not wait for Nagle on top of the delay we add on purpose.
    client.set_nodelay(true)?;
    target.set_nodelay(true)?;
    let (client_read, client_write) = client.into_split();
    let (target_read, target_write) = target.into_split();
    let up = pump(client_read, target_write, delay);
    let down = pump(target_read, client_write, delay);
    // Whichever fails first ends both: dropping the other direction's halves closes them.
    tokio::try_join!(up, down)?;
    Ok(())
}

/// One direction: reads chunks from `from` and writes each to `to` `delay` after it was
/// read; at the end of `from`, shuts down the writing side of `to`.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) -> io::Result<()> {
    let (send, mut queue) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUE);
    let reader = async move {
        loop {
            let mut buf = vec![0; CHUNK];
            let n = from.read(&mut buf).await?;
            if n == 0 {
                // Dropping `send` tells the writer that the stream ended.
                return Ok::<(), io::Error>(());
            }
            buf.truncate(n);
            if send.send((Instant::now() + delay, buf)).await.is_err() {
                // The writer stopped on an error, which it reports.
                return Ok(());
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = queue.recv().await {
            // The timer wheel rounds a sleep up to its next millisecond tick, even one that
            // is already due: sleeping only when there is time left keeps `--delay 0` a
            // plain relay instead of one that adds ~1 ms to every chunk.
            if due > Instant::now() {
                tokio::time::sleep_until(due).await;
            }
            to.write_all(&chunk).await?;
        }
        to.shutdown().await
    };
    tokio::try_join!(reader, writer)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that echoes each connection back until the client half-closes it, then
    /// closes its own side.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        addr
    }

    /// A proxy to `to` with `delay`, on an OS-chosen port.
    async fn proxy(to: SocketAddr, delay: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let proxy = DelayProxy { to: to.to_string(), delay };
        tokio::spawn(proxy.serve(listener));
        addr
    }

    #[tokio::test]
    async fn a_round_trip_costs_twice_the_delay_and_bytes_arrive_intact() {
        let delay = Duration::from_millis(30);
        let addr = proxy(echo_server().await, delay).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let mut reply = [0u8; 5];
        for _ in 0..3 {
            let start = Instant::now();
            stream.write_all(b"hello").await.unwrap();
            stream.read_exact(&mut reply).await.unwrap();
            let took = start.elapsed();
            assert_eq!(&reply, b"hello");
            assert!(took >= 2 * delay, "a round trip took {took:?}, less than 2 x {delay:?}");
            assert!(took < 2 * delay + Duration::from_secs(2), "a round trip took {took:?}");
        }

        // A larger stream, then a half-close: everything comes back in order, then EOF.
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (mut r, mut w) = stream.into_split();
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            w.write_all(&sent).await.unwrap();
            w.shutdown().await.unwrap();
        });
        let mut back = Vec::new();
        r.read_to_end(&mut back).await.unwrap();
        writer.await.unwrap();
        assert!(back == data, "the echoed stream differs ({} of {} bytes)", back.len(), data.len());
    }

    #[tokio::test]
    async fn chunks_in_flight_overlap_their_delays() {
        let delay = Duration::from_millis(100);
        let addr = proxy(echo_server().await, delay).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        // Ten writes 10 ms apart: serialized delays would take over 2 s, overlapped ones
        // about 2 x 100 ms plus the 90 ms of writing.
        let start = Instant::now();
        for i in 0..10u8 {
            stream.write_all(&[i]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut reply = [0u8; 10];
        stream.read_exact(&mut reply).await.unwrap();
        let took = start.elapsed();
        assert_eq!(reply, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert!(took >= 2 * delay, "{took:?}");
        assert!(took < Duration::from_millis(1000), "delays did not overlap: {took:?}");
    }

    #[tokio::test]
    async fn a_target_that_refuses_closes_the_client() {
        // A port that was free a moment ago: nothing listens there.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let addr = proxy(closed, Duration::from_millis(1)).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "the client was not closed: {read:?}");
    }
}
