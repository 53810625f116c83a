//! The engine's content summary: a Bloom filter of the dedup keys of every page it holds
//! in a dedup pool (`fallow_core::content::dedup_key`: the stored checksum, masked by the
//! page's trust domain), which a node hands to clients (CONTENT_SUMMARY) so that they can
//! send a hash instead of a page the engine already holds (`Engine::put_many_by_hash`).

use fallow_core::content::ContentFilter;

use crate::engine::Engine;

/// Content slots visited per hold of the store's read lock: a few hundred microseconds,
/// so puts (which need the write lock) wait no longer than that while a summary is built.
const SLOTS_PER_STEP: usize = 16 * 1024;

impl Engine {
    /// Builds a filter of the dedup keys of the contents held now, sized for the number of stored
    /// contents at `false_positive_rate`, at most `max_bytes`. Walks the content table in
    /// steps, releasing the store lock between them: a page stored meanwhile may be
    /// missing from the filter and one released meanwhile may linger, both harmless (a
    /// page sent whole, or a "not held" answer).
    pub fn content_filter(&self, false_positive_rate: f64, max_bytes: usize) -> ContentFilter {
        let contents = self.inner().store.read().usage().contents as u64;
        let mut filter = ContentFilter::sized(contents, false_positive_rate, max_bytes);
        if filter.is_empty() {
            return filter;
        }
        let mut next = Some(0);
        while let Some(from) = next {
            let store = self.inner().store.read();
            next = store.visit_dedup_keys(from, SLOTS_PER_STEP, &mut |key| filter.insert(key));
        }
        filter
    }
}

#[cfg(test)]
mod tests {
    use fallow_core::content::{checksum, content_hash, page_dedup_key};
    use fallow_core::{
        DedupScope, HashPutOutcome, Lookup, NotStored, PageKey, PageStore, PoolSpec, PutOutcome,
        TrustDomain, PAGE_SIZE,
    };

    use crate::{Engine, EngineBuilder};

    const DOMAIN: DedupScope = DedupScope::Domain(TrustDomain(5));

    fn engine() -> Engine {
        Engine::new(EngineBuilder::new(8 << 20).build().unwrap())
    }

    /// A page distinct for every seed and never a fill page (its first byte differs).
    fn page(seed: u8) -> Vec<u8> {
        let mut page = vec![seed; PAGE_SIZE];
        page[0] = seed.wrapping_add(1);
        page
    }

    fn digest(page: &[u8]) -> (u128, u32) {
        (content_hash(page, DOMAIN).unwrap(), checksum(page))
    }

