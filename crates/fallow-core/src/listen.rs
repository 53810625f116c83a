//! Where a server listens (a node, an NBD server): a TCP address or a Unix socket path.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

/// One listening endpoint, written `127.0.0.1:7400`, `[::1]:7400` or `unix:/run/fallow.sock`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address (port 0 picks a free port).
    Tcp(SocketAddr),
    /// A Unix stream socket at this path.
    Unix(PathBuf),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("`unix:` needs a socket path, as in unix:/run/fallow.sock".into());
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        s.parse::<SocketAddr>().map(ListenAddr::Tcp).map_err(|_| {
            format!("`{s}` is neither HOST:PORT (an IP address and a port) nor unix:PATH")
        })
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(addr) => write!(f, "{addr}"),
            ListenAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// Makes `path` free for a Unix listener: removes a stale socket file that nobody listens
/// on (left by a server that crashed), but never a live socket or a file that is not a
/// socket.
pub fn prepare_unix_socket(path: &std::path::Path) -> std::io::Result<()> {
    use std::io;
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("another process is listening on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms_and_explains_mistakes() {
        assert_eq!(
            "127.0.0.1:7400".parse::<ListenAddr>().unwrap(),
            ListenAddr::Tcp("127.0.0.1:7400".parse().unwrap())
        );
        assert_eq!(
            "unix:/tmp/f.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/tmp/f.sock".into())
        );
        assert!("unix:".parse::<ListenAddr>().unwrap_err().contains("socket path"));
        assert!("localhost".parse::<ListenAddr>().unwrap_err().contains("HOST:PORT"));
        assert_eq!("unix:/a".parse::<ListenAddr>().unwrap().to_string(), "unix:/a");
    }
}
