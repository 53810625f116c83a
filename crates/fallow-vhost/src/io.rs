//! What a parsed request does to the export: the cache layer's read, write, flush, trim and
//! zeroing, with the data copied between the cache and the guest's buffers. Every guest
//! address goes through `vm-memory`, which checks it against the guest's memory table: a
//! buffer outside it fails that request, nothing else.

use bytes::BytesMut;
use fallow_backing::{Durability, Zeroing};
use fallow_cache::CacheLayer;
use vm_memory::{Bytes, GuestAddressSpace};

use crate::backend::{Device, Memory};
use crate::request::{Kind, Request, Status};

/// Runs a request against the export; returns its status and the bytes of data written
/// into the guest's buffers.
pub(crate) async fn run(device: &Device, memory: &Memory, request: &Request) -> (Status, u32) {
    let cache = &device.cache;
    let result: std::io::Result<u32> = match request.kind {
        Kind::In => read(cache, memory, request).await,
        Kind::Out => write(cache, memory, request).await.map(|()| 0),
        Kind::Flush => cache.flush().await.map(|()| 0),
        Kind::GetId => Ok(get_id(&device.name, memory, request)),
        Kind::Discard => discard(cache, request, None).await.map(|()| 0),
        Kind::WriteZeroes => {
            discard(cache, request, Some(Zeroing::KeepAllocated)).await.map(|()| 0)
        }
    };
    match result {
        Ok(written) => (Status::Ok, written),
        Err(err) => {
            tracing::warn!(export = %device.name, kind = request.kind.name(), offset = request.offset, len = request.data_len, %err, "virtio-blk request failed");
            (Status::IoErr, 0)
        }
    }
}

/// IN: the range from the cache, copied into the guest's buffers in order.
async fn read(cache: &CacheLayer, memory: &Memory, request: &Request) -> std::io::Result<u32> {
    let len = u32::try_from(request.data_len).map_err(std::io::Error::other)?;
    let data = cache.read(request.offset, len).await?;
    let mem = memory.memory();
    let mut at = 0usize;
    for buffer in &request.data {
        let end = at + buffer.len as usize;
        let piece = data.get(at..end).ok_or_else(|| std::io::Error::other("short read"))?;
        mem.write_slice(piece, buffer.addr).map_err(std::io::Error::other)?;
        at = end;
    }
    Ok(len)
}

/// OUT: the guest's buffers gathered, then written through the cache. Durable at the next
/// FLUSH, as a disk's write cache (the device offers VIRTIO_BLK_F_FLUSH).
async fn write(cache: &CacheLayer, memory: &Memory, request: &Request) -> std::io::Result<()> {
    let mut data = BytesMut::zeroed(request.data_len as usize);
    {
        let mem = memory.memory();
        let mut at = 0usize;
        for buffer in &request.data {
            let end = at + buffer.len as usize;
            let into = data.get_mut(at..end).ok_or_else(|| std::io::Error::other("overrun"))?;
            mem.read_slice(into, buffer.addr).map_err(std::io::Error::other)?;
            at = end;
        }
    }
    cache.write(request.offset, data.freeze(), Durability::AtFlush).await
}

/// GET_ID: the export's name, cut or padded with zeros to the 20 bytes of an id, into the
/// buffers.
fn get_id(name: &str, memory: &Memory, request: &Request) -> u32 {
    let mut id = [0u8; virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES as usize];
    id.iter_mut().zip(name.bytes()).for_each(|(d, s)| *d = s);
    let mem = memory.memory();
    let mut at = 0usize;
    for buffer in &request.data {
        let Some(piece) = id.get(at..(at + buffer.len as usize).min(id.len())) else { break };
        if piece.is_empty() || mem.write_slice(piece, buffer.addr).is_err() {
            break;
        }
        at += piece.len();
    }
    at as u32
}

/// DISCARD (`zeroing` none) and WRITE_ZEROES (`zeroing` some; a segment with the unmap flag
/// may deallocate), segment by segment.
async fn discard(
    cache: &CacheLayer,
    request: &Request,
    zeroing: Option<Zeroing>,
) -> std::io::Result<()> {
    for segment in &request.segments {
        let len = u32::try_from(segment.len).map_err(std::io::Error::other)?;
        match zeroing {
            None => cache.trim(segment.offset, len).await?,
            Some(zeroing) => {
                let zeroing = if segment.unmap { Zeroing::MayDeallocate } else { zeroing };
                cache.write_zeroes(segment.offset, len, zeroing).await?;
            }
        }
    }
    Ok(())
}
