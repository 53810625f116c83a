//! Listening sockets handed over by the service manager: systemd's socket activation
//! (`LISTEN_FDS`, `LISTEN_PID`), read with the `listenfd` crate.
//!
//! Why: a socket that the service manager holds stays open while the server restarts, so
//! clients that connect meanwhile wait in its backlog instead of being refused, and the
//! new process takes up the same socket (docs/operations.md, "Restarts and upgrades").
//!
//! [`Listener::bind`](crate::Listener::bind) takes an inherited socket bound to the
//! address asked for before it binds one of its own; a server given no address serves on
//! every inherited socket ([`take_all`]). Sockets are read from the environment once, on
//! first use; each is handed out once.

use std::sync::Mutex;

use fallow_core::ListenAddr;

use crate::Listener;

/// The inherited sockets not handed out yet: `None` until the environment is read.
static INHERITED: Mutex<Option<Vec<Listener>>> = Mutex::new(None);

/// The paths of the inherited Unix sockets: their files belong to the service manager.
static INHERITED_PATHS: Mutex<Vec<std::path::PathBuf>> = Mutex::new(Vec::new());

/// Reads `LISTEN_FDS` once. A socket of another kind (not a listening TCP or Unix stream
/// socket) is logged and left alone.
fn with_inherited<T>(f: impl FnOnce(&mut Vec<Listener>) -> T) -> T {
    let mut inherited = INHERITED.lock().unwrap_or_else(|e| e.into_inner());
    let list = inherited.get_or_insert_with(read_environment);
    f(list)
}

fn read_environment() -> Vec<Listener> {
    let mut fds = listenfd::ListenFd::from_env();
    let mut found = Vec::new();
    for index in 0..fds.len() {
        let listener = match fds.take_tcp_listener(index) {
            Ok(Some(tcp)) => adopt_tcp(tcp),
            _ => match fds.take_unix_listener(index) {
                Ok(Some(unix)) => adopt_unix(unix),
                _ => Err(std::io::Error::other("not a listening TCP or Unix stream socket")),
            },
        };
        match listener {
            Ok(listener) => {
                if let Listener::Unix(_, path) = &listener {
                    INHERITED_PATHS.lock().unwrap_or_else(|e| e.into_inner()).push(path.clone());
                }
                let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
                tracing::info!(fd = 3 + index, %addr, "socket handed over by the service manager");
                found.push(listener);
            }
            Err(err) => tracing::warn!(fd = 3 + index, %err, "inherited socket left alone"),
        }
    }
    found
}

fn adopt_tcp(tcp: std::net::TcpListener) -> std::io::Result<Listener> {
    tcp.set_nonblocking(true)?;
    Ok(Listener::Tcp(tokio::net::TcpListener::from_std(tcp)?))
}

fn adopt_unix(unix: std::os::unix::net::UnixListener) -> std::io::Result<Listener> {
    unix.set_nonblocking(true)?;
    let path = unix
        .local_addr()?
        .as_pathname()
        .map(std::path::Path::to_path_buf)
        .ok_or_else(|| std::io::Error::other("an unnamed or abstract Unix socket"))?;
    Ok(Listener::Unix(tokio::net::UnixListener::from_std(unix)?, path))
}

/// The inherited socket bound to `addr`, if there is one (taken: asked again, `None`).
pub(crate) fn take_matching(addr: &ListenAddr) -> Option<Listener> {
    with_inherited(|list| {
        let at = list.iter().position(|l| l.local_addr().is_ok_and(|a| same_address(&a, addr)))?;
        Some(list.remove(at))
    })
}

/// Every inherited socket not taken yet.
pub fn take_all() -> Vec<Listener> {
    with_inherited(std::mem::take)
}

/// Whether `path` is a Unix socket the service manager handed over.
pub fn was_inherited(path: &std::path::Path) -> bool {
    INHERITED_PATHS.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|p| p == path)
}

/// Whether the service manager handed over sockets that are still untaken.
pub fn any_left() -> bool {
    with_inherited(|list| !list.is_empty())
}

/// `bound` is the socket `wanted` names: the same path, or the same IP and port (a
/// wanted port 0 matches nothing: it asks for a new socket).
fn same_address(bound: &ListenAddr, wanted: &ListenAddr) -> bool {
    match (bound, wanted) {
        (ListenAddr::Tcp(a), ListenAddr::Tcp(b)) => b.port() != 0 && a == b,
        (ListenAddr::Unix(a), ListenAddr::Unix(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_match_by_ip_and_port_or_path() {
        let tcp = |s: &str| ListenAddr::Tcp(s.parse().unwrap());
        assert!(same_address(&tcp("127.0.0.1:7400"), &tcp("127.0.0.1:7400")));
        assert!(!same_address(&tcp("127.0.0.1:7400"), &tcp("127.0.0.1:7401")));
        assert!(!same_address(&tcp("127.0.0.1:7400"), &tcp("0.0.0.0:7400")));
        assert!(!same_address(&tcp("127.0.0.1:0"), &tcp("127.0.0.1:0")));
        let unix = |s: &str| ListenAddr::Unix(s.into());
        assert!(same_address(&unix("/run/f.sock"), &unix("/run/f.sock")));
        assert!(!same_address(&unix("/run/f.sock"), &tcp("127.0.0.1:7400")));
    }
}
