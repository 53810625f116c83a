//! The reader task of a connection: replies read in large gulps, decoded, and handed to
//! the requests that wait for them.

use super::*;

/// The reader of one connection: hands each reply to its waiting request.
pub(super) struct Replies {
    pub(super) conn: Arc<Conn>,
    pub(super) reader: Reader,
    /// What was read and not yet used; at least `GULP / 4` free before each read.
    pub(super) input: BytesMut,
    /// The largest READ this store sends: a longer data chunk is a protocol error.
    pub(super) max_data: u32,
}

impl Replies {
    pub(super) async fn run(mut self) {
        let conn = self.conn.clone();
        let ended = tokio::select! {
            biased;
            ended = self.serve() => ended,
            _ = conn.stop.notified() => Err("the store was dropped".to_string()),
        };
        let Err(why) = ended;
        if conn.is_open() {
            tracing::warn!(conn = %conn.label, reason = %why, "upstream NBD connection lost");
        } else {
            tracing::debug!(conn = %conn.label, reason = %why, "upstream NBD connection ended");
        }
        conn.close(&why);
    }

    pub(super) async fn serve(&mut self) -> Result<std::convert::Infallible, String> {
        loop {
            let head = loop {
                match decode_reply_head(&mut self.input, self.max_data, MAX_CHUNK) {
                    Ok(Some(head)) => break head,
                    Ok(None) => fill(&mut self.reader, &mut self.input, 0).await?,
                    Err(err) => return Err(format!("bad reply: {err}")),
                }
            };
            match head {
                ReplyHead::Simple(reply) => self.simple(reply).await?,
                ReplyHead::Data { flags, cookie, offset, data_len } => {
                    self.data(flags, cookie, offset, data_len).await?
                }
                ReplyHead::Chunk(head) => self.chunk(head).await?,
            }
        }
    }

    /// The request `cookie` answers, out of the map while its reply is handled: whoever
    /// takes it answers it, puts it back or fails it.
    pub(super) fn take(&self, cookie: u64) -> Result<Pending, String> {
        let pending = self.conn.pending.lock().remove(&cookie);
        pending.ok_or_else(|| format!("a reply to unknown cookie {cookie}"))
    }

    pub(super) async fn simple(&mut self, reply: SimpleReply) -> Result<(), String> {
        let mut pending = self.take(reply.cookie)?;
        if reply.error != 0 {
            pending.error = Some((reply.error, String::new()));
        } else if pending.cmd == Cmd::Read {
            if self.conn.structured {
                // Structured replies forbid a simple reply with data to a READ: what
                // follows cannot be framed.
                let why = "a simple reply with data to a READ".to_string();
                return self.broken(pending, why);
            }
            let len = pending.length as usize;
            let read = read_append(&mut self.reader, &mut self.input, &mut pending.data, len).await;
            if let Err(why) = read {
                return self.broken(pending, why);
            }
            pending.covered = pending.length as u64;
        }
        self.finish(pending);
        Ok(())
    }

    pub(super) async fn data(
        &mut self,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
    ) -> Result<(), String> {
        let mut pending = self.take(cookie)?;
        let (input, reader) = (&mut self.input, &mut self.reader);
        let read = match pending.place(offset, len) {
            None => Err(format!("data at {offset}+{len} outside its request")),
            Some(Place::Append) => {
                read_append(reader, input, &mut pending.data, len as usize).await
            }
            Some(Place::At(at)) => match pending.data.get_mut(at..at + len as usize) {
                Some(dest) => read_exact(reader, input, dest).await,
                None => Err(format!("data at {offset}+{len} outside its buffer")),
            },
        };
        if let Err(why) = read {
            return self.broken(pending, why);
        }
        pending.covered += len as u64;
        self.done_or_back(flags & NBD_REPLY_FLAG_DONE != 0, cookie, pending);
        Ok(())
    }

    #[expect(clippy::indexing_slicing, reason = "the loop first fills `input` to `len` bytes")]
    pub(super) async fn chunk(&mut self, head: ChunkHead) -> Result<(), String> {
        let len = head.length as usize;
        while self.input.len() < len {
            fill(&mut self.reader, &mut self.input, len).await?;
        }
        // A copy, so that the gulp buffer stays unshared and is reused in place.
        let payload = Bytes::copy_from_slice(&self.input[..len]);
        self.input.advance(len);
        let body = head.parse_payload(payload).map_err(|e| format!("bad reply chunk: {e}"))?;
        let mut pending = self.take(head.cookie)?;
        let broken = match body {
            ChunkBody::None => None,
            ChunkBody::OffsetHole { offset, length } => match pending.place(offset, length) {
                Some(Place::Append) => {
                    let end = pending.data.len() + length as usize;
                    pending.data.resize(end, 0);
                    pending.covered += length as u64;
                    None
                }
                // Zeroed already.
                Some(Place::At(_)) => {
                    pending.covered += length as u64;
                    None
                }
                None => Some(format!("a hole at {offset}+{length} outside its request")),
            },
            ChunkBody::BlockStatus { context_id, extents } => {
                if pending.cmd != Cmd::BlockStatus {
                    Some("block status in reply to another command".to_string())
                } else if Some(context_id) != self.conn.base_allocation {
                    None // a context not asked for: ignored
                } else if pending.extents.replace(extents).is_some() {
                    Some("two block-status chunks for one context".to_string())
                } else {
                    None
                }
            }
            ChunkBody::Error { error, message }
            | ChunkBody::ErrorOffset { error, message, .. }
            | ChunkBody::UnknownError { error, message, .. } => {
                let error = if error == 0 { NBD_EIO } else { error };
                pending.error.get_or_insert((error, message));
                None
            }
            ChunkBody::OffsetData { .. } => Some("data where a header was expected".to_string()),
            ChunkBody::Unknown { chunk_type, .. } => {
                // The spec makes the client hang up on a chunk type it does not know.
                Some(format!("a reply chunk of unknown type {chunk_type}"))
            }
        };
        if let Some(why) = broken {
            return self.broken(pending, why);
        }
        self.done_or_back(head.is_done(), head.cookie, pending);
        Ok(())
    }

