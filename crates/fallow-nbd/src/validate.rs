//! Every check of a transmission request, in one place, each mapped to the NBD error the
//! specification prescribes. A request that fails here is answered with that error and the
//! connection goes on; one that passes becomes a [`ValidRequest`], whose flags are decoded
//! into the words the cache layer takes ([`Durability`], [`Zeroing`]).

use fallow_backing::{Durability, Zeroing};
use fallow_proto::nbd::*;

use crate::export::{Export, MAX_PAYLOAD};
use crate::handshake::Session;

/// Why a request is refused. [`InvalidRequest::errno`] is the NBD error its reply carries;
/// the message goes to the log (and into structured error chunks).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidRequest {
    /// A command this server does not know.
    #[error("unknown command {0}")]
    UnknownCommand(u16),
    /// Flags the command does not take.
    #[error("flags {flags:#x} are not valid for {}", cmd.name())]
    Flags {
        /// The offending flags.
        flags: u16,
        /// The command.
        cmd: Cmd,
    },
    /// DF (do not fragment) without structured replies negotiated.
    #[error("DF needs structured replies")]
    DfWithoutStructuredReplies,
    /// A write, trim or zeroing off the export's minimum block size.
    #[error("{} not aligned to the export's minimum block size of {min} bytes", cmd.name())]
    Misaligned {
        /// The command.
        cmd: Cmd,
        /// The minimum block size.
        min: u64,
    },
    /// A read longer than the largest payload.
    #[error("read of {len} bytes is over the {MAX_PAYLOAD}-byte maximum")]
    TooLong {
        /// The requested length.
        len: u64,
    },
    /// A range past the end of the export.
    #[error("{} beyond the end of the export", cmd.name())]
    OutOfRange {
        /// The command.
        cmd: Cmd,
    },
    /// A write, zeroing or trim on a read-only export.
    #[error("the export is read-only")]
    ReadOnly,
    /// FAST_ZERO on a store whose zeroing is not fast.
    #[error("zeroing is not fast on this store")]
    SlowZero,
    /// TRIM, which this export did not advertise.
    #[error("trim was not advertised")]
    TrimNotAdvertised,
    /// BLOCK_STATUS without structured replies and `base:allocation`.
    #[error("block status needs structured replies and base:allocation")]
    BlockStatusNotNegotiated,
}

impl InvalidRequest {
    /// The NBD error the specification prescribes for it.
    pub fn errno(&self) -> u32 {
        use InvalidRequest::*;
        match self {
            TooLong { .. } => NBD_EOVERFLOW,
            ReadOnly => NBD_EPERM,
            SlowZero => NBD_ENOTSUP,
            // A write past the end is ENOSPC; any other range past the end is EINVAL.
            OutOfRange { cmd: Cmd::Write | Cmd::WriteZeroes } => NBD_ENOSPC,
            _ => NBD_EINVAL,
        }
    }
}

/// A request that passed [`validate`]: within the export, allowed on it, its flags
/// understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidRequest {
    /// The request as decoded.
    pub request: Request,
    /// FUA: the write (or trim, or zeroing) is durable before it is answered.
    pub durability: Durability,
    /// NO_HOLE: a zeroing must leave the range allocated.
    pub zeroing: Zeroing,
}

/// Checks `request` against the export and what the session negotiated.
pub fn validate(
    request: &Request,
    session: &Session,
    export: &Export,
) -> Result<ValidRequest, InvalidRequest> {
    let cmd = request.cmd;
    if let Cmd::Unknown(code) = cmd {
        return Err(InvalidRequest::UnknownCommand(code));
    }
    let unknown_flags = request.flags & !cmd.valid_flags();
    if unknown_flags != 0 {
        return Err(InvalidRequest::Flags { flags: unknown_flags, cmd });
    }
    if request.flags & NBD_CMD_FLAG_DF != 0 && !session.structured {
        return Err(InvalidRequest::DfWithoutStructuredReplies);
    }
    let read_only = export.is_read_only();
    let len = request.length as u64;
    let in_range = request.offset.checked_add(len).is_some_and(|end| end <= export.size());
    // Reads of any alignment are served (split around whole pages); writes go through to
    // the backing store, which may need them aligned (an upstream NBD export's minimum
    // block size, advertised to our clients too).
    let min = export.min_block() as u64;
    let aligned = request.offset.is_multiple_of(min) && len.is_multiple_of(min);
    if matches!(cmd, Cmd::Write | Cmd::WriteZeroes | Cmd::Trim) && !aligned && !read_only {
        return Err(InvalidRequest::Misaligned { cmd, min });
    }
    check_command(request, session, export, in_range)?;
    Ok(ValidRequest {
        request: *request,
        durability: if request.flags & NBD_CMD_FLAG_FUA != 0 {
            Durability::Immediate
        } else {
            Durability::AtFlush
        },
        zeroing: if request.flags & NBD_CMD_FLAG_NO_HOLE != 0 {
            Zeroing::KeepAllocated
        } else {
            Zeroing::MayDeallocate
        },
    })
}

/// The checks that depend on the command.
fn check_command(
    request: &Request,
    session: &Session,
    export: &Export,
    in_range: bool,
) -> Result<(), InvalidRequest> {
    let cmd = request.cmd;
    let read_only = export.is_read_only();
    let caps = export.cache.backing().capabilities();
    let out_of_range = InvalidRequest::OutOfRange { cmd };
    match cmd {
        Cmd::Read | Cmd::Cache => {
            if cmd == Cmd::Read && request.length > MAX_PAYLOAD {
                return Err(InvalidRequest::TooLong { len: request.length as u64 });
            }
            if !in_range {
                return Err(out_of_range);
            }
        }
        Cmd::Write | Cmd::WriteZeroes => {
            if read_only {
                return Err(InvalidRequest::ReadOnly);
            }
            if !in_range {
                return Err(out_of_range);
            }
            if cmd == Cmd::WriteZeroes
                && request.flags & NBD_CMD_FLAG_FAST_ZERO != 0
                && !caps.fast_zero
            {
                return Err(InvalidRequest::SlowZero);
            }
        }
        Cmd::Trim => {
            if read_only {
                return Err(InvalidRequest::ReadOnly);
            }
            if !caps.trim {
                return Err(InvalidRequest::TrimNotAdvertised);
            }
            if !in_range {
                return Err(out_of_range);
            }
        }
        // A flush on a read-only export has nothing to do; it is still allowed.
        Cmd::Flush => {}
        Cmd::BlockStatus => {
            if !session.structured || !session.base_allocation {
                return Err(InvalidRequest::BlockStatusNotNegotiated);
            }
            if !in_range || request.length == 0 {
                return Err(out_of_range);
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
