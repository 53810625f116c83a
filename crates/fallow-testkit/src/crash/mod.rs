//! Crash-state enumeration: record what reaches a backing store, work out every state a
//! crash could leave it in, and check each against what the client was told.
//!
//! # Components
//! [`RecordingStore`]: a backing store wrapper that logs every completed WRITE (with its
//! data and FUA), WRITE_ZEROES, TRIM and FLUSH, stamped with a shared [`Clock`].
//! [`Replayer`]: the crash points of a log and the states at each (durable prefix, all
//! completed, random subsets in random orders real time allows). [`History`] and
//! [`CellChecker`]: a client that writes stamped cells, and the check that a state lost
//! nothing the client was told was durable and holds nothing never written.
//! `docs/reliability.md` ("Crash states") describes the tests built on them.

pub mod cells;
pub mod recorder;
pub mod states;

pub use cells::{CellChecker, ClientKind, History, CELL};
pub use recorder::{Clock, RecordingStore, StoreOp, StoreOpKind};
pub use states::{Choice, Replayer};
