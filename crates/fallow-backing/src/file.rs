//! A local file or block device: `pread`/`pwrite` on tokio's blocking threads,
//! `fdatasync` for flush and FUA, hole punching for trim and zeroing, `SEEK_DATA` /
//! `SEEK_HOLE` for block status. New images are sparse.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use rustix::fs::{FallocateFlags, SeekFrom};

use crate::{check_range, BackingStore, Capabilities, Durability, Extent, Zeroing};

/// A file or block device.
#[derive(Debug, Clone)]
pub struct FileStore {
    file: Arc<File>,
    path: PathBuf,
    size: u64,
    read_only: bool,
    /// Regular files can punch holes and report them; block devices are treated as
    /// fully allocated.
    regular: bool,
}

impl FileStore {
    /// Opens an existing file or block device; its size is the store's size.
    pub fn open(path: &Path, read_only: bool) -> io::Result<FileStore> {
        let file = OpenOptions::new().read(true).write(!read_only).open(path).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display()))
        })?;
        let meta = file.metadata()?;
        let regular = meta.file_type().is_file();
        let size = if meta.file_type().is_block_device() {
            rustix::fs::seek(&file, SeekFrom::End(0))?
        } else if regular {
            meta.len()
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is neither a regular file nor a block device", path.display()),
            ));
        };
        Ok(FileStore { file: Arc::new(file), path: path.to_path_buf(), size, read_only, regular })
    }

    /// Opens `path`, creating it as a sparse file of `size` bytes if it does not exist.
    /// An existing file keeps its size (a different `size` is an error, so an image is
    /// never silently truncated or grown).
    pub fn open_or_create(path: &Path, size: u64) -> io::Result<FileStore> {
        match OpenOptions::new().read(true).write(true).create_new(true).open(path) {
            Ok(file) => {
                file.set_len(size)?;
                tracing::info!(path = %path.display(), size, "created a sparse image");
                drop(file);
                FileStore::open(path, false)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let store = FileStore::open(path, false)?;
                if store.size != size {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "{} exists with {} bytes, not the {size} asked for",
                            path.display(),
                            store.size
                        ),
                    ));
                }
                Ok(store)
            }
            Err(e) => {
                Err(io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display())))
            }
        }
    }

    /// The path opened.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn writable(&self) -> io::Result<()> {
        if self.read_only {
            Err(io::Error::new(io::ErrorKind::PermissionDenied, "the store is read-only"))
        } else {
            Ok(())
        }
    }

    /// Runs a blocking system call on tokio's blocking threads.
    async fn blocking<T, F>(&self, f: F) -> io::Result<T>
    where
        F: FnOnce(&File) -> io::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let file = self.file.clone();
        tokio::task::spawn_blocking(move || f(&file))
            .await
            .map_err(|e| io::Error::other(format!("I/O task failed: {e}")))?
    }

    /// Punches a hole (reads as zeros). `Unsupported` where the file system cannot.
    fn punch(file: &File, offset: u64, len: u64) -> io::Result<()> {
        rustix::fs::fallocate(
            file,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
        .map_err(io::Error::from)
    }
}

#[async_trait]
impl BackingStore for FileStore {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: self.read_only,
            flush: true,
            fua: true,
            trim: self.regular,
            trim_zeroes: self.regular,
            fast_zero: self.regular,
            block_status: self.regular,
            // One open file description: the page cache makes every connection's writes
            // visible to the others, and fdatasync covers them all.
            multi_conn: true,
        }
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        check_range(offset, len as u64, self.size)?;
        self.blocking(move |file| {
            let mut buf = vec![0u8; len as usize];
            file.read_exact_at(&mut buf, offset)?;
            Ok(Bytes::from(buf))
        })
        .await
    }

    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> io::Result<()> {
        self.writable()?;
        check_range(offset, data.len() as u64, self.size)?;
        self.blocking(move |file| {
            file.write_all_at(&data, offset)?;
            if durability == Durability::Immediate {
                file.sync_data()?;
            }
            Ok(())
        })
        .await
    }

    async fn flush(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.blocking(|file| file.sync_data()).await
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        self.writable()?;
        check_range(offset, len as u64, self.size)?;
        if !self.regular {
            return Ok(()); // a hint: keeping the data is allowed
        }
        self.blocking(move |file| match Self::punch(file, offset, len as u64) {
            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
            other => other,
        })
        .await
    }

    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        self.writable()?;
        check_range(offset, len as u64, self.size)?;
        let regular = self.regular;
        self.blocking(move |file| {
            if regular {
                let mode = if zeroing == Zeroing::MayDeallocate {
                    FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE
                } else {
                    FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE
                };
                match rustix::fs::fallocate(file, mode, offset, len as u64) {
                    Ok(()) => return Ok(()),
                    Err(e) if io::Error::from(e).kind() != io::ErrorKind::Unsupported => {
                        return Err(e.into())
                    }
                    Err(_) => {} // fall back to writing zeros
                }
            }
            let zeros = vec![0u8; (len as usize).min(1 << 20)];
            let mut done = 0u64;
            while done < len as u64 {
                let n = (len as u64 - done).min(zeros.len() as u64) as usize;
                file.write_all_at(zeros.get(..n).unwrap_or_default(), offset + done)?;
                done += n as u64;
            }
            Ok(())
        })
        .await
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        check_range(offset, len as u64, self.size)?;
        if !self.regular {
            return Ok(vec![Extent { length: len as u64, hole: false, zero: false }]);
        }
        let end = offset + len as u64;
        self.blocking(move |file| {
            let mut extents = Vec::new();
            let mut at = offset;
            while at < end {
                // Where the next data starts; ENXIO means there is none after `at`.
                let data = match rustix::fs::seek(file, SeekFrom::Data(at)) {
                    Ok(pos) => pos.min(end),
                    Err(rustix::io::Errno::NXIO) => end,
                    Err(e) => return Err(e.into()),
                };
                if data > at {
                    extents.push(Extent { length: data - at, hole: true, zero: true });
                    at = data;
                    continue;
                }
                let hole = match rustix::fs::seek(file, SeekFrom::Hole(at)) {
                    Ok(pos) => pos.min(end),
                    Err(rustix::io::Errno::NXIO) => end,
                    Err(e) => return Err(e.into()),
                };
                let hole = hole.max(at + 1);
                extents.push(Extent { length: hole - at, hole: false, zero: false });
                at = hole;
            }
            Ok(extents)
        })
        .await
    }
}
