//! `fallow nbd --config FILE`: the same settings as the flags, in TOML, plus one section per
//! export with settings of its own (`deploy/nbd/example.toml` has every key). A flag wins
//! over the file's top-level setting of the same name; an export's section wins over both
//! for that export. SIGHUP reads the file again (`nbd.rs`, `reload`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Deserialize;

use super::exports::{CacheMode, ExportArgs, ExportSettingsFile, WriteMode};
use super::tls::{NbdTlsArgs, TlsMode};

/// The config file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NbdFile {
    /// As `--listen`.
    pub listen: Option<Vec<String>>,
    /// As `--metrics`.
    pub metrics: Option<String>,
    /// The log filter; `FALLOW_LOG` wins. Changes on SIGHUP.
    pub log: Option<String>,
    /// As `--poll-us`.
    pub poll_us: Option<u64>,
    /// As `--pool`.
    pub pool: Option<String>,
    /// As `--secret-file`.
    pub secret_file: Option<PathBuf>,
    /// As `--node-tls`.
    pub node_tls: Option<PathBuf>,
    /// As `--state-dir`.
    pub state_dir: Option<PathBuf>,
    /// As `--compress`.
    pub compress: Option<bool>,
    /// As `--read-only`.
    pub read_only: Option<bool>,
    /// As `--local-tier`, for every export without its own. Changes on SIGHUP.
    pub local_tier: Option<String>,
    /// As `--mode`.
    pub mode: Option<CacheMode>,
    /// As `--write-policy`.
    pub write_policy: Option<WriteMode>,
    /// As `--max-dirty`. Changes on SIGHUP.
    pub max_dirty: Option<String>,
    /// As `--max-dirty-age`. Changes on SIGHUP.
    pub max_dirty_age_ms: Option<u64>,
    /// As `--stop-timeout`, in seconds.
    pub stop_timeout: Option<u64>,
    /// As `--tls`.
    pub tls: Option<TlsMode>,
    /// As `--tls-certificates`.
    pub tls_certificates: Option<PathBuf>,
    /// As `--tls-psk`.
    pub tls_psk: Option<PathBuf>,
    /// As `--tls-verify-peer`.
    pub tls_verify_peer: Option<bool>,
    /// The exports, by name: each its `backing` and settings of its own.
    #[serde(default)]
    pub exports: BTreeMap<String, ExportSettingsFile>,
}

impl NbdFile {
    /// Reads and checks `path`: TOML, every key known.
    pub fn load(path: &Path) -> anyhow::Result<NbdFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("config file {}", path.display()))
    }

    /// Fills what the flags left unset, and adds the file's exports to `--export`'s.
    pub fn merge_into(
        self,
        listen: &mut Vec<fallow_core::ListenAddr>,
        metrics: &mut Option<std::net::SocketAddr>,
        poll_us: &mut Option<u64>,
        exports: &mut ExportArgs,
        tls: &mut NbdTlsArgs,
    ) -> anyhow::Result<()> {
        // Each export travels on as `--export NAME=BACKING`, whose name ends at the first
        // `=`: a name holding one would be served under a shorter name, with the rest
        // taken for part of its store, and without its section's settings.
        if let Some(name) = self.exports.keys().find(|name| name.contains('=')) {
            anyhow::bail!("config file: [exports.{name:?}]: an export name cannot contain '='");
        }
        if listen.is_empty() {
            for text in self.listen.unwrap_or_default() {
                listen
                    .push(text.parse().map_err(anyhow::Error::msg).context("config file: listen")?);
            }
        }
        if metrics.is_none() {
            if let Some(text) = &self.metrics {
                let addr =
                    text.parse().with_context(|| format!("config file: metrics = {text:?}"))?;
                *metrics = Some(addr);
            }
        }
        *poll_us = poll_us.or(self.poll_us);
        let e = exports;
        e.pool = e.pool.take().or(self.pool);
        e.secret_file = e.secret_file.take().or(self.secret_file);
        e.node_tls.node_tls = e.node_tls.node_tls.take().or(self.node_tls);
        e.state_dir = e.state_dir.take().or(self.state_dir);
        e.compress |= self.compress.unwrap_or(false);
        e.read_only |= self.read_only.unwrap_or(false);
        e.local_tier = e.local_tier.take().or(self.local_tier);
        e.mode = e.mode.or(self.mode);
        e.write_policy = e.write_policy.or(self.write_policy);
        e.max_dirty = e.max_dirty.take().or(self.max_dirty);
        e.max_dirty_age = e.max_dirty_age.or(self.max_dirty_age_ms);
        e.stop_timeout = e.stop_timeout.or(self.stop_timeout);
        for (name, own) in self.exports {
            e.exports.push(format!("{name}={}", own.backing));
            e.own.insert(name, own);
        }
        tls.tls = tls.tls.or(self.tls);
        tls.tls_certificates = tls.tls_certificates.take().or(self.tls_certificates);
        tls.tls_psk = tls.tls_psk.take().or(self.tls_psk);
        tls.tls_verify_peer |= self.tls_verify_peer.unwrap_or(false);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `fallow nbd`'s flags, none given.
    #[derive(Parser)]
    struct NoFlags {
        #[command(flatten)]
        exports: ExportArgs,
        #[command(flatten)]
        tls: NbdTlsArgs,
    }

    fn merge(text: &str) -> anyhow::Result<NoFlags> {
        let file: NbdFile = toml::from_str(text).unwrap();
        let mut flags = NoFlags::parse_from(["fallow"]);
        let (mut listen, mut metrics, mut poll_us) = (Vec::new(), None, None);
        file.merge_into(
            &mut listen,
            &mut metrics,
            &mut poll_us,
            &mut flags.exports,
            &mut flags.tls,
        )?;
        Ok(flags)
    }

    #[test]
    fn export_names_with_an_equals_sign_are_refused() {
        // Found by the config_toml fuzz target: `[exports."a=b"]` was served as export
        // `a` over the store `b=mem:1M`, without its section's settings.
        let err = merge("[exports.\"a=b\"]\nbacking = \"mem:1M\"\n").err().unwrap();
        assert!(format!("{err:#}").contains("cannot contain '='"), "{err:#}");
        let flags =
            merge("[exports.a]\nbacking = \"file:/tmp/x=y\"\nlocal_tier = \"8K\"\n").unwrap();
        let specs = flags.exports.specs().unwrap();
        assert_eq!(specs, [("a".to_string(), "file:/tmp/x=y".to_string())]);
        assert_eq!(flags.exports.cache_settings("a").unwrap().local_pages, 2);
    }

    #[test]
    fn the_sample_parses_and_unknown_keys_are_refused() {
        let sample = include_str!("../../../../deploy/nbd/example.toml");
        let file: NbdFile = toml::from_str(sample).unwrap();
        assert!(!file.exports.is_empty());
        let err = toml::from_str::<NbdFile>("lcoal_tier = \"1G\"\n").unwrap_err().to_string();
        assert!(err.contains("unknown field"), "{err}");
        let err = toml::from_str::<NbdFile>("[exports.d]\nbacking = \"mem:1M\"\nmod = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field"), "{err}");
    }
}
