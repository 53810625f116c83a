//! The TOML config files: a node's (`fallow node --config`, `fallow_node::ConfigFile`)
//! and the NBD server's (`fallow nbd --config`, `NbdFile` in the binary), with the value
//! parsers their settings go through when the programs start.
//!
//! The input is the file's text (input that is not UTF-8 is skipped: `read_to_string`
//! refuses it before TOML sees it).
//!
//! Checked:
//! * a file parses to the same settings whether read from its text or from its TOML
//!   document written out again (the two serde paths into one struct agree);
//! * node settings: sizes (`lend`, `reserve`, `summary_max`), listen addresses and CPU
//!   lists that parse come back the same from their canonical spelling;
//! * NBD settings merged over empty flags as `fallow nbd` merges them: every export of the
//!   file becomes one `--export NAME=BACKING` under the same name, and each export's cache
//!   settings resolve exactly when its sizes parse.

#![no_main]

use std::str::FromStr;

use clap::Parser;
use fallow_core::ListenAddr;
use fallow_net::cpus::CpuList;
use fallow_node::lending::{format_size, parse_size, LendMode};
use fallow_node::ConfigFile;
use libfuzzer_sys::fuzz_target;

// The binary's config code, compiled here from its own sources: `fallow` is a binary
// crate, which a fuzz target cannot depend on. These are the modules `nbd_file.rs` needs;
// a new `super::` import there needs its module added here.
#[allow(dead_code)]
#[path = "../../crates/fallow/src/cmd"]
mod cmd {
    pub mod exports;
    pub mod nbd_file;
    pub mod tls;
    pub mod warm;
}

use cmd::exports::ExportArgs;
use cmd::nbd_file::NbdFile;
use cmd::tls::NbdTlsArgs;

/// `fallow nbd` with no flags: the defaults the file is merged into.
#[derive(Parser)]
struct NoFlags {
    #[command(flatten)]
    exports: ExportArgs,
    #[command(flatten)]
    tls: NbdTlsArgs,
}

fuzz_target!(|input: &[u8]| {
    let Ok(text) = std::str::from_utf8(input) else { return };
    // Both programs read the same text; at most one accepts it (unknown keys are refused),
    // so each parse is cheap when it is the wrong one.
    if let Some(file) = parse_both_ways::<ConfigFile>(text, same_node_file) {
        node_values(&file);
    }
    if let Some(file) = parse_both_ways::<NbdFile>(text, |a, b| a == b) {
        nbd_merge(file);
    }
});

/// The struct from the text, checked against the struct from the text's TOML document
/// written out again (when the document can be written: a table array after a table, for
/// one, may have no faithful spelling).
fn parse_both_ways<T: serde::de::DeserializeOwned + std::fmt::Debug>(
    text: &str,
    same: impl Fn(&T, &T) -> bool,
) -> Option<T> {
    let direct = toml::from_str::<T>(text);
    let document = toml::from_str::<toml::Table>(text);
    let (direct, document) = match (direct, document) {
        (Ok(direct), Ok(document)) => (direct, document),
        (Ok(direct), Err(e)) => panic!("{direct:?} parsed, but its document does not: {e}"),
        (Err(_), _) => return None,
    };
    if let Ok(written) = toml::to_string(&document) {
        let again = toml::from_str::<T>(&written).unwrap_or_else(|e| {
            panic!("{direct:?} written out as {written:?} does not parse: {e}")
        });
        assert!(same(&direct, &again), "{direct:?} written out as {written:?} reads as {again:?}");
    }
    Some(direct)
}

/// Equal, with a NaN false-positive rate equal to itself (TOML has `nan`).
fn same_node_file(a: &ConfigFile, b: &ConfigFile) -> bool {
    let nan = |f: &ConfigFile| f.summary_fpr.is_some_and(f64::is_nan);
    let strip = |f: &ConfigFile| ConfigFile { summary_fpr: None, ..f.clone() };
    match (nan(a), nan(b)) {
        (true, true) => strip(a) == strip(b),
        (false, false) => a == b,
        _ => false,
    }
}

/// The node's values, parsed as `fallow node` parses them (crates/fallow/src/cmd/node.rs).
fn node_values(file: &ConfigFile) {
    for text in file.listen.iter().flatten() {
        if let Ok(addr) = ListenAddr::from_str(text) {
            assert_eq!(addr.to_string().parse::<ListenAddr>(), Ok(addr.clone()), "{text:?}");
        }
    }
    if let Some(text) = &file.lend {
        if let Ok(lend) = text.parse::<LendMode>() {
            let shown = lend.to_string();
            let again = shown.parse::<LendMode>().expect("a lend mode's own spelling");
            assert_eq!(again.to_string(), shown, "{text:?}");
        }
    }
    for text in [&file.lend, &file.reserve, &file.summary_max].into_iter().flatten() {
        if let Ok(bytes) = parse_size(text) {
            assert_eq!(parse_size(&format_size(bytes)), Ok(bytes), "{text:?}");
        }
    }
    if let Some(Ok(cpus)) = file.cpus.as_deref().map(CpuList::from_str) {
        assert_eq!(cpus.to_string().parse::<CpuList>(), Ok(cpus.clone()));
    }
}

/// The file merged over no flags, then the exports and their cache settings, as
/// `fallow nbd` resolves them before it opens anything (crates/fallow/src/cmd/nbd.rs).
fn nbd_merge(file: NbdFile) {
    let names: Vec<String> = file.exports.keys().cloned().collect();
    let own = file.exports.clone();
    let mut flags = NoFlags::parse_from(["fallow"]);
    let (mut listen, mut metrics, mut poll_us) = (Vec::new(), None, None);
    let merged = file.merge_into(
        &mut listen,
        &mut metrics,
        &mut poll_us,
        &mut flags.exports,
        &mut flags.tls,
    );
    if merged.is_err() {
        return; // a listen or metrics address that does not parse: `fallow nbd` stops here
    }
    let specs = flags.exports.specs();
    if names.is_empty() || names.iter().any(String::is_empty) {
        assert!(specs.is_err(), "{names:?} accepted");
        return;
    }
    let specs = specs.unwrap_or_else(|e| panic!("exports {names:?} refused: {e:#}"));
    let spec_names: Vec<&String> = specs.iter().map(|(name, _)| name).collect();
    assert_eq!(spec_names, names.iter().collect::<Vec<_>>(), "export names changed on the way");
    for (name, backing) in &specs {
        let section = &own[name];
        assert_eq!(backing, &section.backing, "export {name:?}'s backing");
        let settings = flags.exports.cache_settings(name);
        let sizes_parse = [&section.local_tier, &section.max_dirty]
            .into_iter()
            .flatten()
            .all(|size| parse_size(size).is_ok());
        let defaults_parse = [&flags.exports.local_tier, &flags.exports.max_dirty]
            .into_iter()
            .flatten()
            .all(|size| parse_size(size).is_ok());
        if sizes_parse && defaults_parse {
            let settings = settings.unwrap_or_else(|e| panic!("export {name:?}: {e:#}"));
            if let Some(Ok(bytes)) = section.local_tier.as_deref().map(parse_size) {
                assert_eq!(settings.local_pages as u64, bytes / 4096, "export {name:?}");
            }
        }
    }
}
