//! Crash states: what the recorded store could hold if the machine lost power at some
//! moment, built from a [`RecordingStore`](super::RecordingStore)'s log.
//!
//! The store is taken to be a disk with a volatile write cache, as NBD and the
//! [`BackingStore`](fallow_backing::BackingStore) contract describe one: a completed write
//! is durable once a flush that *began after it completed* has completed, or at once if it
//! was written with FUA; anything else that began before the crash may or may not have
//! reached the platter, in any order that real time allows.
//!
//! # Crash points
//! A state is built for a crash at tick `t`. Between two durability events (a flush that
//! completes, a FUA write that completes) the durable part of the store does not change,
//! so the points are one tick before each durability event completes, plus one after the
//! whole log. Each point is the latest crash with its durable part, hence the most
//! demanding one for the client's side: everything acknowledged by then must be there.
//!
//! # States at a point
//! * the **base**: every operation that completed before the start of the last flush that
//!   completed before `t`, applied in completion order (kept as an image and moved forward
//!   from point to point, so a state costs one copy of the image, not a replay of the log);
//! * the **candidates**: the other operations that began before `t`. FUA writes that
//!   completed before `t` are always applied; each state applies a subset of the rest:
//!   [`Choice::DurableOnly`] none of them (the prefix up to the flush), [`Choice::AllCompleted`]
//!   all that completed (the store as it was), [`Choice::Random`] a random subset (each
//!   state its own probability of keeping an operation), applied in a random order that
//!   real time allows: each operation lands at a random tick between its start and its end
//!   (or the crash, if it was still running), so two that overlapped land in either order
//!   and one that ended before another began lands first.
//!
//! A TRIM replays as zeros; a state that leaves it out is one where the store kept the
//! trimmed data, which a trim allows.

use rand::Rng;

use super::recorder::{StoreOp, StoreOpKind};

/// Which candidates a state applies on top of the base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Only what is durable: the base and the FUA writes that completed.
    DurableOnly,
    /// Every operation that completed before the crash, in completion order.
    AllCompleted,
    /// A random subset of the candidates, in a random order real time allows.
    Random,
}

/// What one recorded operation does to an image of units (bytes, or decoded cells).
#[derive(Debug, Clone)]
enum Effect<T> {
    /// These units, from the first one named.
    Put(Vec<T>),
    /// So many units of the zero value.
    Fill(usize),
    /// Nothing (a flush).
    None,
}

#[derive(Debug, Clone)]
struct ReplayOp<T> {
    start: u64,
    end: u64,
    fua: bool,
    flush: bool,
    /// The first unit it touches.
    at: usize,
    effect: Effect<T>,
}

impl<T: Clone> ReplayOp<T> {
    fn apply(&self, image: &mut [T], zero: &T) {
        match &self.effect {
            Effect::Put(units) => image[self.at..self.at + units.len()].clone_from_slice(units),
            Effect::Fill(n) => image[self.at..self.at + n].fill(zero.clone()),
            Effect::None => {}
        }
    }
}

/// Builds crash states from a log, point after point. The image is a vector of units:
/// bytes ([`Replayer::new`]), or anything a run of bytes decodes into, such as the
/// stamped cells of [`super::cells`] ([`Replayer::with_units`]), so that a state costs a
/// copy of a few thousand cells rather than of every byte, and no decoding.
#[derive(Debug)]
pub struct Replayer<T = u8> {
    /// The log, sorted by `end`.
    ops: Vec<ReplayOp<T>>,
    /// Flushes as `(end, greatest start of any flush that ended by then)`, by `end`.
    barriers: Vec<(u64, u64)>,
    points: Vec<u64>,
    zero: T,
    /// The image with `ops[..applied]` applied.
    base: Vec<T>,
    applied: usize,
    /// The crash tick the replayer is at.
    at: u64,
}

