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
    /// More pages in the budget than the shards asked for can index.
    #[error(
        "{shards} shards index at most {max} pages ({} bytes), fewer than a budget of {budget} \
         bytes holds: use {needed} shards or more",
        max * fallow_core::PAGE_SIZE
    )]
    TooFewShards {
        /// Shards asked for.
        shards: usize,
        /// The pages they can index.
        max: usize,
        /// The budget.
        budget: usize,
        /// The fewest shards that can index it.
        needed: usize,
    },
}

/// The most one engine can lend, 2 TiB: frame numbers are content ids and stay below 2³⁰
/// (`arena.rs`), and half of them are kept free so that segment numbers released by a
/// shrink can drain before they are reused. 64 index shards can hold it
/// (`shard::MAX_PAGES` each).
pub const MAX_BUDGET_BYTES: usize = (1 << 29) * fallow_core::PAGE_SIZE;

/// The fewest pages a default shard is given of the most its engine may lend (64 MiB),
/// unless that leaves fewer than 4 shards. A shard's arrays are sized for its share of
/// the pages, and that share varies: objects smaller than a run per shard whose ids are
/// hashes land on some shards and not others (`hashing::shard_of`). Full shards outgrow
/// their arrays, and the arrays they outgrew stay resident in the heap though no table
/// holds them; small shards also waste a part of a page per array. The engine's own
/// figure counts neither. Resident metadata a page of a full 256 MiB ephemeral pool
/// (`FALLOW_BENCH_SHARDS=N target/release/deps/memory-* --case ephemeral`):
/// 31.5 B in 4 shards, 31.8 B in 8, 33.8 B in 16, 40.4 B in 64 and 44.9 B in 256, against
/// 29.9–32.0 B reported. A host of 64 CPUs had 256 shards by default before this bound,
/// and 62.7 B a page then (its spans also reserved more; `spans.rs`).
pub const MIN_SHARD_PAGES: usize = 1 << 14;

/// Shards a default engine has however small its budget, CPUs allowing: two threads
/// calling one engine of a single shard took 0.84–0.85 µs a get, 0.53–0.57 µs in 4 shards
/// and 0.57 µs in 8 (`FALLOW_BENCH_SHARDS=N cargo bench -p fallow-pool --bench engine --
/// 2threads/get_hit.get_hit`, 64 MiB, this repository's 2-CPU machine).
const FEW_SHARDS: usize = 4;

