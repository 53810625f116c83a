//! TLS for fallow's channels: the NBD export (`NBD_OPT_STARTTLS`), the node protocol, and
//! the NBD store's connection to an upstream server (`nbds://`).
//!
//! Built on the system OpenSSL (the `openssl` crate) because it has both kinds of
//! credentials NBD users keep: X.509 certificates in the directory layout qemu's
//! `tls-creds-x509` and nbdkit's `--tls-certificates` read (`ca-cert.pem`,
//! `server-cert.pem`, `server-key.pem`, and `client-cert.pem`/`client-key.pem` on the
//! client side), and external pre-shared keys in the psktool format ([`psk`]).
//!
//! # Components
//! [`TlsServer`]: the server's half, made once from [`ServerOptions`] and shared by every
//! connection. [`TlsClient`]: the client's half, made from [`ClientOptions`]. Both hand
//! over a [`TlsStream`].
//! [`Prefixed`]: a stream whose first bytes were already read (a server that looks at a
//! connection's first bytes to tell TLS from plaintext hands them back this way).
//! [`looks_like_tls`]: that test.

// Bytes from the network or a file never panic the process (STYLE.md rule 7).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

pub mod psk;

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use openssl::asn1::Asn1Time;
use openssl::error::ErrorStack;
use openssl::ssl::{
    Ssl, SslAcceptor, SslConnector, SslContext, SslContextBuilder, SslFiletype, SslMethod,
    SslOptions, SslRef, SslVerifyMode, SslVersion,
};
use openssl::x509::{X509Name, X509VerifyResult, X509};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_openssl::SslStream;

pub use psk::PskFile;

/// The certificate authority's certificate in a credentials directory.
pub const CA_CERT: &str = "ca-cert.pem";
/// The server's certificate (with its chain) in a credentials directory.
pub const SERVER_CERT: &str = "server-cert.pem";
/// The server's private key in a credentials directory.
pub const SERVER_KEY: &str = "server-key.pem";
/// A client's certificate in a credentials directory (optional).
pub const CLIENT_CERT: &str = "client-cert.pem";
/// A client's private key in a credentials directory (optional).
pub const CLIENT_KEY: &str = "client-key.pem";

/// Why credentials could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A file was read but is not what it should be.
    #[error("{path}: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// OpenSSL refused the settings.
    #[error("TLS setup failed: {0}")]
    OpenSsl(#[from] ErrorStack),
    /// Options that cannot work together, or none at all.
    #[error("{0}")]
    Options(String),
}

impl TlsError {
    fn file(path: &Path, source: io::Error) -> TlsError {
        TlsError::File { path: path.into(), source }
    }

    /// Wraps an OpenSSL error about one file, with the file's name and OpenSSL's reason.
    fn openssl(path: &Path, err: ErrorStack) -> TlsError {
        TlsError::Invalid { path: path.into(), why: describe_stack(&err) }
    }
}

/// TLS 1.3's cipher suites in the server's order: AES-128-GCM first. Every TLS 1.3 peer
/// has it (RFC 8446 makes it mandatory), it seals a 4 KiB page in 1.17 µs here against
/// AES-256-GCM's 1.38 (`openssl speed`; BENCHMARKS.md, "TLS against plaintext"), and its
/// hash is SHA-256, which OpenSSL needs to use a pre-shared key in TLS 1.3. Clients order
/// otherwise (GnuTLS puts AES-256-GCM first), so the server chooses.
const TLS13_SUITES: &str =
    "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384";

/// What a TLS server presents and checks.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// A directory with `ca-cert.pem`, `server-cert.pem` and `server-key.pem`.
    pub certificates: Option<PathBuf>,
    /// A psktool file: clients that know one of its keys are let in.
    pub psk: Option<PathBuf>,
    /// Ask every client for a certificate and refuse those not signed by `ca-cert.pem`.
    pub verify_peer: bool,
    /// Accept TLS 1.3 only (the node protocol); otherwise TLS 1.2 too (NBD clients).
    pub tls13_only: bool,
}

/// The server half of TLS, shared by all connections.
#[derive(Clone)]
pub struct TlsServer {
    context: Arc<SslContext>,
    summary: String,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer").field("summary", &self.summary).finish_non_exhaustive()
    }
}

