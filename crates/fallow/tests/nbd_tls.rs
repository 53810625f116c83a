//! NBD over TLS, end to end, against the clients and the server users run: `fallow nbd
//! --tls require` serves qemu-io, qemu-img, nbdinfo and nbdcopy over STARTTLS with X.509
//! certificates and with a pre-shared key; plaintext clients, wrong keys, certificates from
//! another CA or for another host, and garbage after STARTTLS are all refused, counted in
//! the metrics, and leave the server serving; an expired certificate is refused at start;
//! `--tls on` serves both kinds of client; `--tls-verify-peer` admits only client
//! certificates from its CA; and `fallow nbd` reaches an upstream `nbdkit --tls=require`
//! over `nbds://`, and as a client refuses what libnbd refuses. Every test makes its own
//! [`Pki`] (0.2 s) in a scratch directory, and skips when openssl or a client it drives is
//! missing.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fallow_testkit::tls::Pki;
use support::{have, metrics_addr, nbd_serving_uri, poll_until, Daemon, KillOnDrop, TempDir};

/// How long `fallow nbd` and nbdkit have to start.
const START: Duration = Duration::from_secs(20);

/// How long a metric has to reach the value a test expects once the client is gone.
const SETTLE: Duration = Duration::from_secs(10);

/// The size of every export here: `mem:16M`, or nbdkit's `memory 16M`.
const SIZE: usize = 16 << 20;

/// How many TLS handshakes a server sees fail when nbdinfo, then qemu-img, refuse its
/// certificate: one. libnbd checks the certificate during the handshake and breaks it off;
/// QEMU checks it once the handshake is over, so the server sees that connection end
/// afterwards, as an I/O error (`reason="io"`).
const HANDSHAKES_BROKEN_OFF: u64 = 1;

// The NBD handshake, as a raw client writes and reads it (the spec's "Newstyle negotiation").
const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1;
const NBD_FLAG_C_NO_ZEROES: u32 = 2;
const NBD_OPT_EXPORT_NAME: u32 = 1;
const NBD_OPT_STARTTLS: u32 = 5;
const NBD_REP_ACK: u32 = 1;

/// Whether every tool in `tools` is installed; if not, says which test skips and why.
fn have_all(test: &str, tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !have(t)).collect();
    if missing.is_empty() {
        return true;
    }
    eprintln!(
        "skipped {test}: {} not installed (Debian openssl, qemu-utils, libnbd-bin, nbdkit)",
        missing.join(", ")
    );
    false
}

/// A scratch directory named after the test (removed when dropped) and a [`Pki`] in it.
fn scratch_pki(test: &str) -> (TempDir, Pki) {
    let dir = TempDir::new(&format!("nbd-tls-{test}"));
    let pki = Pki::create(&dir.path().join("pki")).unwrap();
    (dir, pki)
}

/// A running `fallow nbd` with one 16 MiB RAM export `d`.
struct Server {
    daemon: Daemon,
    /// The port it serves NBD on, at 127.0.0.1.
    port: u16,
    /// The address of its metrics endpoint.
    metrics: String,
    /// The URI it printed (`nbd://` or, with `--tls require`, `nbds://`).
    uri: String,
}

/// Starts `fallow nbd --export d=mem:16M` on 127.0.0.1, with metrics, and `args` besides.
fn start_fallow(args: &[&str]) -> Server {
    start_fallow_exporting("d=mem:16M", args)
}

/// Starts `fallow nbd --export d=mem:16M --tls MODE --tls-certificates DIR` on 127.0.0.1,
/// with metrics, and `args` besides.
fn start_with_certificates(mode: &str, dir: &Path, args: &[&str]) -> Server {
    let tls = ["--tls", mode, "--tls-certificates", dir.to_str().unwrap()];
    start_fallow(&[&tls[..], args].concat())
}

/// Starts `fallow nbd --export EXPORT` on 127.0.0.1, with metrics, and `args` besides.
fn start_fallow_exporting(export: &str, args: &[&str]) -> Server {
    let mut daemon = Daemon::spawn(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--export", export, "--listen", "127.0.0.1:0"])
            .args(["--metrics", "127.0.0.1:0"])
            .args(args)
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
    );
    let metrics = daemon.wait_for_line("metrics address", START, metrics_addr);
    let uri = daemon.wait_for_line("NBD URI", START, nbd_serving_uri);
    let port = uri
        .split_once("127.0.0.1:")
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no 127.0.0.1 port in {uri:?}"));
    Server { daemon, port, metrics, uri }
}

