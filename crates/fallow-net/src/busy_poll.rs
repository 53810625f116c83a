//! Busy-polling a connection's socket before its task parks (`--poll-us`), for the servers
//! that accept through this crate (`fallow node`, `fallow nbd`).
//!
//! A request that arrives while the server's task is parked costs a wake-up: the kernel
//! wakes the runtime's thread sleeping in `epoll_wait`, which polls the task again, tens
//! of microseconds on a VM. [`BusyPoll`] keeps the task awake instead: when a read would
//! park (the inner stream's `poll_read` is `Pending`, which has already registered the
//! task's waker with the reactor), it asks the socket itself for data with non-blocking
//! `recv(MSG_DONTWAIT)` calls, and returns the first bytes that come.
//!
//! ```text
//!  poll_read ─▶ inner poll_read ─ Ready ─────────────────────────────▶ data, EOF or error
//!                  │ Pending (waker registered)
//!                  ▼
//!   given up? ─ yes (and no probe due) ─▶ Pending: parked until the reactor wakes the task
//!                  │ no
//!                  ▼
//!   recv(MSG_DONTWAIT) again and again ─ bytes, EOF, error ─▶ returned at once
//!                  │ nothing for `window`
//!                  ▼
//!   Pending (the waker is registered: the next data wakes the task as usual)
//! ```
//!
//! The window runs from the moment the read would park, the end of the last request's
//! work, so it covers the client's turn: a client that answers within it keeps the
//! connection spinning from one request to the next. Adaptive: a connection whose windows
//! pass empty twice in a row (an idle one, or a client slower than the window) stops
//! spinning, except for a probe every 16 requests; a probe that catches data resumes it.
//! An idle connection costs one or two windows of CPU, then parks until data wakes it the
//! usual way.
//!
//! The cost: the thread that polls the task spins, so a tokio worker is busy (a core, while
//! the connection has requests coming) and runs nothing else for up to a window at a time.
//! Bytes read by a spin bypass tokio's readiness flags, which stay as the last read left
//! them; their arrival still makes the reactor wake the task, which finds nothing to read
//! then and parks again, so nothing is lost and nothing hangs.
//!
//! On TCP the socket also gets `SO_BUSY_POLL` (the same window), for network devices whose
//! driver supports it: each `recv` then polls the device's receive queue as well. Above
//! `net.core.busy_read` the kernel allows it only with `CAP_NET_ADMIN`, and loopback has no
//! such queue: there it does nothing, and what `BENCHMARKS.md` measures on loopback ("A
//! fallow node against memcached") is this module's polling alone.

use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::RecvFlags;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::Stream;

/// The longest window accepted; a longer one is cut to it. A second of spinning between
/// two requests is already a core spent for nothing.
pub const MAX_WINDOW: Duration = Duration::from_secs(1);

/// The most bytes one spinning `recv` asks for. The part of the caller's buffer it uses
/// must be zeroed first (safe code may not hand the kernel uninitialised memory), once
/// per window, while the connection waits anyway: 64 KiB holds a burst of requests.
const SPIN_READ_MAX: usize = 64 * 1024;

/// How a server's connections wait for their next request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadPolling {
    /// How long after its last data a connection keeps polling its socket before its task
    /// parks; zero parks at once (no polling). At most [`MAX_WINDOW`].
    pub window: Duration,
}

impl ReadPolling {
    /// No polling: every read that would block parks the task.
    pub const OFF: ReadPolling = ReadPolling { window: Duration::ZERO };

    /// Polling for `window` after the last data (cut to [`MAX_WINDOW`]).
    pub fn for_window(window: Duration) -> ReadPolling {
        ReadPolling { window: window.min(MAX_WINDOW) }
    }

    /// Whether connections poll at all.
    pub fn is_on(&self) -> bool {
        !self.window.is_zero()
    }

