//! Throwaway X.509 certificates and TLS pre-shared keys for tests, made by the `openssl`
//! command-line tool with the same commands a user runs to make their own, so that what
//! the tests prove holds for what users do.
//!
//! Keys are EC P-256: one takes a millisecond to make where an RSA-2048 key takes 0.3 s, and
//! GnuTLS (nbdkit, libnbd, QEMU) and OpenSSL both accept them. A whole [`Pki`] takes
//! fourteen `openssl` runs, about 0.2 s.
//!
//! # Layout
//!
//! Each directory is what one party is given, in the file names QEMU's `tls-creds-x509`,
//! nbdkit's `--tls-certificates` and libnbd's `tls-certificates` read:
//!
//! ```text
//! DIR/ca/              the CAs' keys, requests, extension files and `openssl ca` database:
//!                      never handed to a server or a client
//! DIR/server/          ca-cert.pem server-cert.pem server-key.pem client-cert.pem client-key.pem
//! DIR/client/          ca-cert.pem client-cert.pem client-key.pem
//! DIR/client-ca-only/  ca-cert.pem
//! DIR/other-ca/        ca-cert.pem client-cert.pem client-key.pem    (another, unrelated CA)
//! DIR/expired/         ca-cert.pem server-cert.pem server-key.pem    (expired on 2020-01-02)
//! DIR/wrong-host/      ca-cert.pem server-cert.pem server-key.pem    (SAN DNS:wrong.example)
//! DIR/keys.psk         fallow:<64 hex digits>   (also DIR/psk/keys.psk, for QEMU)
//! DIR/wrong-psk/keys.psk                    fallow:<another key>
//! ```
//!
//! A server certificate names `DNS:localhost` and `IP:127.0.0.1` (plus any addresses given
//! to [`Pki::create_with`]), because GnuTLS checks the name or address the client dialled
//! against the subject alternative names, and tests dial `127.0.0.1`.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The identity in both pre-shared key files: a client names it (`username=fallow` in QEMU,
/// `nbds://fallow@…` in libnbd) and the server looks its key up by it.
pub const PSK_IDENTITY: &str = "fallow";

/// Where the "already expired" certificate's validity starts and ends, in `openssl ca`'s
/// `YYYYMMDDHHMMSSZ` form: a fixed day in the past, so the certificate is expired on any
/// machine whose clock is sane, without faking the time.
const EXPIRED_START: &str = "20200101000000Z";
const EXPIRED_END: &str = "20200102000000Z";

/// How long the CAs (`3650`) and the other certificates (`365`) are valid, in days: longer
/// than any test, so that a `Pki` kept between runs does not expire under them.
const CA_DAYS: &str = "3650";
const LEAF_DAYS: &str = "365";

/// Extensions of a client certificate. QEMU refuses a certificate whose critical key usage
/// lacks `keyEncipherment`, meaningless as that is for an EC key, so it is listed.
const CLIENT_EXT: &str = "basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
";

/// The `openssl ca` configuration, used only to sign the expired certificate: `openssl
/// x509 -req` in OpenSSL 3.0 cannot set a start and end date, `openssl ca` can. Paths are
/// relative to the [`Pki`]'s directory, where every command runs. The database and serial
/// file are rewritten by each [`Pki::create_with`], so a second run in the same directory
/// starts from a clean slate.
const CA_CONFIG: &str = "[ca]
default_ca = fallow_ca

[fallow_ca]
database = ca/index.txt
serial = ca/serial
new_certs_dir = ca
certificate = ca/ca-cert.pem
private_key = ca/ca-key.pem
default_md = sha256
policy = any_subject
unique_subject = no

[any_subject]
commonName = supplied
";

/// The directories under a [`Pki`]'s, as the module documentation lays them out.
const SUBDIRS: [&str; 9] = [
    "ca",
    "server",
    "client",
    "client-ca-only",
    "other-ca",
    "expired",
    "wrong-host",
    "psk",
    "wrong-psk",
];

