//! Fencing: a request a client gave up on never takes effect after the client's later
//! requests.
//!
//! A client that times out a request closes that connection and goes on, but the node may
//! not have read the request yet: a starved or paused node reads it later, from its socket
//! buffer, and would apply, say, an old PUT over the page the client put next. So each
//! connection of a client says in HELLO where it stands in the client's session (a random
//! session id, a connection number, and `fence_below`, docs/protocol.md §3.4). Before the
//! node answers a connection's AUTH, it stops every connection of that session numbered
//! below `fence_below`: a stopped connection runs no request it has not begun, and the node
//! waits for the requests those connections are running (on blocking threads, forwarded to
//! peers) to end. The client sends nothing on the new connection before the AUTH reply, so
//! whatever it sends next lands after every request it gave up on, or instead of it.
//!
//! # Locking
//! `Sessions::table` (a `parking_lot::Mutex`) is held to register, fence or forget a
//! connection, never across `.await` and with no other lock. A [`Gate`] is lock-free: a
//! request raises `busy` and then reads `fenced`; a fence sets `fenced` and then reads
//! `busy` (both `SeqCst`), so either the request sees the fence and does not run, or the
//! fence sees the request and waits for it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use fallow_proto::fallow::Session;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The sessions of every client, by (client id, session id).
#[derive(Debug, Default, Clone)]
pub(crate) struct Sessions {
    table: Arc<Mutex<HashMap<(u128, u64), Members>>>,
}

/// A session's live connections.
#[derive(Debug, Default)]
struct Members {
    /// Connections numbered below this are fenced; a later registration below it is stale.
    floor: u32,
    /// Each live connection's number and gate.
    connections: Vec<(u32, Arc<Gate>)>,
}

/// One connection's gate: requests pass while it is open; a fence closes it and waits for
/// the requests that passed.
#[derive(Debug)]
pub(crate) struct Gate {
    fenced: AtomicBool,
    busy: AtomicUsize,
    idle: Notify,
    /// Cancelled by the fence, so the connection stops reading and closes.
    stop: CancellationToken,
}

/// A request that passed a gate; the fence waits until it is dropped.
#[derive(Debug)]
pub(crate) struct Busy(Arc<Gate>);

/// Why a connection cannot join its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("connection {epoch} of this session is older than its fence ({floor})")]
pub(crate) struct Stale {
    epoch: u32,
    floor: u32,
}

/// A connection's place in its session, given up when dropped (the connection closed).
#[derive(Debug)]
pub(crate) struct Registration {
    sessions: Sessions,
    key: (u128, u64),
    gate: Arc<Gate>,
}

impl Gate {
    fn new(stop: CancellationToken) -> Gate {
        Gate {
            fenced: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            idle: Notify::new(),
            stop,
        }
    }

    /// Lets a request through, unless the connection is fenced.
    pub(crate) fn enter(self: &Arc<Self>) -> Option<Busy> {
        self.busy.fetch_add(1, Ordering::SeqCst);
        let busy = Busy(self.clone());
        if self.fenced.load(Ordering::SeqCst) {
            return None;
        }
        Some(busy)
    }

    /// Closes the gate and tells the connection to stop.
    fn fence(&self) {
        self.fenced.store(true, Ordering::SeqCst);
        self.stop.cancel();
    }