/// Runs `timeout 60 PROGRAM ARGS...`: whether it exited with status 0, and its stdout and
/// stderr together.
fn run(program: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new("timeout")
        .arg("60")
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// The libnbd URI of `export` at `port` over TLS, with the certificates in `dir`.
fn x509_uri(port: u16, export: &str, dir: &Path) -> String {
    format!("nbds://127.0.0.1:{port}/{export}?tls-certificates={}", dir.display())
}

/// The libnbd URI of `export` at `port` over TLS, with the pre-shared key in `file`.
fn psk_uri(port: u16, export: &str, file: &Path) -> String {
    format!("nbds://fallow@127.0.0.1:{port}/{export}?tls-psk-file={}", file.display())
}

/// QEMU's `--object` for X.509 client credentials read from `dir`.
fn qemu_x509(dir: &Path) -> String {
    format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", dir.display())
}

/// QEMU's `--object` for pre-shared key credentials read from `dir`/keys.psk.
fn qemu_psk(dir: &Path) -> String {
    format!("tls-creds-psk,id=tls0,endpoint=client,dir={},username=fallow", dir.display())
}

/// QEMU's `--image-opts` for export `d` at `port` with the credentials `tls0`.
fn qemu_image(port: u16) -> String {
    format!("driver=nbd,host=127.0.0.1,port={port},export=d,tls-creds=tls0")
}

/// Runs `qemu-io --object OBJECT --image-opts IMAGE -c COMMAND...`; returns whether it
/// succeeded (status 0 and no failure reported: qemu-io reports a failed `read -P` with
/// status 0) and its output.
fn qemu_io_tls(object: &str, image: &str, commands: &[&str]) -> (bool, String) {
    let mut args = vec!["--object", object, "--image-opts", image];
    for c in commands {
        args.extend(["-c", c]);
    }
    let (exited_ok, text) = run("qemu-io", &args);
    let failed = !exited_ok || text.contains("fail") || text.contains("error");
    (!failed, text)
}

/// [`support::qemu_io`] on a plaintext URI, held to the same standard as [`qemu_io_tls`].
fn qemu_io_plain(uri: &str, commands: &[&str]) -> (bool, String) {
    let (exited_ok, text) = support::qemu_io(uri, commands);
    let failed = !exited_ok || text.contains("fail") || text.contains("error");
    (!failed, text)
}

/// Runs `qemu-img info --object OBJECT --image-opts IMAGE`: its success and output.
fn qemu_img_info_tls(object: &str, image: &str) -> (bool, String) {
    run("qemu-img", &["info", "--object", object, "--image-opts", image])
}

/// Asserts that `nbdinfo URI` works and went over TLS.
fn assert_nbdinfo_over_tls(uri: &str) {
    let (ok, text) = run("nbdinfo", &[uri]);
    assert!(ok, "nbdinfo {uri}: {text}");
    assert!(text.contains("with TLS"), "nbdinfo {uri} did not use TLS: {text}");
    assert!(text.contains(&format!("export-size: {SIZE}")), "{text}");
}

/// Asserts that `nbdinfo URI` fails; returns what it said.
fn assert_nbdinfo_refused(uri: &str) -> String {
    let (ok, text) = run("nbdinfo", &[uri]);
    assert!(!ok, "nbdinfo {uri} should have been refused: {text}");
    text
}

/// `fallow_nbd_negotiation_failures_total{reason="REASON"}` on the metrics at `addr`; 0
/// while no failure of that kind has happened (the series is not there yet).
fn negotiation_failures(addr: &str, reason: &str) -> u64 {
    let label = format!("reason=\"{reason}\"");
    let text = support::scrape(addr);
    support::metric(&text, "fallow_nbd_negotiation_failures_total", &label).unwrap_or(0)
}

/// Waits until the `reason` failures on `server`'s metrics number `want`, and asserts that
/// they do (neither fewer nor, by then, more).
fn assert_failures(server: &Server, reason: &str, want: u64) {
    let mut got = 0;
    poll_until(SETTLE, || {
        got = negotiation_failures(&server.metrics, reason);
        got >= want
    });
    assert_eq!(got, want, "{reason} failures; the server's log:\n{}", server.daemon.log_so_far());
}

/// Waits until `want` of the server's log lines say a negotiation failed because `why`
/// (the line is logged just after the failure is counted), and asserts that `want` do.
fn assert_logged(server: &Server, why: &str, want: usize) {
    let count = || {
        let lines = server.daemon.log_lines();
        lines.iter().filter(|l| l.contains("negotiation failed") && l.contains(why)).count()
    };
    poll_until(SETTLE, || count() >= want);
    assert_eq!(count(), want, "{why:?} in the server's log:\n{}", server.daemon.log_so_far());
}

/// Asserts that `server` is still running.
fn assert_running(server: &mut Server) {
    let status = server.daemon.try_wait();
    assert!(status.is_none(), "exited ({status:?}):\n{}", server.daemon.log_so_far());
}

/// Asserts that `server` still serves a good TLS client that checks its certificate against
/// `client_dir` (nbdinfo, which must say it used TLS).
fn assert_still_serves(server: &mut Server, client_dir: &Path) {
    assert_running(server);
    assert_nbdinfo_over_tls(&x509_uri(server.port, "d", client_dir));
}

/// A raw TCP client that has read the server's 18-byte greeting (NBDMAGIC, IHAVEOPT, the
/// handshake flags) and sent `client_flags`. Reads time out after 10 s, so a server that
/// neither answers nor hangs up fails the test instead of hanging it.
fn raw_client(port: u16, client_flags: u32) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(u64::from_be_bytes(greeting[..8].try_into().unwrap()), NBDMAGIC);
    assert_eq!(u64::from_be_bytes(greeting[8..16].try_into().unwrap()), IHAVEOPT);
    stream.write_all(&client_flags.to_be_bytes()).unwrap();
    stream
}