/// Why a [`Pki`] could not be made. Each names the command or file that failed.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// `openssl` could not be started: most often it is not installed (Debian `openssl`),
    /// and the test skips.
    #[error("cannot run `{command}` (is openssl installed?): {source}")]
    Spawn {
        /// The command line, runnable in a shell.
        command: String,
        /// Why it could not be started.
        source: io::Error,
    },
    /// `openssl` ran and failed, or printed something other than what was asked for.
    #[error("`{command}` failed: {detail}")]
    Failed {
        /// The command line, runnable in a shell.
        command: String,
        /// The exit status and what the command wrote on stderr.
        detail: String,
    },
    /// A directory or file could not be created, written or copied.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// A test PKI: two CAs, the certificates and keys signed by them, and pre-shared key files,
/// laid out under one directory as the module documentation shows. Nothing is removed when
/// it is dropped: the directory belongs to the caller (a `TempDir`, usually).
#[derive(Debug, Clone)]
pub struct Pki {
    /// The directory everything is under; every `openssl` command runs in it.
    root: PathBuf,
}

/// Which CA signs a certificate.
#[derive(Debug, Clone, Copy)]
enum Issuer {
    /// The CA every good party trusts.
    Good,
    /// A second, unrelated CA, that no good party trusts.
    Other,
}

impl Issuer {
    fn cert(self) -> &'static str {
        match self {
            Issuer::Good => "ca/ca-cert.pem",
            Issuer::Other => "ca/other-ca-cert.pem",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Issuer::Good => "ca/ca-key.pem",
            Issuer::Other => "ca/other-ca-key.pem",
        }
    }
}

/// Makes a [`Pki`] under `dir` whose good server certificates also name `extra_ips`, for a
/// test that serves on another address than 127.0.0.1 (`::1`, a bridge's address).
pub fn create_with(dir: &Path, extra_ips: &[IpAddr]) -> Result<Pki, PkiError> {
    Pki::create_with(dir, extra_ips)
}

impl Pki {
    /// Makes, under `dir` (created if missing), everything the module documentation lists.
    /// Files left by an earlier run are overwritten. Keys are EC P-256, because they are
    /// fast to make.
    pub fn create(dir: &Path) -> Result<Pki, PkiError> {
        Pki::create_with(dir, &[])
    }

    /// As [`Pki::create`], with `extra_ips` added to the subject alternative names of the
    /// good (and the expired) server certificate, after `DNS:localhost, IP:127.0.0.1`.
    pub fn create_with(dir: &Path, extra_ips: &[IpAddr]) -> Result<Pki, PkiError> {
        let pki = Pki { root: dir.to_path_buf() };
        for sub in SUBDIRS {
            mkdir(&dir.join(sub))?;
        }
        pki.write("ca/server.ext", &server_ext(&server_san(extra_ips)))?;
        pki.write("ca/wrong-host.ext", &server_ext("DNS:wrong.example"))?;
        pki.write("ca/client.ext", CLIENT_EXT)?;

        pki.make_ca(Issuer::Good, "/CN=fallow-test-CA")?;
        pki.make_ca(Issuer::Other, "/CN=fallow-other-test-CA")?;
        pki.make_leaves()?;
        pki.make_expired()?;
        pki.make_psk_files()?;
        Ok(pki)
    }

    /// `DIR/server`: `ca-cert.pem`, `server-cert.pem`, `server-key.pem` (SAN
    /// `DNS:localhost, IP:127.0.0.1` plus the extra addresses), and `client-cert.pem`,
    /// `client-key.pem` (signed by the same CA, `extendedKeyUsage = clientAuth`): the
    /// directory QEMU's `tls-creds-x509,endpoint=server` and nbdkit's `--tls-certificates`
    /// read, which also serves as a client's (QEMU's client side reads `ca-cert.pem`,
    /// `client-cert.pem` and `client-key.pem`).
    pub fn server_dir(&self) -> PathBuf {
        self.root.join("server")
    }

    /// `DIR/client`: `ca-cert.pem` (the same CA), `client-cert.pem`, `client-key.pem`: what
    /// a client is given, and nothing of the server's.
    pub fn client_dir(&self) -> PathBuf {
        self.root.join("client")
    }

