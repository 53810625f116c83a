//! The client's side of a crash: a history of what the client asked for and was told,
//! written in stamped cells, and the check of a crash state against it.
//!
//! # Cells
//! The device is cut into [`CELL`]-byte cells and every write covers whole cells. A cell
//! written by client operation `id` holds a stamp: a magic word, `id`, the cell's own
//! number and words derived from both, so a cell's content names the write it came from,
//! and a cell that holds a torn, misplaced or invented stamp is caught. The initial image
//! is operation 0's stamps; zeroing and trimming leave zeros.
//!
//! # What a crash at `t` must show, cell by cell
//! An operation is *durable* at `t` if it was acknowledged before a client FLUSH that
//! was itself acknowledged before `t` was sent (NBD: a FLUSH covers the writes completed
//! before it was received), or if it is a FUA write acknowledged before `t`. Operation 0
//! is durable from the start. A TRIM is never durable (a store may keep trimmed data); a
//! WRITE_ZEROES is.
//!
//! The cell may hold what any operation `o` that covers it left, provided `o` was sent
//! before `t` and is not *superseded*: acknowledged before some durable operation on the
//! same cell was sent. That allows the newest durable content, anything that raced with
//! it, and anything newer (acknowledged or still in flight at the crash), and rejects
//! both a lost durable write (older content shows) and data never written.

use std::sync::Mutex;

use bytes::Bytes;

use super::recorder::Clock;

/// The unit of the stamped contents, in bytes: writes cover whole cells.
pub const CELL: usize = 64;

const MAGIC: u64 = 0xfa11_0c0d_ce11_5eed;

/// What a client operation was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind {
    /// A write of stamps; `fua`: with NBD's FUA flag.
    Write {
        /// Durable once acknowledged.
        fua: bool,
    },
    /// WRITE_ZEROES.
    Zero,
    /// TRIM.
    Trim,
    /// FLUSH.
    Flush,
}

/// One client operation, with the clock's ticks when it was sent and acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOp {
    /// What it was.
    pub kind: ClientKind,
    /// Where (0 for a flush).
    pub offset: u64,
    /// How many bytes (0 for a flush).
    pub len: u64,
    /// Taken before it was sent.
    pub sent: u64,
    /// Taken after it succeeded; `None`: it failed or never ended, so it may or may not
    /// have happened.
    pub acked: Option<u64>,
}

/// An operation sent and not yet ended: its id (which names its stamps) and send tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "end the operation with History::ack or History::fail"]
pub struct Sent {
    /// The operation's id (1 and up; 0 is the initial image).
    pub id: u32,
}

/// The client's operations; shared by the tasks that run them.
#[derive(Debug)]
pub struct History {
    clock: Clock,
    /// By id; index 0 is the initial image. A std mutex held for one push or update.
    ops: Mutex<Vec<ClientOp>>,
}

impl History {
    /// An empty history stamped with `clock`'s ticks.
    pub fn new(clock: Clock) -> History {
        let initial = ClientOp {
            kind: ClientKind::Write { fua: true },
            offset: 0,
            len: 0,
            sent: 0,
            acked: Some(0),
        };
        History { clock, ops: Mutex::new(vec![initial]) }
    }

    /// Records that an operation is about to be sent. A write's data comes from
    /// [`stamps`] with the id returned.
    pub fn send(&self, kind: ClientKind, offset: u64, len: u64) -> Sent {
        let mut ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let id = u32::try_from(ops.len()).expect("fewer than 2^32 operations");
        let sent = self.clock.tick();
        ops.push(ClientOp { kind, offset, len, sent, acked: None });
        Sent { id }
    }

    /// Records that the operation succeeded.
    pub fn ack(&self, op: Sent) {
        let acked = self.clock.tick();
        self.ops.lock().unwrap_or_else(|e| e.into_inner())[op.id as usize].acked = Some(acked);
    }

    /// Records that the operation failed: it stays unacknowledged, so either outcome
    /// is allowed.
    pub fn fail(&self, op: Sent) {
        let _ = op;
    }

    /// The operations so far, by id.
    pub fn ops(&self) -> Vec<ClientOp> {
        self.ops.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn mix(id: u32, cell: u64) -> u64 {
    let mut x = (u64::from(id) << 32) ^ cell.rotate_left(17);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 29)
}

/// Word `w` of the stamp of operation `id` in `cell`; `hash` is `mix(id, cell)`.
fn stamp_word(id: u32, cell: u64, hash: u64, w: usize) -> u64 {
    match w {
        0 => MAGIC,
        1 => u64::from(id),
        2 => cell,
        _ => hash ^ (w as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    }
}

fn stamp_cell(id: u32, cell: u64, out: &mut [u8]) {
    let hash = mix(id, cell);
    for (w, chunk) in out.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&stamp_word(id, cell, hash, w).to_le_bytes());
    }
}

