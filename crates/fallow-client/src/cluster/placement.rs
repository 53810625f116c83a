//! Where a page goes: weighted rendezvous (highest-random-weight) hashing of the page's key
//! over the nodes that may receive pages.
//!
//! Every node gets a score for a key, `w / -ln(u)`, where `w` is the node's weight and `u`
//! a hash of (key, node) mapped to (0, 1); the key goes to the node with the highest score.
//! This is the weighted form of rendezvous hashing (Thaler & Ravishankar, "Using
//! name-based mappings to increase hit rates", IEEE/ACM ToN 1998, for the unweighted
//! form; the logarithm method is Schindelhauer & Schomaker, "Weighted distributed hash
//! tables", SPAA 2005, and J. Resch, "New hashing algorithms for data storage", SNIA SDC
//! 2015). Why it is exactly proportional: `-ln(u) / w` is exponentially distributed with
//! rate `w`, and the smallest of independent exponentials is the one of rate `w_i` with
//! probability `w_i / Σ w`. So node i receives that share of the keys.
//!
//! Stability: a key's scores depend only on the key and each node's own name and weight.
//! Adding a node moves exactly the keys for which the newcomer scores highest (about
//! `w_new / Σ w` of them), all to the newcomer; removing one moves only its own keys.
//! A node's seed is a hash of its name (its protocol address), so a restarted node gets
//! its old keys back.
//!
//! Weights follow free lent memory ([`weight`]), rounded to steps of 2^(1/8) so that the
//! once-a-second jitter of a node's free memory does not move keys at every refresh.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::summary::Slot;

/// One node that may receive a key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    /// The node's slot in the cluster client.
    pub slot: Slot,
    /// A hash of the node's name ([`node_seed`]).
    pub seed: u64,
    /// Its weight ([`weight`]); a node of weight 0 receives nothing.
    pub weight: f64,
}

/// The hash of a page key under a pool's placement seed: every client that shares a pool
/// must use the same seed (a shared pool's is derived from its UUID).
pub(crate) fn key_hash(pool_seed: u64, object: u64, index: u64) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&object.to_le_bytes());
    bytes[8..].copy_from_slice(&index.to_le_bytes());
    xxh3_64_with_seed(&bytes, pool_seed)
}

/// A node's seed: the hash of its name, stable across its restarts.
pub(crate) fn node_seed(name: &str) -> u64 {
    xxh3_64(name.as_bytes())
}

/// The node with the highest score for `key`, or `None` when no candidate has a weight.
/// Ties (vanishingly rare) go to the lower slot, so every client decides alike.
pub(crate) fn owner(key: u64, candidates: &[Candidate]) -> Option<Slot> {
    let mut best: Option<(f64, Slot)> = None;
    for c in candidates.iter().filter(|c| c.weight > 0.0) {
        let s = score(key, c);
        match best {
            Some((b, slot)) if b > s || (b == s && slot < c.slot) => {}
            _ => best = Some((s, c.slot)),
        }
    }
    best.map(|(_, slot)| slot)
}

/// The two nodes with the highest scores for `key`, best first (the holders of a
/// persistent page's two copies; the first is [`owner`]). `None` where fewer candidates
/// have weight. Ties go to the lower slot, as in [`owner`].
pub(crate) fn top_two(key: u64, candidates: &[Candidate]) -> [Option<Slot>; 2] {
    let mut best: [Option<(f64, Slot)>; 2] = [None, None];
    let beats = |s: f64, slot: Slot, other: Option<(f64, Slot)>| match other {
        None => true,
        Some((b, o)) => s > b || (s == b && slot < o),
    };
    for c in candidates.iter().filter(|c| c.weight > 0.0) {
        let s = score(key, c);
        if beats(s, c.slot, best[0]) {
            best[1] = best[0];
            best[0] = Some((s, c.slot));
        } else if beats(s, c.slot, best[1]) {
            best[1] = Some((s, c.slot));
        }
    }
    best.map(|b| b.map(|(_, slot)| slot))
}

/// `w / -ln(u)` with `u` uniform in (0, 1), drawn from the key and the node's seed.
fn score(key: u64, c: &Candidate) -> f64 {
    let h = xxh3_64_with_seed(&key.to_le_bytes(), c.seed);
    // 53 random bits, offset by half a step: never 0 (ln would be -inf) nor 1 (ln = 0).
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    c.weight / -u.ln()
}

