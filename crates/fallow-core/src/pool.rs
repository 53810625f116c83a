//! What kind of pool to create: ephemeral or persistent, private or shared, and how far its
//! pages may be deduplicated.

/// How long a pool keeps what it is given (`docs/semantics.md`, "Pool kinds").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// A clean-page cache: a put may be dropped, a stored page may vanish at any moment, a
    /// get may miss. Losing a page costs its owner only a re-read.
    Ephemeral,
    /// A put is either refused or kept until it is invalidated; pages are never evicted.
    Persistent,
}

/// Who may reach a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sharing {
    /// Only the client that created it (the node enforces this; the engine only records it).
    Private,
    /// Any client that presents this 128-bit UUID. Creating a shared pool whose UUID is
    /// already known attaches to the existing pool instead.
    Shared {
        /// The pool's UUID, as 128 bits.
        uuid: u128,
    },
}

/// A tenant boundary for deduplication: pages are shared only between pools of the same
/// trust domain, because cross-tenant dedup is a timing side channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TrustDomain(pub u64);

/// How far a pool's pages may share frames with identical pages elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DedupScope {
    /// Identical pages share a frame only with pages of pools in the same trust domain.
    /// Zero-filled and same-filled pages never cost a frame, whatever the scope.
    Domain(TrustDomain),
    /// Every distinct put gets its own frame (zero- and same-filled pages still cost none).
    Off,
}

/// Everything needed to create a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSpec {
    /// Ephemeral or persistent.
    pub kind: PoolKind,
    /// Private or shared by UUID.
    pub sharing: Sharing,
    /// Which pages may share frames.
    pub dedup: DedupScope,
    /// Compress pages that stay cold, in the background. Off by default.
    pub compress: bool,
    /// The most logical pages this pool may hold; `None` means bounded only by the store.
    /// A persistent put over the quota is refused.
    pub quota_pages: Option<u64>,
}

impl PoolSpec {
    /// A private pool of `kind` in trust domain 0, without compression or quota.
    pub const fn new(kind: PoolKind) -> Self {
        Self {
            kind,
            sharing: Sharing::Private,
            dedup: DedupScope::Domain(TrustDomain(0)),
            compress: false,
            quota_pages: None,
        }
    }

    /// A private ephemeral pool (a clean-page cache).
    pub const fn ephemeral() -> Self {
        Self::new(PoolKind::Ephemeral)
    }

    /// A private persistent pool.
    pub const fn persistent() -> Self {
        Self::new(PoolKind::Persistent)
    }

    /// Makes the pool shared under `uuid`.
    pub const fn shared(mut self, uuid: u128) -> Self {
        self.sharing = Sharing::Shared { uuid };
        self
    }

    /// Sets the dedup scope.
    pub const fn dedup(mut self, dedup: DedupScope) -> Self {
        self.dedup = dedup;
        self
    }

    /// Turns background compression of cold pages on or off.
    pub const fn compress(mut self, on: bool) -> Self {
        self.compress = on;
        self
    }

    /// Limits the pool to `pages` logical pages.
    pub const fn quota_pages(mut self, pages: u64) -> Self {
        self.quota_pages = Some(pages);
        self
    }
}
