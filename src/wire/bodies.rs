//! Reused receive buffers for push bodies.
//!
//! A trainer pushes bodies of the same size every step. A fresh 64 MB
//! allocation is a fresh `mmap`: the kernel faults in and zeroes every page
//! while the body is copied in, and unmaps them all when the push is done,
//! which costs about as much as the copy itself. The pool keeps a few
//! buffers of earlier bodies (already faulted in) and hands them out again;
//! a buffer goes back when the last reference to the body it held is
//! dropped (on the engine thread, after the apply). Buffers left idle for a
//! while are freed ([`BodyPool::trim`], from the server's ticker), so a
//! server whose runs stopped pushing does not keep their memory.
//!
//! A declared `Content-Length` is only a promise: a new buffer starts small
//! and grows with the bytes that arrive (toward the declared length, so a
//! body that keeps its promise is not over-allocated), and an idle buffer
//! is reused only if it already holds the declared length.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Idle receive buffers, at most `max_idle` of them.
pub struct BodyPool {
    /// Idle buffers and when each came back.
    idle: Mutex<Vec<(Vec<u8>, Instant)>>,
    max_idle: usize,
}

impl BodyPool {
    pub fn new(max_idle: usize) -> Arc<Self> {
        Arc::new(BodyPool {
            idle: Mutex::new(Vec::new()),
            max_idle,
        })
    }

    /// An empty buffer for a body of about `hint` bytes: the smallest idle
    /// one that holds `hint` already, else a new one of at most
    /// [`FIRST_ALLOCATION`] bytes that grows as data arrives.
    pub fn take(self: &Arc<Self>, hint: usize) -> PooledBuf {
        let reused = {
            let mut idle = self.idle.lock().expect("body pool");
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, (b, _))| b.capacity() >= hint)
                .min_by_key(|(_, (b, _))| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| idle.swap_remove(i).0)
        };
        PooledBuf {
            buf: reused.unwrap_or_else(|| fresh(hint.min(FIRST_ALLOCATION))),
            hint,
            pool: Arc::clone(self),
        }
    }

    /// Bytes held by idle buffers.
    pub fn idle_bytes(&self) -> usize {
        let idle = self.idle.lock().expect("body pool");
        idle.iter().map(|(b, _)| b.capacity()).sum()
    }

    /// Frees the buffers idle for `after` or longer; returns the bytes freed.
    pub fn trim(&self, after: Duration) -> usize {
        let now = Instant::now();
        let mut idle = self.idle.lock().expect("body pool");
        let before: usize = idle.iter().map(|(b, _)| b.capacity()).sum();
        idle.retain(|(_, since)| now.duration_since(*since) < after);
        before - idle.iter().map(|(b, _)| b.capacity()).sum::<usize>()
    }

    fn give_back(&self, mut buf: Vec<u8>) {
        if buf.capacity() == 0 || self.max_idle == 0 {
            return;
        }
        buf.clear();
        let mut idle = self.idle.lock().expect("body pool");
        let now = Instant::now();
        if idle.len() < self.max_idle {
            idle.push((buf, now));
        } else if let Some(smallest) = idle.iter_mut().min_by_key(|(b, _)| b.capacity()) {
            // Keep the larger ones: they fit every body the smaller ones fit.
            if smallest.0.capacity() < buf.capacity() {
                *smallest = (buf, now);
            }
        }
    }
}

/// The most a new receive buffer holds before any data arrives.
pub const FIRST_ALLOCATION: usize = 1 << 20;

/// A new, untouched buffer, advised for huge pages before the body is
/// copied in (see [`crate::hugepages`]).
fn fresh(len: usize) -> Vec<u8> {
    let buf = Vec::with_capacity(len);
    crate::hugepages::advise(buf.as_ptr(), buf.capacity());
    buf
}

/// A receive buffer that returns to its pool when dropped.
pub struct PooledBuf {
    buf: Vec<u8>,
    /// The length the sender declared (0 when unknown): growth stops there
    /// while the body keeps to it.
    hint: usize,
    pool: Arc<BodyPool>,
}

impl PooledBuf {
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Room for at least `len` bytes in all.
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Appends `data`, growing by doubling (capped at the declared length
    /// while the body stays within it). A large realloc is an `mremap`, so
    /// growing costs no copy of what arrived.
    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let need = self.buf.len() + data.len();
        if need > self.buf.capacity() {
            let doubled = self.buf.capacity().saturating_mul(2).max(64 << 10);
            let target = if self.hint >= need {
                doubled.min(self.hint)
            } else {
                doubled
            };
            self.buf.reserve_exact(target.max(need) - self.buf.len());
            crate::hugepages::advise(self.buf.as_ptr(), self.buf.capacity());
        }
        self.buf.extend_from_slice(data);
    }

    /// Sets the length to `len` (new bytes are zero), allocating exactly
    /// once: the decoder knows the decoded size before it writes.
    pub fn resize(&mut self, len: usize) {
        if len > self.buf.capacity() {
            self.buf.reserve_exact(len - self.buf.len());
            crate::hugepages::advise(self.buf.as_ptr(), self.buf.capacity());
        }
        self.buf.resize(len, 0);
    }

    /// The bytes written so far, to fill in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// The body as `Bytes`; the buffer goes back to the pool when the last
    /// clone is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_bounded() {
        let pool = BodyPool::new(2);
        let mut a = pool.take(1000);
        a.extend_from_slice(&[7u8; 1000]);
        let bytes = a.freeze();
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(pool.idle_bytes(), 0, "a clone still holds the body");
        assert_eq!(&clone[..3], &[7, 7, 7]);
        drop(clone);
        assert!(pool.idle_bytes() >= 1000);
        // Reused: same allocation, empty again.
        let b = pool.take(500);
        assert!(b.is_empty() && pool.idle_bytes() == 0);
        drop(b);
        // At most two idle buffers, the largest kept.
        let bufs: Vec<_> = [10, 20, 4000].iter().map(|&n| pool.take(n)).collect();
        drop(bufs);
        {
            let idle = pool.idle.lock().unwrap();
            assert_eq!(idle.len(), 2);
            assert!(idle.iter().any(|(b, _)| b.capacity() >= 4000));
            assert!(idle.iter().any(|(b, _)| b.capacity() >= 1000));
        }
        // A declared length is not allocated up front: the buffer grows
        // with the data, and stops at the declared length.
        let mut big = pool.take(10 << 30);
        assert!(big.capacity() <= FIRST_ALLOCATION, "{}", big.capacity());
        let chunk = vec![1u8; 300 << 10];
        for _ in 0..4 {
            big.extend_from_slice(&chunk);
        }
        assert_eq!(big.len(), 1200 << 10);
        assert!(big.capacity() <= 4 << 20, "{}", big.capacity());
        let mut exact = pool.take(1500);
        exact.extend_from_slice(&[3u8; 1200]);
        exact.extend_from_slice(&[3u8; 300]);
        assert_eq!((exact.len(), exact.capacity() >= 1500), (1500, true));
        drop((big, exact));
        // Recently returned buffers stay; idle ones are freed.
        assert_eq!(pool.trim(Duration::from_secs(3600)), 0);
        let held = pool.idle_bytes();
        assert_eq!(pool.trim(Duration::ZERO), held);
        assert_eq!(pool.idle_bytes(), 0);
    }
}
