//! Dense 32-bit ids over a `Vec`, recycled through a free list: how slots, spans and fill
//! words get their ids, so that other tables can name them in 4 bytes.

/// Stores `value` under a free id if there is one, else under a new one at the end, and
/// returns the id.
pub(crate) fn place<T>(entries: &mut Vec<T>, free: &mut Vec<u32>, value: T) -> u32 {
    place_expecting(entries, free, value, 0)
}

/// [`place`] for a table expected to hold `expected` entries when full (see [`grow`]).
pub(crate) fn place_expecting<T>(
    entries: &mut Vec<T>,
    free: &mut Vec<u32>,
    value: T,
    expected: usize,
) -> u32 {
    place_with(entries, free, value, |e, len| grow(e, len, expected))
}

#[inline]
fn place_with<T>(
    entries: &mut Vec<T>,
    free: &mut Vec<u32>,
    value: T,
    grow: impl FnOnce(&mut Vec<T>, usize),
) -> u32 {
    match free.pop() {
        Some(id) => {
            entries[id as usize] = value;
            id
        }
        None => {
            grow(entries, entries.len() + 1);
            entries.push(value);
            u32::try_from(entries.len() - 1).expect("dense ids fit in 32 bits")
        }
    }
}

/// Makes room in `entries` for `len` entries, for a table expected to hold `expected`
/// when full: the first growth reserves all of `expected` at once (address space: the
/// pages are only resident once entries are written, and dense ids are written in
/// order), so the table never copies itself nor leaves freed blocks of earlier sizes in
/// the heap; should that reservation fail (a budget of terabytes on a small machine), it
/// doubles up to `expected` instead. Past `expected` it grows by a quarter; with no
/// expected size (0), it doubles. Report such a table's memory by its length, not its
/// capacity ([`resident_bytes`]).
pub(crate) fn grow<T>(entries: &mut Vec<T>, len: usize, expected: usize) {
    let cap = entries.capacity();
    if len <= cap {
        return;
    }
    if len <= expected && entries.try_reserve_exact(expected - entries.len()).is_ok() {
        return;
    }
    grow_capped(entries, len, expected);
}

/// Makes room in `entries` for `len` entries, doubling as `Vec` does but stopping at `cap`;
/// past it, by a quarter; with no bound (0), doubling. [`grow`]'s way when its
/// reservation fails.
fn grow_capped<T>(entries: &mut Vec<T>, len: usize, cap: usize) {
    let now = entries.capacity();
    if len <= now {
        return;
    }
    let target = if cap == 0 {
        (now * 2).max(len)
    } else if len <= cap {
        (now * 2).max(16).min(cap)
    } else {
        (now + now / 4).max(len)
    };
    entries.reserve_exact(target.max(len) - entries.len());
}

/// The memory of a table grown by [`grow`]: its entries, written and so resident; the
/// rest of its reservation is address space until written.
pub(crate) fn resident_bytes<T>(entries: &[T]) -> usize {
    std::mem::size_of_val(entries)
}

/// Ids to expect in a shard's tables when it holds `pages` pages when full. A dense
/// object's runs spread over the shards exactly (`hashing::shard_of`); scattered pages go
/// run by run by hash, so a shard's share of them varies around its mean by up to
/// √pages a standard deviation, and room for four of those keeps a full shard from
/// growing.
pub(crate) fn with_headroom(pages: usize) -> usize {
    pages + 4 * (pages as f64).sqrt() as usize + 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_ids_are_reused_before_new_ones() {
        let (mut entries, mut free) = (Vec::new(), Vec::new());
        assert_eq!(place(&mut entries, &mut free, 'a'), 0);
        assert_eq!(place(&mut entries, &mut free, 'b'), 1);
        free.push(0);
        assert_eq!(place(&mut entries, &mut free, 'c'), 0);
        assert_eq!(entries, ['c', 'b']);
        assert_eq!(place(&mut entries, &mut free, 'd'), 2);
    }

    #[test]
    fn a_table_reserves_its_expected_size_once_and_grows_by_a_quarter_past_it() {
        let (mut entries, mut free) = (Vec::new(), Vec::new());
        place_expecting(&mut entries, &mut free, 0u32, 1000);
        assert_eq!(entries.capacity(), 1000, "the whole expected size at the first growth");
        let at = entries.as_ptr();
        for i in 1..1000u32 {
            place_expecting(&mut entries, &mut free, i, 1000);
        }
        assert_eq!(entries.as_ptr(), at, "never moved while filling");
        assert_eq!(resident_bytes(&entries), 4000);
        place_expecting(&mut entries, &mut free, 1000, 1000);
        assert_eq!(entries.capacity(), 1250, "past it, a quarter more");
    }

    #[test]
    fn a_capped_table_doubles_up_to_its_cap() {
        let mut entries: Vec<u32> = Vec::new();
        for len in 1..=1000 {
            grow_capped(&mut entries, len, 1000);
            entries.push(0);
        }
        assert_eq!(entries.capacity(), 1000);
        let mut plain: Vec<u32> = Vec::new();
        grow_capped(&mut plain, 1000, 0);
        plain.extend(0..1000u32);
        grow_capped(&mut plain, 1001, 0);
        assert!(plain.capacity() >= 2000, "with no cap, it doubles");
    }
}
