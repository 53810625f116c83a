//! `--lend SIZE|auto`: how the node decides its budget, and the size syntax it accepts.
//!
//! # Components
//! [`LendMode`]: a fixed size or `auto`. [`parse_size`]: `512M`, `4GiB`, `1g`, `1.5T`,
//! `65536` (bytes); every unit is a power of 1024, as in systemd and `docker -m`.

use std::fmt;
use std::str::FromStr;

use fallow_pool::MAX_BUDGET_BYTES;

use super::decide::AutoConfig;
use super::host::{MemorySource, ProcSource};

/// How much the node lends.
#[derive(Debug, Clone, PartialEq)]
pub enum LendMode {
    /// Exactly this many bytes, set once at start (`--lend 4GiB`).
    Fixed(u64),
    /// Follow the host's memory (`--lend auto`).
    Auto(AutoConfig),
}

/// Why a `--lend` value or a size could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeParseError {
    /// Nothing was given.
    #[error("empty size (expected a size such as 512M or 4GiB, or `auto`)")]
    Empty,
    /// The number part is not a number.
    #[error("{0:?} is not a size: expected a number then a unit, such as 512M, 4GiB or 1.5g")]
    BadNumber(String),
    /// The unit is not one we know.
    #[error("{input:?}: unknown unit {unit:?} (use B, K, M, G or T, optionally followed by B or iB; all are powers of 1024)")]
    UnknownUnit {
        /// The whole input.
        input: String,
        /// The unit found.
        unit: String,
    },
    /// More than one engine can address.
    #[error("{0:?} is more than the {MAX_BUDGET_BYTES} bytes (2 TiB) one node can lend")]
    TooLarge(String),
}

impl LendMode {
    /// The most this mode can lend on this host: the fixed size, or, with `auto`, the
    /// host's memory (its cgroup's limit if smaller) up to `max_lend_bytes`. A node starts
    /// lending nothing and grows; this is what it sizes the engine's index for
    /// (`EngineBuilder::budget_up_to`). 0 when the host's memory cannot be read (the
    /// governor says so when it starts).
    pub fn most_bytes(&self) -> u64 {
        match self {
            Self::Fixed(bytes) => *bytes,
            Self::Auto(auto) => {
                let host = ProcSource::new().sample().map(|m| m.effective_total());
                auto.max_lend_bytes.min(host.unwrap_or(0))
            }
        }
    }
}

impl FromStr for LendMode {
    type Err = SizeParseError;

    /// `auto` (any case) or a size (see [`parse_size`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(LendMode::Auto(AutoConfig::default()))
        } else {
            parse_size(s).map(LendMode::Fixed)
        }
    }
}

impl fmt::Display for LendMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LendMode::Fixed(bytes) => f.write_str(&format_size(*bytes)),
            LendMode::Auto(_) => f.write_str("auto"),
        }
    }
}