    #[test]
    fn the_filter_holds_every_stored_hash_and_only_dedup_pools() {
        let engine = engine();
        let dedup = engine.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).unwrap();
        let plain = engine.create_pool(&PoolSpec::ephemeral().dedup(DedupScope::Off)).unwrap();
        for i in 1..=50u8 {
            assert_eq!(
                engine.put(PageKey::new(dedup, 1, i as u64), &page(i)).unwrap(),
                PutOutcome::Stored
            );
        }
        assert_eq!(engine.put(PageKey::new(plain, 1, 0), &page(99)).unwrap(), PutOutcome::Stored);
        // A rate of 10⁻⁶, so that the page of the plain pool cannot be a false positive.
        let filter = engine.content_filter(1e-6, 1 << 20);
        assert_eq!(filter.entries(), 50);
        let key = |i: u8| page_dedup_key(checksum(&page(i)), DOMAIN).unwrap();
        assert!((1..=50u8).all(|i| filter.contains(key(i))));
        assert!(!filter.contains(key(99)));
        let other = DedupScope::Domain(TrustDomain(6));
        let theirs = page_dedup_key(checksum(&page(1)), other).unwrap();
        assert!(!filter.contains(theirs), "a page is held for its own domain only");
        // Gone pages leave the next filter.
        engine.invalidate_object(dedup, 1).unwrap();
        assert_eq!(engine.content_filter(0.01, 1 << 20).entries(), 0);
    }

    #[test]
    fn a_put_by_hash_shares_a_held_page_and_reads_back() {
        let engine = engine();
        let pool = engine.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).unwrap();
        let other = engine.create_pool(&PoolSpec::persistent().dedup(DOMAIN)).unwrap();
        let bytes = page(7);
        assert_eq!(engine.put(PageKey::new(pool, 1, 1), &bytes).unwrap(), PutOutcome::Stored);
        let frames = engine.memory().frames_used;
        let key = PageKey::new(other, 9, 9);
        assert_eq!(
            engine.put_many_by_hash(&[key], &[digest(&bytes)]).unwrap(),
            [HashPutOutcome::Stored]
        );
        assert_eq!(engine.memory().frames_used, frames, "no new frame");
        let mut out = vec![0; PAGE_SIZE];
        assert_eq!(engine.get(key, &mut out).unwrap(), Lookup::Hit);
        assert_eq!(out, bytes);
        // The shared content outlives the first key: the persistent key pinned it.
        engine.invalidate_page(PageKey::new(pool, 1, 1)).unwrap();
        assert_eq!(engine.get(key, &mut out).unwrap(), Lookup::Hit);
        assert_eq!(out, bytes);
        engine.validate();
    }

    #[test]
    fn unknown_content_wrong_checksums_and_plain_pools_are_not_held() {
        let engine = engine();
        let pool = engine.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).unwrap();
        let plain = engine.create_pool(&PoolSpec::ephemeral().dedup(DedupScope::Off)).unwrap();
        let bytes = page(3);
        assert_eq!(engine.put(PageKey::new(pool, 1, 1), &bytes).unwrap(), PutOutcome::Stored);
        let (hash, crc) = digest(&bytes);
        // Not held changes nothing: an older page under the key stays until the bytes come.
        let key = PageKey::new(pool, 2, 2);
        assert_eq!(engine.put(key, &page(4)).unwrap(), PutOutcome::Stored);
        let got = engine
            .put_many_by_hash(
                &[key, PageKey::new(pool, 2, 3), PageKey::new(plain, 1, 1)],
                &[digest(&page(5)), (hash, crc ^ 1), (hash, crc)],
            )
            .unwrap();
        assert_eq!(got, [HashPutOutcome::NotHeld; 3]);
        let mut out = vec![0; PAGE_SIZE];
        assert!(engine.get(key, &mut out).unwrap().is_hit());
        assert_eq!(out, page(4));
        assert_eq!(engine.get(PageKey::new(pool, 2, 3), &mut out).unwrap(), Lookup::Miss);
        assert!(engine.put_many_by_hash(&[key], &[]).is_err());
        engine.validate();
    }

    /// The same page put again under its own key, by hash: the key's old page is its only
    /// holder, and must not be released before the put takes its reference.
    #[test]
    fn a_key_put_again_by_hash_keeps_its_own_content() {
        let engine = engine();
        let pool = engine.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).unwrap();
        let (key, bytes) = (PageKey::new(pool, 3, 3), page(21));
        assert_eq!(engine.put(key, &bytes).unwrap(), PutOutcome::Stored);
        let again = engine.put_many_by_hash(&[key], &[digest(&bytes)]).unwrap();
        assert_eq!(again, [HashPutOutcome::Stored]);
        let mut out = vec![0; PAGE_SIZE];
        assert_eq!(engine.get(key, &mut out).unwrap(), Lookup::Hit);
        assert_eq!(out, bytes);
        engine.validate();
    }

    #[test]
    fn a_put_by_hash_respects_the_quota() {
        let engine = engine();
        let spec = PoolSpec::persistent().dedup(DOMAIN).quota_pages(1);
        let pool = engine.create_pool(&spec).unwrap();
        let bytes = page(11);
        assert_eq!(engine.put(PageKey::new(pool, 1, 1), &bytes).unwrap(), PutOutcome::Stored);
        let got = engine.put_many_by_hash(&[PageKey::new(pool, 1, 2)], &[digest(&bytes)]).unwrap();
        assert_eq!(got, [HashPutOutcome::NotStored(NotStored::OverQuota)]);
        engine.validate();
    }
}