impl Replayer<u8> {
    /// A replayer over `log` (any order), starting from `initial`, the store's contents
    /// before the first recorded operation.
    pub fn new(log: Vec<StoreOp>, initial: Vec<u8>) -> Replayer<u8> {
        Replayer::with_units(log, initial, 1, 0, |_, bytes| bytes.to_vec())
    }
}

impl<T: Clone> Replayer<T> {
    /// A replayer whose image is `initial`, one unit per `unit` bytes of the store; a
    /// write's bytes become units through `decode(first unit, bytes)`, and a zeroed or
    /// trimmed unit becomes `zero`. Every operation of the log must cover whole units.
    pub fn with_units(
        mut log: Vec<StoreOp>,
        initial: Vec<T>,
        unit: usize,
        zero: T,
        decode: impl Fn(u64, &[u8]) -> Vec<T>,
    ) -> Replayer<T> {
        log.sort_by_key(|op| op.end);
        let mut barriers = Vec::new();
        let mut latest_start = 0;
        for op in log.iter().filter(|op| op.is_flush()) {
            latest_start = latest_start.max(op.start);
            barriers.push((op.end, latest_start));
        }
        let mut points: Vec<u64> =
            log.iter().filter(|op| op.is_flush() || op.is_fua()).map(|op| op.end).collect();
        points.push(u64::MAX);
        points.dedup();
        let whole = |offset: u64, len: u64| {
            assert!(
                offset.is_multiple_of(unit as u64) && len.is_multiple_of(unit as u64),
                "{offset}+{len} is not whole units of {unit} bytes"
            );
            (offset / unit as u64) as usize
        };
        let ops = log
            .iter()
            .map(|op| {
                let (at, effect) = match &op.kind {
                    StoreOpKind::Write { offset, data, .. } => {
                        let at = whole(*offset, data.len() as u64);
                        (at, Effect::Put(decode(at as u64, data)))
                    }
                    StoreOpKind::Zero { offset, len } | StoreOpKind::Trim { offset, len } => {
                        (whole(*offset, *len), Effect::Fill(*len as usize / unit))
                    }
                    StoreOpKind::Flush => (0, Effect::None),
                };
                ReplayOp {
                    start: op.start,
                    end: op.end,
                    fua: op.is_fua(),
                    flush: op.is_flush(),
                    at,
                    effect,
                }
            })
            .collect();
        Replayer { ops, barriers, points, zero, base: initial, applied: 0, at: 0 }
    }

    /// The crash points, ascending: one tick before each flush or FUA write completed
    /// (an operation that ended at tick `p` has not completed at a crash at `p`), and
    /// `u64::MAX`, after everything.
    pub fn points(&self) -> &[u64] {
        &self.points
    }

    /// Operations in the log.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True for an empty log.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The tick before which every operation that completed is durable at a crash at `t`:
    /// the start of the latest flush that completed before `t` (0: none did).
    pub fn barrier(&self, t: u64) -> u64 {
        let done = self.barriers.partition_point(|(end, _)| *end < t);
        if done == 0 {
            0
        } else {
            self.barriers[done - 1].1
        }
    }

    /// Moves to a crash at `t`; `t` never goes back. Applies to the base image what the
    /// crash cannot lose.
    pub fn advance(&mut self, t: u64) {
        assert!(t >= self.at, "crash points go forward: {t} after {}", self.at);
        self.at = t;
        let barrier = self.barrier(t);
        while let Some(op) = self.ops.get(self.applied) {
            if op.end >= barrier {
                break;
            }
            op.apply(&mut self.base, &self.zero);
            self.applied += 1;
        }
    }

    /// The crash tick the replayer is at.
    pub fn at(&self) -> u64 {
        self.at
    }

