//! Which page a request touches: key ids in `0..keys`, drawn uniformly or from a Zipf
//! distribution, or walked in order (the warm-up that fills every key once).
//!
//! A Zipf draw yields a popularity *rank* (0 is the hottest). Ranks are scattered over the
//! key space by a fixed bijection, so the hot keys are not neighbours: otherwise they would
//! all land in one object (fallow) or one run of hash slots, which no real workload does.

use std::fmt;
use std::str::FromStr;

use rand::Rng;
use rand_distr::{Distribution, Zipf};

/// How key ids are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeyDist {
    /// Every key equally likely.
    Uniform,
    /// Zipf: the key of rank `r` (1-based) is drawn with probability ∝ `1 / r^theta`
    /// (`theta` 0.99 is the YCSB default; 0 is uniform).
    Zipf {
        /// The skew exponent, ≥ 0.
        theta: f64,
    },
}

impl FromStr for KeyDist {
    type Err = String;

    /// `uniform` or `zipf:THETA` (`zipf` alone means theta 0.99).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "uniform" => Ok(KeyDist::Uniform),
            None if s == "zipf" => Ok(KeyDist::Zipf { theta: 0.99 }),
            Some(("zipf", t)) => match t.parse::<f64>() {
                Ok(theta) if theta.is_finite() && theta >= 0.0 => Ok(KeyDist::Zipf { theta }),
                _ => Err(format!("zipf theta must be a number ≥ 0, not {t:?}")),
            },
            _ => Err(format!("expected uniform or zipf:THETA, not {s:?}")),
        }
    }
}

impl fmt::Display for KeyDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyDist::Uniform => f.write_str("uniform"),
            KeyDist::Zipf { theta } => write!(f, "zipf:{theta}"),
        }
    }
}

/// Draws key ids in `0..keys`. Cheap to clone: each worker owns one, with its own RNG.
#[derive(Debug, Clone)]
pub struct KeyGen {
    keys: u64,
    sampler: Sampler,
}

#[derive(Debug, Clone)]
enum Sampler {
    Uniform,
    /// `rand_distr`'s rejection-inversion sampler; yields ranks 1..=keys as f64.
    Zipf(Zipf<f64>),
}

/// A prime above any key count we accept (`keys < 2^61`), so `rank * SCATTER mod keys` is a
/// bijection of `0..keys` (the prime shares no factor with `keys`).
const SCATTER: u64 = (1 << 61) - 1;

impl KeyGen {
    /// A generator over `0..keys`. Errors when `keys` is 0 or not below 2^61.
    pub fn new(keys: u64, dist: KeyDist) -> Result<Self, String> {
        if keys == 0 || keys >= SCATTER {
            return Err(format!("the key space must hold 1 to 2^61 - 2 keys, not {keys}"));
        }
        let sampler = match dist {
            KeyDist::Uniform => Sampler::Uniform,
            KeyDist::Zipf { theta } => Sampler::Zipf(
                Zipf::new(keys, theta)
                    .map_err(|e| format!("zipf:{theta} over {keys} keys: {e}"))?,
            ),
        };
        Ok(Self { keys, sampler })
    }

    /// The size of the key space.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// The next key id, in `0..keys`.
    pub fn next<R: Rng>(&self, rng: &mut R) -> u64 {
        match &self.sampler {
            Sampler::Uniform => rng.gen_range(0..self.keys),
            Sampler::Zipf(zipf) => {
                // A rank in 1..=keys; the float-to-int cast saturates, and the clamp keeps a
                // rounding at the top edge inside the key space.
                let rank = (zipf.sample(rng) as u64).clamp(1, self.keys) - 1;
                self.scatter(rank)
            }
        }
    }

    /// The key id that popularity rank `rank` (0-based, 0 hottest) maps to.
    pub fn scatter(&self, rank: u64) -> u64 {
        ((u128::from(rank) * u128::from(SCATTER)) % u128::from(self.keys)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn parses_and_prints_distributions() {
        assert_eq!("uniform".parse::<KeyDist>(), Ok(KeyDist::Uniform));
        assert_eq!("zipf".parse::<KeyDist>(), Ok(KeyDist::Zipf { theta: 0.99 }));
        assert_eq!("zipf:1.2".parse::<KeyDist>(), Ok(KeyDist::Zipf { theta: 1.2 }));
        assert_eq!(KeyDist::Zipf { theta: 0.5 }.to_string(), "zipf:0.5");
        for bad in ["", "zipf:", "zipf:-1", "zipf:nan", "zipf:x", "normal", "uniform:1"] {
            assert!(bad.parse::<KeyDist>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn rejects_an_empty_key_space() {
        assert!(KeyGen::new(0, KeyDist::Uniform).is_err());
        assert!(KeyGen::new(1 << 62, KeyDist::Uniform).is_err());
    }

    #[test]
    fn scatter_is_a_bijection() {
        for keys in [1, 2, 7, 1000, 4096] {
            let gen = KeyGen::new(keys, KeyDist::Uniform).unwrap();
            let mut seen: Vec<u64> = (0..keys).map(|r| gen.scatter(r)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..keys).collect::<Vec<_>>(), "keys = {keys}");
        }
    }

    #[test]
    fn every_draw_is_in_range() {
        let mut rng = SmallRng::seed_from_u64(1);
        for dist in [KeyDist::Uniform, KeyDist::Zipf { theta: 0.99 }, KeyDist::Zipf { theta: 3.0 }]
        {
            for keys in [1, 3, 1000] {
                let gen = KeyGen::new(keys, dist).unwrap();
                assert!((0..10_000).all(|_| gen.next(&mut rng) < keys), "{dist} over {keys}");
            }
        }
    }

    /// Share of draws that fall on the hottest `top` keys of a 10,000-key space.
    fn top_share(dist: KeyDist, top: u64) -> f64 {
        let mut rng = SmallRng::seed_from_u64(7);
        let gen = KeyGen::new(10_000, dist).unwrap();
        let hot: std::collections::HashSet<u64> = (0..top).map(|r| gen.scatter(r)).collect();
        let n = 100_000;
        let hits = (0..n).filter(|_| hot.contains(&gen.next(&mut rng))).count();
        hits as f64 / n as f64
    }

    #[test]
    fn zipf_is_skewed_and_uniform_is_not() {
        // Zipf(0.99) over 10^4 keys: the top 1 % of keys draw about 53 % of the accesses
        // (H(100, 0.99) / H(10^4, 0.99)); uniform draws 1 %.
        let zipf = top_share(KeyDist::Zipf { theta: 0.99 }, 100);
        assert!((0.45..0.62).contains(&zipf), "zipf top-1% share {zipf}");
        let uniform = top_share(KeyDist::Uniform, 100);
        assert!((0.005..0.015).contains(&uniform), "uniform top-1% share {uniform}");
        // A steeper skew concentrates more.
        assert!(top_share(KeyDist::Zipf { theta: 1.5 }, 100) > zipf + 0.2);
    }

    #[test]
    fn zipf_hottest_key_is_scattered_rank_zero() {
        let mut rng = SmallRng::seed_from_u64(3);
        let gen = KeyGen::new(1000, KeyDist::Zipf { theta: 1.0 }).unwrap();
        let mut counts = vec![0u32; 1000];
        (0..50_000).for_each(|_| counts[gen.next(&mut rng) as usize] += 1);
        let hottest = (0..1000).max_by_key(|&k| counts[k]).unwrap() as u64;
        assert_eq!(hottest, gen.scatter(0));
        assert_ne!(gen.scatter(1), gen.scatter(0) + 1, "hot keys should not be neighbours");
    }
}