    /// Waits until no request that passed the gate is running.
    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.busy.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// True when no request that passed the gate is running.
    pub(crate) fn is_idle(&self) -> bool {
        self.busy.load(Ordering::SeqCst) == 0
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Sessions {
    /// Registers a connection of `client_id` at `session` (its gate cancels `stop` when
    /// fenced), and fences the session's connections numbered below `session.fence_below`.
    /// Returns the registration and the gates fenced, whose running requests the caller
    /// waits for before it answers AUTH.
    pub(crate) fn join(
        &self,
        client_id: u128,
        session: Session,
        stop: CancellationToken,
    ) -> Result<(Registration, Vec<Arc<Gate>>), Stale> {
        let key = (client_id, session.id);
        let mut table = self.table.lock();
        let members = table.entry(key).or_default();
        if session.epoch < members.floor {
            let floor = members.floor;
            if members.connections.is_empty() {
                table.remove(&key);
            }
            return Err(Stale { epoch: session.epoch, floor });
        }
        // A connection never fences itself, whatever its fence says.
        members.floor = members.floor.max(session.fence_below.min(session.epoch));
        let floor = members.floor;
        let fenced: Vec<Arc<Gate>> = members
            .connections
            .iter()
            .filter(|(epoch, _)| *epoch < floor)
            .map(|(_, gate)| gate.clone())
            .collect();
        fenced.iter().for_each(|gate| gate.fence());
        let gate = Arc::new(Gate::new(stop));
        members.connections.push((session.epoch, gate.clone()));
        Ok((Registration { sessions: self.clone(), key, gate }, fenced))
    }

    /// How many sessions have live connections.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().len()
    }
}

impl Registration {
    /// The connection's gate.
    pub(crate) fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut table = self.sessions.table.lock();
        let Some(members) = table.get_mut(&self.key) else { return };
        members.connections.retain(|(_, gate)| !Arc::ptr_eq(gate, &self.gate));
        // With no connection left nothing can run late, so the floor is forgotten too: a
        // connection that joins later below it never had a request answered (it is only
        // used once AUTH is answered, which needs the join).
        if members.connections.is_empty() {
            table.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(epoch: u32, fence_below: u32) -> Session {
        Session { id: 9, epoch, fence_below }
    }

    #[test]
    fn a_connection_fences_the_older_ones_of_its_session_only() {
        let sessions = Sessions::default();
        let (first, stop1, stop2) =
            (CancellationToken::new(), CancellationToken::new(), CancellationToken::new());
        let (one, fenced) = sessions.join(1, session(1, 0), first.clone()).unwrap();
        assert!(fenced.is_empty());
        let (two, _) = sessions.join(1, session(2, 0), stop1.clone()).unwrap();
        // Another client, and another session of the same client, are left alone.
        let (other_client, _) = sessions.join(2, session(1, 0), CancellationToken::new()).unwrap();
        let other_session = Session { id: 10, epoch: 1, fence_below: 0 };
        let (other, _) = sessions.join(1, other_session, CancellationToken::new()).unwrap();
        let (three, fenced) = sessions.join(1, session(3, 3), stop2.clone()).unwrap();
        assert_eq!(fenced.len(), 2);
        assert!(first.is_cancelled() && stop1.is_cancelled() && !stop2.is_cancelled());
        assert!(one.gate().enter().is_none() && two.gate().enter().is_none());
        assert!(three.gate().enter().is_some());
        assert!(other.gate().enter().is_some() && other_client.gate().enter().is_some());
        // A connection that joins below the fence is stale; one that fences above its own
        // number does not fence itself.
        assert_eq!(
            sessions.join(1, session(2, 0), CancellationToken::new()).unwrap_err(),
            Stale { epoch: 2, floor: 3 }
        );
        let (four, _) = sessions.join(1, session(4, 9), CancellationToken::new()).unwrap();
        assert!(four.gate().enter().is_some() && three.gate().enter().is_none());
        drop((one, two, three, four, other, other_client));
        assert_eq!(sessions.len(), 0, "a session is forgotten with its last connection");
    }

    #[tokio::test]
    async fn a_fence_waits_for_the_requests_under_way() {
        let sessions = Sessions::default();
        let (old, _) = sessions.join(1, session(1, 0), CancellationToken::new()).unwrap();
        let running = old.gate().enter().unwrap();
        let (_new, fenced) = sessions.join(1, session(2, 2), CancellationToken::new()).unwrap();
        assert!(!fenced[0].is_idle());
        assert!(old.gate().enter().is_none(), "no request starts once fenced");
        let wait = tokio::spawn(async move { fenced[0].idle().await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!wait.is_finished(), "the fence waits for the running request");
        drop(running);
        tokio::time::timeout(std::time::Duration::from_secs(5), wait).await.unwrap().unwrap();
    }
}