/// The data a write of operation `id` puts at `offset..offset + len` (whole cells).
pub fn stamps(id: u32, offset: u64, len: u64) -> Bytes {
    assert!(
        offset.is_multiple_of(CELL as u64) && len.is_multiple_of(CELL as u64),
        "writes cover whole cells"
    );
    let mut out = vec![0u8; len as usize];
    for (i, cell) in out.chunks_exact_mut(CELL).enumerate() {
        stamp_cell(id, offset / CELL as u64 + i as u64, cell);
    }
    Bytes::from(out)
}

/// The initial image of a `size`-byte device: operation 0's stamps.
pub fn initial_image(size: u64) -> Vec<u8> {
    stamps(0, 0, size).to_vec()
}

/// The cells of `bytes`, which start at cell `first` ([`super::Replayer::with_units`]'s
/// `decode`).
pub fn decode_cells(first: u64, bytes: &[u8]) -> Vec<Found> {
    bytes.chunks_exact(CELL).zip(first..).map(|(cell, n)| decode(n, cell)).collect()
}

/// The initial image of a `size`-byte device as cells: operation 0's stamps.
pub fn initial_cells(size: u64) -> Vec<Found> {
    vec![Found::Stamp(0); size as usize / CELL]
}

/// What a cell holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// The stamp of operation `id`.
    Stamp(u32),
    /// Zeros.
    Zero,
    /// A stamp of operation `id` made for another cell.
    Misplaced {
        /// The writer.
        id: u32,
        /// The cell it was for.
        cell: u64,
    },
    /// Neither zeros nor a whole stamp: data never written.
    Garbage,
}

/// Reads one cell.
pub fn decode(cell_number: u64, bytes: &[u8]) -> Found {
    if bytes.iter().all(|b| *b == 0) {
        return Found::Zero;
    }
    let words = bytes.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
    let word = |w: usize| words.clone().nth(w).unwrap_or(0);
    let (Ok(id), cell) = (u32::try_from(word(1)), word(2)) else { return Found::Garbage };
    let hash = mix(id, cell);
    if words.enumerate().any(|(w, word)| word != stamp_word(id, cell, hash, w)) {
        Found::Garbage
    } else if cell != cell_number {
        Found::Misplaced { id, cell }
    } else {
        Found::Stamp(id)
    }
}

/// A cell whose content a crash state may not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Violation {
    /// The cell's number (byte offset / [`CELL`]).
    pub cell: u64,
    /// What it held.
    pub found: Found,
    /// The newest operation on the cell whose content, or newer, the state had to hold:
    /// durable at the crash, or, for a read, acknowledged before it (0: the initial image).
    pub newest: u32,
}

/// Checks crash states against a finished [`History`], crash point after crash point.
#[derive(Debug)]
pub struct CellChecker {
    ops: Vec<ClientOp>,
    /// Per cell, the ids of the operations that cover it, ascending.
    by_cell: Vec<Vec<u32>>,
    /// Flushes as `(acked, greatest sent of any flush acknowledged by then)`, by `acked`.
    flushes: Vec<(u64, u64)>,
    /// Acknowledged writes and zeroings by `acked`, and the FUA writes by `acked`.
    by_ack: Vec<u32>,
    fua_by_ack: Vec<u32>,
    /// How far `by_ack` and `fua_by_ack` have been taken as durable.
    durable_upto: usize,
    fua_upto: usize,
    /// Per cell, the newest durable operation (the greatest `sent`): nothing
    /// acknowledged before that one was sent may show.
    newest_durable: Vec<u32>,
    at: u64,
}

impl CellChecker {
    /// A checker of a `size`-byte device (whole cells) for the operations of `history`.
    pub fn new(history: &History, size: u64) -> CellChecker {
        assert!(size.is_multiple_of(CELL as u64), "the device is whole cells");
        let ops = history.ops();
        let cells = (size / CELL as u64) as usize;
        let mut by_cell = vec![vec![0u32]; cells];
        let mut flushes = Vec::new();
        let mut by_ack = Vec::new();
        let mut fua_by_ack = Vec::new();
        for (id, op) in ops.iter().enumerate().skip(1) {
            let id = id as u32;
            match op.kind {
                ClientKind::Flush => {
                    if let Some(acked) = op.acked {
                        flushes.push((acked, op.sent));
                    }
                    continue;
                }
                ClientKind::Write { fua } => {
                    if fua && op.acked.is_some() {
                        fua_by_ack.push(id);
                    }
                    if op.acked.is_some() {
                        by_ack.push(id);
                    }
                }
                ClientKind::Zero if op.acked.is_some() => by_ack.push(id),
                ClientKind::Zero | ClientKind::Trim => {}
            }
            let first = (op.offset / CELL as u64) as usize;
            let last = ((op.offset + op.len).div_ceil(CELL as u64) as usize).min(cells);
            for cell in &mut by_cell[first..last] {
                cell.push(id);
            }
        }
        flushes.sort_unstable();
        let mut latest = 0;
        for f in &mut flushes {
            latest = latest.max(f.1);
            f.1 = latest;
        }
        by_ack.sort_unstable_by_key(|id| ops[*id as usize].acked);
        fua_by_ack.sort_unstable_by_key(|id| ops[*id as usize].acked);
        CellChecker {
            ops,
            by_cell,
            flushes,
            by_ack,
            fua_by_ack,
            durable_upto: 0,
            fua_upto: 0,
            newest_durable: vec![0; cells],
            at: 0,
        }
    }

