//! The log: to stderr, filtered by `FALLOW_LOG` (tracing's `EnvFilter` syntax: `info`,
//! `fallow_node=debug,warn`, …), else by a daemon's config file (`log = "…"`), else the
//! command's default. The filter sits behind a reload handle so that a daemon can change
//! it on SIGHUP.

use std::sync::OnceLock;

use anyhow::Context;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

/// The environment variable that sets the filter, and wins over any file.
pub const ENV: &str = "FALLOW_LOG";

static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Installs the global subscriber: `FALLOW_LOG` if set, else `default_level`.
pub fn init(default_level: &str) {
    let filter = EnvFilter::try_from_env(ENV).unwrap_or_else(|_| EnvFilter::new(default_level));
    let (filter, handle) = reload::Layer::new(filter);
    let output = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    tracing_subscriber::registry().with(filter).with(output).init();
    let _ = FILTER.set(handle);
}

/// True when `FALLOW_LOG` decides the filter (a config file's `log` is then ignored).
pub fn set_by_environment() -> bool {
    std::env::var_os(ENV).is_some()
}

/// Replaces the filter with `spec` (`EnvFilter` syntax).
pub fn set_filter(spec: &str) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(spec).with_context(|| format!("log = {spec:?}"))?;
    let handle = FILTER.get().context("the log is not set up")?;
    handle.reload(filter).context("changing the log filter")?;
    Ok(())
}

/// The end of a config reload (SIGHUP): the settings that wait for a restart, in one
/// warning, and what was applied (or that nothing was), in one line; `daemon` names the
/// process in the warning ("node", "server").
pub fn report_reload(daemon: &str, applied: &[String], waiting: &[String]) {
    if !waiting.is_empty() {
        tracing::warn!(
            settings = %waiting.join(", "),
            "changed in the config file; they take effect when the {daemon} restarts"
        );
    }
    let applied = if applied.is_empty() { "nothing".to_string() } else { applied.join("; ") };
    tracing::info!(%applied, "config reloaded");
}

/// Applies a reloaded file's `log` filter (unless `FALLOW_LOG` decides it); says so in
/// `applied`, or logs why the old filter stays.
pub fn reload_filter(spec: &str, applied: &mut Vec<String>) {
    if set_by_environment() {
        return;
    }
    match set_filter(spec) {
        Ok(()) => applied.push(format!("log {spec}")),
        Err(err) => tracing::error!(error = %format!("{err:#}"), "the log filter stays"),
    }
}
