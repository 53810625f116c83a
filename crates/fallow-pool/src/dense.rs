//! Dense 32-bit ids over a `Vec`, recycled through a free list: how slots, contents, object
//! entries and fill words get their ids, so that other tables can name them in 4 bytes.

/// Stores `value` under a free id if there is one, else under a new one at the end, and
/// returns the id.
pub(crate) fn place<T>(entries: &mut Vec<T>, free: &mut Vec<u32>, value: T) -> u32 {
    match free.pop() {
        Some(id) => {
            entries[id as usize] = value;
            id
        }
        None => {
            entries.push(value);
            u32::try_from(entries.len() - 1).expect("dense ids fit in 32 bits")
        }
    }
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
}
