//! Dedup across nodes, one node's side: fetching its content summary and storing pages by
//! hash (CONTENT_SUMMARY and PUT_HASHES, `docs/protocol.md`). The cluster client decides
//! when to use them (`cluster/dedup.rs`).

#![expect(clippy::indexing_slicing, reason = "ranges of the caller's keys, computed here")]

use fallow_core::content::ContentFilter;
use fallow_core::{HashPutOutcome, PageKey};
use fallow_proto::fallow::{Reply, Request};

use crate::client::{failure, refs, runs, Client};
use crate::ClientError;

/// The largest summary a client accepts (a node advertising more is broken or hostile).
pub const MAX_SUMMARY_BYTES: u64 = 256 << 20;

/// A node rebuilt its summary this many times while we read it: give up for now.
const SUMMARY_ATTEMPTS: usize = 3;

impl Client {
    /// The node's content summary: a Bloom filter of the content hashes it holds, read in
    /// pieces of at most 1 MiB. Restarts if the node rebuilds it midway (at most three
    /// times). The empty filter when the node holds nothing.
    pub async fn content_summary(&self) -> Result<ContentFilter, ClientError> {
        'attempt: for _ in 0..SUMMARY_ATTEMPTS {
            let first = self.summary_piece(0).await?;
            if first.total_len > MAX_SUMMARY_BYTES {
                return Err(ClientError::Protocol(format!(
                    "content summary of {} bytes, over the {MAX_SUMMARY_BYTES} a client accepts",
                    first.total_len
                )));
            }
            let mut bytes = Vec::with_capacity(first.total_len as usize);
            bytes.extend_from_slice(&first.data);
            while (bytes.len() as u64) < first.total_len {
                let piece = self.summary_piece(bytes.len() as u64).await?;
                if piece.generation != first.generation {
                    continue 'attempt;
                }
                if piece.data.is_empty() {
                    return Err(ClientError::Protocol("an empty content summary piece".into()));
                }
                bytes.extend_from_slice(&piece.data);
            }
            return ContentFilter::from_parts(&bytes, first.hashes, first.entries)
                .map_err(|e| ClientError::Protocol(format!("content summary: {e}")));
        }
        Err(ClientError::Protocol(format!(
            "the node rebuilt its content summary {SUMMARY_ATTEMPTS} times while it was read"
        )))
    }

    async fn summary_piece(
        &self,
        offset: u64,
    ) -> Result<fallow_proto::fallow::SummaryChunk, ClientError> {
        match self.request(&Request::ContentSummary { offset }, 0).await? {
            Reply::Summary(piece) if piece.offset == offset => Ok(piece),
            Reply::Summary(piece) => Err(ClientError::Protocol(format!(
                "asked for the summary from byte {offset}, got byte {}",
                piece.offset
            ))),
            other => Err(failure(other, None)),
        }
    }

    /// Stores pages by content hash: `contents[i]` is the content hash
    /// (`fallow_core::content::content_hash` with the pool's dedup scope) and CRC-32C of
    /// the page for `keys[i]`. [`HashPutOutcome::NotHeld`] means the node does not hold
    /// that content: send the page with [`Client::put_many`].
    pub async fn put_hashes(
        &self,
        keys: &[PageKey],
        contents: &[(u128, u32)],
    ) -> Result<Vec<HashPutOutcome>, ClientError> {
        if keys.len() != contents.len() {
            return Err(ClientError::BadLength { got: contents.len(), expected: keys.len() });
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let max = self.max_batch().await?;
        let requests = runs(keys, max).map(|(pool, range)| {
            let request = Request::PutHashes {
                pool,
                pages: refs(&keys[range.clone()]),
                contents: contents[range.clone()].to_vec(),
            };
            let n = range.len();
            async move {
                match self.request(&request, n).await? {
                    Reply::PutHashes(outcomes) => Ok(outcomes),
                    other => Err(failure(other, Some(pool))),
                }
            }
        });
        let parts = futures::future::try_join_all(requests).await?;
        Ok(parts.into_iter().flatten().collect())
    }
}