/// The default shard count for `cpus` CPUs and an engine that may lend up to `most_pages`
/// pages, of which `needed` shards can index all: 4 per CPU, for fewer threads waiting
/// on one shard's lock, but no more than leave each [`MIN_SHARD_PAGES`] (or
/// [`FEW_SHARDS`] in all), and never fewer than needed. A power of two.
fn default_shards(cpus: usize, most_pages: usize, needed: usize) -> usize {
    let by_cpus = (cpus.max(1) * 4).next_power_of_two().min(256);
    let by_pages = (most_pages / MIN_SHARD_PAGES).max(1);
    // The largest power of two at most `by_pages`.
    let by_pages = 1 << by_pages.ilog2();
    by_cpus.min(by_pages.max(FEW_SHARDS)).max(needed)
}

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
    budget_up_to: usize,
    shards: Option<usize>,
    threads: Option<usize>,
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
            budget_up_to: 0,
            shards: None,
            threads: None,
            policy: eviction::DEFAULT_POLICY.to_string(),
            entries_per_frame: 4,
            compress_interval: Some(Duration::from_millis(100)),
            compress_batch: 32,
        }
    }

    /// The most the budget may grow to while the engine runs ([`crate::Engine::set_budget`]),
    /// if more than it starts with: the default shard count covers it too. A node that
    /// starts lending nothing passes its host's memory.
    pub fn budget_up_to(mut self, bytes: usize) -> Self {
        self.budget_up_to = bytes;
        self
    }

    /// Index shards; defaults to 4 × the CPUs, rounded up to a power of two (at most 256),
    /// but no more than give each shard [`MIN_SHARD_PAGES`] of the most the budget may
    /// reach, or more if the budget needs them: a shard indexes at most 2²⁴ − 1 pages
    /// (64 GiB), and fewer shards than the budget needs is an error. Use 1 for an exact
    /// global eviction order (trace replay).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// How many threads may call the engine at once, for the default shard count (4 a
    /// thread); defaults to the CPUs this process may run on.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = Some(threads);
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
        if self.budget_bytes > MAX_BUDGET_BYTES {
            return Err(ConfigError::BudgetTooLarge(self.budget_bytes));
        }
        // A shard indexes at most `MAX_PAGES` pages (its slot ids fit 24-bit links).
        let shards_for = |bytes: usize| {
            let pages = bytes.min(MAX_BUDGET_BYTES) / fallow_core::PAGE_SIZE;
            pages.div_ceil(crate::shard::MAX_PAGES).next_power_of_two()
        };
        let needed = shards_for(self.budget_bytes);
        let shards = self.shards.unwrap_or_else(|| {
            let cpus = self
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let most = self.budget_bytes.max(self.budget_up_to).min(MAX_BUDGET_BYTES);
            default_shards(cpus, most / fallow_core::PAGE_SIZE, shards_for(most))
        });
        if !shards.is_power_of_two() || shards > 1024 {
            return Err(ConfigError::BadShardCount(shards));
        }
        if shards < needed {
            let max = shards * crate::shard::MAX_PAGES;
            return Err(ConfigError::TooFewShards {
                shards,
                max,
                budget: self.budget_bytes,
                needed,
            });
        }
        let policy = eviction::POLICY_NAMES
            .iter()
            .copied()
            .find(|&n| n == self.policy)
            .ok_or(ConfigError::UnknownPolicy(self.policy))?;
        if self.entries_per_frame == 0 {
            return Err(ConfigError::BadEntriesPerFrame);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::MAX_PAGES;
    use fallow_core::PAGE_SIZE;

    #[test]
    fn the_default_shards_index_the_whole_budget() {
        let config = EngineBuilder::new(MAX_BUDGET_BYTES).build().unwrap();
        assert!(config.shards * MAX_PAGES * PAGE_SIZE >= MAX_BUDGET_BYTES, "{}", config.shards);
        let small = EngineBuilder::new(1 << 30).build().unwrap();
        assert!(small.shards <= 256, "{}", small.shards);
        // An engine that starts empty and grows (a node) is sized for where it may go.
        let growing = EngineBuilder::new(0).budget_up_to(MAX_BUDGET_BYTES).build().unwrap();
        assert_eq!(growing.shards, config.shards);
        let beyond = EngineBuilder::new(0).budget_up_to(usize::MAX).build().unwrap();
        assert_eq!(beyond.shards, config.shards, "past the most an engine lends, that most");
    }

    #[test]
    fn default_shards_leave_each_at_least_its_minimum_of_pages() {
        const GIB: usize = (1 << 30) / PAGE_SIZE;
        // Four a CPU when the budget is large enough for them.
        assert_eq!(default_shards(2, 64 * GIB, 1), 8);
        assert_eq!(default_shards(3, 64 * GIB, 1), 16);
        assert_eq!(default_shards(64, 64 * GIB, 1), 256);
        assert_eq!(default_shards(1024, 1024 * GIB, 16), 256);
        // A host of many CPUs lending little gets fewer, larger shards.
        assert_eq!(default_shards(64, GIB / 4, 1), 4);
        assert_eq!(default_shards(64, GIB, 1), 16);
        assert_eq!(default_shards(64, 3 * GIB, 1), 32, "a power of two, rounded down");
        assert_eq!(default_shards(64, 1000, 1), 4, "a few however small the budget");
        assert_eq!(default_shards(0, 0, 1), 4);
        // Never fewer than index the budget.
        assert_eq!(default_shards(1, 2048 * GIB, 32), 32);
        // The builder's threads stand for the CPUs.
        let built = |threads, bytes| {
            EngineBuilder::new(bytes).threads(threads).build().map(|c| c.shards).unwrap()
        };
        assert_eq!(built(64, 256 << 20), 4);
        assert_eq!(built(64, 16 << 20), 4);
        assert_eq!(built(64, 64 << 30), 256);
        assert_eq!(built(2, 64 << 30), 8);
        for (cpus, pages) in [(64, GIB / 4), (64, 5 * GIB), (8, 100 * GIB)] {
            let shards = default_shards(cpus, pages, 1);
            assert!(pages / shards >= MIN_SHARD_PAGES, "{cpus} CPUs, {pages} pages: {shards}");
        }
    }

    #[test]
    fn too_few_shards_for_the_budget_are_refused_with_how_many_it_needs() {
        let budget = (MAX_PAGES + 1) * PAGE_SIZE;
        let err = EngineBuilder::new(budget).shards(1).build().unwrap_err();
        assert_eq!(err, ConfigError::TooFewShards { shards: 1, max: MAX_PAGES, budget, needed: 2 });
        assert!(err.to_string().contains("use 2 shards or more"), "{err}");
        assert!(EngineBuilder::new(budget).shards(2).build().is_ok());
        assert!(EngineBuilder::new(MAX_PAGES * PAGE_SIZE).shards(1).build().is_ok());
    }

    #[test]
    fn bad_builders_are_refused() {
        assert_eq!(
            EngineBuilder::new(1 << 20).shards(3).build().unwrap_err(),
            ConfigError::BadShardCount(3)
        );
        assert_eq!(
            EngineBuilder::new(MAX_BUDGET_BYTES + PAGE_SIZE).build().unwrap_err(),
            ConfigError::BudgetTooLarge(MAX_BUDGET_BYTES + PAGE_SIZE)
        );
        // Too large says so, whatever the shards.
        assert_eq!(
            EngineBuilder::new(MAX_BUDGET_BYTES + PAGE_SIZE).shards(1).build().unwrap_err(),
            ConfigError::BudgetTooLarge(MAX_BUDGET_BYTES + PAGE_SIZE)
        );
        assert!(EngineBuilder::new(1 << 20).policy("fifo-ish").build().is_err());
        assert_eq!(
            EngineBuilder::new(1 << 20).entries_per_frame(0).build().unwrap_err(),
            ConfigError::BadEntriesPerFrame
        );
    }
}