    /// Client operations in the history (the initial image not counted).
    pub fn len(&self) -> usize {
        self.ops.len() - 1
    }

    /// True for a history with no operation.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Moves to a crash at `t`; `t` never goes back.
    pub fn advance(&mut self, t: u64) {
        assert!(t >= self.at, "crash points go forward");
        self.at = t;
        let done = self.flushes.partition_point(|(acked, _)| *acked < t);
        let barrier = if done == 0 { 0 } else { self.flushes[done - 1].1 };
        while let Some(&id) = self.by_ack.get(self.durable_upto) {
            if self.ops[id as usize].acked.is_none_or(|a| a >= barrier) {
                break;
            }
            self.make_durable(id);
            self.durable_upto += 1;
        }
        while let Some(&id) = self.fua_by_ack.get(self.fua_upto) {
            if self.ops[id as usize].acked.is_none_or(|a| a >= t) {
                break;
            }
            self.make_durable(id);
            self.fua_upto += 1;
        }
    }

    fn make_durable(&mut self, id: u32) {
        let op = self.ops[id as usize];
        let first = (op.offset / CELL as u64) as usize;
        let last = ((op.offset + op.len).div_ceil(CELL as u64) as usize).min(self.by_cell.len());
        for newest in &mut self.newest_durable[first..last] {
            if self.ops[*newest as usize].sent < op.sent {
                *newest = id;
            }
        }
    }

    /// May operation `id`'s content show in `cell` at the current crash point?
    fn allowed(&self, cell: usize, id: u32) -> bool {
        let op = &self.ops[id as usize];
        let newest = &self.ops[self.newest_durable[cell] as usize];
        let superseded = op.acked.is_some_and(|a| a < newest.sent);
        (id == 0 || op.sent < self.at) && !superseded
    }

    /// Checks a crash state (the whole device) at the current crash point; returns the
    /// cells that hold what they may not.
    pub fn check(&self, image: &[u8]) -> Vec<Violation> {
        self.check_cells(&decode_cells(0, image))
    }

    /// [`CellChecker::check`] for a state already decoded into cells.
    pub fn check_cells(&self, cells: &[Found]) -> Vec<Violation> {
        let mut bad = Vec::new();
        for (cell, &found) in cells.iter().enumerate() {
            let ok = match found {
                Found::Stamp(id) => {
                    self.by_cell[cell].binary_search(&id).is_ok()
                        && matches!(self.ops[id as usize].kind, ClientKind::Write { .. })
                        && self.allowed(cell, id)
                }
                Found::Zero => self.by_cell[cell].iter().any(|id| {
                    matches!(self.ops[*id as usize].kind, ClientKind::Zero | ClientKind::Trim)
                        && self.allowed(cell, *id)
                }),
                Found::Misplaced { .. } | Found::Garbage => false,
            };
            if !ok {
                bad.push(Violation { cell: cell as u64, found, newest: self.newest_durable[cell] });
            }
        }
        bad
    }

    /// The operation `id`, for reports.
    pub fn op(&self, id: u32) -> ClientOp {
        self.ops[id as usize]
    }

