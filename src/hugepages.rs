//! Transparent huge pages for the large, long-lived host buffers: the EMA
//! and mirror tensors of a rank and the pooled receive buffers.
//!
//! Where the kernel's THP mode is `madvise` (the common default), an
//! anonymous buffer gets 4 KiB pages unless it asks. Each pass of the
//! update streams the body and every EMA buffer; with 4 KiB pages that is a
//! TLB miss every 4 KiB and, past a few GB, page-table walks that miss the
//! cache too (their entries alone are 2 MB per GB of buffer), which makes
//! the cost per parameter grow with the model. 2 MiB pages take both away.
//! The advice must come before the pages are first touched: buffers are
//! allocated, advised, then filled.

/// The size of a transparent huge page on x86-64 and aarch64 (4 KiB base).
const HUGE: usize = 2 << 20;

/// Asks for huge pages on the 2 MiB-aligned part of `[ptr, ptr + len)`;
/// returns the bytes advised (0 when the range holds no whole huge page or
/// the platform has no THP). Advice only: memory is unchanged either way.
pub fn advise(ptr: *const u8, len: usize) -> usize {
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize).saturating_add(len) / HUGE * HUGE;
    if end <= start {
        return 0;
    }
    advise_aligned(start, end - start)
}

#[cfg(target_os = "linux")]
fn advise_aligned(start: usize, len: usize) -> usize {
    // SAFETY: the range lies inside one allocation the caller owns, is
    // page-aligned, and MADV_HUGEPAGE changes no contents.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    if rc == 0 {
        len
    } else {
        0
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_aligned(_start: usize, _len: usize) -> usize {
    0
}

/// A zero-filled tensor on `device`; on the CPU its memory is advised for
/// huge pages before the zeros are written.
pub fn zeros(
    numel: i64,
    kind: tch::Kind,
    device: tch::Device,
) -> Result<tch::Tensor, tch::TchError> {
    if device != tch::Device::Cpu {
        return tch::Tensor::f_zeros([numel], (kind, device));
    }
    let mut t = empty(numel, kind)?;
    let _ = t.f_zero_()?;
    Ok(t)
}

/// An uninitialised flat CPU tensor, advised for huge pages; the caller
/// writes every element before reading any.
pub fn empty(numel: i64, kind: tch::Kind) -> Result<tch::Tensor, tch::TchError> {
    let t = tch::Tensor::f_empty([numel], (kind, tch::Device::Cpu))?;
    advise(
        t.data_ptr() as *const u8,
        numel as usize * kind.elt_size_in_bytes(),
    );
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advises_only_whole_aligned_huge_pages() {
        // Less than one huge page: nothing to advise, whatever the alignment.
        let small = vec![0u8; HUGE - 1];
        assert_eq!(advise(small.as_ptr(), small.len()), 0);
        // 3 huge pages plus change: at least two whole aligned ones inside.
        let big = vec![0u8; 3 * HUGE + 123];
        let advised = advise(big.as_ptr(), big.len());
        if cfg!(target_os = "linux") {
            assert!((2 * HUGE..=3 * HUGE).contains(&advised), "{advised}");
            assert_eq!(advised % HUGE, 0);
        }
        assert!(big.iter().all(|&b| b == 0), "advice changes no contents");
    }

    #[test]
    fn zeros_are_zero_on_every_path() {
        for numel in [0i64, 5, (3 * HUGE / 4) as i64] {
            let t = zeros(numel, tch::Kind::Float, tch::Device::Cpu).unwrap();
            assert_eq!(t.size(), [numel]);
            assert_eq!(t.abs().sum(tch::Kind::Double).double_value(&[]), 0.0);
        }
    }
}
