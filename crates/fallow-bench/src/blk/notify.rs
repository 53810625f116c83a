//! Notifications: the eventfds behind kicks (driver → device) and calls (device → driver),
//! and waiting on several of them at once, with a timeout.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use vmm_sys_util::eventfd::EventFd;

/// One eventfd, non-blocking.
#[derive(Debug)]
pub struct Event(EventFd);

impl Event {
    /// A new eventfd with its counter at 0.
    pub fn new() -> io::Result<Event> {
        EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map(Event)
    }

    /// A second handle on the same eventfd (for the null device's thread).
    pub fn try_clone(&self) -> io::Result<Event> {
        self.0.try_clone().map(Event)
    }

    /// The eventfd itself, as vhost-user's SET_VRING_KICK/CALL take it.
    pub fn eventfd(&self) -> &EventFd {
        &self.0
    }

    /// Signals (adds 1 to the counter).
    pub fn signal(&self) -> io::Result<()> {
        self.0.write(1)
    }

    /// Resets the counter; whether it had been signalled.
    pub fn drain(&self) -> bool {
        // Non-blocking: EAGAIN when the counter is 0.
        self.0.read().is_ok()
    }
}

impl AsFd for Event {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `self.0` owns this descriptor and keeps it open for as long as `self`
        // lives, which bounds the borrow's lifetime; nothing closes it meanwhile.
        unsafe { BorrowedFd::borrow_raw(self.0.as_raw_fd()) }
    }
}

/// Waits until one of `fds` is readable (or hung up), or `timeout` passes. Returns which
/// were ready; all `false` after a timeout or a signal.
pub fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Duration) -> io::Result<Vec<bool>> {
    let flags = PollFlags::IN | PollFlags::RDHUP;
    let mut polled: Vec<PollFd<'_>> = fds.iter().map(|fd| PollFd::new(fd, flags)).collect();
    let timeout = Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    match poll(&mut polled, Some(&timeout)) {
        Ok(_) => Ok(polled.iter().map(|p| !p.revents().is_empty()).collect()),
        Err(rustix::io::Errno::INTR) => Ok(vec![false; fds.len()]),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_wakes_the_waiter_once() {
        let (a, b) = (Event::new().unwrap(), Event::new().unwrap());
        let none = wait_readable(&[a.as_fd(), b.as_fd()], Duration::from_millis(1)).unwrap();
        assert_eq!(none, [false, false]);
        b.try_clone().unwrap().signal().unwrap();
        let ready = wait_readable(&[a.as_fd(), b.as_fd()], Duration::from_secs(5)).unwrap();
        assert_eq!(ready, [false, true]);
        assert!(b.drain() && !b.drain() && !a.drain());
    }
}
