//! Reading the journals back after a crash: every file's records in order, each key
//! ending with what its last record says, and the pages that are left handed to the caller
//! to put again.
//!
//! ```text
//!  STATE/journal/          the running node's journals (one file per shard)
//!  STATE/journal.replay/   the same files, renamed at the start that recovers them
//!  STATE/journal.done/     journal.replay renamed once its pages are back in the engine
//!                          (and journaled anew), then removed
//! ```
//!
//! A start that finds `journal.replay` was itself interrupted while recovering: nothing
//! was acknowledged since (the node serves only after [`Recovered::finish`]), so the
//! half-written `journal` beside it is dropped and the replay starts over. The rename to
//! `journal.done` is what makes the end of a recovery one step: a crash while its files
//! are being removed leaves `journal.done` (removed at the next start) and the complete
//! new `journal`, never a half-removed `journal.replay` that would be taken for the
//! journals to replay.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use fallow_core::{PageKey, PoolId, PAGE_SIZE};
use memmap2::Mmap;

use super::{Record, FILE_HEADER, MAGIC};

/// Where a recovered page's bytes are.
#[derive(Debug, Clone, Copy)]
enum Held {
    /// In file `file` of the replay, at byte `at`.
    Page { file: usize, at: usize },
    /// Every word is this one.
    Fill(u64),
}

/// What reading the journals found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Journal files read.
    pub files: usize,
    /// Records that decoded and passed their checksum.
    pub records: u64,
    /// Files whose end did not decode: the record a crash cut short, which belonged to a
    /// request never answered. Its file is read up to it.
    pub torn: usize,
    /// Files that are not journals (another magic): left out.
    pub foreign: usize,
    /// Files emptied when their journal stopped after a failed write (a full state
    /// directory): the persistent pages of their shard are lost.
    pub stopped: usize,
    /// Pages left to put again.
    pub pages: usize,
    /// Bytes read.
    pub bytes: u64,
}

/// The pages of a crashed node's journals, ready to be put again.
pub struct Recovered {
    dir: PathBuf,
    maps: Vec<Mmap>,
    pages: Vec<(PageKey, Held)>,
    report: RecoveryReport,
}

impl std::fmt::Debug for Recovered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recovered").field("dir", &self.dir).field("report", &self.report).finish()
    }
}

/// The running journals' directory in state directory `state`.
pub fn journal_dir(state: &Path) -> PathBuf {
    state.join("journal")
}

fn replay_dir(state: &Path) -> PathBuf {
    state.join("journal.replay")
}

/// Where replayed journals go to be removed: removing files one by one is not atomic, and
/// a start must never mistake a half-removed `journal.replay` for the journals to replay
/// (it would drop the complete new journal for it).
fn done_dir(state: &Path) -> PathBuf {
    state.join("journal.done")
}

/// Removes `replay` as one step: renamed to [`done_dir`], then deleted.
fn remove_replayed(replay: &Path) -> io::Result<()> {
    let done = replay.with_file_name("journal.done");
    if done.exists() {
        std::fs::remove_dir_all(&done)?;
    }
    std::fs::rename(replay, &done)?;
    std::fs::remove_dir_all(&done)
}

/// Sets the journals of the last run in `state` aside and reads them; `None` when there
/// are none. The engine can start journaling into [`journal_dir`] as soon as this
/// returns. Records are checked one by one; a file is read up to its first record that
/// does not decode.
pub fn recover(state: &Path) -> io::Result<Option<Recovered>> {
    let (live, replay) = (journal_dir(state), replay_dir(state));
    // Journals replayed before, whose removal a crash cut short.
    let done = done_dir(state);
    if done.exists() {
        std::fs::remove_dir_all(&done)?;
    }
    if replay.exists() {
        if live.exists() {
            std::fs::remove_dir_all(&live)?;
        }
    } else if live.exists() {
        std::fs::rename(&live, &replay)?;
    } else {
        return Ok(None);
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir(&replay)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("shard-") && path.extension().is_none()
        })
        .collect();
    names.sort();
    let mut report = RecoveryReport::default();
    let mut maps = Vec::new();
    let mut pages = Vec::new();
    for path in names {
        let file = File::open(&path)?;
        // SAFETY: the file is this node's own journal, which nothing else writes: the
        // process that wrote it is gone, and the journals of this one go to another
        // directory.
        let map = unsafe { Mmap::map(&file)? };
        report.files += 1;
        report.bytes += map.len() as u64;
        if map.is_empty() {
            // Every journal starts with its header; only a journal that stopped after a
            // failed append is emptied (`Journal::stop`).
            report.stopped += 1;
            continue;
        }
        if map.len() < FILE_HEADER || &map[..MAGIC.len()] != MAGIC {
            tracing::warn!(file = %path.display(), "not a journal file; left out");
            report.foreign += 1;
            continue;
        }
        let file_index = maps.len();
        let (held, records, torn) = replay_file(&map, file_index);
        report.records += records;
        if torn {
            report.torn += 1;
        }
        pages.extend(
            held.into_iter()
                .map(|((pool, object, index), h)| (PageKey::new(PoolId(pool), object, index), h)),
        );
        maps.push(map);
    }
    report.pages = pages.len();
    Ok(Some(Recovered { dir: replay, maps, pages, report }))
}

