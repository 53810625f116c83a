//! `nbd://` and `nbd+unix://` URIs of an upstream export.

use super::*;

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
    },
    /// `nbd+unix:///EXPORT?socket=PATH[&conns=N]`.
    Unix {
        /// The socket.
        path: PathBuf,
        /// The export name (may be empty).
        export: String,
        /// `conns=N`: connections to open if the server allows several.
        connections: Option<usize>,
    },
}

impl NbdUri {
    /// Parses `nbd://HOST[:PORT][/EXPORT]` (port 10809 by default) or
    /// `nbd+unix:///[EXPORT]?socket=PATH`, either with `conns=N` (1 to 16) among its query
    /// parameters.
    pub fn parse(uri: &str) -> io::Result<NbdUri> {
        let bad = |why: &str| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("NBD URI {uri:?}: {why}"))
        };
        let (unix, rest) = if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            (true, rest)
        } else if let Some(rest) = uri.strip_prefix("nbd://") {
            (false, rest)
        } else {
            return Err(bad("expected nbd:// or nbd+unix://"));
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (mut socket, mut connections) = (None, None);
        for param in query.split('&').filter(|p| !p.is_empty()) {
            match param.split_once('=') {
                Some(("socket", path)) if unix => socket = Some(PathBuf::from(path)),
                Some(("conns", n)) => {
                    let n = n.parse().ok().filter(|n| (1..=MAX_CONNECTIONS).contains(n));
                    let why = format!("conns must be 1 to {MAX_CONNECTIONS}");
                    connections = Some(n.ok_or_else(|| bad(&why))?);
                }
                _ => return Err(bad(&format!("unknown parameter {param:?}"))),
            }
        }
        if unix {
            let export = rest.strip_prefix('/').unwrap_or(rest).to_string();
            let path = socket.ok_or_else(|| bad("needs ?socket=PATH"))?;
            return Ok(NbdUri::Unix { path, export, connections });
        }
        let (host, export) = match rest.split_once('/') {
            Some((host, export)) => (host, export.to_string()),
            None => (rest, String::new()),
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let has_port = host.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok())
            && !host.ends_with(']');
        let addr = if has_port { host.to_string() } else { format!("{host}:10809") };
        Ok(NbdUri::Tcp { addr, export, connections })
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
        let sep = match self {
            NbdUri::Tcp { addr, export, .. } => {
                write!(f, "nbd://{addr}/{export}")?;
                '?'
            }
            NbdUri::Unix { path, export, .. } => {
                write!(f, "nbd+unix:///{export}?socket={}", path.display())?;
                '&'
            }
        };
        match self.connections() {
            Some(n) => write!(f, "{sep}conns={n}"),
            None => Ok(()),
        }
    }
}