    /// `DIR/client-ca-only`: `ca-cert.pem` only, for a client that checks the server but
    /// has no certificate of its own (refused by a server that verifies its peers).
    pub fn ca_only_dir(&self) -> PathBuf {
        self.root.join("client-ca-only")
    }

    /// `DIR/other-ca`: a second, unrelated CA's `ca-cert.pem`, and `client-cert.pem`,
    /// `client-key.pem` signed by that CA: for "a client certificate from another CA is
    /// refused" (by the server) and "a wrong CA is refused" (the client rejects the good
    /// server's certificate).
    pub fn other_ca_dir(&self) -> PathBuf {
        self.root.join("other-ca")
    }

    /// `DIR/expired`: `ca-cert.pem` (the good CA), and `server-cert.pem`, `server-key.pem`
    /// signed by the good CA, with the good server certificate's SAN, but valid only from
    /// 2020-01-01 to 2020-01-02: for "an expired certificate is refused". Serve it with
    /// nbdkit: QEMU refuses to load it ("The server certificate … has expired").
    pub fn expired_dir(&self) -> PathBuf {
        self.root.join("expired")
    }

    /// `DIR/wrong-host`: `ca-cert.pem` (the good CA), and `server-cert.pem`,
    /// `server-key.pem` signed by it whose only SAN is `DNS:wrong.example`, with no
    /// address: for "a certificate for another host is refused".
    pub fn wrong_host_dir(&self) -> PathBuf {
        self.root.join("wrong-host")
    }

    /// `DIR/keys.psk`: one line `fallow:HEXKEY` (32 random bytes, lowercase hex), the
    /// format of GnuTLS's `psktool`, which `nbdkit --tls-psk=FILE` and libnbd's
    /// `tls-psk-file=FILE` read. A libnbd client names the identity in the URI
    /// (`nbds://fallow@127.0.0.1:PORT?tls-psk-file=FILE`); without it, libnbd uses the
    /// login name, which a test under a container may not have.
    pub fn psk_file(&self) -> PathBuf {
        self.root.join("keys.psk")
    }

    /// `DIR/psk`, holding a copy of [`Pki::psk_file`] as `keys.psk`: QEMU's
    /// `tls-creds-psk` takes a directory and reads `keys.psk` in it.
    pub fn psk_dir(&self) -> PathBuf {
        self.root.join("psk")
    }

    /// `DIR/wrong-psk/keys.psk`: the same identity as [`Pki::psk_file`] with another key,
    /// for "a wrong key is refused". It is named `keys.psk` so that its directory (its
    /// `parent()`) serves as QEMU's `tls-creds-psk,dir=`.
    pub fn wrong_psk_file(&self) -> PathBuf {
        self.root.join("wrong-psk/keys.psk")
    }

    /// Makes a self-signed CA certificate and its key. The extensions are given on the
    /// command line so that the CA does not depend on the system's `openssl.cnf`; QEMU
    /// refuses a CA without `basicConstraints = CA:TRUE`.
    fn make_ca(&self, ca: Issuer, subject: &str) -> Result<(), PkiError> {
        let (key, cert) = (ca.key(), ca.cert());
        self.openssl(&format!(
            "req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -noenc \
             -keyout {key} -out {cert} -subj {subject} -days {CA_DAYS} \
             -addext basicConstraints=critical,CA:TRUE \
             -addext keyUsage=critical,keyCertSign,cRLSign"
        ))?;
        Ok(())
    }

    /// Makes the certificates that are valid now, and hands each directory its files.
    fn make_leaves(&self) -> Result<(), PkiError> {
        let (good, other) = (Issuer::Good, Issuer::Other);
        self.issue(good, "server/server", "/CN=localhost", "ca/server.ext")?;
        self.issue(good, "client/client", "/CN=fallow-test-client", "ca/client.ext")?;
        self.issue(good, "wrong-host/server", "/CN=wrong.example", "ca/wrong-host.ext")?;
        self.issue(other, "other-ca/client", "/CN=fallow-other-client", "ca/client.ext")?;

        self.copy("ca/other-ca-cert.pem", "other-ca/ca-cert.pem")?;
        for dir in ["server", "client", "client-ca-only", "expired", "wrong-host"] {
            self.copy("ca/ca-cert.pem", &format!("{dir}/ca-cert.pem"))?;
        }
        // The server's directory holds a client certificate too, as QEMU's layout has it.
        self.copy("client/client-cert.pem", "server/client-cert.pem")?;
        self.copy("client/client-key.pem", "server/client-key.pem")
    }