type Key = (u32, u64, u64);

/// One file's records applied in order; what each key holds at the end, the records read,
/// and whether the file ended in a record that did not decode.
fn replay_file(bytes: &[u8], file: usize) -> (BTreeMap<Key, Held>, u64, bool) {
    let mut held = BTreeMap::new();
    let mut at = FILE_HEADER;
    let mut records = 0;
    let drop_range = |held: &mut BTreeMap<Key, Held>, from: Key, to: Key| {
        let gone: Vec<Key> = held.range(from..=to).map(|(k, _)| *k).collect();
        for key in gone {
            held.remove(&key);
        }
    };
    while at < bytes.len() {
        let Some((record, len)) = Record::decode(&bytes[at..]) else {
            // The file is allocated ahead of its appends, in zeros: the records end where
            // they start. Anything else is a record the crash cut short.
            let torn = bytes[at..].iter().any(|b| *b != 0);
            return (held, records, torn);
        };
        match record {
            Record::Page(key, _) => {
                held.insert((key.pool.0, key.object, key.index), Held::Page { file, at });
            }
            Record::Fill(key, word) => {
                held.insert((key.pool.0, key.object, key.index), Held::Fill(word));
            }
            Record::Gone(key) => {
                held.remove(&(key.pool.0, key.object, key.index));
            }
            Record::ObjectGone(pool, object) => {
                drop_range(&mut held, (pool.0, object, 0), (pool.0, object, u64::MAX));
            }
            Record::PoolGone(pool) => {
                drop_range(&mut held, (pool.0, 0, 0), (pool.0, u64::MAX, u64::MAX));
            }
        }
        records += 1;
        at += len;
    }
    (held, records, false)
}

impl Recovered {
    /// What was read.
    pub fn report(&self) -> RecoveryReport {
        self.report
    }

    /// The pools that recovered pages belong to, in order, each once.
    pub fn pools(&self) -> Vec<PoolId> {
        let mut pools: Vec<PoolId> = self.pages.iter().map(|(k, _)| k.pool).collect();
        pools.dedup();
        pools
    }

    /// Calls `put` with up to `batch` keys and their pages at a time, in key order.
    pub fn for_each_batch(&self, batch: usize, mut put: impl FnMut(&[PageKey], &[u8])) {
        let batch = batch.max(1);
        let mut keys = Vec::with_capacity(batch);
        let mut data = vec![0u8; batch * PAGE_SIZE];
        for chunk in self.pages.chunks(batch) {
            keys.clear();
            for (i, (key, held)) in chunk.iter().enumerate() {
                let out = &mut data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                match *held {
                    Held::Page { file, at } => {
                        // Decoded (and checked) once already, when the file was read.
                        let Some((Record::Page(_, page), _)) =
                            Record::decode(&self.maps[file][at..])
                        else {
                            unreachable!("a page record read before no longer decodes")
                        };
                        out.copy_from_slice(page);
                    }
                    Held::Fill(word) => fallow_core::content::write_fill(word, out),
                }
                keys.push(*key);
            }
            put(&keys, &data[..keys.len() * PAGE_SIZE]);
        }
    }

    /// Removes the journals read, once their pages are back in the engine (and journaled
    /// anew). Until this succeeds, the node must not serve: a later start would replay
    /// these files again and drop what was journaled since.
    pub fn finish(self) -> io::Result<()> {
        drop(self.maps);
        remove_replayed(&self.dir)
    }

