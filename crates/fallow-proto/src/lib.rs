//! fallow's wire formats as sans-io codecs: they read and fill byte buffers and never touch
//! a socket or a runtime, so the node, the client library, the benchmarks and the fuzz
//! tests share one implementation.
//!
//! # Components
//! [`fallow`]: the node protocol (`docs/protocol.md` is its normative specification).
//! [`nbd`]: the NBD protocol, fixed-newstyle handshake and transmission, for the server
//! and for the upstream client (NetworkBlockDevice/nbd `doc/proto.md` is normative).

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

pub mod fallow;
pub mod nbd;