    /// Makes `PREFIX-key.pem` and `PREFIX-cert.pem` (PREFIX being `server/server`, say):
    /// a key and a request for `subject`, then the certificate `ca` signs with the
    /// extensions in `ext`. The request goes to `ca/`, with a name made from PREFIX.
    fn issue(&self, ca: Issuer, prefix: &str, subject: &str, ext: &str) -> Result<(), PkiError> {
        let (key, cert) = (format!("{prefix}-key.pem"), format!("{prefix}-cert.pem"));
        let csr = format!("ca/{}.csr", prefix.replace('/', "-"));
        self.request(&key, &csr, subject)?;
        let (ca_cert, ca_key) = (ca.cert(), ca.key());
        self.openssl(&format!(
            "x509 -req -in {csr} -CA {ca_cert} -CAkey {ca_key} -days {LEAF_DAYS} \
             -extfile {ext} -out {cert}"
        ))?;
        Ok(())
    }

    /// Makes a new key at `key` and a certificate request for it at `csr`.
    fn request(&self, key: &str, csr: &str, subject: &str) -> Result<(), PkiError> {
        self.openssl(&format!(
            "req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -noenc \
             -keyout {key} -out {csr} -subj {subject}"
        ))?;
        Ok(())
    }

    /// Makes the expired server certificate with `openssl ca`, the one command in OpenSSL
    /// 3.0 that sets a certificate's dates (`x509 -not_before` came in 3.4). Its database
    /// is emptied first, so that a second run in the same directory works.
    fn make_expired(&self) -> Result<(), PkiError> {
        self.write("ca/ca.cnf", CA_CONFIG)?;
        self.write("ca/index.txt", "")?;
        self.write("ca/serial", "01\n")?;
        self.request("expired/server-key.pem", "ca/expired-server.csr", "/CN=localhost")?;
        self.openssl(&format!(
            "ca -batch -config ca/ca.cnf -notext \
             -startdate {EXPIRED_START} -enddate {EXPIRED_END} -extfile ca/server.ext \
             -in ca/expired-server.csr -out expired/server-cert.pem"
        ))?;
        Ok(())
    }

    /// Writes the good and the wrong pre-shared key files, each key from `openssl rand`.
    fn make_psk_files(&self) -> Result<(), PkiError> {
        let good = self.psk_line()?;
        self.write_secret("keys.psk", &good)?;
        self.write_secret("psk/keys.psk", &good)?;
        let wrong = self.psk_line()?;
        // Two draws of 32 random bytes do not match unless the random source is broken;
        // a "wrong key" test must not pass by such luck, so it is checked.
        if wrong == good {
            return Err(PkiError::Failed {
                command: command_line(&self.root, "rand -hex 32"),
                detail: "printed the same key twice".to_string(),
            });
        }
        self.write_secret("wrong-psk/keys.psk", &wrong)
    }