/// Sends option `option` with `data`: IHAVEOPT, the option, the length, the data.
fn send_option(stream: &mut TcpStream, option: u32, data: &[u8]) {
    let mut buf = Vec::with_capacity(16 + data.len());
    buf.extend_from_slice(&IHAVEOPT.to_be_bytes());
    buf.extend_from_slice(&option.to_be_bytes());
    buf.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    buf.extend_from_slice(data);
    stream.write_all(&buf).unwrap();
}

/// Reads one option reply: its option, type and data.
fn read_option_reply(stream: &mut TcpStream) -> (u32, u32, Vec<u8>) {
    let mut head = [0u8; 20];
    stream.read_exact(&mut head).unwrap();
    assert_eq!(u64::from_be_bytes(head[..8].try_into().unwrap()), OPTION_REPLY_MAGIC);
    let option = u32::from_be_bytes(head[8..12].try_into().unwrap());
    let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(head[16..20].try_into().unwrap());
    let mut data = vec![0u8; usize::try_from(len).unwrap()];
    stream.read_exact(&mut data).unwrap();
    (option, kind, data)
}

/// Asserts that the server hangs up on `stream` without sending another byte.
fn assert_hung_up_silently(mut stream: TcpStream, what: &str) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "{what}: the server sent {rest:02x?} before hanging up"),
        // A hang-up with our bytes unread is a reset: a hang-up all the same.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{what}: the server did not hang up: {e}"),
    }
}