impl TlsServer {
    /// Loads the credentials and checks them (the key matches the certificate, the files
    /// parse), so that a mistake shows at start, not at the first client.
    pub fn new(options: &ServerOptions) -> Result<TlsServer, TlsError> {
        if options.certificates.is_none() && options.psk.is_none() {
            return Err(TlsError::Options(
                "TLS needs certificates (a directory) or a pre-shared key file".into(),
            ));
        }
        if options.verify_peer && options.certificates.is_none() {
            return Err(TlsError::Options(
                "verifying client certificates needs a certificates directory with \
                 ca-cert.pem"
                    .into(),
            ));
        }
        let mut builder = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())?;
        let min = if options.tls13_only { SslVersion::TLS1_3 } else { SslVersion::TLS1_2 };
        builder.set_min_proto_version(Some(min))?;
        builder.set_ciphersuites(TLS13_SUITES)?;
        builder.set_options(SslOptions::CIPHER_SERVER_PREFERENCE);
        // Read what the socket holds, not one record header and then its body: two `recv`
        // calls per small record otherwise (a request of NBD or of the node protocol).
        builder.set_read_ahead(true);
        let mut summary = Vec::new();
        if let Some(dir) = &options.certificates {
            let (cert, key, ca) = (dir.join(SERVER_CERT), dir.join(SERVER_KEY), dir.join(CA_CERT));
            load_identity(&mut builder, &cert, &key)?;
            check_validity(&cert)?;
            summary.push(format!("certificate {}", cert.display()));
            if options.verify_peer {
                readable(&ca)?;
                builder.set_ca_file(&ca).map_err(|e| TlsError::openssl(&ca, e))?;
                let names =
                    X509Name::load_client_ca_file(&ca).map_err(|e| TlsError::openssl(&ca, e))?;
                builder.set_client_ca_list(names);
                builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
                summary.push(format!("client certificates checked against {}", ca.display()));
            }
        }
        if let Some(path) = &options.psk {
            let keys = PskFile::load(path)?;
            // The callback gets the identity the client named and copies its key out; an
            // unknown identity fails the handshake (returning 0 bytes of key).
            builder.set_psk_server_callback(move |_ssl, identity, out| {
                let key = identity
                    .and_then(|id| std::str::from_utf8(id).ok())
                    .and_then(|id| keys.key(id.trim_end_matches('\0')));
                Ok(copy_key(key, out))
            });
            summary.push(format!("pre-shared keys from {}", path.display()));
        }
        Ok(TlsServer {
            context: Arc::new(builder.build().into_context()),
            summary: summary.join(", "),
        })
    }

    /// What the server presents and checks, for its start-up log line.
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// Runs the server's side of the handshake on `stream`.
    pub async fn accept<S>(&self, stream: S) -> io::Result<TlsStream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let ssl = Ssl::new(&self.context).map_err(io::Error::other)?;
        let mut tls = SslStream::new(ssl, stream).map_err(io::Error::other)?;
        match Pin::new(&mut tls).accept().await {
            Ok(()) => Ok(TlsStream::new(tls)),
            Err(err) => Err(handshake_error(tls.ssl(), &err)),
        }
    }
}

/// What a TLS client trusts and presents.
#[derive(Debug, Clone, Default)]
pub struct ClientOptions {
    /// A directory with `ca-cert.pem` (the authority the server's certificate must chain
    /// to), and optionally `client-cert.pem` and `client-key.pem` to present.
    pub certificates: Option<PathBuf>,
    /// A psktool file and the identity to use from it (the file's first if none).
    pub psk: Option<(PathBuf, Option<String>)>,
    /// Accept TLS 1.3 only.
    pub tls13_only: bool,
}

/// The client half of TLS.
#[derive(Clone)]
pub struct TlsClient {
    connector: Arc<SslConnector>,
    uses_psk: bool,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient").field("uses_psk", &self.uses_psk).finish_non_exhaustive()
    }
}

