//! Cutting a byte range into page-sized pieces: an unaligned head, whole pages, an
//! unaligned tail. The cache works in whole pages; a piece that covers part of a page is
//! served from (or written through to) the backing store around it.

use fallow_core::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;

/// One page's share of a byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The page number.
    pub page: u64,
    /// Where the piece starts inside the page.
    pub start: usize,
    /// Where it ends inside the page (exclusive).
    pub end: usize,
}

impl Piece {
    /// True when the piece covers its whole page.
    pub fn is_whole(&self) -> bool {
        self.start == 0 && self.end == PAGE_SIZE
    }

    /// Bytes in the piece.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// True for an empty piece (never produced by [`pieces`]).
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// The pieces of `offset..offset + len`, in order: at most one partial piece at each end.
pub fn pieces(offset: u64, len: u64) -> impl Iterator<Item = Piece> {
    let end = offset + len;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let page = at / PAGE;
        let start = (at - page * PAGE) as usize;
        let stop = (end - page * PAGE).min(PAGE) as usize;
        at = page * PAGE + stop as u64;
        Some(Piece { page, start, end: stop })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn head_body_tail() {
        let got: Vec<Piece> = pieces(4000, 4096 * 2 + 200).collect();
        assert_eq!(
            got,
            vec![
                Piece { page: 0, start: 4000, end: 4096 },
                Piece { page: 1, start: 0, end: 4096 },
                Piece { page: 2, start: 0, end: 4096 },
                Piece { page: 3, start: 0, end: 104 },
            ]
        );
        assert_eq!(
            pieces(8192, 4096).collect::<Vec<_>>(),
            vec![Piece { page: 2, start: 0, end: 4096 }]
        );
        assert_eq!(pieces(10, 0).count(), 0);
        assert_eq!(pieces(10, 5).collect::<Vec<_>>(), vec![Piece { page: 0, start: 10, end: 15 }]);
    }

    proptest! {
        #[test]
        fn pieces_tile_the_range(offset in 0u64..1 << 40, len in 0u64..100_000) {
            let all: Vec<Piece> = pieces(offset, len).collect();
            let total: usize = all.iter().map(|p| p.len()).sum();
            prop_assert_eq!(total as u64, len);
            let mut at = offset;
            for (i, p) in all.iter().enumerate() {
                prop_assert_eq!(p.page * PAGE + p.start as u64, at);
                prop_assert!(!p.is_empty());
                if i > 0 && i + 1 < all.len() {
                    prop_assert!(p.is_whole());
                }
                at += p.len() as u64;
            }
        }
    }
}
