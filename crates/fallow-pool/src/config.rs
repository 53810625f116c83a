//! How an engine is configured: a validated builder (STYLE rule 12).

use std::time::Duration;

use crate::eviction;

/// What is wrong with an engine configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `--policy` names no policy we ship.
    #[error("unknown eviction policy {0:?} (known: {known})", known = eviction::POLICY_NAMES.join(", "))]
    UnknownPolicy(String),
    /// The shard count must be a power of two between 1 and 1024.
    #[error("shard count {0} is not a power of two between 1 and 1024")]
    BadShardCount(usize),
    /// Entries per frame must be at least 1.
    #[error("entries per frame must be at least 1")]
    BadEntriesPerFrame,
    /// More than [`MAX_BUDGET_BYTES`] to lend.
    #[error("a budget of {0} bytes is more than the {MAX_BUDGET_BYTES} one engine can address")]
    BudgetTooLarge(usize),
}

/// The most one engine can lend, 2 TiB: frame numbers are content ids and stay below 2³⁰
/// (`arena.rs`), and half of them are kept free so that segment numbers released by a
/// shrink can drain before they are reused. It is also what 8 index shards can hold
/// (`shard::MAX_PAGES`).
pub const MAX_BUDGET_BYTES: usize = (1 << 29) * fallow_core::PAGE_SIZE;

/// A validated engine configuration.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Bytes of page data the engine may hold (the lent budget).
    pub budget_bytes: usize,
    /// Index shards (a power of two).
    pub shards: usize,
    /// Eviction policy for ephemeral pages.
    pub policy: &'static str,
    /// Index entries allowed per budget frame: bounds the metadata of pages that cost no
    /// frame (fill pages, dedup sharers).
    pub entries_per_frame: usize,
    /// How often background compression runs; `None` for never (callers may still call
    /// `Engine::compress_cold`).
    pub compress_interval: Option<Duration>,
    /// Pages compressed per background pass (bounds how long the store lock is held).
    pub compress_batch: usize,
}

/// Builds an [`EngineConfig`].
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    budget_bytes: usize,
    shards: Option<usize>,
    policy: String,
    entries_per_frame: usize,
    compress_interval: Option<Duration>,
    compress_batch: usize,
}

impl EngineBuilder {
    /// An engine that may hold `budget_bytes` of pages (rounded down to whole pages).
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget_bytes,
            shards: None,
            policy: eviction::DEFAULT_POLICY.to_string(),
            entries_per_frame: 4,
            compress_interval: Some(Duration::from_millis(100)),
            compress_batch: 32,
        }
    }

    /// Index shards; defaults to 4 × the CPUs, rounded up to a power of two. Use 1 for an
    /// exact global eviction order (trace replay).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// Eviction policy by name (`eviction::POLICY_NAMES`).
    pub fn policy(mut self, name: &str) -> Self {
        self.policy = name.to_string();
        self
    }

    /// Index entries allowed per budget frame (default 4).
    pub fn entries_per_frame(mut self, n: usize) -> Self {
        self.entries_per_frame = n;
        self
    }

    /// Background compression period (default 100 ms); `None` turns the thread off.
    pub fn compress_interval(mut self, every: Option<Duration>) -> Self {
        self.compress_interval = every;
        self
    }

    /// Pages compressed per background pass (default 32).
    pub fn compress_batch(mut self, n: usize) -> Self {
        self.compress_batch = n.max(1);
        self
    }

    /// Checks the configuration.
    pub fn build(self) -> Result<EngineConfig, ConfigError> {
        let shards = self.shards.unwrap_or_else(|| {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cpus * 4).next_power_of_two().min(256)
        });
        if !shards.is_power_of_two() || shards > 1024 {
            return Err(ConfigError::BadShardCount(shards));
        }
        let policy = eviction::POLICY_NAMES
            .iter()
            .copied()
            .find(|&n| n == self.policy)
            .ok_or(ConfigError::UnknownPolicy(self.policy))?;
        if self.entries_per_frame == 0 {
            return Err(ConfigError::BadEntriesPerFrame);
        }
        if self.budget_bytes > MAX_BUDGET_BYTES {
            return Err(ConfigError::BudgetTooLarge(self.budget_bytes));
        }
        Ok(EngineConfig {
            budget_bytes: self.budget_bytes,
            shards,
            policy,
            entries_per_frame: self.entries_per_frame,
            compress_interval: self.compress_interval,
            compress_batch: self.compress_batch,
        })
    }
}
