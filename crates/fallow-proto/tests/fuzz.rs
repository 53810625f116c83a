//! The decoder under random and mutated input: whatever bytes arrive, splitting frames and
//! parsing bodies return a value or an error, never a panic, and valid requests survive an
//! encode–decode round trip unchanged. This is the proptest-driven fuzz run CI does on every
//! build (`FALLOW_FUZZ_CASES` raises the case count for a longer local run).

use bytes::{Bytes, BytesMut};
use fallow_core::{DedupScope, PoolId, PoolKind, PoolSpec, Sharing, TrustDomain, PAGE_SIZE};
use fallow_proto::fallow::frame::decode;
use fallow_proto::fallow::{Hello, Op, PageRef, Reply, Request, Session, MAX_BATCH};
use proptest::prelude::*;

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("FALLOW_FUZZ_CASES").ok().and_then(|v| v.parse().ok());
    ProptestConfig { cases: cases.unwrap_or(default), ..ProptestConfig::default() }
}

/// Splits `bytes` into frames and parses each as a request and as a reply to every op.
fn chew(bytes: &[u8]) {
    let mut buf = BytesMut::from(bytes);
    while let Ok(Some(frame)) = decode(&mut buf) {
        let _ = Request::parse(frame.clone());
        for op in Op::ALL {
            for keys in [0, 1, 3, MAX_BATCH] {
                let _ = Reply::parse(frame.clone(), op, keys);
            }
        }
    }
}

fn page_refs() -> impl Strategy<Value = Vec<PageRef>> {
    prop::collection::vec(
        (any::<u64>(), any::<u64>()).prop_map(|(object, index)| PageRef { object, index }),
        1..=8,
    )
}

fn spec() -> impl Strategy<Value = PoolSpec> {
    (
        any::<bool>(),
        prop::option::of(any::<u128>()),
        prop::option::of(any::<u64>()),
        any::<bool>(),
        prop::option::of(any::<u64>()),
    )
        .prop_map(|(persistent, uuid, domain, compress, quota)| PoolSpec {
            kind: if persistent { PoolKind::Persistent } else { PoolKind::Ephemeral },
            sharing: uuid.map_or(Sharing::Private, |uuid| Sharing::Shared { uuid }),
            dedup: domain.map_or(DedupScope::Off, |d| DedupScope::Domain(TrustDomain(d))),
            compress,
            quota_pages: quota,
        })
}

fn request() -> impl Strategy<Value = Request> {
    let pool = any::<u32>().prop_map(PoolId);
    prop_oneof![
        (
            any::<u16>(),
            any::<u16>(),
            any::<u128>(),
            "[a-z0-9-]{0,64}",
            proptest::option::of(any::<(u64, u32, u32)>())
        )
            .prop_map(|(a, b, client_id, name, session)| Request::Hello(Hello {
                version_min: a.min(b),
                version_max: a.max(b),
                client_id,
                name,
                session: session.map(|(id, epoch, fence_below)| Session { id, epoch, fence_below }),
            })),
        (any::<[u8; 32]>(), any::<[u8; 32]>())
            .prop_map(|(client_nonce, proof)| Request::Auth { client_nonce, proof }),
        Just(Request::Ping),
        Just(Request::Stats),
        Just(Request::Members),
        spec().prop_map(Request::CreatePool),
        spec().prop_map(Request::CreateClusterPool),
        pool.clone().prop_map(Request::DestroyPool),
        pool.clone().prop_map(Request::InvalidatePool),
        (pool.clone(), any::<u64>())
            .prop_map(|(pool, object)| Request::InvalidateObject { pool, object }),
        (pool.clone(), page_refs())
            .prop_map(|(pool, pages)| Request::InvalidatePages { pool, pages }),
        (pool.clone(), page_refs()).prop_map(|(pool, pages)| Request::Get { pool, pages }),
        (pool.clone(), page_refs()).prop_map(|(pool, pages)| Request::Take { pool, pages }),
        (pool, page_refs(), any::<u8>()).prop_map(|(pool, pages, fill)| {
            let data = Bytes::from(vec![fill; pages.len() * PAGE_SIZE]);
            Request::Put { pool, pages, data }
        }),
    ]
}

proptest! {
    // The bulk of the fuzz run: cheap cases, many of them (about 10 s in a debug build).
    #![proptest_config(cases(40_000))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        chew(&bytes);
    }

    #[test]
    fn random_bodies_behind_a_valid_header_never_panic(
        op in any::<u8>(),
        status in any::<u8>(),
        body in prop::collection::vec(any::<u8>(), 0..600),
    ) {
        let mut buf = BytesMut::new();
        fallow_proto::fallow::frame::encode(&mut buf, op, status, 1, &body);
        chew(&buf);
    }

}

proptest! {
    #![proptest_config(cases(4000))]

    #[test]
    fn requests_round_trip(request in request(), id in any::<u64>()) {
        let mut buf = BytesMut::new();
        request.encode(id, &mut buf);
        let frame = decode(&mut buf).unwrap().unwrap();
        prop_assert!(buf.is_empty());
        prop_assert_eq!(frame.id, id);
        prop_assert_eq!(Request::parse(frame).unwrap(), request);
    }

    #[test]
    fn mutated_requests_never_panic(
        request in request(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut buf = BytesMut::new();
        request.encode(7, &mut buf);
        let mut bytes = buf.to_vec();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        chew(&bytes);
        chew(&bytes[..cut.index(bytes.len())]);
    }
}