    /// An accepted TCP connection as the server gets it: wrapped in a [`BusyPoll`] when
    /// polling is on, with `SO_BUSY_POLL` asked for.
    pub(crate) fn tcp(self, stream: tokio::net::TcpStream) -> Box<dyn Stream> {
        if !self.is_on() {
            return Box::new(stream);
        }
        if let Err(err) = set_kernel_busy_poll(&stream, self.window) {
            // Expected without CAP_NET_ADMIN; the polling in user space goes on without it.
            tracing::debug!(%err, "SO_BUSY_POLL not set");
        }
        Box::new(BusyPoll::new(stream, self.window))
    }

    /// An accepted Unix connection: wrapped in a [`BusyPoll`] when polling is on.
    pub(crate) fn unix(self, stream: tokio::net::UnixStream) -> Box<dyn Stream> {
        match self.is_on() {
            true => Box::new(BusyPoll::new(stream, self.window)),
            false => Box::new(stream),
        }
    }
}

/// Asks the kernel to busy-poll the device queue of `stream` for up to `window` when it is
/// read (`SO_BUSY_POLL`, in microseconds).
fn set_kernel_busy_poll(stream: &tokio::net::TcpStream, window: Duration) -> io::Result<()> {
    let micros = u32::try_from(window.as_micros()).unwrap_or(u32::MAX);
    socket2::SockRef::from(stream).set_busy_poll(micros)
}

/// A stream whose reads poll the socket for up to a window before they park; writes pass
/// straight through. See the module doc.
#[derive(Debug)]
pub struct BusyPoll<S> {
    inner: S,
    /// How long a read that would park spins first. Zero: every call goes straight to
    /// `inner`.
    window: Duration,
    /// Windows in a row that passed with nothing; from [`GIVE_UP_AFTER`] on, reads do not
    /// spin, except for a probe every [`PROBE_EVERY`] reads that return data.
    empty: u32,
    /// While spinning is given up: reads that returned data since the last probe.
    unspun: u32,
    /// Reads that spun (each for what was left of its window, at most), for tests.
    spins: u64,
}

/// Windows that pass empty in a row before a connection stops spinning. The next request
/// of a client that sends them further apart than the window always comes through the
/// reactor, so spinning for it costs a window of CPU and gains nothing; one empty window
/// may be chance, two in a row are the client's pace.
const GIVE_UP_AFTER: u32 = 2;

/// While given up, one read in this many that would park spins anyway, to notice a client
/// that has come closer: a probe that catches data resumes spinning.
const PROBE_EVERY: u32 = 16;

impl<S> BusyPoll<S> {
    /// Wraps `inner`, polling for `window` (cut to [`MAX_WINDOW`]; zero: no polling).
    pub fn new(inner: S, window: Duration) -> BusyPoll<S> {
        BusyPoll { inner, window: window.min(MAX_WINDOW), empty: 0, unspun: 0, spins: 0 }
    }

    /// Whether spinning is given up (too many empty windows in a row).
    fn given_up(&self) -> bool {
        self.empty >= GIVE_UP_AFTER
    }
}