    /// The connection cannot go on: closed first, so that the failed request's retry
    /// does not find it open.
    pub(super) fn broken(&self, pending: Pending, why: String) -> Result<(), String> {
        tracing::warn!(conn = %self.conn.label, reason = %why, "upstream NBD connection closed");
        self.conn.close(&why);
        pending.fail(&why);
        Err(why)
    }

    pub(super) fn done_or_back(&self, done: bool, cookie: u64, pending: Pending) {
        if done {
            self.finish(pending);
        } else {
            self.conn.pending.lock().insert(cookie, pending);
        }
    }

    /// Answers a request whose last reply chunk (or simple reply) is in.
    pub(super) fn finish(&self, pending: Pending) {
        let result = match pending.error {
            Some((error, message)) => {
                if error == NBD_ESHUTDOWN {
                    self.conn.begin_closing();
                }
                Err(Failure::Nbd { error, message })
            }
            None => match pending.cmd {
                Cmd::Read if pending.covered != pending.length as u64 => {
                    Err(Failure::Bad(format!(
                        "{}: the server sent {} of {} bytes",
                        self.conn.label, pending.covered, pending.length
                    )))
                }
                Cmd::Read => Ok(Answer::Data(pending.data.freeze())),
                Cmd::BlockStatus => match pending.extents {
                    Some(extents) => Ok(Answer::Extents(extents)),
                    None => Err(Failure::Bad(format!(
                        "{}: no block status for {BASE_ALLOCATION}",
                        self.conn.label
                    ))),
                },
                Cmd::Write | Cmd::Trim | Cmd::WriteZeroes if !pending.fua => {
                    let d = &self.conn.durability;
                    let mark = d.epoch.load(Ordering::Acquire) + 1;
                    self.conn.unflushed.fetch_max(mark, Ordering::AcqRel);
                    Ok(Answer::Done)
                }
                _ => Ok(Answer::Done),
            },
        };
        let _ = pending.done.send(result);
        self.conn.disconnect_if_idle();
    }
}

/// Reads more into `input`: at least `want` bytes of room (and `GULP / 4`) first.
pub(super) async fn fill(
    reader: &mut Reader,
    input: &mut BytesMut,
    want: usize,
) -> Result<(), String> {
    if input.capacity() - input.len() < want.max(GULP / 4) {
        input.reserve(want.max(GULP));
    }
    match reader.read_buf(input).await {
        Ok(0) => Err("the server closed the connection".to_string()),
        Ok(_) => Ok(()),
        Err(err) => Err(format!("reading from the server: {err}")),
    }
}

/// Appends the next `len` bytes of the stream to `data`: what `input` holds, then the
/// socket (straight into `data` when much is left).
#[expect(clippy::indexing_slicing, reason = "`n` is at most what `input` holds")]
pub(super) async fn read_append(
    reader: &mut Reader,
    input: &mut BytesMut,
    data: &mut BytesMut,
    len: usize,
) -> Result<(), String> {
    let end = data.len() + len;
    loop {
        let n = input.len().min(end - data.len());
        data.extend_from_slice(&input[..n]);
        input.advance(n);
        if data.len() == end {
            return Ok(());
        }
        if end - data.len() < DIRECT_READ {
            fill(reader, input, 0).await?;
            continue;
        }
        let left = end - data.len();
        match reader.read_buf(&mut (&mut *data).limit(left)).await {
            Ok(0) => return Err("the server closed the connection mid-reply".to_string()),
            Ok(_) => {}
            Err(err) => return Err(format!("reading from the server: {err}")),
        }
    }
}

/// Fills `dest` with the next bytes of the stream: what `input` holds, then the socket.
#[expect(clippy::indexing_slicing, reason = "`at + n` stays within `dest` and `input`")]
pub(super) async fn read_exact(
    reader: &mut Reader,
    input: &mut BytesMut,
    dest: &mut [u8],
) -> Result<(), String> {
    let mut at = 0;
    loop {
        let n = input.len().min(dest.len() - at);
        dest[at..at + n].copy_from_slice(&input[..n]);
        input.advance(n);
        at += n;
        if at == dest.len() {
            return Ok(());
        }
        if dest.len() - at < DIRECT_READ {
            fill(reader, input, 0).await?;
            continue;
        }
        match reader.read(&mut dest[at..]).await {
            Ok(0) => return Err("the server closed the connection mid-reply".to_string()),
            Ok(n) => at += n,
            Err(err) => return Err(format!("reading from the server: {err}")),
        }
    }
}
