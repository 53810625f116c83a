//! The MEMBERS reply: the cluster as the answering node sees it, one fixed 56-byte entry
//! per member followed by its name. `docs/protocol.md` §4.6 is normative.
//!
//! ```text
//!  0      1      2        3        4                20     22    24           32
//!  state  flags  family   id_len   ip (16)          port   rsv   generation   lendable
//!  40          48       52    56
//!  free        age_ms   rsv   id (id_len bytes, UTF-8)           all little-endian
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use bytes::{BufMut, BytesMut};

use super::wire::{BodyError, Reader};

/// Bytes of an entry before its name.
pub const MEMBER_ENTRY_LEN: usize = 56;

/// The most entries a reply carries: with 255-byte names they fit in a frame.
pub const MAX_MEMBERS: usize = 3000;

/// Flag bit: this entry is the answering node itself.
const FLAG_LOCAL: u8 = 0x01;

pub use fallow_core::MemberState;

/// One entry of a MEMBERS reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberInfo {
    /// The member's name, 1 to 255 bytes of UTF-8, stable across its restarts.
    pub id: String,
    /// Alive, suspect or dead.
    pub state: MemberState,
    /// True for the node that answered.
    pub local: bool,
    /// Where clients reach it (the node protocol over TCP).
    pub addr: SocketAddr,
    /// Which run of the member: larger after a restart.
    pub generation: u64,
    /// Bytes it lends.
    pub lendable_bytes: u64,
    /// Bytes of those not holding pages.
    pub free_bytes: u64,
    /// Milliseconds since the answering node last heard news of it (0 for itself).
    pub age_ms: u32,
}

/// Appends a MEMBERS reply body: the count, then each entry (at most [`MAX_MEMBERS`];
/// names are cut to 255 bytes on a character boundary).
pub(crate) fn encode(members: &[MemberInfo], buf: &mut BytesMut) {
    let members = members.iter().take(MAX_MEMBERS);
    buf.put_u16_le(members.len() as u16);
    for m in members {
        let id = super::wire::truncate_utf8(&m.id, u8::MAX as usize);
        buf.put_u8(m.state as u8);
        buf.put_u8(if m.local { FLAG_LOCAL } else { 0 });
        let (family, ip) = match m.addr.ip() {
            IpAddr::V4(v4) => {
                let mut ip = [0; 16];
                ip[..4].copy_from_slice(&v4.octets());
                (4, ip)
            }
            IpAddr::V6(v6) => (6, v6.octets()),
        };
        buf.put_u8(family);
        buf.put_u8(id.len() as u8);
        buf.put_slice(&ip);
        buf.put_u16_le(m.addr.port());
        buf.put_u16_le(0);
        buf.put_u64_le(m.generation);
        buf.put_u64_le(m.lendable_bytes);
        buf.put_u64_le(m.free_bytes);
        buf.put_u32_le(m.age_ms);
        buf.put_u32_le(0);
        buf.put_slice(id.as_bytes());
    }
}

/// Parses a MEMBERS reply body.
pub(crate) fn parse(r: &mut Reader) -> Result<Vec<MemberInfo>, BodyError> {
    let count = r.u16("member count")? as usize;
    if count > MAX_MEMBERS {
        return Err(BodyError::Invalid("member count: over 3000"));
    }
    let mut members = Vec::with_capacity(count);
    for _ in 0..count {
        let state = MemberState::from_code(r.u8("member state")?)
            .ok_or(BodyError::Invalid("member state code"))?;
        let flags = r.u8("member flags")?;
        if flags & !FLAG_LOCAL != 0 {
            return Err(BodyError::Invalid("member flags: unknown bits"));
        }
        let family = r.u8("address family")?;
        let id_len = r.u8("member id length")? as usize;
        let ip: [u8; 16] = r.array("member ip")?;
        let ip = match family {
            4 if ip[4..].iter().all(|b| *b == 0) => {
                IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]))
            }
            4 => return Err(BodyError::Invalid("member ip: IPv4 with bytes after the 4th")),
            6 => IpAddr::V6(Ipv6Addr::from(ip)),
            _ => return Err(BodyError::Invalid("address family: not 4 or 6")),
        };
        let port = r.u16("member port")?;
        let _reserved = r.u16("reserved")?;
        let generation = r.u64("generation")?;
        let lendable_bytes = r.u64("lendable bytes")?;
        let free_bytes = r.u64("free bytes")?;
        let age_ms = r.u32("age")?;
        let _reserved = r.u32("reserved")?;
        if id_len == 0 {
            return Err(BodyError::Invalid("member id: empty"));
        }
        let id = String::from_utf8(r.bytes(id_len, "member id")?.to_vec())
            .map_err(|_| BodyError::Invalid("member id: not UTF-8"))?;
        members.push(MemberInfo {
            id,
            state,
            local: flags & FLAG_LOCAL != 0,
            addr: SocketAddr::new(ip, port),
            generation,
            lendable_bytes,
            free_bytes,
            age_ms,
        });
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_codes_round_trip() {
        for state in MemberState::ALL {
            assert_eq!(MemberState::from_code(state as u8), Some(state));
        }
        assert_eq!(MemberState::from_code(3), None);
    }

    #[test]
    fn long_names_are_cut_on_a_character_boundary() {
        let member = MemberInfo {
            id: "é".repeat(200), // 400 bytes
            state: MemberState::Alive,
            local: false,
            addr: "[::1]:7400".parse().unwrap(),
            generation: 1,
            lendable_bytes: 2,
            free_bytes: 1,
            age_ms: 0,
        };
        let mut buf = BytesMut::new();
        encode(&[member], &mut buf);
        let parsed = parse(&mut Reader::new(buf.freeze())).unwrap();
        assert_eq!(parsed[0].id.len(), 254);
        assert_eq!(parsed[0].addr, "[::1]:7400".parse().unwrap());
    }
}