/// `len` bytes of a fixed xorshift sequence: noise, the same on every run.
fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// Starts `nbdkit memory 16M` on a free port of 127.0.0.1, requiring TLS with `tls_arg`
/// (`--tls-certificates=DIR` or `--tls-psk=FILE`); returns it and its port once it accepts
/// connections. (nbdkit logs an error for the bare connection that probes it: harmless,
/// and its stderr is discarded.)
fn start_nbdkit(tls_arg: &str) -> (KillOnDrop, u16) {
    let port = support::free_port();
    let nbdkit = KillOnDrop::spawn(
        Command::new("nbdkit")
            .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "--exit-with-parent"])
            .args(["--tls=require", tls_arg, "memory", "16M"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    assert!(support::port_opens(port, START), "nbdkit did not start");
    (nbdkit, port)
}

/// `nbdcopy URI FILE`, and FILE's bytes.
fn nbdcopy_out(uri: &str, file: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(file);
    let (ok, text) = run("nbdcopy", &[uri, &file.display().to_string()]);
    assert!(ok, "nbdcopy {uri}: {text}");
    std::fs::read(file).unwrap()
}

/// Asserts that `bytes` is 16 MiB of `pattern` in the first MiB and zeros after it.
fn assert_first_mib_is(bytes: &[u8], pattern: u8) {
    assert_eq!(bytes.len(), SIZE, "the whole export");
    let at = bytes[..1 << 20].iter().position(|b| *b != pattern);
    assert_eq!(at, None, "byte {at:?} of the first MiB is not {pattern:#x}");
    let at = bytes[1 << 20..].iter().position(|b| *b != 0);
    assert_eq!(at, None, "byte {at:?} after the first MiB is not zero");
}

#[test]
fn qemu_io_nbdcopy_and_nbdinfo_work_over_tls_with_certificates() {
    if !have_all("x509", &["openssl", "qemu-io", "nbdinfo", "nbdcopy"]) {
        return;
    }
    let (dir, pki) = scratch_pki("x509");
    let mut server = start_with_certificates("require", &pki.server_dir(), &[]);
    assert_eq!(server.uri, format!("nbds://127.0.0.1:{}/d", server.port));
    let client = pki.client_dir();

    let (object, image) = (qemu_x509(&client), qemu_image(server.port));
    let (ok, text) = qemu_io_tls(
        &object,
        &image,
        &["write -P 0xab 0 1M", "read -P 0xab 0 1M", "read -P 0 1M 64k", "flush"],
    );
    assert!(ok, "qemu-io over TLS: {text}");

    let copy = nbdcopy_out(&x509_uri(server.port, "d", &client), &dir.path().join("copy.img"));
    assert_first_mib_is(&copy, 0xab);
    assert_nbdinfo_over_tls(&x509_uri(server.port, "d", &client));

    let connected = server.daemon.log_lines();
    let tls_sessions =
        connected.iter().filter(|l| l.contains("NBD client connected") && l.contains("tls=true"));
    assert!(tls_sessions.count() >= 3, "{}", connected.join("\n"));
    assert!(!connected.iter().any(|l| l.contains("tls=false")), "{}", connected.join("\n"));
    assert_running(&mut server);
}

#[test]
fn a_pre_shared_key_admits_its_clients_and_a_wrong_key_is_refused() {
    if !have_all("psk", &["openssl", "qemu-img", "nbdinfo"]) {
        return;
    }
    let (_dir, pki) = scratch_pki("psk");
    let psk = pki.psk_file();
    let mut server = start_fallow(&["--tls", "require", "--tls-psk", psk.to_str().unwrap()]);

    let image = qemu_image(server.port);
    let (ok, text) = qemu_img_info_tls(&qemu_psk(&pki.psk_dir()), &image);
    assert!(ok && text.contains("virtual size: 16 MiB"), "qemu-img with the key: {text}");
    assert_nbdinfo_over_tls(&psk_uri(server.port, "d", &psk));

    // The same identity with another key: refused by nbdinfo and qemu-img alike.
    let wrong = pki.wrong_psk_file();
    assert_nbdinfo_refused(&psk_uri(server.port, "d", &wrong));
    let (ok, text) = qemu_img_info_tls(&qemu_psk(wrong.parent().unwrap()), &image);
    assert!(!ok, "qemu-img with a wrong key should have been refused: {text}");
    assert_failures(&server, "tls_handshake", 2);
    assert_logged(&server, "TLS handshake failed", 2);

    // And the server serves the right key after.
    assert_running(&mut server);
    assert_nbdinfo_over_tls(&psk_uri(server.port, "d", &psk));
    let (ok, text) = qemu_img_info_tls(&qemu_psk(&pki.psk_dir()), &image);
    assert!(ok && text.contains("virtual size: 16 MiB"), "qemu-img after: {text}");
}

#[test]
fn plaintext_clients_are_refused_by_a_server_that_requires_tls() {
    if !have_all("plaintext", &["openssl", "qemu-img", "nbdinfo"]) {
        return;
    }
    let (_dir, pki) = scratch_pki("plaintext");
    let mut server = start_with_certificates("require", &pki.server_dir(), &[]);
    let plain = format!("nbd://127.0.0.1:{}/d", server.port);

    // NBD_OPT_GO before STARTTLS: NBD_REP_ERR_TLS_REQD, which qemu-img reports as such.
    let (ok, text) = run("qemu-img", &["info", &plain]);
    assert!(!ok, "qemu-img {plain} should have been refused: {text}");
    assert!(text.contains("TLS"), "qemu-img should say TLS is needed: {text}");
    let text = assert_nbdinfo_refused(&plain);
    assert!(text.contains("without TLS"), "{text}");
    // Those clients got an error reply and gave up cleanly: nothing is counted for them.
    assert_failures(&server, "tls_required", 0);

    // NBD_OPT_EXPORT_NAME before STARTTLS has no error reply: the server hangs up, whether
    // the client is fixed newstyle or not.
    for flags in [NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES, 0] {
        let mut raw = raw_client(server.port, flags);
        send_option(&mut raw, NBD_OPT_EXPORT_NAME, b"d");
        assert_hung_up_silently(raw, &format!("EXPORT_NAME with client flags {flags}"));
    }
    assert_failures(&server, "tls_required", 2);
    assert_logged(&server, "TLS is required", 2);
    assert_still_serves(&mut server, &pki.client_dir());
}

#[test]
fn tls_on_serves_plaintext_and_tls_clients_alike() {
    if !have_all("tls-on", &["openssl", "qemu-io", "nbdinfo"]) {
        return;
    }
    let (_dir, pki) = scratch_pki("tls-on");
    let mut server = start_with_certificates("on", &pki.server_dir(), &[]);
    assert_eq!(server.uri, format!("nbd://127.0.0.1:{}/d", server.port));

    // Written in the clear, read back over TLS, and the other way round.
    let (ok, text) = qemu_io_plain(&server.uri, &["write -P 0x3c 0 64k", "flush"]);
    assert!(ok, "plaintext qemu-io: {text}");
    let (object, image) = (qemu_x509(&pki.client_dir()), qemu_image(server.port));
    let (ok, text) =
        qemu_io_tls(&object, &image, &["read -P 0x3c 0 64k", "write -P 0xc3 64k 64k", "flush"]);
    assert!(ok, "qemu-io over TLS: {text}");
    let (ok, text) = qemu_io_plain(&server.uri, &["read -P 0x3c 0 64k", "read -P 0xc3 64k 64k"]);
    assert!(ok, "plaintext qemu-io: {text}");

    let (ok, text) = run("nbdinfo", &[&server.uri]);
    assert!(ok && text.contains("without TLS"), "plaintext nbdinfo: {text}");
    assert_nbdinfo_over_tls(&x509_uri(server.port, "d", &pki.client_dir()));

    let log = server.daemon.log_lines();
    let connected = |tls: &str| {
        log.iter().filter(|l| l.contains("NBD client connected") && l.contains(tls)).count()
    };
    assert_eq!(connected("tls=false"), 3, "{}", log.join("\n"));
    assert_eq!(connected("tls=true"), 2, "{}", log.join("\n"));
    assert_running(&mut server);
}

#[test]
fn a_client_that_trusts_another_ca_refuses_the_server() {
    if !have_all("other-ca", &["openssl", "qemu-img", "nbdinfo"]) {
        return;
    }
    let (_dir, pki) = scratch_pki("other-ca");
    let mut server = start_with_certificates("require", &pki.server_dir(), &[]);
    let other = pki.other_ca_dir();
    let text = assert_nbdinfo_refused(&x509_uri(server.port, "d", &other));
    assert!(text.to_lowercase().contains("certificate"), "nbdinfo should name the cause: {text}");
    let (ok, text) = qemu_img_info_tls(&qemu_x509(&other), &qemu_image(server.port));
    assert!(!ok, "qemu-img trusting another CA should have refused the server: {text}");
    assert!(text.to_lowercase().contains("certificate"), "qemu-img should name the cause: {text}");
    assert_failures(&server, "tls_handshake", HANDSHAKES_BROKEN_OFF);
    // And fallow's own client, in front of it.
    let why = "unable to get local issuer certificate";
    assert_upstream_refused(&x509_uri(server.port, "d", &other), why);
    assert_still_serves(&mut server, &pki.client_dir());
}

#[test]
fn an_expired_server_certificate_is_refused_by_fallow_as_server_and_as_client() {
    if !have_all("expired", &["openssl", "nbdkit", "nbdinfo"]) {
        return;
    }
    let (_dir, pki) = scratch_pki("expired");
    let expired = pki.expired_dir();

    // As a server: it will not start with it (every client would refuse it).
    let serve = ["nbd", "--listen", "127.0.0.1:0", "--export", "d=mem:16M", "--tls", "require"];
    let certs = ["--tls-certificates", expired.to_str().unwrap()];
    let (ok, text) = run(support::BIN, &[&serve[..], &certs].concat());
    assert!(!ok, "fallow nbd should not serve an expired certificate: {text}");
    assert!(text.contains("expired"), "{text}");

    // As a client: an upstream (nbdkit) that presents it is refused, as nbdinfo refuses it.
    let (_nbdkit, port) = start_nbdkit(&format!("--tls-certificates={}", expired.display()));
    let upstream = x509_uri(port, "", &pki.client_dir());
    let text = assert_nbdinfo_refused(&upstream);
    assert!(text.contains("certificate verification"), "nbdinfo should name the cause: {text}");
    assert_upstream_refused(&upstream, "certificate has expired");
}

#[test]
fn a_server_certificate_for_another_host_is_refused() {
    if !have_all("wrong-host", &["openssl", "qemu-img", "nbdinfo"]) {
        return;
    }
    let (_dir, pki) = scratch_pki("wrong-host");
    let mut server = start_with_certificates("require", &pki.wrong_host_dir(), &[]);
    let client = pki.client_dir();
    let text = assert_nbdinfo_refused(&x509_uri(server.port, "d", &client));
    assert!(text.to_lowercase().contains("certificate"), "nbdinfo should name the cause: {text}");
    let (ok, text) = qemu_img_info_tls(&qemu_x509(&client), &qemu_image(server.port));
    assert!(!ok, "qemu-img should have refused a certificate for wrong.example: {text}");
    assert!(text.contains("127.0.0.1"), "qemu-img should name the address it dialled: {text}");
    assert_failures(&server, "tls_handshake", HANDSHAKES_BROKEN_OFF);
    assert_upstream_refused(&x509_uri(server.port, "d", &client), "IP address mismatch");
    assert_running(&mut server);
}

#[test]
fn verify_peer_admits_only_client_certificates_from_its_ca() {
    if !have_all("verify-peer", &["openssl", "qemu-img", "nbdinfo"]) {
        return;
    }
    let (dir, pki) = scratch_pki("verify-peer");
    let mut server = start_with_certificates("require", &pki.server_dir(), &["--tls-verify-peer"]);
    let image = qemu_image(server.port);
    assert_nbdinfo_over_tls(&x509_uri(server.port, "d", &pki.client_dir()));
    let (ok, text) = qemu_img_info_tls(&qemu_x509(&pki.client_dir()), &image);
    assert!(ok && text.contains("virtual size: 16 MiB"), "qemu-img with a good cert: {text}");

    // No client certificate: the server refuses.
    assert_nbdinfo_refused(&x509_uri(server.port, "d", &pki.ca_only_dir()));
    assert_failures(&server, "tls_handshake", 1);
    assert_logged(&server, "peer did not return a certificate", 1);

    // A certificate from another CA, presented by a client that trusts the server (the
    // good CA), so that only the server can be the one refusing. Not nbdinfo or QEMU:
    // GnuTLS withholds a certificate that none of the CAs the server names has signed,
    // and QEMU will not load one its own CA does not vouch for. fallow's upstream client
    // (OpenSSL) presents it, and fails to start when refused.
    let mixed: PathBuf = dir.path().join("other-client-good-ca");
    std::fs::create_dir(&mixed).unwrap();
    std::fs::copy(pki.client_dir().join("ca-cert.pem"), mixed.join("ca-cert.pem")).unwrap();
    for file in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(pki.other_ca_dir().join(file), mixed.join(file)).unwrap();
    }
    let export = format!("up={}", x509_uri(server.port, "d", &mixed));
    let (ok, text) = run(support::BIN, &["nbd", "--listen", "127.0.0.1:0", "--export", &export]);
    assert!(!ok, "fallow nbd with another CA's client certificate should not start: {text}");
    // Under TLS 1.3 the client's handshake is over before the server checks its
    // certificate, so the client learns of the refusal only as a hang-up: it names the
    // upstream and says what such a hang-up can mean; the server's log and metrics say why.
    assert!(
        text.contains("failed during negotiation") && text.contains("client certificate"),
        "{text}"
    );
    assert_failures(&server, "tls_handshake", 2);
    assert_logged(&server, "certificate verify failed", 1);

    // The same client with the good CA's certificate is let in.
    let good = format!("up={}", x509_uri(server.port, "d", &pki.client_dir()));
    let mut chained = start_fallow_exporting(&good, &[]);
    let (ok, text) = qemu_io_plain(&chained.uri, &["write -P 0x71 0 64k", "read -P 0x71 0 64k"]);
    assert!(ok, "through a fallow whose upstream verifies it: {text}");
    assert_running(&mut chained);
    assert_still_serves(&mut server, &pki.client_dir());
}

