//! Initramfs archives (cpio, "newc" format): the base archive of an image, and the small
//! one a run appends with its script. The kernel unpacks concatenated archives in order,
//! so a run costs one small file, not a copy of the base.

use std::io::Write;
use std::path::Path;

use super::GuestError;

/// A cpio archive being put together in memory.
#[derive(Default)]
pub struct Cpio {
    /// Path (without a leading `/`), mode with the file type bits, contents.
    entries: Vec<(String, u32, Vec<u8>)>,
}

impl Cpio {
    /// An empty archive.
    pub fn new() -> Cpio {
        Cpio::default()
    }

    /// Adds directory `path` (and the directories above it that are not there yet).
    pub fn dir(&mut self, path: &str) -> &mut Cpio {
        let path = path.trim_matches('/');
        let mut at = String::new();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            if !at.is_empty() {
                at.push('/');
            }
            at.push_str(part);
            if !self.entries.iter().any(|(p, _, _)| *p == at) {
                self.entries.push((at.clone(), 0o040_755, Vec::new()));
            }
        }
        self
    }

    /// Adds a regular file `path` with permissions `mode` (e.g. `0o755`), creating its
    /// directory.
    pub fn file(&mut self, path: &str, mode: u32, contents: Vec<u8>) -> &mut Cpio {
        let path = path.trim_start_matches('/');
        if let Some((dir, _)) = path.rsplit_once('/') {
            self.dir(dir);
        }
        self.entries.push((path.to_string(), 0o100_000 | (mode & 0o7777), contents));
        self
    }

    /// The archive's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GuestError> {
        let mut out = Vec::new();
        for (ino, (path, mode, contents)) in self.entries.iter().enumerate() {
            let size = u32::try_from(contents.len()).map_err(|_| GuestError::Image {
                step: format!("adding {path} to an initramfs"),
                detail: "larger than 4 GiB".to_string(),
            })?;
            let mut writer = cpio::newc::Builder::new(path)
                .ino(ino as u32 + 1)
                .mode(*mode)
                .nlink(1)
                .write(&mut out, size);
            writer.write_all(contents).and_then(|()| writer.finish().map(drop)).map_err(|e| {
                GuestError::Image { step: format!("adding {path}"), detail: e.to_string() }
            })?;
        }
        cpio::newc::trailer(&mut out).map_err(|e| GuestError::Image {
            step: "closing an initramfs".to_string(),
            detail: e.to_string(),
        })?;
        Ok(out)
    }

    /// Writes the archive to `path`.
    pub fn write_to(&self, path: &Path) -> Result<(), GuestError> {
        std::fs::write(path, self.to_bytes()?).map_err(|e| GuestError::Image {
            step: format!("writing {}", path.display()),
            detail: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names and modes of the entries of `bytes`, read back with the crate's reader.
    fn entries(mut bytes: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut found = Vec::new();
        loop {
            let mut reader = cpio::NewcReader::new(bytes).unwrap();
            if reader.entry().is_trailer() {
                return found;
            }
            let name = reader.entry().name().to_string();
            let mode = reader.entry().mode();
            let mut contents = Vec::new();
            std::io::Read::read_to_end(&mut reader, &mut contents).unwrap();
            found.push((name, mode, contents));
            bytes = reader.finish().unwrap();
        }
    }

    #[test]
    fn files_bring_their_directories_once_and_keep_their_modes() {
        let mut cpio = Cpio::new();
        cpio.file("/fallow/script", 0o755, b"echo hi\n".to_vec())
            .file("fallow/args", 0o644, b"x".to_vec())
            .dir("lib/modules");
        let got = entries(&cpio.to_bytes().unwrap());
        let names: Vec<_> = got.iter().map(|(n, m, _)| (n.as_str(), *m)).collect();
        assert_eq!(
            names,
            [
                ("fallow", 0o040_755),
                ("fallow/script", 0o100_755),
                ("fallow/args", 0o100_644),
                ("lib", 0o040_755),
                ("lib/modules", 0o040_755),
            ]
        );
        assert_eq!(got[1].2, b"echo hi\n");
    }
}
