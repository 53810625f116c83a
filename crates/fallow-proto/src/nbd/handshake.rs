//! The fixed-bytes parts of the handshake: the server's greeting, the client's flags, and
//! the reply that ends negotiation after `NBD_OPT_EXPORT_NAME`.
//!
//! ```text
//!  greeting (server):  0          8          16       18
//!                      ├ NBDMAGIC ┼ IHAVEOPT ┼ hflags ┤
//!  client flags:       0        4
//!                      ├ cflags ┤
//!  EXPORT_NAME reply:  0        8       10                    134
//!                      ├ size ──┼ tflags ┼ 124 zero bytes ────┤  (zeroes omitted when
//!                                                                 NBD_FLAG_C_NO_ZEROES)
//! ```

use bytes::{Buf, BufMut, BytesMut};

use super::wire::{peek, peek_u64};
use super::{Error, CLISERV_MAGIC, IHAVEOPT, NBDMAGIC};
use super::{NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES, NBD_FLAG_NO_ZEROES};

/// Bytes of the greeting.
pub const GREETING_LEN: usize = 18;
/// Bytes of the client flags.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// The zero padding after an EXPORT_NAME reply, unless `NBD_FLAG_C_NO_ZEROES`.
pub const EXPORT_NAME_PADDING: usize = 124;

/// Server: appends the greeting with these handshake flags (`NBD_FLAG_FIXED_NEWSTYLE`,
/// usually with `NBD_FLAG_NO_ZEROES`).
pub fn encode_greeting(buf: &mut BytesMut, handshake_flags: u16) {
    buf.reserve(GREETING_LEN);
    buf.put_u64(NBDMAGIC);
    buf.put_u64(IHAVEOPT);
    buf.put_u16(handshake_flags);
}

/// Client: takes the greeting off `buf` and returns the server's handshake flags.
///
/// Unknown handshake flags are returned as they are (the client ignores what it does not
/// know). `Err(Error::Oldstyle)` for an oldstyle server, `Err(BadMagic)` for anything else
/// that is not a newstyle greeting; either way the client hangs up.
pub fn decode_greeting(buf: &mut BytesMut) -> Result<Option<u16>, Error> {
    if let Some(magic) = peek_u64(buf, 0) {
        if magic != NBDMAGIC {
            return Err(Error::BadMagic { what: "greeting", found: magic });
        }
    }
    match peek_u64(buf, 8) {
        None => return Ok(None),
        Some(CLISERV_MAGIC) => return Err(Error::Oldstyle),
        Some(IHAVEOPT) => {}
        Some(found) => return Err(Error::BadMagic { what: "greeting", found }),
    }
    let Some(b) = peek::<GREETING_LEN>(buf) else {
        return Ok(None);
    };
    buf.advance(GREETING_LEN);
    Ok(Some(u16::from_be_bytes([b[16], b[17]])))
}

/// Client: appends the client flags.
pub fn encode_client_flags(buf: &mut BytesMut, client_flags: u32) {
    buf.put_u32(client_flags);
}

/// Server: takes the client flags off `buf`, and checks them against the handshake flags
/// the server sent (`advertised`).
///
/// `Err(BadClientFlags)` when the client sets a bit the spec does not define, or
/// `NBD_FLAG_C_NO_ZEROES` when the server did not offer `NBD_FLAG_NO_ZEROES`: the spec makes
/// the server drop the connection then. A client that omits `NBD_FLAG_C_FIXED_NEWSTYLE` is
/// accepted; whether to serve it is the server's choice.
pub fn decode_client_flags(buf: &mut BytesMut, advertised: u16) -> Result<Option<u32>, Error> {
    let Some(b) = peek::<CLIENT_FLAGS_LEN>(buf) else {
        return Ok(None);
    };
    let flags = u32::from_be_bytes(b);
    let mut allowed = NBD_FLAG_C_FIXED_NEWSTYLE;
    if advertised & NBD_FLAG_NO_ZEROES != 0 {
        allowed |= NBD_FLAG_C_NO_ZEROES;
    }
    if flags & !allowed != 0 {
        return Err(Error::BadClientFlags { flags });
    }
    buf.advance(CLIENT_FLAGS_LEN);
    Ok(Some(flags))
}

/// What the server sends after `NBD_OPT_EXPORT_NAME` when it accepts the export (when it
/// does not, it can only hang up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportNameReply {
    /// Size of the export in bytes.
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | …`).
    pub flags: u16,
}

impl ExportNameReply {
    /// The bytes this reply takes on the wire for a client that sent `client_flags`.
    pub fn wire_len(client_flags: u32) -> usize {
        if client_flags & NBD_FLAG_C_NO_ZEROES != 0 {
            10
        } else {
            10 + EXPORT_NAME_PADDING
        }
    }

    /// Server: appends the reply, with the 124 zero bytes unless the client sent
    /// `NBD_FLAG_C_NO_ZEROES` in `client_flags`.
    pub fn encode(&self, buf: &mut BytesMut, client_flags: u32) {
        let len = Self::wire_len(client_flags);
        buf.reserve(len);
        buf.put_u64(self.size);
        buf.put_u16(self.flags);
        buf.put_bytes(0, len - 10);
    }
}

/// Client: takes the EXPORT_NAME reply off `buf`; `client_flags` are the flags the client
/// sent, which decide whether 124 zero bytes follow. The padding is skipped unread (the
/// spec reserves it; nothing is gained by refusing a server that fills it).
pub fn decode_export_name_reply(
    buf: &mut BytesMut,
    client_flags: u32,
) -> Result<Option<ExportNameReply>, Error> {
    let len = ExportNameReply::wire_len(client_flags);
    let Some(b) = peek::<10>(buf) else {
        return Ok(None);
    };
    if buf.len() < len {
        return Ok(None);
    }
    buf.advance(len);
    let size = u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    Ok(Some(ExportNameReply { size, flags: u16::from_be_bytes([b[8], b[9]]) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::NBD_FLAG_FIXED_NEWSTYLE;

    #[test]
    fn greeting_waits_for_all_eighteen_bytes() {
        let mut whole = BytesMut::new();
        encode_greeting(&mut whole, NBD_FLAG_FIXED_NEWSTYLE);
        for cut in 0..GREETING_LEN {
            let mut part = BytesMut::from(&whole[..cut]);
            assert_eq!(decode_greeting(&mut part), Ok(None), "cut at {cut}");
            assert_eq!(part.len(), cut);
        }
        assert_eq!(decode_greeting(&mut whole), Ok(Some(1)));
        assert!(whole.is_empty());
    }

    #[test]
    fn oldstyle_is_named_as_such() {
        let mut buf = BytesMut::new();
        buf.put_u64(NBDMAGIC);
        buf.put_u64(CLISERV_MAGIC);
        assert_eq!(decode_greeting(&mut buf), Err(Error::Oldstyle));
    }

    #[test]
    fn no_zeroes_needs_the_server_to_offer_it() {
        let mut buf = BytesMut::from(&3u32.to_be_bytes()[..]);
        assert_eq!(
            decode_client_flags(&mut buf, NBD_FLAG_FIXED_NEWSTYLE),
            Err(Error::BadClientFlags { flags: 3 })
        );
        assert_eq!(decode_client_flags(&mut buf, 3), Ok(Some(3)));
    }
}
