//! Dense 32-bit ids over a `Vec`, recycled through a free list: how slots, contents, object
//! entries and fill words get their ids, so that other tables can name them in 4 bytes.

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
    match free.pop() {
        Some(id) => {
            entries[id as usize] = value;
            id
        }
        None => {
            grow(entries, entries.len() + 1, expected);
            entries.push(value);
            u32::try_from(entries.len() - 1).expect("dense ids fit in 32 bits")
        }
    }
}

/// Makes room in `entries` for `len` entries. Below `expected` it doubles, as `Vec` does,
/// but stops at `expected`, so that a table that fills to the size it was told to expect
/// ends with no unused capacity (which `heap_bytes` would count, and whose doublings leave
/// freed blocks in the heap); past `expected` it grows by a quarter; with no expected
/// size (0), it doubles. Never allocates ahead of use: a budget of terabytes costs nothing
/// until pages come.
pub(crate) fn grow<T>(entries: &mut Vec<T>, len: usize, expected: usize) {
    let cap = entries.capacity();
    if len <= cap {
        return;
    }
    let target = if expected == 0 {
        (cap * 2).max(len)
    } else if len <= expected {
        (cap * 2).max(16).min(expected)
    } else {
        (cap + cap / 4).max(len)
    };
    entries.reserve_exact(target.max(len) - entries.len());
}

/// Ids to expect in a shard's tables when it holds `pages` pages when full: keys fall into
/// shards by hash, so a shard's share of a full cache varies by a few standard deviations
/// (√pages) around its mean; room for four of them keeps a full shard from growing.
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
    fn a_table_fills_to_its_expected_size_with_no_spare_capacity() {
        let (mut entries, mut free) = (Vec::new(), Vec::new());
        for i in 0..1000u32 {
            place_expecting(&mut entries, &mut free, i, 1000);
        }
        assert_eq!(entries.capacity(), 1000);
        place_expecting(&mut entries, &mut free, 1000, 1000);
        assert_eq!(entries.capacity(), 1250, "past it, a quarter more");
        let mut plain = Vec::new();
        grow(&mut plain, 1000, 0);
        plain.extend(0..1000u32);
        grow(&mut plain, 1001, 0);
        assert!(plain.capacity() >= 2000, "with no expected size, it doubles");
    }
}
