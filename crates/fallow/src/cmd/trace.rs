//! `fallow trace replay` and `fallow trace sweep`: real traces through the real engine.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use fallow_bench::replay::{replay, sizes_at, ReplayResult};
use fallow_bench::trace::{self, PageAccess, TraceFormat, TraceOptions};
use fallow_pool::eviction::{DEFAULT_POLICY, POLICY_NAMES};

/// Trace subcommands.
#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// Replay one trace through an ephemeral pool of N pages and print its miss ratio.
    ///
    /// Every access is a get; a miss is followed by a put (write-allocate). A block
    /// request is one access to every 4 KiB page it overlaps. The default policy's
    /// simulations sample keys by hash; FALLOW_SIM_SEED=N samples others, to see how much
    /// a result depends on the sample. Policies with a small queue print the share it
    /// ended with; FALLOW_LOG=fallow_pool::eviction=debug logs each epoch of the
    /// simulations that move it (their decayed misses and the share that follows).
    Replay {
        #[command(flatten)]
        input: TraceInput,
        /// Cache size, in 4 KiB pages (at most 16,777,215: one index shard, so that the
        /// eviction order is the policy's global order).
        #[arg(long)]
        cache_pages: usize,
        /// Eviction policy.
        #[arg(long, default_value = DEFAULT_POLICY, value_parser = clap::builder::PossibleValuesParser::new(POLICY_NAMES))]
        policy: String,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Replay one trace at several cache sizes (percent of its distinct pages) under every
    /// policy, and print the miss-ratio table.
    Sweep {
        #[command(flatten)]
        input: TraceInput,
        /// Cache sizes, in percent of the trace's distinct pages.
        #[arg(long, value_delimiter = ',', default_value = "1,5,10,25")]
        percents: Vec<f64>,
        /// Cache sizes in pages, instead of percents (for example a reference table's).
        #[arg(long, value_delimiter = ',', conflicts_with = "percents")]
        cache_sizes: Vec<usize>,
        /// Policies to compare.
        #[arg(long, value_delimiter = ',', default_values_t = POLICY_NAMES.iter().map(|s| s.to_string()))]
        policies: Vec<String>,
        /// Print one JSON object per row instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List the eviction policies (the default first).
    Policies {
        /// Print only the default policy's name.
        #[arg(long)]
        default: bool,
    },
}

/// Which trace, and how to read it.
#[derive(Debug, Args)]
pub struct TraceInput {
    /// The trace file; .gz, .xz, .zst and .bz2 are decompressed on the fly.
    file: PathBuf,
    /// Its format: vscsi, arc, lirs, lirs2, tencent, msr, systor.
    #[arg(long)]
    format: TraceFormat,
    /// Block size in bytes, for formats counted in blocks (arc: default 512; 4096 makes
    /// each line one page).
    #[arg(long)]
    block_size: Option<u32>,
    /// Replay reads only (writes are skipped, not counted).
    #[arg(long)]
    reads_only: bool,
}

impl TraceInput {
    fn options(&self) -> TraceOptions {
        let mut opts = TraceOptions::new(self.format);
        opts.block_size = self.block_size;
        opts.reads_only = self.reads_only;
        opts
    }

    fn open(&self) -> anyhow::Result<trace::TraceReader> {
        // The error names the file and the reason.
        Ok(trace::open(&self.file, &self.options())?)
    }
}

/// Runs a trace subcommand.
pub fn run(command: TraceCommand) -> anyhow::Result<()> {
    match command {
        TraceCommand::Replay { input, cache_pages, policy, json } => {
            let result = replay(input.open()?, cache_pages, &policy)?;
            print_replay(&input, &result, json)
        }
        TraceCommand::Sweep { input, percents, cache_sizes, policies, json } => {
            let sizes = Sizes { percents, pages: cache_sizes };
            sweep(&input, &sizes, &policies, json)
        }
        TraceCommand::Policies { default } => {
            println!("{DEFAULT_POLICY}");
            if !default {
                POLICY_NAMES.iter().filter(|&&p| p != DEFAULT_POLICY).for_each(|p| println!("{p}"));
            }
            Ok(())
        }
    }
}

fn print_replay(input: &TraceInput, r: &ReplayResult, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        println!("trace       {}", input.file.display());
        println!("policy      {}", r.policy);
        println!("cache pages {}", r.cache_pages);
        println!("accesses    {}", r.accesses);
        println!("hits        {}", r.hits);
        println!("misses      {}", r.misses);
        println!("miss ratio  {:.4}", r.miss_ratio);
        if let Some(percent) = r.small_share_percent {
            println!("small share {percent} % at the end");
        }
    }
    Ok(())
}

/// Cache sizes for a sweep: explicit pages if any, else percents of the distinct pages.
struct Sizes {
    percents: Vec<f64>,
    pages: Vec<usize>,
}

fn sweep(input: &TraceInput, sizes: &Sizes, policies: &[String], json: bool) -> anyhow::Result<()> {
    for p in policies {
        anyhow::ensure!(POLICY_NAMES.contains(&p.as_str()), "unknown policy {p:?}");
    }
    // Read the trace once; every replay then runs from memory.
    let pages: Vec<u64> = input.open()?.map(|a| a.map(|a| a.page)).collect::<Result<_, _>>()?;
    let sizes = if sizes.pages.is_empty() {
        let mut distinct = pages.clone();
        distinct.sort_unstable();
        distinct.dedup();
        sizes_at(distinct.len() as u64, &sizes.percents)
    } else {
        sizes.pages.clone()
    };
    let name = input.file.display().to_string();
    if !json {
        println!("{name}: {} accesses", pages.len());
        print!("{:>10}", "pages");
        policies.iter().for_each(|p| print!(" {p:>9}"));
        println!();
    }
    for &size in &sizes {
        if !json {
            print!("{size:>10}");
        }
        for policy in policies {
            let accesses = pages.iter().map(|&page| Ok(PageAccess { page, write: false }));
            let r = replay(accesses, size, policy)?;
            if json {
                let row = serde_json::json!({
                    "trace": name, "policy": r.policy, "cache_pages": size,
                    "accesses": r.accesses, "misses": r.misses, "miss_ratio": r.miss_ratio,
                });
                println!("{row}");
            } else {
                print!(" {:>9.4}", r.miss_ratio);
                std::io::stdout().flush()?;
            }
        }
        if !json {
            println!();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_help_gives_the_most_pages_a_replay_takes() {
        // `--cache-pages`' help writes the number out; it must follow the constant.
        assert_eq!(fallow_pool::MAX_SHARD_PAGES, 16_777_215, "update --cache-pages' help");
    }
}