impl TlsClient {
    /// Loads the credentials.
    pub fn new(options: &ClientOptions) -> Result<TlsClient, TlsError> {
        let mut builder = SslConnector::builder(SslMethod::tls_client())?;
        let min = if options.tls13_only { SslVersion::TLS1_3 } else { SslVersion::TLS1_2 };
        builder.set_min_proto_version(Some(min))?;
        builder.set_read_ahead(true);
        match (&options.certificates, &options.psk) {
            (None, None) => {
                return Err(TlsError::Options(
                    "a TLS client needs a certificates directory (with ca-cert.pem) or a \
                     pre-shared key file"
                        .into(),
                ))
            }
            (Some(dir), _) => {
                let ca = dir.join(CA_CERT);
                readable(&ca)?;
                builder.set_ca_file(&ca).map_err(|e| TlsError::openssl(&ca, e))?;
                let (cert, key) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
                if cert.exists() {
                    load_identity(&mut builder, &cert, &key)?;
                }
            }
            (None, Some(_)) => {}
        }
        if let Some((path, identity)) = &options.psk {
            let keys = PskFile::load(path)?;
            let (identity, key) = match identity {
                Some(id) => match keys.key(id) {
                    Some(key) => (id.clone(), key.to_vec()),
                    None => {
                        return Err(TlsError::Invalid {
                            path: path.clone(),
                            why: format!("no key for the identity {id:?}"),
                        })
                    }
                },
                None => match keys.first() {
                    Some((id, key)) => (id.to_string(), key.to_vec()),
                    None => {
                        return Err(TlsError::Invalid { path: path.clone(), why: "no key".into() })
                    }
                },
            };
            builder.set_psk_client_callback(move |_ssl, _hint, identity_out, key_out| {
                // The identity goes out NUL-terminated, as OpenSSL expects.
                let name = identity.as_bytes();
                match identity_out.get_mut(..name.len() + 1) {
                    Some(slot) => {
                        let (text, nul) = slot.split_at_mut(name.len());
                        text.copy_from_slice(name);
                        nul.fill(0);
                    }
                    None => return Ok(0),
                }
                Ok(copy_key(Some(&key), key_out))
            });
        }
        Ok(TlsClient { connector: Arc::new(builder.build()), uses_psk: options.psk.is_some() })
    }

    /// Runs the client's side of the handshake on `stream` to the server named `host` (a
    /// DNS name or an IP address): its certificate must chain to the CA and name `host`.
    /// With a pre-shared key, the key itself authenticates the server.
    pub async fn connect<S>(&self, host: &str, stream: S) -> io::Result<TlsStream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ssl =
            self.connector.configure().and_then(|c| c.into_ssl(host)).map_err(io::Error::other)?;
        let mut tls = SslStream::new(ssl, stream).map_err(io::Error::other)?;
        match Pin::new(&mut tls).connect().await {
            Ok(()) => Ok(TlsStream::new(tls)),
            Err(err) => Err(handshake_error(tls.ssl(), &err)),
        }
    }
}

/// The most bytes [`TlsStream`] gathers from a vectored write into one TLS write: four full
/// records.
const MAX_GATHER: usize = 64 * 1024;

/// A TLS connection after its handshake. It is `tokio_openssl`'s stream with vectored
/// writes: those gather their slices into one TLS write (up to [`MAX_GATHER`] bytes), where
/// the stream alone would take the first slice only, so that a server writing several
/// ready replies at once (an NBD reply's header, then its data, then the next reply) sends
/// them in full 16 KiB records and few `send` calls, as it does in the clear.
#[derive(Debug)]
pub struct TlsStream<S> {
    inner: SslStream<S>,
    gather: Vec<u8>,
}

impl<S> TlsStream<S> {
    fn new(inner: SslStream<S>) -> TlsStream<S> {
        TlsStream { inner, gather: Vec::new() }
    }