/// `fallow nbd` in front of an upstream that requires TLS (nbdkit), reached at `upstream`
/// (an `nbds://` URI with its credentials): qemu-io writes through fallow and reads back,
/// and nbdcopy reads the write straight from nbdkit over TLS with `direct`.
fn check_upstream_over_tls(dir: &Path, upstream: &str, direct: &str) {
    let fallow = start_fallow_exporting(&format!("d={upstream}"), &[]);
    let (ok, text) = qemu_io_plain(
        &fallow.uri,
        &["write -P 0x5c 0 1M", "flush", "read -P 0x5c 0 1M", "read -P 0 1M 64k"],
    );
    assert!(ok, "qemu-io through fallow: {text}");
    let copy = nbdcopy_out(direct, &dir.join("upstream.img"));
    assert_first_mib_is(&copy, 0x5c);
    // And through fallow again, now that the cache holds it.
    let (ok, text) = qemu_io_plain(&fallow.uri, &["read -P 0x5c 0 1M"]);
    assert!(ok, "qemu-io through fallow: {text}");
}

/// Asserts that `fallow nbd --export d=URI` fails at start, saying `why`.
fn assert_upstream_refused(uri: &str, why: &str) {
    let export = format!("d={uri}");
    let (ok, text) = run(support::BIN, &["nbd", "--listen", "127.0.0.1:0", "--export", &export]);
    assert!(!ok, "fallow nbd with {uri} should not start: {text}");
    assert!(text.contains(why), "fallow nbd with {uri} should say {why:?}: {text}");
}