impl<S: AsFd> BusyPoll<S> {
    /// The inner stream would park: polls the socket until data, EOF or an error comes, or
    /// the window closes (`Pending`; the inner poll registered the waker).
    fn spin(&mut self, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if buf.remaining() == 0 {
            return Poll::Pending;
        }
        if self.given_up() {
            if self.unspun < PROBE_EVERY {
                return Poll::Pending;
            }
            self.unspun = 0;
        }
        // The window runs from the moment the connection would park, that is from the end
        // of the last request's work: what it must cover is the client's turn (its
        // wake-up, its next request, the way back), whatever the server's work took.
        let deadline = Instant::now() + self.window;
        self.spins += 1;
        let dst = buf.initialize_unfilled_to(buf.remaining().min(SPIN_READ_MAX));
        let received = loop {
            match rustix::net::recv(self.inner.as_fd(), &mut *dst, RecvFlags::DONTWAIT) {
                Ok((n, _)) => break Ok(n),
                Err(Errno::AGAIN | Errno::INTR) => {}
                Err(errno) => break Err(io::Error::from(errno)),
            }
            if Instant::now() >= deadline {
                self.empty = self.empty.saturating_add(1);
                return Poll::Pending;
            }
            // Between two looks, let whatever else is runnable on this CPU have it: above
            // all a client on the same host, which the kernel tends to wake on the CPU of
            // the thread whose reply woke it (this one), where a bare spin would make it
            // wait out the window before it can send the request this loop waits for.
            std::thread::yield_now();
        };
        self.empty = 0;
        let n = received?;
        // `n` is at most the length of `dst`, all of it initialised above; zero is EOF.
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsFd + Unpin> AsyncRead for BusyPoll<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.window.is_zero() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && this.given_up() {
                    this.unspun = this.unspun.saturating_add(1);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            Poll::Pending => this.spin(buf),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for BusyPoll<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    //! The reactor never runs in these tests: each builds a runtime only so that streams
    //! can be registered with it, and polls with a waker that does nothing. A read that
    //! returns data can only have found it by spinning (tokio's readiness flags, never set
    //! by a reactor, keep the inner stream `Pending`). No test asserts on time: a window
    //! that should catch data is the longest allowed (a second, against data sent 20 ms
    //! in), and one that should pass empty is a few milliseconds.

    use std::io::Write;
    use std::net::{TcpListener, TcpStream as StdTcp};
    use std::task::Waker;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    const LONG: Duration = MAX_WINDOW;

    /// A runtime (never run, only entered) and a connected pair: the server end as a
    /// tokio stream, the client end as a blocking std stream.
    fn pair() -> (tokio::runtime::Runtime, TcpStream, StdTcp) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (server, client) = pair_in(&rt);
        (rt, server, client)
    }

    /// A connected pair, the server end registered with `rt`.
    fn pair_in(rt: &tokio::runtime::Runtime) -> (TcpStream, StdTcp) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = StdTcp::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        let server = {
            let _in_runtime = rt.enter();
            TcpStream::from_std(server).unwrap()
        };
        (server, client)
    }

    /// One `poll_read` into a 64-byte buffer, with a waker that does nothing: `None` for
    /// `Pending`, else the bytes read (empty: EOF) or the error.
    fn poll_once<S: AsyncRead + Unpin>(stream: &mut S) -> Option<io::Result<Vec<u8>>> {
        let mut space = [0u8; 64];
        let mut buf = ReadBuf::new(&mut space);
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(stream).poll_read(&mut cx, &mut buf) {
            Poll::Pending => None,
            Poll::Ready(Ok(())) => Some(Ok(buf.filled().to_vec())),
            Poll::Ready(Err(err)) => Some(Err(err)),
        }
    }

