//! The NBD server's transmission phase up to the cache layer: requests taken off the input
//! as the server takes them (`decode_request_with_payload`, bounded by the largest payload
//! it advertises) and checked by `fallow_nbd::validate::validate`.
//!
//! The first input byte picks the session and the export: bit 0 structured replies, bit 1
//! `base:allocation` (only with bit 0), bits 2 and up the export (see `fallow_fuzz`). The
//! rest is what the client sends.
//!
//! Checked: each header re-encodes to the bytes it came from and a WRITE carries exactly
//! its payload; `validate` accepts exactly the requests the NBD spec allows on this export
//! (a model written from the spec, below), each refusal carries one of the spec's errors,
//! and an accepted request keeps its fields and reads FUA and NO_HOLE right.

#![no_main]

use bytes::BytesMut;
use fallow_backing::{Durability, Zeroing};
use fallow_nbd::export::MAX_PAYLOAD;
use fallow_nbd::handshake::Session;
use fallow_nbd::validate::validate;
use fallow_nbd::Export;
use fallow_proto::nbd::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&choice, stream)) = input.split_first() else { return };
    let fixture = fallow_fuzz::nbd_fixture();
    let export = &fixture.exports[usize::from(choice >> 2) % fixture.exports.len()];
    let structured = choice & 1 != 0;
    let session = Session { export: export.clone(), structured, base_allocation: choice & 3 == 3 };
    let mut buf = BytesMut::from(stream);
    loop {
        let at = stream.len() - buf.len();
        let before = buf.clone();
        match decode_request_with_payload(&mut buf, MAX_PAYLOAD) {
            Ok(Some((request, payload))) => {
                assert_eq!(&request.to_bytes()[..], &stream[at..at + REQUEST_LEN]);
                let carried = if request.has_payload() { request.length as usize } else { 0 };
                assert_eq!(payload.len(), carried, "{request:?}");
                assert_eq!(&payload[..], &stream[at + REQUEST_LEN..at + REQUEST_LEN + carried]);
                check(&request, &session, export);
            }
            Ok(None) => {
                assert_eq!(buf, before, "an incomplete request was consumed");
                break;
            }
            Err(_) => break,
        }
    }
});

/// `validate` against the spec's rules for an export whose store can do everything (a
/// `MemStore`: trim, fast zeroing, block status, any alignment).
fn check(request: &Request, session: &Session, export: &Export) {
    let cmd = request.cmd;
    let len = u64::from(request.length);
    let in_range = request.offset.checked_add(len).is_some_and(|end| end <= export.size());
    let writes = matches!(cmd, Cmd::Write | Cmd::WriteZeroes | Cmd::Trim);
    let touches_data = writes || matches!(cmd, Cmd::Read | Cmd::Cache | Cmd::BlockStatus);
    let refused = matches!(cmd, Cmd::Unknown(_))
        || request.flags & !cmd.valid_flags() != 0
        || (request.flags & NBD_CMD_FLAG_DF != 0 && !session.structured)
        || (writes && export.is_read_only())
        || (cmd == Cmd::Read && request.length > MAX_PAYLOAD)
        || (cmd == Cmd::BlockStatus
            && (!session.structured || !session.base_allocation || request.length == 0))
        || (touches_data && !in_range);
    match validate(request, session, export) {
        Ok(valid) => {
            assert!(!refused, "{request:?} accepted against the spec");
            assert_eq!(valid.request, *request);
            let fua = request.flags & NBD_CMD_FLAG_FUA != 0;
            assert_eq!(valid.durability == Durability::Immediate, fua);
            let no_hole = request.flags & NBD_CMD_FLAG_NO_HOLE != 0;
            assert_eq!(valid.zeroing == Zeroing::KeepAllocated, no_hole);
        }
        Err(invalid) => {
            assert!(refused, "{request:?} refused for no reason the spec gives: {invalid}");
            let errors = [NBD_EPERM, NBD_EINVAL, NBD_ENOSPC, NBD_EOVERFLOW, NBD_ENOTSUP];
            assert!(errors.contains(&invalid.errno()), "{invalid}: errno {}", invalid.errno());
        }
    }
}