/// A node's weight: its free lent memory plus an eighth of all it lends, rounded to a
/// step of 2^(1/8) (~9 %). The free part sends new pages where there is room; the lent
/// part keeps full nodes (a warm cache is full everywhere) receiving pages in proportion
/// to their size instead of not at all. A node that lends nothing gets 0.
pub(crate) fn weight(lendable_bytes: u64, free_bytes: u64) -> f64 {
    let raw = free_bytes.min(lendable_bytes) as f64 + lendable_bytes as f64 / 8.0;
    if raw < 1.0 {
        return 0.0;
    }
    ((raw.log2() * 8.0).round() / 8.0).exp2()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: u64 = 60_000;

    fn nodes(weights: &[f64]) -> Vec<Candidate> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| Candidate {
                slot: i as Slot + 1,
                seed: node_seed(&format!("127.0.0.1:{}", 7400 + 10 * i)),
                weight,
            })
            .collect()
    }

    fn owners(candidates: &[Candidate]) -> Vec<Slot> {
        (0..KEYS).map(|i| owner(key_hash(42, i / 1000, i), candidates).unwrap()).collect()
    }

    #[test]
    fn shares_follow_the_weights() {
        let weights = [1.0, 2.0, 3.0, 6.0];
        let got = owners(&nodes(&weights));
        let total: f64 = weights.iter().sum();
        for (i, w) in weights.iter().enumerate() {
            let share = got.iter().filter(|&&s| s == i as Slot + 1).count() as f64 / KEYS as f64;
            let want = w / total;
            // Binomial standard deviation is under 0.2 % here; allow 1 % absolute.
            assert!((share - want).abs() < 0.01, "node {i}: share {share:.4}, want {want:.4}");
        }
    }

    #[test]
    fn adding_a_node_moves_only_its_keys_to_it() {
        let mut candidates = nodes(&[1.0; 5]);
        let before = owners(&candidates[..4]);
        let after = owners(&candidates);
        let moved: Vec<usize> = (0..before.len()).filter(|&i| before[i] != after[i]).collect();
        assert!(moved.iter().all(|&i| after[i] == 5), "a key moved between old nodes");
        let share = moved.len() as f64 / KEYS as f64;
        assert!((share - 0.2).abs() < 0.01, "moved {share:.4}, expected about 1/5");

        // Removing a node moves exactly its keys; the others stay put.
        candidates.remove(2);
        let removed = owners(&candidates);
        for i in 0..after.len() {
            if after[i] != 3 {
                assert_eq!(after[i], removed[i], "key {i} moved though its node stayed");
            } else {
                assert_ne!(removed[i], 3);
            }
        }
    }

    #[test]
    fn a_small_weight_change_moves_few_keys() {
        let a = owners(&nodes(&[1.0, 1.0, 1.0]));
        let b = owners(&nodes(&[1.0, 1.0, 1.1]));
        let moved = a.iter().zip(&b).filter(|(x, y)| x != y).count() as f64 / KEYS as f64;
        // Node 3's share goes from 1/3 to 1.1/3.1: about 2.2 % of keys move, all to it.
        assert!(moved < 0.035, "moved {moved:.4}");
        assert!(a.iter().zip(&b).all(|(x, y)| x == y || *y == 3));
    }

    #[test]
    fn the_second_copy_goes_to_the_runner_up() {
        let candidates = nodes(&[1.0, 2.0, 3.0, 1.0]);
        for i in 0..5000 {
            let key = key_hash(7, 1, i);
            let [first, second] = top_two(key, &candidates);
            assert_eq!(first, owner(key, &candidates));
            let second = second.unwrap();
            assert_ne!(Some(second), first);
            // The runner-up is the owner once the best node is gone.
            let rest: Vec<Candidate> =
                candidates.iter().copied().filter(|c| Some(c.slot) != first).collect();
            assert_eq!(Some(second), owner(key, &rest));
        }
        assert_eq!(top_two(1, &nodes(&[1.0])), [Some(1), None]);
        assert_eq!(top_two(1, &nodes(&[0.0, 0.0])), [None, None]);
    }

    #[test]
    fn nodes_without_weight_get_nothing() {
        assert_eq!(owner(1, &nodes(&[0.0, 0.0])), None);
        assert_eq!(owner(1, &[]), None);
        let got = owners(&nodes(&[0.0, 1.0]));
        assert!(got.iter().all(|&s| s == 2));
    }

    #[test]
    fn weights_are_rounded_and_follow_free_memory() {
        assert_eq!(weight(0, 0), 0.0);
        let gib = 1u64 << 30;
        // Rounded to steps of 2^(1/8): a 1 % change in free memory changes nothing.
        assert_eq!(weight(gib, gib / 2), weight(gib, gib / 2 + gib / 100));
        // An empty node weighs 9 times a full one of the same size.
        let ratio = weight(gib, gib) / weight(gib, 0);
        assert!((ratio - 9.0).abs() < 9.0 * 0.1, "{ratio}");
        // A full node that lends twice as much weighs about twice as much.
        let ratio = weight(2 * gib, 0) / weight(gib, 0);
        assert!((ratio - 2.0).abs() < 0.2, "{ratio}");
        // Free above lendable (a race in the gossip) counts as lendable.
        assert_eq!(weight(gib, 2 * gib), weight(gib, gib));
    }
}
