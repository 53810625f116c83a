//! A client's session with one node (docs/protocol.md §3.4): the connections it opens are
//! numbered, and each says in HELLO below which number the node must fence.
//!
//! A request given up on (timed out, or in flight when its connection failed) may still
//! reach the node and take effect later, after requests this client sends next. So giving
//! up raises the fence past every connection opened so far: none of them is used again,
//! and the next connection opened carries the fence, which the node applies (stopping the
//! old connections and waiting for what they run) before it answers AUTH. Whatever the
//! client sends after that lands after the request it gave up on, or instead of it.

use std::sync::atomic::{AtomicU32, Ordering};

use fallow_proto::fallow::Session;
use parking_lot::Mutex;

/// The numbering of one client's connections to one node. A cluster client keeps it
/// across the client objects it makes for a node it retires and adopts again
/// ([`crate::Client::connect_in`]).
#[derive(Debug)]
pub(crate) struct Numbering {
    id: u64,
    /// The next connection's number and the fence, changed together: a connection that
    /// took its number after a give-up also carries that give-up's fence.
    numbers: Mutex<Numbers>,
    /// `numbers.fence_below`, read without the lock on every request.
    fence_below: AtomicU32,
}

#[derive(Debug)]
struct Numbers {
    next: u32,
    fence_below: u32,
}

impl Numbering {
    /// A new session, with a random id (two client objects sharing a client id stay
    /// apart).
    pub(crate) fn new() -> Numbering {
        Numbering {
            id: rand::random(),
            numbers: Mutex::new(Numbers { next: 1, fence_below: 0 }),
            fence_below: AtomicU32::new(0),
        }
    }

    /// The place of a connection about to be opened.
    pub(crate) fn next(&self) -> Session {
        let mut numbers = self.numbers.lock();
        let epoch = numbers.next;
        numbers.next = numbers.next.saturating_add(1);
        Session { id: self.id, epoch, fence_below: numbers.fence_below }
    }

    /// Gives up on the requests in flight: every connection opened so far is fenced.
    pub(crate) fn give_up(&self) {
        let mut numbers = self.numbers.lock();
        numbers.fence_below = numbers.next;
        self.fence_below.store(numbers.fence_below, Ordering::Release);
    }

    /// True when the connection numbered `epoch` was opened before a give-up: it must not
    /// carry new requests.
    pub(crate) fn is_fenced(&self, epoch: u32) -> bool {
        epoch < self.fence_below.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_give_up_fences_every_connection_opened_before_it_and_travels_with_the_next() {
        let sessions = Numbering::new();
        let (one, two) = (sessions.next(), sessions.next());
        assert_eq!((one.epoch, one.fence_below, two.epoch, two.fence_below), (1, 0, 2, 0));
        assert_eq!(one.id, two.id);
        assert!(!sessions.is_fenced(1) && !sessions.is_fenced(2));
        sessions.give_up();
        assert!(sessions.is_fenced(1) && sessions.is_fenced(2));
        let three = sessions.next();
        assert_eq!((three.epoch, three.fence_below), (3, 3));
        assert!(!sessions.is_fenced(3));
        assert_ne!(Numbering::new().id, one.id, "sessions are random");
    }
}