    /// Builds into `out` the state `choice` names for the current crash point and returns
    /// how many operations it applied on top of the base (`rng` draws the random ones).
    pub fn state(&self, choice: Choice, rng: &mut impl Rng, out: &mut Vec<T>) -> usize {
        let t = self.at;
        let keep = rng.gen::<f64>();
        // (tick at which it lands, tie-breaker, op)
        let mut chosen: Vec<(u64, usize, &ReplayOp<T>)> = Vec::new();
        for (i, op) in self.ops.iter().enumerate().skip(self.applied) {
            if op.flush || op.start >= t {
                continue;
            }
            let completed = op.end < t;
            let take = match choice {
                _ if completed && op.fua => true,
                Choice::DurableOnly => false,
                Choice::AllCompleted => completed,
                Choice::Random => rng.gen::<f64>() < keep,
            };
            if !take {
                continue;
            }
            let lands = match choice {
                Choice::Random => rng.gen_range(op.start..=op.end.min(t - 1)),
                _ => op.end,
            };
            chosen.push((lands, i, op));
        }
        chosen.sort_unstable_by_key(|(lands, i, _)| (*lands, *i));
        out.clear();
        out.extend_from_slice(&self.base);
        for (_, _, op) in &chosen {
            op.apply(out, &self.zero);
        }
        chosen.len()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use rand::SeedableRng;

    use super::*;

    fn write(start: u64, end: u64, offset: u64, byte: u8, fua: bool) -> StoreOp {
        let data = Bytes::from(vec![byte; 2]);
        StoreOp { start, end, kind: StoreOpKind::Write { offset, data, fua } }
    }

    fn flush(start: u64, end: u64) -> StoreOp {
        StoreOp { start, end, kind: StoreOpKind::Flush }
    }

    #[test]
    fn a_write_is_durable_only_after_a_flush_that_began_after_it_completed() {
        // w1 completes, then the flush runs; w2 completes during the flush.
        let log = vec![write(1, 2, 0, 1, false), flush(3, 6), write(4, 5, 2, 2, false)];
        let mut r = Replayer::new(log, vec![0; 4]);
        assert_eq!(r.points(), &[6, u64::MAX]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut out = Vec::new();
        r.advance(6);
        r.state(Choice::DurableOnly, &mut rng, &mut out);
        assert_eq!(out, [0, 0, 0, 0], "the flush had not completed");
        r.state(Choice::AllCompleted, &mut rng, &mut out);
        assert_eq!(out, [1, 1, 2, 2]);
        r.advance(u64::MAX);
        r.state(Choice::DurableOnly, &mut rng, &mut out);
        assert_eq!(out, [1, 1, 0, 0], "w2 completed after the flush began");
    }

    #[test]
    fn a_completed_fua_write_is_always_there() {
        let log = vec![write(1, 2, 0, 7, true), write(3, 4, 2, 8, false)];
        let mut r = Replayer::new(log, vec![0; 4]);
        assert_eq!(r.points(), &[2, u64::MAX]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let mut out = Vec::new();
        r.advance(2);
        r.state(Choice::AllCompleted, &mut rng, &mut out);
        assert_eq!(out, [0, 0, 0, 0], "a crash at 2 comes before the FUA write completed");
        r.advance(u64::MAX);
        for _ in 0..20 {
            r.state(Choice::Random, &mut rng, &mut out);
            assert_eq!(out[..2], [7, 7]);
        }
    }

    #[test]
    fn overlapping_writes_land_in_either_order_and_ordered_ones_in_theirs() {
        // a and b overlap in time; c begins after both ended.
        let log =
            vec![write(1, 4, 0, 1, false), write(2, 3, 0, 2, false), write(5, 6, 0, 3, false)];
        let mut r = Replayer::new(log, vec![0; 2]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut out = Vec::new();
        r.advance(u64::MAX);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..400 {
            r.state(Choice::Random, &mut rng, &mut out);
            seen.insert(out[0]);
        }
        assert_eq!(seen, [0, 1, 2, 3].into_iter().collect(), "each write can be the last");
        // c always lands last when it lands: with c in the state, nothing else shows.
        let log = vec![write(1, 2, 0, 1, false), write(3, 4, 0, 2, false)];
        let mut r = Replayer::new(log, vec![0; 2]);
        r.advance(u64::MAX);
        r.state(Choice::AllCompleted, &mut rng, &mut out);
        assert_eq!(out[0], 2);
    }
}