    /// Removes the journals read without putting their pages back: a start that restored
    /// a newer snapshot instead.
    pub fn discard(self) -> io::Result<()> {
        self.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{write_header, write_record};
    use super::*;

    fn file_of(records: &[Record<'_>]) -> Vec<u8> {
        let mut bytes = Vec::new();
        write_header(&mut bytes).unwrap();
        for record in records {
            write_record(&mut bytes, *record, None).unwrap();
        }
        bytes
    }

    fn key(object: u64, index: u64) -> PageKey {
        PageKey::new(PoolId(1), object, index)
    }

    fn kept(bytes: &[u8]) -> Vec<(Key, bool)> {
        let (held, _, _) = replay_file(bytes, 0);
        held.into_iter().map(|(k, h)| (k, matches!(h, Held::Page { .. }))).collect()
    }

    #[test]
    fn the_last_record_of_each_key_wins_and_removals_remove() {
        let page = vec![1u8; PAGE_SIZE];
        let bytes = file_of(&[
            Record::Page(key(1, 0), &page),
            Record::Page(key(1, 1), &page),
            Record::Fill(key(1, 0), 7),
            Record::Page(key(2, 0), &page),
            Record::Gone(key(1, 1)),
            Record::Page(key(3, 5), &page),
            Record::ObjectGone(PoolId(1), 2),
            Record::Page(PageKey::new(PoolId(9), 0, 0), &page),
            Record::PoolGone(PoolId(9)),
            Record::Page(key(2, 4), &page),
        ]);
        assert_eq!(
            kept(&bytes),
            [((1, 1, 0), false), ((1, 2, 4), true), ((1, 3, 5), true)],
            "a fill overwrote a page; a take, an object and a pool went; a page came after"
        );
    }

    #[test]
    fn a_torn_last_record_ends_the_file_and_what_came_before_stays() {
        let page = vec![3u8; PAGE_SIZE];
        let mut bytes = file_of(&[Record::Page(key(1, 0), &page), Record::Page(key(1, 1), &page)]);
        let whole = bytes.len();
        bytes.truncate(whole - 100);
        let (held, records, torn) = replay_file(&bytes, 0);
        assert_eq!((held.len(), records, torn), (1, 1, true));
        // The zeros a file is allocated with, after its last record, are its end: not torn.
        let mut padded = file_of(&[Record::Page(key(1, 0), &page)]);
        padded.resize(padded.len() + 3 * PAGE_SIZE, 0);
        let (held, records, torn) = replay_file(&padded, 0);
        assert_eq!((held.len(), records, torn), (1, 1, false));
        // A bit flipped in the first record's page ends the file there: nothing after a
        // record that does not hold is trusted.
        let mut flipped = file_of(&[Record::Page(key(1, 0), &page), Record::Gone(key(1, 0))]);
        flipped[FILE_HEADER + 100] ^= 4;
        let (held, records, torn) = replay_file(&flipped, 0);
        assert_eq!((held.len(), records, torn), (0, 0, true));
    }

    #[test]
    fn recovery_sets_the_journals_aside_and_an_interrupted_one_starts_over() {
        let state =
            std::env::temp_dir().join(format!("fallow-recover-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        assert!(recover(&state).unwrap().is_none(), "nothing to recover");
        std::fs::create_dir_all(journal_dir(&state)).unwrap();
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| i as u8).collect();
        let bytes = file_of(&[Record::Page(key(1, 0), &page), Record::Fill(key(1, 1), 9)]);
        std::fs::write(journal_dir(&state).join("shard-0000"), &bytes).unwrap();
        std::fs::write(journal_dir(&state).join("shard-0001"), b"something else").unwrap();
        std::fs::write(journal_dir(&state).join("shard-0002.compacting"), b"half").unwrap();
        // Emptied when it stopped after a failed write.
        std::fs::write(journal_dir(&state).join("shard-0003"), b"").unwrap();
        let first = recover(&state).unwrap().unwrap();
        assert!(!journal_dir(&state).exists() && replay_dir(&state).exists());
        let r = first.report();
        assert_eq!((r.files, r.foreign, r.stopped, r.pages), (3, 1, 1, 2));
        drop(first);
        // The start that read them died before finishing: its new journal is dropped and
        // the same files are read again.
        std::fs::create_dir_all(journal_dir(&state)).unwrap();
        let again = recover(&state).unwrap().unwrap();
        assert!(!journal_dir(&state).exists());
        let mut seen = Vec::new();
        again.for_each_batch(1, |keys, pages| seen.push((keys[0], pages.to_vec())));
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0], (key(1, 0), page.clone()));
        assert_eq!(seen[1].1, 9u64.to_le_bytes().repeat(PAGE_SIZE / 8));
        again.finish().unwrap();
        assert!(!replay_dir(&state).exists());
        std::fs::remove_dir_all(&state).unwrap();
    }

    /// A crash while the replayed journals were being removed must not lose what the new
    /// journal holds: the replayed ones are renamed out of the way before any file goes.
    #[test]
    fn a_crash_while_removing_the_replayed_journals_keeps_the_new_journal() {
        let state =
            std::env::temp_dir().join(format!("fallow-recover-done-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(journal_dir(&state)).unwrap();
        let old = file_of(&[Record::Fill(key(1, 0), 1), Record::Fill(key(1, 1), 1)]);
        std::fs::write(journal_dir(&state).join("shard-0000"), &old).unwrap();
        std::fs::write(journal_dir(&state).join("shard-0001"), &old).unwrap();
        let first = recover(&state).unwrap().unwrap();
        // The recovered pages are journaled anew, with a later change of one of them.
        std::fs::create_dir_all(journal_dir(&state)).unwrap();
        let new = file_of(&[Record::Fill(key(1, 0), 1), Record::Fill(key(1, 1), 2)]);
        std::fs::write(journal_dir(&state).join("shard-0000"), &new).unwrap();
        // The removal is cut short after its rename and one file.
        drop(first);
        std::fs::rename(replay_dir(&state), done_dir(&state)).unwrap();
        std::fs::remove_file(done_dir(&state).join("shard-0000")).unwrap();
        let next = recover(&state).unwrap().unwrap();
        assert!(!done_dir(&state).exists(), "the half-removed journals are gone");
        let mut seen = Vec::new();
        next.for_each_batch(8, |keys, pages| {
            for (i, key) in keys.iter().enumerate() {
                seen.push((*key, pages[i * PAGE_SIZE]));
            }
        });
        assert_eq!(seen, [(key(1, 0), 1), (key(1, 1), 2)], "the new journal, whole");
        next.finish().unwrap();
        std::fs::remove_dir_all(&state).unwrap();
    }
}