    /// The TLS session (version, cipher, the peer's certificate).
    pub fn ssl(&self) -> &SslRef {
        self.inner.ssl()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsStream<S> {
    /// One TLS read yields one record; a client that pipelines small requests (NBD) sends
    /// a record per request. So after the first, the records OpenSSL already holds (read
    /// ahead from the socket) are read too, while there is room: the caller gets the whole
    /// burst at once and answers it together, as it would in the clear.
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        while buf.remaining() > 0 && buf.filled().len() > before && has_pending(this.inner.ssl()) {
            let len = buf.filled().len();
            match Pin::new(&mut this.inner).poll_read(cx, buf) {
                Poll::Ready(Ok(())) if buf.filled().len() > len => {}
                // The rest of a record still on its way, the end, or an error: what was
                // read is returned now; an error or the end shows again on the next read.
                _ => break,
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Whether OpenSSL holds bytes of records not yet read (`SSL_has_pending`, OpenSSL 1.1.0
/// and later), so that reading them needs no socket.
fn has_pending(ssl: &SslRef) -> bool {
    use foreign_types::ForeignTypeRef;
    extern "C" {
        fn SSL_has_pending(s: *const openssl_sys::SSL) -> std::os::raw::c_int;
    }
    // SAFETY: `ssl.as_ptr()` is a live SSL object for the borrow's length, and
    // SSL_has_pending only reads its buffer counts.
    unsafe { SSL_has_pending(ssl.as_ptr()) == 1 }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        // Copied again on a retry after `Pending`: the caller offers the same bytes, as a
        // TLS write that could not finish must be given them again.
        this.gather.clear();
        for buf in bufs {
            let room = MAX_GATHER - this.gather.len();
            if room == 0 {
                break;
            }
            this.gather.extend_from_slice(buf.get(..room.min(buf.len())).unwrap_or_default());
        }
        Pin::new(&mut this.inner).poll_write(cx, &this.gather)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// True if `first` (a connection's first bytes, at least 3) starts a TLS handshake record:
/// content type 22 and major version 3. No fallow frame or NBD greeting starts that way
/// (a fallow frame's first bytes are a small little-endian length).
pub fn looks_like_tls(first: &[u8]) -> bool {
    matches!(first, [0x16, 0x03, minor, ..] if *minor <= 0x04)
}

/// A stream whose first bytes were read already: they are read again first.
#[derive(Debug)]
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    taken: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    /// `prefix` comes before what `inner` has yet to give.
    pub fn new(prefix: Vec<u8>, inner: S) -> Prefixed<S> {
        Prefixed { prefix, taken: 0, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let rest = this.prefix.get(this.taken..).unwrap_or_default();
        if !rest.is_empty() {
            let n = rest.len().min(buf.remaining());
            buf.put_slice(rest.get(..n).unwrap_or_default());
            this.taken += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Copies `key` into OpenSSL's buffer; 0 (no key: the handshake fails) if there is none
/// or it does not fit.
fn copy_key(key: Option<&[u8]>, out: &mut [u8]) -> usize {
    match key.and_then(|key| out.get_mut(..key.len()).map(|slot| (key, slot))) {
        Some((key, slot)) => {
            slot.copy_from_slice(key);
            key.len()
        }
        None => 0,
    }
}

/// How long before its end a certificate in use is warned about at start.
const EXPIRY_WARNING_DAYS: u32 = 30;

/// Refuses a server certificate that is not valid now, as QEMU does: every client would
/// refuse it, one handshake at a time, far from the cause. Warns when it ends within
/// [`EXPIRY_WARNING_DAYS`].
fn check_validity(path: &Path) -> Result<(), TlsError> {
    let pem = std::fs::read(path).map_err(|e| TlsError::file(path, e))?;
    let chain = X509::stack_from_pem(&pem).map_err(|e| TlsError::openssl(path, e))?;
    let Some(cert) = chain.first() else {
        return Err(TlsError::Invalid { path: path.into(), why: "no certificate".into() });
    };
    let now = Asn1Time::days_from_now(0)?;
    if cert.not_after() < now {
        let why = format!("the certificate expired on {}", cert.not_after());
        return Err(TlsError::Invalid { path: path.into(), why });
    }
    if cert.not_before() > now {
        let why = format!("the certificate is not valid before {}", cert.not_before());
        return Err(TlsError::Invalid { path: path.into(), why });
    }
    if cert.not_after() < Asn1Time::days_from_now(EXPIRY_WARNING_DAYS)? {
        tracing::warn!(path = %path.display(), not_after = %cert.not_after(), "the TLS certificate expires soon");
    }
    Ok(())
}

/// Loads a certificate (with its chain) and its private key, and checks that they match.
fn load_identity(builder: &mut SslContextBuilder, cert: &Path, key: &Path) -> Result<(), TlsError> {
    readable(cert)?;
    readable(key)?;
    builder.set_certificate_chain_file(cert).map_err(|e| TlsError::openssl(cert, e))?;
    builder.set_private_key_file(key, SslFiletype::PEM).map_err(|e| TlsError::openssl(key, e))?;
    builder.check_private_key().map_err(|e| TlsError::openssl(key, e))
}

fn readable(path: &Path) -> Result<(), TlsError> {
    std::fs::File::open(path).map(drop).map_err(|e| TlsError::file(path, e))
}

/// A failed handshake as an I/O error that says why: the certificate check's verdict
/// when that is what failed, otherwise OpenSSL's reasons.
fn handshake_error(ssl: &SslRef, err: &openssl::ssl::Error) -> io::Error {
    let verdict = ssl.verify_result();
    let why = if verdict != X509VerifyResult::OK {
        format!("certificate verify failed: {}", verdict.error_string())
    } else if let Some(stack) = err.ssl_error() {
        describe_stack(stack)
    } else if let Some(io) = err.io_error() {
        format!("{io}")
    } else if err.code() == openssl::ssl::ErrorCode::ZERO_RETURN
        || err.code() == openssl::ssl::ErrorCode::SYSCALL
    {
        "the peer closed the connection during the TLS handshake".into()
    } else {
        err.to_string()
    };
    io::Error::new(io::ErrorKind::ConnectionAborted, format!("TLS handshake failed: {why}"))
}

/// OpenSSL's reasons, without its numeric codes and source locations.
fn describe_stack(stack: &ErrorStack) -> String {
    let reasons: Vec<String> = stack
        .errors()
        .iter()
        .map(|e| e.reason().map(str::to_string).unwrap_or_else(|| e.to_string()))
        .collect();
    if reasons.is_empty() {
        "unknown OpenSSL error".into()
    } else {
        reasons.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn tells_tls_from_fallow_and_nbd_openings() {
        assert!(looks_like_tls(&[0x16, 0x03, 0x01, 0x02, 0x00]));
        assert!(looks_like_tls(&[0x16, 0x03, 0x03]));
        // A fallow HELLO frame: a small little-endian length first.
        assert!(!looks_like_tls(&[40, 0, 0, 0, 1]));
        assert!(!looks_like_tls(b"NBDMAGIC"));
        assert!(!looks_like_tls(&[0x16]));
        assert!(!looks_like_tls(&[0x16, 0x03, 0x09]));
    }

    #[tokio::test]
    async fn prefixed_stream_gives_its_prefix_back_first() {
        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(b" world").await.unwrap();
        drop(a);
        let mut stream = Prefixed::new(b"hello".to_vec(), b);
        let mut all = String::new();
        stream.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "hello world");
    }

    #[test]
    fn options_that_cannot_work_are_refused() {
        let none = TlsServer::new(&ServerOptions::default()).unwrap_err();
        assert!(none.to_string().contains("certificates"), "{none}");
        let psk_verify = ServerOptions {
            psk: Some("/nonexistent".into()),
            verify_peer: true,
            ..ServerOptions::default()
        };
        assert!(TlsServer::new(&psk_verify).unwrap_err().to_string().contains("ca-cert.pem"));
        let missing = ServerOptions {
            certificates: Some("/nonexistent-fallow-tls".into()),
            ..ServerOptions::default()
        };
        let err = TlsServer::new(&missing).unwrap_err().to_string();
        assert!(err.contains("server-cert.pem"), "{err}");
        assert!(TlsClient::new(&ClientOptions::default()).is_err());
    }

    /// A vectored write goes out whole in one TLS write, not just its first slice.
    #[tokio::test]
    async fn a_vectored_write_sends_every_slice_at_once() {
        let (server, client) = psk_pair("vectored");
        let (a, b) = tokio::io::duplex(1 << 20);
        let serving = tokio::spawn(async move {
            let mut tls = server.accept(b).await.unwrap();
            let mut got = vec![0u8; 16 + 4096 + 16 + 4096];
            tls.read_exact(&mut got).await.unwrap();
            got
        });
        let mut tls = client.connect("localhost", a).await.unwrap();
        assert!(tls.is_write_vectored());
        let (head, data) = ([1u8; 16], [2u8; 4096]);
        let slices = [
            io::IoSlice::new(&head),
            io::IoSlice::new(&data),
            io::IoSlice::new(&head),
            io::IoSlice::new(&data),
        ];
        let written = tls.write_vectored(&slices).await.unwrap();
        assert_eq!(written, 2 * (16 + 4096), "every slice in one write");
        tls.flush().await.unwrap();
        let got = serving.await.unwrap();
        assert_eq!(&got[..16], &head);
        assert_eq!(&got[16..4112], &data);
        assert_eq!(&got[4112..4128], &head);
    }

    /// Small records that arrived together come out of one read, as they would from a
    /// plain socket.
    #[tokio::test]
    async fn one_read_takes_every_record_already_there() {
        let (server, client) = psk_pair("burst");
        let (a, b) = tokio::io::duplex(1 << 20);
        let accepting = tokio::spawn(async move { server.accept(b).await.unwrap() });
        let mut tls = client.connect("localhost", a).await.unwrap();
        let mut server = accepting.await.unwrap();
        for i in 0..8u8 {
            tls.write_all(&[i; 32]).await.unwrap();
            tls.flush().await.unwrap();
        }
        // Let the records land in the pipe, then read once.
        tokio::task::yield_now().await;
        let mut buf = vec![0u8; 4096];
        let n = server.read(&mut buf).await.unwrap();
        assert_eq!(n, 8 * 32, "one read for the eight records");
        for i in 0..8u8 {
            assert!(buf[i as usize * 32..(i as usize + 1) * 32].iter().all(|b| *b == i));
        }
    }

    fn psk_pair(tag: &str) -> (TlsServer, TlsClient) {
        let dir = std::env::temp_dir().join(format!("fallow-tls-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("keys.psk");
        std::fs::write(&keys, format!("fallow:{}\n", "ab".repeat(32))).unwrap();
        let server =
            TlsServer::new(&ServerOptions { psk: Some(keys.clone()), ..Default::default() })
                .unwrap();
        let client =
            TlsClient::new(&ClientOptions { psk: Some((keys, None)), ..Default::default() })
                .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        (server, client)
    }

    /// A TLS 1.3 handshake with a pre-shared key and data both ways, over an in-memory
    /// pipe; a client with the wrong key is refused.
    #[tokio::test]
    async fn psk_handshake_works_and_a_wrong_key_is_refused() {
        let dir = std::env::temp_dir().join(format!("fallow-tls-psk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.psk");
        let bad = dir.join("bad.psk");
        std::fs::write(&good, format!("fallow:{}\n", "ab".repeat(32))).unwrap();
        std::fs::write(&bad, format!("fallow:{}\n", "cd".repeat(32))).unwrap();
        let server = TlsServer::new(&ServerOptions {
            psk: Some(good.clone()),
            tls13_only: true,
            ..ServerOptions::default()
        })
        .unwrap();
        for (file, works) in [(&good, true), (&bad, false)] {
            let client = TlsClient::new(&ClientOptions {
                psk: Some((file.clone(), Some("fallow".into()))),
                tls13_only: true,
                ..ClientOptions::default()
            })
            .unwrap();
            let (a, b) = tokio::io::duplex(1 << 16);
            let serving = {
                let server = server.clone();
                tokio::spawn(async move {
                    let mut tls = server.accept(b).await?;
                    let mut buf = [0u8; 4];
                    tls.read_exact(&mut buf).await?;
                    tls.write_all(&buf).await?;
                    tls.flush().await?;
                    Ok::<_, io::Error>(())
                })
            };
            let talked = async {
                let mut tls = client.connect("localhost", a).await?;
                tls.write_all(b"ping").await?;
                let mut buf = [0u8; 4];
                tls.read_exact(&mut buf).await?;
                Ok::<_, io::Error>(buf)
            }
            .await;
            let served = serving.await.unwrap();
            if works {
                assert_eq!(&talked.unwrap(), b"ping");
                served.unwrap();
            } else {
                let err = served.unwrap_err().to_string();
                assert!(err.contains("TLS handshake failed"), "{err}");
                assert!(talked.is_err());
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