    /// `fallow:HEXKEY\n`, the key being 32 random bytes from `openssl rand -hex 32`.
    fn psk_line(&self) -> Result<String, PkiError> {
        let args = "rand -hex 32";
        let out = self.openssl(args)?;
        let key = String::from_utf8_lossy(&out).trim().to_string();
        if key.len() != 64 || !key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(PkiError::Failed {
                command: command_line(&self.root, args),
                detail: format!("printed {key:?}, not 64 lowercase hex digits"),
            });
        }
        Ok(format!("{PSK_IDENTITY}:{key}\n"))
    }

    /// Runs `openssl ARGS` in the PKI's directory, with no input, and returns its stdout.
    /// `args` is split at white space: every path in it is relative to the PKI's directory
    /// and every subject is one word, so no argument holds a space, and the command reads
    /// as it is typed.
    fn openssl(&self, args: &str) -> Result<Vec<u8>, PkiError> {
        let output = Command::new("openssl")
            .args(args.split_whitespace())
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| PkiError::Spawn {
                command: command_line(&self.root, args),
                source,
            })?;
        if !output.status.success() {
            return Err(PkiError::Failed {
                command: command_line(&self.root, args),
                detail: format!(
                    "{}: {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            });
        }
        Ok(output.stdout)
    }

    /// Writes `contents` to `rel`, a path under the PKI's directory.
    fn write(&self, rel: &str, contents: &str) -> Result<(), PkiError> {
        let path = self.root.join(rel);
        std::fs::write(&path, contents).map_err(|source| PkiError::Io { path, source })
    }

    /// Writes a key file, readable by its owner only, as `openssl` writes private keys.
    fn write_secret(&self, rel: &str, contents: &str) -> Result<(), PkiError> {
        let path = self.root.join(rel);
        // `mode` applies only when the file is created; a file an earlier run left keeps
        // its mode, which was 0600 then too.
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(contents.as_bytes()))
            .map_err(|source| PkiError::Io { path, source })
    }

    /// Copies `from` to `to`, both under the PKI's directory; the mode goes with it, so a
    /// copied key stays 0600.
    fn copy(&self, from: &str, to: &str) -> Result<(), PkiError> {
        let path = self.root.join(to);
        match std::fs::copy(self.root.join(from), &path) {
            Ok(_) => Ok(()),
            Err(source) => Err(PkiError::Io { path, source }),
        }
    }
}

/// Creates `dir` and its parents, if missing.
fn mkdir(dir: &Path) -> Result<(), PkiError> {
    std::fs::create_dir_all(dir).map_err(|source| PkiError::Io { path: dir.to_path_buf(), source })
}

/// `DNS:localhost, IP:127.0.0.1`, then each of `extra_ips` not already named.
fn server_san(extra_ips: &[IpAddr]) -> String {
    let mut ips = vec![IpAddr::V4(Ipv4Addr::LOCALHOST)];
    for ip in extra_ips {
        if !ips.contains(ip) {
            ips.push(*ip);
        }
    }
    let mut san = String::from("DNS:localhost");
    for ip in ips {
        san.push_str(&format!(", IP:{ip}"));
    }
    san
}

/// The extensions of a server certificate naming `san`. GnuTLS checks the dialled name
/// against `subjectAltName`; QEMU refuses a server certificate whose critical key usage
/// lacks `keyEncipherment`, or whose extended key usage lacks `serverAuth`.
fn server_ext(san: &str) -> String {
    format!(
        "basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = {san}
"
    )
}

/// `cd DIR && openssl ARGS`, quoted so it can be pasted into a shell to see the failure
/// again.
fn command_line(dir: &Path, args: &str) -> String {
    let mut line = format!("cd {} && openssl", shell_quote(&dir.to_string_lossy()));
    for arg in args.split_whitespace() {
        line.push(' ');
        line.push_str(&shell_quote(arg));
    }
    line
}