    #[test]
    fn data_sent_during_the_spin_is_returned_without_the_reactor() {
        let (_rt, server, mut client) = pair();
        let mut polled = BusyPoll::new(server, LONG);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            client.write_all(b"request").unwrap();
            client
        });
        let got = poll_once(&mut polled).expect("the spin returns the data");
        assert_eq!(got.unwrap(), b"request");
        assert_eq!(polled.spins, 1);
        drop(writer.join().unwrap());
    }

    #[test]
    fn eof_and_errors_pass_through_the_spin() {
        let (_rt, server, client) = pair();
        let mut polled = BusyPoll::new(server, LONG);
        drop(client);
        assert_eq!(poll_once(&mut polled).unwrap().unwrap(), b"", "EOF");
        // A peer that closes with unread data and linger 0 resets the connection.
        let (_rt, server, mut client) = pair();
        let mut polled = BusyPoll::new(server, LONG);
        socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO)).unwrap();
        client.write_all(b"x").unwrap();
        assert_eq!(poll_once(&mut polled).unwrap().unwrap(), b"x");
        drop(client);
        let err = poll_once(&mut polled).unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
    }

    #[test]
    fn an_idle_read_spins_for_one_window_then_parks_until_data_comes() {
        let (rt, server, mut client) = pair();
        let mut polled = BusyPoll::new(server, Duration::from_millis(5));
        // Nothing comes: one window spun, then Pending.
        assert!(poll_once(&mut polled).is_none());
        assert_eq!((polled.spins, polled.empty), (1, 1));
        // The waker the inner stream registered brings the data that comes later, and a
        // read that finds data clears the count of empty windows.
        client.write_all(b"a").unwrap();
        let mut one = [0u8; 1];
        rt.block_on(polled.read_exact(&mut one)).unwrap();
        assert_eq!(&one, b"a");
        assert!(polled.empty <= 1);
        client.write_all(b"b").unwrap();
        assert_eq!(poll_once(&mut polled).unwrap().unwrap(), b"b", "the spin finds it");
        assert_eq!(polled.empty, 0);
    }

    #[test]
    fn spinning_stops_after_empty_windows_and_a_probe_resumes_it() {
        let (rt, server, mut client) = pair();
        // Short windows that pass empty.
        let mut polled = BusyPoll::new(server, Duration::from_millis(5));
        for _ in 0..GIVE_UP_AFTER {
            assert!(!polled.given_up());
            assert!(poll_once(&mut polled).is_none());
        }
        assert!(polled.given_up());
        // Given up: no spin, however long the window.
        polled.window = LONG;
        let spins = polled.spins;
        assert!(poll_once(&mut polled).is_none());
        assert_eq!(polled.spins, spins);
        // Requests through the reactor until the next read probes; data comes during the
        // probe, and spinning resumes.
        let mut one = [0u8; 1];
        for _ in 0..PROBE_EVERY {
            client.write_all(b"r").unwrap();
            rt.block_on(polled.read_exact(&mut one)).unwrap();
        }
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            client.write_all(b"caught").unwrap();
            client
        });
        assert_eq!(poll_once(&mut polled).unwrap().unwrap(), b"caught");
        assert!(!polled.given_up());
        assert_eq!(polled.spins, spins + 1);
        drop(writer.join().unwrap());
    }

    #[test]
    fn a_zero_window_behaves_as_the_inner_stream() {
        let (rt, plain, mut plain_client) = pair();
        let (wrapped, mut wrapped_client) = pair_in(&rt);
        let mut wrapped = BusyPoll::new(wrapped, Duration::ZERO);
        let mut plain = plain;
        for client in [&mut plain_client, &mut wrapped_client] {
            client.write_all(b"same bytes").unwrap();
        }
        // Data waits in both sockets, but without the reactor neither stream looks.
        assert!(poll_once(&mut plain).is_none());
        assert!(poll_once(&mut wrapped).is_none());
        assert_eq!(wrapped.spins, 0);
        let (mut a, mut b) = ([0u8; 10], [0u8; 10]);
        rt.block_on(async {
            plain.read_exact(&mut a).await.unwrap();
            wrapped.read_exact(&mut b).await.unwrap();
            plain.write_all(b"reply").await.unwrap();
            wrapped.write_all(b"reply").await.unwrap();
        });
        assert_eq!(a, b);
        for mut client in [plain_client, wrapped_client] {
            let mut reply = [0u8; 5];
            std::io::Read::read_exact(&mut client, &mut reply).unwrap();
            assert_eq!(&reply, b"reply");
        }
        rt.block_on(async {
            assert_eq!(plain.read(&mut a).await.unwrap(), 0);
            assert_eq!(wrapped.read(&mut b).await.unwrap(), 0);
        });
    }

    #[test]
    fn writes_pass_through() {
        let (rt, server, mut client) = pair();
        let mut polled = BusyPoll::new(server, LONG);
        rt.block_on(async {
            polled.write_all(b"one ").await.unwrap();
            let bufs = [io::IoSlice::new(b"two "), io::IoSlice::new(b"three")];
            let n = polled.write_vectored(&bufs).await.unwrap();
            assert_eq!(n, 9, "one writev on a socket with room");
            polled.shutdown().await.unwrap();
        });
        let mut got = String::new();
        std::io::Read::read_to_string(&mut client, &mut got).unwrap();
        assert_eq!(got, "one two three");
    }

    #[test]
    fn unix_sockets_poll_too() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (server, mut client) = std::os::unix::net::UnixStream::pair().unwrap();
        server.set_nonblocking(true).unwrap();
        let server = {
            let _in_runtime = rt.enter();
            tokio::net::UnixStream::from_std(server).unwrap()
        };
        let mut polled = BusyPoll::new(server, LONG);
        client.write_all(b"unix").unwrap();
        assert_eq!(poll_once(&mut polled).unwrap().unwrap(), b"unix");
    }
}