/// Reads a size in bytes: a number (decimals allowed) and an optional unit among `B`, `K`,
/// `M`, `G`, `T`, each optionally followed by `B` or `iB`, in any case, with or without a
/// space: `512M`, `4GiB`, `1g`, `1.5 TiB`, `4096`. Units are powers of 1024 (`1K` is 1024
/// bytes, `1GB` is 2³⁰ bytes). A fraction of a byte is rounded down. Sizes above the 2 TiB
/// one engine can address are refused.
pub fn parse_size(s: &str) -> Result<u64, SizeParseError> {
    let input = s.trim();
    if input.is_empty() {
        return Err(SizeParseError::Empty);
    }
    let split = input.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(input.len());
    let (number, unit) = input.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(SizeParseError::UnknownUnit {
                input: input.to_string(),
                unit: unit.trim().to_string(),
            })
        }
    };
    let bad = || SizeParseError::BadNumber(input.to_string());
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 12 {
        return Err(bad());
    }
    // Exact integer arithmetic: whole × 2^shift + frac / 10^len × 2^shift.
    let too_large = || SizeParseError::TooLarge(input.to_string());
    let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
    let frac_bytes = if frac.is_empty() {
        0
    } else {
        let digits: u128 = frac.parse().map_err(|_| bad())?;
        (digits << shift) / 10u128.pow(frac.len() as u32)
    };
    let bytes = whole
        .checked_shl(shift)
        .filter(|b| b >> shift == whole)
        .and_then(|b| b.checked_add(frac_bytes))
        .ok_or_else(too_large)?;
    if bytes > MAX_BUDGET_BYTES as u128 {
        return Err(too_large());
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

/// `bytes` in the largest binary unit that shows it exactly (`512MiB`, `3GiB`, `4097B`).
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_every_accepted_spelling() {
        for (text, bytes) in [
            ("0", 0),
            ("4096", 4096),
            ("4096B", 4096),
            ("512M", 512 << 20),
            ("512m", 512 << 20),
            ("512MB", 512 << 20),
            ("4GiB", 4 << 30),
            ("4 GiB", 4 << 30),
            ("  1g ", 1 << 30),
            ("1.5G", 3 << 29),
            (".5K", 512),
            ("2.", 2),
            ("1.0000000001K", 1024),
            ("2T", 2 << 40),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text:?}");
        }
    }

    #[test]
    fn bad_sizes_say_what_is_wrong() {
        assert_eq!(parse_size("  "), Err(SizeParseError::Empty));
        assert_eq!(
            parse_size("4XB").unwrap_err().to_string(),
            "\"4XB\": unknown unit \"XB\" (use B, K, M, G or T, optionally followed by B or iB; \
             all are powers of 1024)"
        );
        assert!(matches!(parse_size("G"), Err(SizeParseError::BadNumber(_))));
        assert!(matches!(parse_size("."), Err(SizeParseError::BadNumber(_))));
        assert!(matches!(parse_size("1.2.3M"), Err(SizeParseError::BadNumber(_))));
        assert!(matches!(parse_size("-1G"), Err(SizeParseError::UnknownUnit { .. })));
        assert!(matches!(parse_size("3T"), Err(SizeParseError::TooLarge(_))));
        assert!(matches!(
            parse_size("99999999999999999999999999999999999999999T"),
            Err(SizeParseError::TooLarge(_))
        ));
        assert!(matches!(parse_size("18446744073709551616"), Err(SizeParseError::TooLarge(_))));
        assert!(matches!(parse_size("1.0000000000001M"), Err(SizeParseError::BadNumber(_))));
    }

    proptest::proptest! {
        #[test]
        fn parse_size_never_panics(text in "(?s).{0,40}", sizeish in "[0-9.]{0,30}[kKmMgGtTiIbB ]{0,4}") {
            let _ = parse_size(&text);
            if let Ok(bytes) = parse_size(&sizeish) {
                proptest::prop_assert!(bytes <= MAX_BUDGET_BYTES as u64);
            }
        }
    }

    #[test]
    fn the_most_a_mode_lends_is_its_size_or_at_most_the_host() {
        assert_eq!(LendMode::Fixed(5 << 30).most_bytes(), 5 << 30);
        let auto = AutoConfig { max_lend_bytes: 1 << 20, ..AutoConfig::default() };
        assert!(LendMode::Auto(auto).most_bytes() <= 1 << 20);
    }

    #[test]
    fn lend_mode_parses_auto_and_sizes_and_prints_back() {
        assert_eq!("auto".parse::<LendMode>(), Ok(LendMode::Auto(AutoConfig::default())));
        assert_eq!("AUTO".parse::<LendMode>(), Ok(LendMode::Auto(AutoConfig::default())));
        assert_eq!("512M".parse::<LendMode>(), Ok(LendMode::Fixed(512 << 20)));
        assert!("automatic".parse::<LendMode>().is_err());
        for text in ["auto", "512MiB", "3GiB", "4097B", "0B", "1TiB", "1KiB"] {
            assert_eq!(text.parse::<LendMode>().unwrap().to_string(), text);
        }
    }
}