/// `word` as a shell reads it back: as it is when it holds only safe characters, else in
/// single quotes.
fn shell_quote(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Instant;

    use super::*;
    use crate::process::{have, TempDir};

    /// Tells apart the scratch directories of the tests running at once in this process.
    static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

    /// A fresh scratch directory (removed when dropped) and a `Pki` made in it with
    /// `extra_ips`; `None`, after saying so, if openssl is not installed.
    fn pki(extra_ips: &[IpAddr]) -> Option<(TempDir, Pki)> {
        if !have("openssl") {
            eprintln!("skipped: openssl not installed (Debian openssl)");
            return None;
        }
        let n = NEXT_DIR.fetch_add(1, Ordering::Relaxed);
        let dir = TempDir::new(&format!("tls-{n}"));
        let started = Instant::now();
        let pki = create_with(&dir.path().join("pki"), extra_ips).unwrap();
        eprintln!("made the PKI in {:?}", started.elapsed());
        Some((dir, pki))
    }

    /// Runs `openssl verify -CAfile CA EXTRA... CERT`: whether it passed, and what it said.
    fn verify(ca: &Path, cert: &Path, extra: &[&str]) -> (bool, String) {
        let out = Command::new("openssl")
            .arg("verify")
            .arg("-CAfile")
            .arg(ca)
            .args(extra)
            .arg(cert)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), said)
    }

    /// Asserts that `cert` verifies against `ca` with `extra` options.
    fn assert_verifies(ca: &Path, cert: &Path, extra: &[&str]) {
        let (ok, said) = verify(ca, cert, extra);
        assert!(
            ok,
            "{} should verify against {} with {extra:?}: {said}",
            cert.display(),
            ca.display()
        );
    }

    /// Asserts that `cert` fails to verify against `ca` with `extra`, saying `why`.
    fn assert_refused(ca: &Path, cert: &Path, extra: &[&str], why: &str) {
        let (ok, said) = verify(ca, cert, extra);
        assert!(!ok, "{} should not verify against {}: {said}", cert.display(), ca.display());
        assert!(said.contains(why), "expected {why:?}, got: {said}");
    }

    /// The public key, as PEM, that `openssl ARGS FILE` prints.
    fn public_key(args: &[&str], file: &Path) -> String {
        let out = Command::new("openssl").args(args).arg(file).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn good_certificates_verify_against_the_ca_for_their_purpose() {
        let Some((_dir, pki)) = pki(&[]) else { return };
        let (server, client) = (pki.server_dir(), pki.client_dir());
        let ca = client.join("ca-cert.pem");
        assert_verifies(&ca, &server.join("server-cert.pem"), &["-purpose", "sslserver"]);
        assert_verifies(&ca, &server.join("client-cert.pem"), &["-purpose", "sslclient"]);
        assert_verifies(&ca, &client.join("client-cert.pem"), &["-purpose", "sslclient"]);
        assert_verifies(
            &pki.ca_only_dir().join("ca-cert.pem"),
            &server.join("server-cert.pem"),
            &[],
        );
        let other = pki.other_ca_dir();
        assert_verifies(&other.join("ca-cert.pem"), &other.join("client-cert.pem"), &[]);
        // Each party's CA is the same certificate.
        let ca_pem = std::fs::read(&ca).unwrap();
        for dir in [server.clone(), pki.ca_only_dir(), pki.expired_dir(), pki.wrong_host_dir()] {
            assert_eq!(
                std::fs::read(dir.join("ca-cert.pem")).unwrap(),
                ca_pem,
                "{}",
                dir.display()
            );
        }
        // A client certificate is not a server's, and each key belongs to its certificate.
        assert_refused(&ca, &client.join("client-cert.pem"), &["-purpose", "sslserver"], "purpose");
        for (dir, who) in [(&server, "server"), (&server, "client"), (&client, "client")] {
            let cert = public_key(
                &["x509", "-noout", "-pubkey", "-in"],
                &dir.join(format!("{who}-cert.pem")),
            );
            let key = public_key(&["pkey", "-pubout", "-in"], &dir.join(format!("{who}-key.pem")));
            assert_eq!(cert, key, "{} {who}", dir.display());
        }
    }

    #[test]
    fn another_cas_client_certificate_is_not_trusted() {
        let Some((_dir, pki)) = pki(&[]) else { return };
        let ca = pki.client_dir().join("ca-cert.pem");
        let other = pki.other_ca_dir();
        assert_refused(&ca, &other.join("client-cert.pem"), &[], "unable to get local issuer");
        // And the other CA does not vouch for the good server.
        let server = pki.server_dir().join("server-cert.pem");
        assert_refused(&other.join("ca-cert.pem"), &server, &[], "unable to get local issuer");
    }

    #[test]
    fn expired_certificate_fails_as_expired() {
        let Some((_dir, pki)) = pki(&[]) else { return };
        let dir = pki.expired_dir();
        assert_refused(&dir.join("ca-cert.pem"), &dir.join("server-cert.pem"), &[], "expired");
        // It fails only for its dates: with them unchecked, it verifies for 127.0.0.1. (Not
        // `-attime` in 2020: the CA, made today, was not valid then.)
        let extra = ["-no_check_time", "-verify_ip", "127.0.0.1"];
        assert_verifies(&dir.join("ca-cert.pem"), &dir.join("server-cert.pem"), &extra);
    }

    #[test]
    fn only_the_good_server_certificate_names_localhost() {
        let Some((_dir, pki)) = pki(&[]) else { return };
        let ca = pki.client_dir().join("ca-cert.pem");
        let good = pki.server_dir().join("server-cert.pem");
        let wrong = pki.wrong_host_dir().join("server-cert.pem");
        assert_verifies(&ca, &good, &["-verify_ip", "127.0.0.1"]);
        assert_verifies(&ca, &good, &["-verify_hostname", "localhost"]);
        assert_verifies(&ca, &wrong, &[]);
        assert_refused(&ca, &wrong, &["-verify_ip", "127.0.0.1"], "IP address mismatch");
        assert_refused(&ca, &wrong, &["-verify_hostname", "localhost"], "hostname mismatch");
    }

    #[test]
    fn extra_addresses_are_named_by_the_server_certificate() {
        let extra: [IpAddr; 2] = ["10.11.12.13".parse().unwrap(), "::1".parse().unwrap()];
        let Some((_dir, pki)) = pki(&extra) else { return };
        let ca = pki.client_dir().join("ca-cert.pem");
        let good = pki.server_dir().join("server-cert.pem");
        for ip in ["127.0.0.1", "10.11.12.13", "::1"] {
            assert_verifies(&ca, &good, &["-verify_ip", ip]);
        }
        assert_refused(&ca, &good, &["-verify_ip", "10.11.12.14"], "IP address mismatch");
    }

    #[test]
    fn psk_files_hold_one_identity_with_different_keys() {
        let Some((_dir, pki)) = pki(&[]) else { return };
        let good = std::fs::read_to_string(pki.psk_file()).unwrap();
        let wrong = std::fs::read_to_string(pki.wrong_psk_file()).unwrap();
        for line in [&good, &wrong] {
            let key = line.strip_prefix("fallow:").and_then(|l| l.strip_suffix('\n'));
            let key = key.unwrap_or_else(|| panic!("not `fallow:KEY\\n`: {line:?}"));
            let hex = |b: u8| matches!(b, b'0'..=b'9' | b'a'..=b'f');
            assert!(key.len() == 64 && key.bytes().all(hex), "not 64 lowercase hex: {key:?}");
        }
        assert_ne!(good, wrong);
        assert_eq!(std::fs::read_to_string(pki.psk_dir().join("keys.psk")).unwrap(), good);
        assert_eq!(pki.wrong_psk_file().file_name().unwrap(), "keys.psk");
    }

    #[test]
    fn a_second_run_in_the_same_directory_makes_a_new_pki() {
        let Some((dir, first)) = pki(&[]) else { return };
        let old_ca = std::fs::read(first.client_dir().join("ca-cert.pem")).unwrap();
        let second = Pki::create(&dir.path().join("pki")).unwrap();
        let ca = second.client_dir().join("ca-cert.pem");
        assert_ne!(std::fs::read(&ca).unwrap(), old_ca);
        assert_verifies(&ca, &second.server_dir().join("server-cert.pem"), &[]);
        let expired = second.expired_dir();
        assert_refused(&ca, &expired.join("server-cert.pem"), &[], "expired");
    }

    #[test]
    fn a_failing_command_is_named_with_its_stderr() {
        let Some((_dir, pki)) = pki(&[]) else { return };
        let err = pki.openssl("x509 -in no-such-file.pem").unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, PkiError::Failed { .. }), "{text}");
        assert!(text.contains("&& openssl x509 -in no-such-file.pem"), "{text}");
        assert!(text.contains("No such file"), "{text}");
    }
}
