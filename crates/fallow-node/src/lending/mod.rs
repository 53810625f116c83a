//! How much memory the node lends: a fixed size (`--lend 4GiB`), or `auto`, following the
//! host. In `auto`, a governor thread samples MemAvailable, memory PSI and the cgroup v2
//! limit every 25 ms, keeps a reserve free for the host, shrinks the engine's budget at once
//! when the host needs memory (ephemeral pages go first, whole 2 MiB segments go back to
//! the OS) and grows it back gradually once the pressure is over. Every change is logged
//! and counted. The rule, its inputs and defaults are in `docs/governor.md`.
//!
//! ```no_run
//! use std::sync::Arc;
//! use fallow_node::lending::{Governor, LendMode};
//! use fallow_pool::{Engine, EngineBuilder};
//!
//! let engine = Arc::new(Engine::new(EngineBuilder::new(0).build().unwrap()));
//! let mode: LendMode = "auto".parse().unwrap();
//! let governor = Governor::start(engine, &mode).unwrap();
//! println!("lending {} bytes", governor.status().budget_bytes);
//! ```
//!
//! # Components
//! [`mode`]: [`LendMode`] and the size syntax of `--lend`.
//! [`host`]: [`HostMemory`] samples from a [`MemorySource`] ([`ProcSource`], or a
//! [`SimulatedSource`] in tests). [`procfs`]: the pure parsers behind [`ProcSource`].
//! [`decide`]: the rule itself ([`Decider`], [`AutoConfig`]), pure and unit-tested.
//! [`governor`]: the thread that applies it ([`Governor`], [`GovernorHandle`],
//! [`GovernorStatus`]).

pub mod decide;
pub mod governor;
pub mod host;
pub mod mode;
pub mod procfs;

pub use decide::{AutoConfig, AutoConfigError, Decider, Decision, Reason};
pub use governor::{BudgetChange, Governor, GovernorError, GovernorHandle, GovernorStatus};
pub use host::{CgroupMemory, HostMemory, MemorySource, ProcSource, SimulatedSource};
pub use mode::{format_size, parse_size, LendMode, SizeParseError};
