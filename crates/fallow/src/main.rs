//! The `fallow` command: one binary for every role: `node` (lend memory), `nbd` and
//! `vhost` (serve block devices from the pool over NBD or to local QEMU guests), `up` (a
//! node and its exports in one), `stat` (a node's or an NBD server's state), `bench` (load
//! against a node, memcached or a block device) and `trace` (judge the pool's eviction
//! policies on real block-I/O traces).

use clap::{Parser, Subcommand};

mod cmd;

/// fallow pools the idle RAM of many machines into one shared, second-chance cache for
/// slow storage.
#[derive(Debug, Parser)]
#[command(name = "fallow", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmarks against a running server: `bench pages` (a fallow node or memcached),
    /// `bench blk` (a vhost-user-blk socket or an NBD export).
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    Up(cmd::up::UpArgs),
    Nbd(cmd::nbd::NbdArgs),
    Node(cmd::node::NodeArgs),
    Vhost(cmd::vhost::VhostArgs),
    Stat(cmd::stat::StatArgs),
    /// Replay real block-I/O traces through the page pool engine.
    #[command(subcommand)]
    Trace(cmd::trace::TraceCommand),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // A daemon says what it does by default; the one-shot commands only warn.
    let default_level = if matches!(
        cli.command,
        Command::Node(_) | Command::Nbd(_) | Command::Vhost(_) | Command::Up(_)
    ) {
        "info"
    } else {
        "warn"
    };
    cmd::logging::init(default_level);
    let result = match cli.command {
        Command::Up(args) => cmd::up::run(args),
        Command::Nbd(args) => cmd::nbd::run(args),
        Command::Vhost(args) => cmd::vhost::run(args),
        Command::Node(args) => cmd::node::run(args),
        Command::Stat(args) => cmd::stat::run(args),
        Command::Bench(c) => cmd::bench::run(c),
        Command::Trace(c) => cmd::trace::run(c),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fallow: {}", describe(&err));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, leaving out a cause that an outer message
/// already quotes (our library errors name their cause in their own text).
fn describe(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}
