//! Free space on the data dir's filesystem.
//!
//! A snapshot or state write that fills the disk fails half-way and, worse,
//! leaves SQLite (on the same filesystem) unable to record that it failed.
//! So writes are refused up front when they would leave less than
//! `--disk-reserve` free, and the free space is exported as a gauge.

use std::path::Path;

use super::Snaps;

pub use crate::services::error::NoSpace;

/// Bytes an unprivileged process may still write on the filesystem of `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a valid NUL-terminated path and `stat` a plain struct
    // the call fills in.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut stat) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Refreshes the free-space gauges; returns the free bytes (None when the
/// filesystem could not be asked).
pub fn refresh_gauge(state: &Snaps) -> Option<u64> {
    let metrics = &state.metrics;
    metrics
        .disk_reserve_bytes
        .set(state.args.disk_reserve.0 as i64);
    match free_bytes(state.pending.data_dir()) {
        Ok(free) => {
            metrics.disk_free_bytes.set(free as i64);
            Some(free)
        }
        Err(e) => {
            tracing::warn!(error = %e, "asking the data dir's free space failed");
            None
        }
    }
}

/// Refuses a write of `need` bytes that would leave less than the reserve.
/// A filesystem that cannot be asked is not refused: the write itself
/// will tell.
pub fn check(state: &Snaps, need: u64) -> Result<(), NoSpace> {
    let Some(free) = refresh_gauge(state) else {
        return Ok(());
    };
    let reserve = state.args.disk_reserve.0;
    let left = free as i128 - need as i128;
    if left < reserve as i128 {
        return Err(NoSpace {
            need,
            free,
            left,
            reserve,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_bytes_of_a_real_directory() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        assert!(free > 0);
        let err = free_bytes(&dir.path().join("missing")).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn the_refusal_says_why() {
        let e = NoSpace {
            need: 100,
            free: 150,
            left: 50,
            reserve: 64,
        };
        let text = e.to_string();
        assert!(text.contains("not enough disk space"), "{text}");
        assert!(text.contains("--disk-reserve"), "{text}");
    }
}
