//! Where a node listens: a TCP address or a Unix socket path.

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
