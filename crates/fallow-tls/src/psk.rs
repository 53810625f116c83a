//! Pre-shared keys in the psktool format that GnuTLS, qemu (`tls-creds-psk`) and nbdkit
//! (`--tls-psk`) read: one `IDENTITY:HEXKEY` per line.

use std::path::Path;

use crate::TlsError;

/// The longest identity accepted (RFC 8446 allows 2^16 - 1 bytes; psktool names are short).
pub const MAX_IDENTITY_LEN: usize = 128;

/// The longest key accepted: OpenSSL's `PSK_MAX_PSK_LEN`.
pub const MAX_KEY_LEN: usize = 512;

/// The keys of one psktool file.
#[derive(Clone)]
pub struct PskFile {
    keys: Vec<(String, Vec<u8>)>,
}

impl std::fmt::Debug for PskFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Identities travel in the clear anyway; keys are never printed.
        let names: Vec<&str> = self.keys.iter().map(|(id, _)| id.as_str()).collect();
        f.debug_struct("PskFile").field("identities", &names).finish_non_exhaustive()
    }
}

impl PskFile {
    /// Reads and checks `path`: every non-empty line must be `IDENTITY:HEXKEY`, with an
    /// identity of printable ASCII and a key of at least 16 bytes (psktool makes 32).
    pub fn load(path: &Path) -> Result<PskFile, TlsError> {
        let text = std::fs::read_to_string(path).map_err(|e| TlsError::file(path, e))?;
        PskFile::parse(&text).map_err(|why| TlsError::Invalid { path: path.into(), why })
    }

    /// Parses the text of a psktool file.
    pub fn parse(text: &str) -> Result<PskFile, String> {
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let lineno = n + 1;
            let Some((identity, hex)) = line.rsplit_once(':') else {
                return Err(format!("line {lineno}: expected IDENTITY:HEXKEY"));
            };
            if identity.is_empty()
                || identity.len() > MAX_IDENTITY_LEN
                || !identity.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(format!(
                    "line {lineno}: the identity must be 1 to {MAX_IDENTITY_LEN} printable \
                     ASCII characters without spaces"
                ));
            }
            let key = decode_hex(hex.trim())
                .ok_or_else(|| format!("line {lineno}: the key is not hexadecimal"))?;
            if !(16..=MAX_KEY_LEN).contains(&key.len()) {
                return Err(format!(
                    "line {lineno}: the key has {} bytes; 16 to {MAX_KEY_LEN} are accepted",
                    key.len()
                ));
            }
            if keys.iter().any(|(id, _)| id == identity) {
                return Err(format!("line {lineno}: identity {identity:?} appears twice"));
            }
            keys.push((identity.to_string(), key));
        }
        if keys.is_empty() {
            return Err("no key in the file".into());
        }
        Ok(PskFile { keys })
    }

    /// The key of `identity`.
    pub fn key(&self, identity: &str) -> Option<&[u8]> {
        self.keys.iter().find(|(id, _)| id == identity).map(|(_, key)| key.as_slice())
    }

    /// The first identity and its key: what a client uses when no username is given
    /// (qemu's `tls-creds-psk` defaults to `qemu`; a client file holds one line).
    pub fn first(&self) -> Option<(&str, &[u8])> {
        self.keys.first().map(|(id, key)| (id.as_str(), key.as_slice()))
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| hex.get(i..i + 2).and_then(|pair| u8::from_str_radix(pair, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn reads_psktool_lines() {
        let file = PskFile::parse(&format!("fallow:{KEY}\nqemu:{}\n", &KEY[..32])).unwrap();
        assert_eq!(file.key("fallow").unwrap().len(), 32);
        assert_eq!(file.key("qemu").unwrap(), &decode_hex(&KEY[..32]).unwrap()[..]);
        assert_eq!(file.first().unwrap().0, "fallow");
        assert!(file.key("other").is_none());
        assert!(!format!("{file:?}").contains("0011"));
    }

    #[test]
    fn refuses_what_is_not_a_key_file() {
        for (text, why) in [
            ("", "no key"),
            ("fallow", "IDENTITY:HEXKEY"),
            (&format!(":{KEY}") as &str, "identity"),
            (&format!("a b:{KEY}"), "identity"),
            ("fallow:abc", "hexadecimal"),
            ("fallow:zz112233445566778899aabbccddeeff", "hexadecimal"),
            ("fallow:0011", "16 to"),
            (&format!("x:{KEY}\nx:{KEY}"), "twice"),
        ] {
            let err = PskFile::parse(text).unwrap_err();
            assert!(err.contains(why), "{text:?}: {err}");
        }
    }
}
