//! Any byte string as a push body: the parser answers a `WireError` or a
//! parse whose every byte range lies inside the body; it never panics,
//! loops or reads out of bounds.

#![no_main]

use libfuzzer_sys::fuzz_target;
use polyak_fuzz::run::NonfinitePolicy;
use polyak_fuzz::wire::push::{parse_push, WireLimits};

fuzz_target!(|data: &[u8]| {
    let policy = match data.first().map(|b| b % 3) {
        Some(1) => NonfinitePolicy::SkipTensor,
        Some(2) => NonfinitePolicy::Allow,
        _ => NonfinitePolicy::Reject,
    };
    let body = bytes::Bytes::copy_from_slice(data);
    let limits = WireLimits {
        header_limit: 1 << 20,
    };
    if let Ok(parsed) = parse_push(body, limits, policy) {
        for t in &parsed.tensors {
            assert!(t.range.start <= t.range.end && t.range.end <= data.len());
            // Shape times dtype is what the range holds.
            let numel = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d as usize));
            assert_eq!(numel.map(|n| n * t.dtype.size()), Some(t.range.len()));
            assert_eq!(parsed.bytes_of(t).len(), t.range.len());
        }
    }
});