    /// Checks what a read returned (`data` at `offset`, whole cells; sent at tick `sent`,
    /// answered at `answered`): each cell holds what an operation that covers it left,
    /// sent before the read was answered, and not superseded by one acknowledged before
    /// the read was sent (a TRIM supersedes nothing: a store may keep trimmed data). That
    /// rejects stale data (older than a write acknowledged before the read began) and
    /// data never written.
    pub fn check_read(&self, offset: u64, data: &[u8], sent: u64, answered: u64) -> Vec<Violation> {
        let mut bad = Vec::new();
        for (i, bytes) in data.chunks_exact(CELL).enumerate() {
            let cell = (offset / CELL as u64) as usize + i;
            let ops = &self.by_cell[cell];
            // The newest operation on the cell that the read must see, or something newer.
            let newest = ops
                .iter()
                .copied()
                .filter(|id| {
                    let op = &self.ops[*id as usize];
                    op.kind != ClientKind::Trim && op.acked.is_some_and(|a| a < sent)
                })
                .max_by_key(|id| self.ops[*id as usize].sent)
                .unwrap_or(0);
            let floor = self.ops[newest as usize].sent;
            let may_show = |id: u32| {
                let op = &self.ops[id as usize];
                (id == 0 || op.sent < answered) && op.acked.is_none_or(|a| a >= floor)
            };
            let found = decode(cell as u64, bytes);
            let ok = match found {
                Found::Stamp(id) => {
                    ops.binary_search(&id).is_ok()
                        && matches!(self.ops[id as usize].kind, ClientKind::Write { .. })
                        && may_show(id)
                }
                Found::Zero => ops.iter().any(|id| {
                    matches!(self.ops[*id as usize].kind, ClientKind::Zero | ClientKind::Trim)
                        && may_show(*id)
                }),
                Found::Misplaced { .. } | Found::Garbage => false,
            };
            if !ok {
                bad.push(Violation { cell: cell as u64, found, newest });
            }
        }
        bad
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_names_its_write_and_its_cell() {
        let data = stamps(7, 128, 128);
        assert_eq!(decode(2, &data[..CELL]), Found::Stamp(7));
        assert_eq!(decode(3, &data[CELL..]), Found::Stamp(7));
        assert_eq!(decode(4, &data[CELL..]), Found::Misplaced { id: 7, cell: 3 });
        assert_eq!(decode(2, &[0; CELL]), Found::Zero);
        let mut torn = data[..CELL].to_vec();
        torn[40] ^= 1;
        assert_eq!(decode(2, &torn), Found::Garbage);
    }

    fn history(ops: &[(ClientKind, u64, u64, bool)]) -> History {
        let h = History::new(Clock::new());
        for &(kind, offset, len, ack) in ops {
            let sent = h.send(kind, offset, len);
            if ack {
                h.ack(sent);
            }
        }
        h
    }

    #[test]
    fn a_flushed_write_must_survive_and_an_unflushed_one_may_not() {
        let w = ClientKind::Write { fua: false };
        // 1: write cell 0 (ticks 1,2); 2: flush (3,4); 3: write cell 0 again (5,6).
        let h = history(&[(w, 0, 64, true), (ClientKind::Flush, 0, 0, true), (w, 0, 64, true)]);
        let mut c = CellChecker::new(&h, 128);
        let state = |cell0: u32| {
            let mut image = stamps(cell0, 0, 64).to_vec();
            image.extend_from_slice(&stamps(0, 64, 64));
            image
        };
        c.advance(4); // the flush is not acknowledged yet
        assert!(c.check(&state(0)).is_empty());
        assert!(c.check(&state(1)).is_empty());
        c.advance(5);
        assert_eq!(c.check(&state(0)).len(), 1, "write 1 was flushed");
        assert!(c.check(&state(1)).is_empty());
        assert_eq!(c.check(&state(3)).len(), 1, "write 3 is sent at tick 5, after the crash");
        assert_eq!(c.check(&state(2)).len(), 1, "op 2 is a flush, it wrote nothing");
        c.advance(6);
        assert!(c.check(&state(3)).is_empty(), "a newer write may have landed");
    }

    #[test]
    fn zeros_need_a_zeroing_and_a_trim_never_hides_older_data() {
        let h = history(&[
            (ClientKind::Write { fua: true }, 0, 64, true),
            (ClientKind::Trim, 0, 64, true),
            (ClientKind::Flush, 0, 0, true),
        ]);
        let mut c = CellChecker::new(&h, 64);
        c.advance(u64::MAX);
        assert!(c.check(&[0; CELL]).is_empty());
        assert!(c.check(&stamps(1, 0, 64)).is_empty(), "a trim may keep the data");
        assert_eq!(c.check(&stamps(0, 0, 64)).len(), 1, "the FUA write superseded the initial");
        let h = history(&[(ClientKind::Zero, 0, 64, true), (ClientKind::Flush, 0, 0, true)]);
        let mut c = CellChecker::new(&h, 64);
        c.advance(u64::MAX);
        assert_eq!(c.check(&stamps(0, 0, 64)).len(), 1, "the zeroing was flushed");
        assert!(c.check_read(0, &[0; CELL], 100, 101).is_empty());
        assert_eq!(c.check_read(0, &[1; CELL], 100, 101).len(), 1, "never written");
        assert_eq!(c.check_read(0, &stamps(0, 0, 64), 100, 101).len(), 1, "stale");
        assert!(c.check_read(0, &stamps(0, 0, 64), 1, 2).is_empty(), "raced the zeroing");
    }
}
