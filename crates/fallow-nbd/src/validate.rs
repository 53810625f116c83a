//! Every check of a transmission request, in one place, each mapped to the NBD error the
//! specification prescribes. A request that fails here is answered with that error and the
//! connection goes on.

use fallow_proto::nbd::*;

use crate::export::{Export, MAX_PAYLOAD};
use crate::handshake::Session;

/// Checks `request` against the export and what the session negotiated. `Err` carries the
/// NBD error code and a message for the log (and for structured error chunks).
pub fn validate(
    request: &Request,
    session: &Session,
    export: &Export,
) -> Result<(), (u32, String)> {
    let cmd = request.cmd;
    if let Cmd::Unknown(code) = cmd {
        return Err((NBD_EINVAL, format!("unknown command {code}")));
    }
    let unknown_flags = request.flags & !cmd.valid_flags();
    if unknown_flags != 0 {
        return Err((
            NBD_EINVAL,
            format!("flags {unknown_flags:#x} are not valid for {}", cmd.name()),
        ));
    }
    if request.flags & NBD_CMD_FLAG_DF != 0 && !session.structured {
        return Err((NBD_EINVAL, "DF needs structured replies".into()));
    }
    let read_only = export.is_read_only();
    let caps = export.cache.backing().capabilities();
    let len = request.length as u64;
    let in_range = request.offset.checked_add(len).is_some_and(|end| end <= export.size());
    // Reads of any alignment are served (split around whole pages); writes go through to
    // the backing store, which may need them aligned (an upstream NBD export's minimum
    // block size, advertised to our clients too).
    let min = export.min_block() as u64;
    let aligned = request.offset.is_multiple_of(min) && len.is_multiple_of(min);
    if matches!(cmd, Cmd::Write | Cmd::WriteZeroes | Cmd::Trim) && !aligned && !read_only {
        return Err((
            NBD_EINVAL,
            format!("{} not aligned to the export's minimum block size of {min} bytes", cmd.name()),
        ));
    }
    match cmd {
        Cmd::Read | Cmd::Cache => {
            if cmd == Cmd::Read && request.length > MAX_PAYLOAD {
                return Err((
                    NBD_EOVERFLOW,
                    format!("read of {len} bytes is over the {MAX_PAYLOAD}-byte maximum"),
                ));
            }
            if !in_range {
                return Err((NBD_EINVAL, "read beyond the end of the export".into()));
            }
        }
        Cmd::Write | Cmd::WriteZeroes => {
            if read_only {
                return Err((NBD_EPERM, "the export is read-only".into()));
            }
            if !in_range {
                return Err((NBD_ENOSPC, "write beyond the end of the export".into()));
            }
            if cmd == Cmd::WriteZeroes
                && request.flags & NBD_CMD_FLAG_FAST_ZERO != 0
                && !caps.fast_zero
            {
                return Err((NBD_ENOTSUP, "zeroing is not fast on this store".into()));
            }
        }
        Cmd::Trim => {
            if read_only {
                return Err((NBD_EPERM, "the export is read-only".into()));
            }
            if !caps.trim {
                return Err((NBD_EINVAL, "trim was not advertised".into()));
            }
            if !in_range {
                return Err((NBD_EINVAL, "trim beyond the end of the export".into()));
            }
        }
        Cmd::Flush => {
            if read_only {
                // A flush on a read-only export has nothing to do; it is still allowed.
                return Ok(());
            }
        }
        Cmd::BlockStatus => {
            if !session.structured || !session.base_allocation {
                return Err((
                    NBD_EINVAL,
                    "block status needs structured replies and base:allocation".into(),
                ));
            }
            if !in_range || len == 0 {
                return Err((NBD_EINVAL, "block status beyond the end of the export".into()));
            }
        }
        Cmd::Disc | Cmd::Unknown(_) => {}
    }
    Ok(())
}

/// The NBD error for an I/O error from the backing store.
pub fn errno(err: &std::io::Error) -> u32 {
    use std::io::ErrorKind::*;
    match err.kind() {
        InvalidInput => NBD_EINVAL,
        PermissionDenied | ReadOnlyFilesystem => NBD_EPERM,
        StorageFull | QuotaExceeded | FileTooLarge => NBD_ENOSPC,
        OutOfMemory => NBD_ENOMEM,
        Unsupported => NBD_ENOTSUP,
        _ => NBD_EIO,
    }
}