#[test]
fn an_upstream_nbdkit_requiring_tls_is_reached_with_certificates() {
    if !have_all("upstream-x509", &["openssl", "nbdkit", "qemu-io", "nbdcopy"]) {
        return;
    }
    let (dir, pki) = scratch_pki("upstream-x509");
    let certs = format!("--tls-certificates={}", pki.server_dir().display());
    let (_nbdkit, port) = start_nbdkit(&certs);
    let via = x509_uri(port, "", &pki.client_dir());
    check_upstream_over_tls(dir.path(), &via, &via);
    assert_upstream_refused(&format!("nbd://127.0.0.1:{port}/"), "requires TLS");
}

#[test]
fn an_upstream_nbdkit_requiring_tls_is_reached_with_a_pre_shared_key() {
    if !have_all("upstream-psk", &["openssl", "nbdkit", "qemu-io", "nbdcopy"]) {
        return;
    }
    let (dir, pki) = scratch_pki("upstream-psk");
    let psk = format!("--tls-psk={}", pki.psk_file().display());
    let (_nbdkit, port) = start_nbdkit(&psk);
    let via = psk_uri(port, "", &pki.psk_file());
    check_upstream_over_tls(dir.path(), &via, &via);
    assert_upstream_refused(&format!("nbd://127.0.0.1:{port}/"), "requires TLS");
}

#[test]
fn garbage_after_starttls_is_counted_and_the_server_serves_on() {
    if !have_all("garbage", &["openssl", "nbdinfo"]) {
        return;
    }
    let (_dir, pki) = scratch_pki("garbage");
    let mut server = start_with_certificates("require", &pki.server_dir(), &[]);

    // A TLS record header announcing a 512-byte ClientHello, and only its first few bytes.
    let mut truncated_hello =
        vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];
    truncated_hello.extend(noise(20));
    for garbage in [noise(512), truncated_hello] {
        let mut raw = raw_client(server.port, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES);
        send_option(&mut raw, NBD_OPT_STARTTLS, &[]);
        let (option, kind, data) = read_option_reply(&mut raw);
        assert_eq!((option, kind, data.len()), (NBD_OPT_STARTTLS, NBD_REP_ACK, 0));
        raw.write_all(&garbage).unwrap();
        drop(raw);
    }
    assert_failures(&server, "tls_handshake", 2);
    assert_logged(&server, "TLS handshake failed", 2);
    assert_still_serves(&mut server, &pki.client_dir());
}
