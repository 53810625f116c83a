//! The socket of one export: a Unix socket QEMU connects to (`-chardev socket,path=…`), one
//! connection at a time, each a fresh vhost-user session with the same device behind it.
//! When QEMU goes (the guest shut down, QEMU killed, or QEMU reconnecting after it lost the
//! connection), the session's threads end, the requests it left in flight finish, and the
//! socket takes the next connection.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::{BlkBackend, Device};

/// An error that stops a socket.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The socket could not be bound.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// The socket's path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The vhost-user library could not set a session up.
    #[error("vhost-user session on {path} failed: {message}")]
    Session {
        /// The socket's path.
        path: PathBuf,
        /// The library's error.
        message: String,
    },
}

/// One export's listening socket.
pub struct Server {
    device: Arc<Device>,
    path: PathBuf,
    listener: Mutex<Listener>,
    stopping: AtomicBool,
    /// The session being served, so that [`Server::shutdown`] can end it.
    current: Mutex<Option<ShutdownHandle>>,
}

impl Server {
    /// Binds `path` (a stale socket file left by a process that is gone is replaced; a live
    /// one is an error) for `device`.
    pub fn bind(path: &Path, device: Arc<Device>) -> Result<Server, ServeError> {
        let bind_error = |source| ServeError::Bind { path: path.to_path_buf(), source };
        fallow_core::prepare_unix_socket(path).map_err(bind_error)?;
        let listener = Listener::new(path, false)
            .map_err(|err| bind_error(std::io::Error::other(err.to_string())))?;
        Ok(Server {
            device,
            path: path.to_path_buf(),
            listener: Mutex::new(listener),
            stopping: AtomicBool::new(false),
            current: Mutex::new(None),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device behind it.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Serves one connection after another until [`Server::shutdown`]. Blocks: run it on a
    /// thread of its own.
    pub fn serve(&self) -> Result<(), ServeError> {
        let name = self.device.name().to_string();
        let session_error = |err: &dyn std::fmt::Display| ServeError::Session {
            path: self.path.clone(),
            message: err.to_string(),
        };
        while !self.stopping.load(Ordering::Acquire) {
            let backend = BlkBackend::new(self.device.clone());
            let memory = GuestMemoryAtomic::new(GuestMemoryMmap::new());
            let mut session = VhostUserDaemon::new(format!("vhost-{name}"), backend, memory)
                .map_err(|err| session_error(&err))?;
            {
                let mut listener = self.listener.lock().unwrap_or_else(|e| e.into_inner());
                session.start(&mut listener).map_err(|err| session_error(&err))?;
            }
            *self.current.lock().unwrap_or_else(|e| e.into_inner()) = session.shutdown_handle();
            if self.stopping.load(Ordering::Acquire) {
                session.request_shutdown();
            } else {
                tracing::info!(export = %name, socket = %self.path.display(), "vhost-user frontend connected");
            }
            let ended = session.wait();
            self.current.lock().unwrap_or_else(|e| e.into_inner()).take();
            // Dropping the session stops its queue threads; the requests they started
            // finish before the next session may touch the disk.
            drop(session);
            self.device.quiesce();
            match ended {
                // The wake-up connection of a shutdown is no frontend.
                _ if self.stopping.load(Ordering::Acquire) => {}
                Ok(()) => tracing::info!(export = %name, "vhost-user frontend disconnected"),
                Err(err) => {
                    tracing::warn!(export = %name, %err, "vhost-user session ended with an error")
                }
            }
        }
        Ok(())
    }

    /// Ends the session being served and makes [`Server::serve`] return; the socket file is
    /// removed.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        if let Some(session) = self.current.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            session.shutdown();
        }
        // A serve loop waiting in accept is woken by a connection of our own, which it
        // then drops.
        let _ = std::os::unix::net::UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}
