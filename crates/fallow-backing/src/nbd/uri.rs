//! `nbd://`, `nbds://`, `nbd+unix://` and `nbds+unix://` URIs of an upstream export, with
//! the query parameters libnbd gives the same meaning (`socket=`, `tls-certificates=`,
//! `tls-psk-file=`, and a PSK identity as the URI's user).

use super::*;

/// The TLS an `nbds://` URI asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTls {
    /// `tls-certificates=DIR`: `ca-cert.pem` to check the server against, and
    /// `client-cert.pem`/`client-key.pem` to present if they are there.
    pub certificates: Option<PathBuf>,
    /// `tls-psk-file=FILE`: a psktool file.
    pub psk_file: Option<PathBuf>,
    /// The PSK identity: the URI's user (`nbds://NAME@HOST/...`), else the file's first.
    pub username: Option<String>,
    /// The name the server's certificate must carry: the URI's host.
    pub host: String,
}

impl UpstreamTls {
    /// The TLS client these settings make.
    pub fn client(&self) -> io::Result<fallow_tls::TlsClient> {
        let options = fallow_tls::ClientOptions {
            certificates: self.certificates.clone(),
            psk: self.psk_file.clone().map(|file| (file, self.username.clone())),
            tls13_only: false,
        };
        fallow_tls::TlsClient::new(&options)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))
    }
}

/// Where the upstream server is, and how to use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdUri {
    /// `nbd://HOST:PORT/EXPORT[?conns=N]`.
    Tcp {
        /// `HOST:PORT`.
        addr: String,
        /// The export name (may be empty).
        export: String,
        /// `conns=N`: connections to open if the server allows several.
        connections: Option<usize>,
        /// `nbds://`: TLS, started with `NBD_OPT_STARTTLS` before any other option.
        tls: Option<UpstreamTls>,
    },
    /// `nbd+unix:///EXPORT?socket=PATH[&conns=N]`.
    Unix {
        /// The socket.
        path: PathBuf,
        /// The export name (may be empty).
        export: String,
        /// `conns=N`: connections to open if the server allows several.
        connections: Option<usize>,
        /// `nbds+unix://`: TLS.
        tls: Option<UpstreamTls>,
    },
}

impl NbdUri {
    /// Parses `nbd://HOST[:PORT][/EXPORT]` (port 10809 by default) or
    /// `nbd+unix:///[EXPORT]?socket=PATH`, either with `conns=N` (1 to 16) among its query
    /// parameters; `nbds://` and `nbds+unix://` are the same over TLS, with
    /// `tls-certificates=DIR` or `tls-psk-file=FILE` (and the PSK identity as the user:
    /// `nbds://NAME@HOST/EXPORT`).
    pub fn parse(uri: &str) -> io::Result<NbdUri> {
        let bad = |why: &str| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("NBD URI {uri:?}: {why}"))
        };
        let schemes = [
            ("nbd+unix://", true, false),
            ("nbds+unix://", true, true),
            ("nbd://", false, false),
            ("nbds://", false, true),
        ];
        let Some((unix, secure, rest)) = schemes
            .iter()
            .find_map(|(scheme, unix, secure)| Some((*unix, *secure, uri.strip_prefix(scheme)?)))
        else {
            return Err(bad("expected nbd://, nbds://, nbd+unix:// or nbds+unix://"));
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (mut socket, mut connections) = (None, None);
        let (mut certificates, mut psk_file) = (None, None);
        for param in query.split('&').filter(|p| !p.is_empty()) {
            match param.split_once('=') {
                Some(("socket", path)) if unix => socket = Some(PathBuf::from(path)),
                Some(("conns", n)) => {
                    let n = n.parse().ok().filter(|n| (1..=MAX_CONNECTIONS).contains(n));
                    let why = format!("conns must be 1 to {MAX_CONNECTIONS}");
                    connections = Some(n.ok_or_else(|| bad(&why))?);
                }
                Some(("tls-certificates", dir)) if secure => certificates = Some(dir.into()),
                Some(("tls-psk-file", file)) if secure => psk_file = Some(file.into()),
                Some(("tls-certificates" | "tls-psk-file", _)) => {
                    return Err(bad(&format!("{param:?} needs nbds:// or nbds+unix://")))
                }
                _ => return Err(bad(&format!("unknown parameter {param:?}"))),
            }
        }
        let (authority, export) = match rest.split_once('/') {
            Some((authority, export)) => (authority, export.to_string()),
            None => (rest, String::new()),
        };
        let (username, host) = match authority.rsplit_once('@') {
            Some((user, host)) if secure && !user.is_empty() => (Some(user.to_string()), host),
            Some(_) => return Err(bad("a user name is only meaningful with nbds:// and a PSK")),
            None => (None, authority),
        };
        let tls = match (secure, &certificates, &psk_file) {
            (false, ..) => None,
            (true, None, None) => {
                return Err(bad("nbds:// needs tls-certificates=DIR or tls-psk-file=FILE"))
            }
            (true, ..) => {
                let name = match host.rsplit_once(':') {
                    Some((name, port)) if port.parse::<u16>().is_ok() => name,
                    _ => host,
                };
                let name = name.trim_start_matches('[').trim_end_matches(']');
                let host = if unix || name.is_empty() { "localhost" } else { name };
                Some(UpstreamTls { certificates, psk_file, username, host: host.to_string() })
            }
        };
        if unix {
            if !host.is_empty() {
                return Err(bad("a Unix socket URI has no host: nbd+unix:///EXPORT?socket=PATH"));
            }
            let path = socket.ok_or_else(|| bad("needs ?socket=PATH"))?;
            return Ok(NbdUri::Unix { path, export, connections, tls });
        }
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let has_port = host.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok())
            && !host.ends_with(']');
        let addr = if has_port { host.to_string() } else { format!("{host}:10809") };
        Ok(NbdUri::Tcp { addr, export, connections, tls })
    }

    /// The TLS the URI asks for, if any.
    pub fn tls(&self) -> Option<&UpstreamTls> {
        match self {
            NbdUri::Tcp { tls, .. } | NbdUri::Unix { tls, .. } => tls.as_ref(),
        }
    }

    pub(super) fn export(&self) -> &str {
        match self {
            NbdUri::Tcp { export, .. } | NbdUri::Unix { export, .. } => export,
        }
    }

    /// The connections the URI asks for (`conns=N`), if it says.
    pub fn connections(&self) -> Option<usize> {
        match self {
            NbdUri::Tcp { connections, .. } | NbdUri::Unix { connections, .. } => *connections,
        }
    }
}

impl std::fmt::Display for NbdUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The TLS parameters are left out: this is for logs, and the scheme says TLS.
        let s = if self.tls().is_some() { "s" } else { "" };
        let sep = match self {
            NbdUri::Tcp { addr, export, .. } => {
                write!(f, "nbd{s}://{addr}/{export}")?;
                '?'
            }
            NbdUri::Unix { path, export, .. } => {
                write!(f, "nbd{s}+unix:///{export}?socket={}", path.display())?;
                '&'
            }
        };
        match self.connections() {
            Some(n) => write!(f, "{sep}conns={n}"),
            None => Ok(()),
        }
    }
}
