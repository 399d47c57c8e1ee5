//! The fused CPU update: one pass over a segment of the pushed weights
//! updates every profile's float32 EMA.
//!
//! The source is read once per cache-sized block (and converted from
//! bf16/fp16 into a block-sized buffer on the way, with no temporary
//! tensor), then each profile's block is lerped while the source block is
//! still in L2. With P profiles the memory traffic is `src + P x (read + write)`
//! instead of `P x (src + read + write)`. The optional drift sums
//! (`||ema - w||^2`, `||w||^2`) are accumulated in the same pass.
//!
//! Numerics follow ATen's vectorised CPU `lerp_` exactly:
//! `|w| < 0.5 ? fma(w, end - self, self) : fma(w - 1, end - self, end)`,
//! with the weight rounded to float32 (ATen's opmath for float). Where the
//! CPU has FMA the fused multiply-add is used, as ATen's AVX2 kernel does.

use half::slice::HalfFloatSliceExt;

use crate::wire::quant::{scale_at, FP8_E4M3};

/// What one profile does to the segment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Copy,
    Lerp(f32),
    Hold,
}

/// The pushed weights of a segment, as stored in the body or the mirror.
#[derive(Debug, Clone, Copy)]
pub enum Src<'a> {
    F32(&'a [f32]),
    BF16(&'a [u16]),
    F16(&'a [half::f16]),
}

impl Src<'_> {
    pub fn len(&self) -> usize {
        match self {
            Src::F32(s) => s.len(),
            Src::BF16(s) => s.len(),
            Src::F16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn range(&self, start: usize, end: usize) -> Self {
        match self {
            Src::F32(s) => Src::F32(&s[start..end]),
            Src::BF16(s) => Src::BF16(&s[start..end]),
            Src::F16(s) => Src::F16(&s[start..end]),
        }
    }
}

/// Elements per block: 256 KiB of float32. The source block stays in L2
/// while every profile's block is updated, and each EMA is streamed in runs
/// long enough for the hardware prefetchers (16 KiB blocks measured 8-20 %
/// slower with 4 profiles, where five streams take turns).
const BLOCK: usize = 64 << 10;

/// Elements summed in f32 lanes before the drift sums go to f64.
const DRIFT_CHUNK: usize = 4096;

/// Segments smaller than this are updated on the calling thread alone.
const PARALLEL_MIN: usize = 1 << 20;

/// A raw, `Send` pointer to one profile's EMA segment.
#[derive(Clone, Copy)]
pub struct EmaPtr(pub *mut f32);
// SAFETY: every thread writes a disjoint range of each buffer.
unsafe impl Send for EmaPtr {}
unsafe impl Sync for EmaPtr {}

/// Updates `emas` (each `src.len()` floats) per `ops`, reading `src`
/// once; returns per profile `(sum (ema - w)^2, sum w^2)` after the update
/// when `drift` is set.
///
/// # Safety
/// Each pointer in `emas` must point to `src.len()` writable floats that no
/// one else accesses during the call, and the buffers must not overlap.
pub unsafe fn update(
    emas: &[EmaPtr],
    ops: &[Op],
    src: Src<'_>,
    threads: usize,
    drift: bool,
) -> Vec<(f64, f64)> {
    assert_eq!(emas.len(), ops.len());
    in_parallel(src.len(), threads, emas.len(), &|start, end| {
        // SAFETY: disjoint ranges of the caller's buffers.
        unsafe { update_range(emas, ops, src.range(start, end), start, drift) }
    })
}

/// Runs `part(start, end)` over contiguous, block-aligned ranges of
/// `0..n` on up to `threads` threads (one when `n` is small) and sums the
/// per-profile drift pairs.
fn in_parallel(
    n: usize,
    threads: usize,
    profiles: usize,
    part: &(dyn Fn(usize, usize) -> Vec<(f64, f64)> + Sync),
) -> Vec<(f64, f64)> {
    let threads = if n >= PARALLEL_MIN {
        threads.clamp(1, 16)
    } else {
        1
    };
    if threads == 1 {
        return part(0, n);
    }
    // Contiguous per-thread ranges, rounded to whole blocks.
    let per = n.div_ceil(threads).div_ceil(BLOCK) * BLOCK;
    let mut totals = vec![(0.0, 0.0); profiles];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (1..threads)
            .filter_map(|t| {
                let (start, end) = (t * per, ((t + 1) * per).min(n));
                (start < end).then(|| scope.spawn(move || part(start, end)))
            })
            .collect();
        let first = part(0, per.min(n));
        for (t, d) in totals.iter_mut().zip(first) {
            t.0 += d.0;
            t.1 += d.1;
        }
        for h in handles {
            let part = h.join().expect("update thread");
            for (t, d) in totals.iter_mut().zip(part) {
                t.0 += d.0;
                t.1 += d.1;
            }
        }
    });
    totals
}

/// A delta pushed against the mirror, as stored in the body.
#[derive(Debug, Clone, Copy)]
pub enum Delta<'a> {
    F32(&'a [f32]),
    BF16(&'a [u16]),
    /// fp8 e4m3 values and their little-endian float32 scales, one per
    /// `block` values.
    Fp8 {
        q: &'a [u8],
        scales: &'a [u8],
        block: usize,
    },
    Int8 {
        q: &'a [i8],
        scales: &'a [u8],
        block: usize,
    },
}

impl Delta<'_> {
    pub fn len(&self) -> usize {
        match self {
            Delta::F32(s) => s.len(),
            Delta::BF16(s) => s.len(),
            Delta::Fp8 { q, .. } => q.len(),
            Delta::Int8 { q, .. } => q.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `out[j] = dequant(element start + j)`: `float32(q) * scale`, one
    /// rounding, as torch computes `q.float() * scale`.
    fn dequant(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match *self {
            Delta::F32(s) => out.copy_from_slice(&s[start..end]),
            Delta::BF16(s) => {
                for (o, &x) in out.iter_mut().zip(&s[start..end]) {
                    *o = f32::from_bits((x as u32) << 16);
                }
            }
            Delta::Fp8 { q, scales, block } => {
                dequant_blocks(&q[start..end], start, block, scales, out, |x| {
                    FP8_E4M3[x as usize]
                })
            }
            Delta::Int8 { q, scales, block } => {
                dequant_blocks(&q[start..end], start, block, scales, out, |x| x as f32)
            }
        }
    }
}

/// `out[j] = value(q[j]) * scale` for the elements `start..start + q.len()`
/// of a blockwise-scaled delta: one scale read per block of `block`
/// values, so the inner loop has no division and vectorises (a division
/// per element made quantised deltas 30 % slower to apply than fp32).
fn dequant_blocks<T: Copy>(
    q: &[T],
    start: usize,
    block: usize,
    scales: &[u8],
    out: &mut [f32],
    value: impl Fn(T) -> f32,
) {
    let mut j = 0;
    while j < q.len() {
        let b = (start + j) / block;
        let stop = ((b + 1) * block - start).min(q.len());
        let scale = scale_at(scales, b);
        for (o, &x) in out[j..stop].iter_mut().zip(&q[j..stop]) {
            *o = value(x) * scale;
        }
        j = stop;
    }
}

/// A mirror segment the delta is added to, in its dtype.
#[derive(Clone, Copy)]
pub enum MirrorPtr {
    F32(*mut f32),
    BF16(*mut u16),
}
// SAFETY: every thread writes a disjoint range of the mirror.
unsafe impl Send for MirrorPtr {}
unsafe impl Sync for MirrorPtr {}

/// Adds `delta` to `mirror` and updates `emas` from the new mirror, in one
/// pass: each block of the delta is dequantised, added to the mirror block
/// (rounded to the mirror's dtype) and, still in cache, averaged into every
/// profile. Returns the drift sums as [`update`] does.
///
/// # Safety
/// As [`update`], and `mirror` must point to `delta.len()` writable
/// elements that alias neither the EMAs nor the delta.
pub unsafe fn update_delta(
    emas: &[EmaPtr],
    ops: &[Op],
    mirror: MirrorPtr,
    delta: Delta<'_>,
    threads: usize,
    drift: bool,
) -> Vec<(f64, f64)> {
    assert_eq!(emas.len(), ops.len());
    in_parallel(delta.len(), threads, emas.len(), &|start, end| {
        // SAFETY: disjoint ranges of the caller's buffers.
        unsafe { update_delta_range(emas, ops, mirror, delta, start, end, drift) }
    })
}

unsafe fn update_delta_range(
    emas: &[EmaPtr],
    ops: &[Op],
    mirror: MirrorPtr,
    delta: Delta<'_>,
    start: usize,
    end: usize,
    drift: bool,
) -> Vec<(f64, f64)> {
    let fma = has_fma();
    let mut sums = vec![(0.0f64, 0.0f64); emas.len()];
    let mut buf = vec![0f32; BLOCK.min(end - start)];
    let mut i = start;
    while i < end {
        let len = BLOCK.min(end - i);
        let w = &mut buf[..len];
        delta.dequant(i, w);
        match mirror {
            MirrorPtr::F32(m) => {
                let m = std::slice::from_raw_parts_mut(m.add(i), len);
                for (x, d) in m.iter_mut().zip(w.iter_mut()) {
                    *x += *d;
                    *d = *x;
                }
            }
            MirrorPtr::BF16(m) => {
                let m = std::slice::from_raw_parts_mut(m.add(i), len);
                for (x, d) in m.iter_mut().zip(w.iter_mut()) {
                    let sum = half::bf16::from_f32(f32::from_bits((*x as u32) << 16) + *d);
                    *x = sum.to_bits();
                    *d = sum.to_f32();
                }
            }
        }
        apply_ops(emas, ops, i, w, drift, fma, &mut sums);
        i += len;
    }
    sums
}

/// Every profile's op on elements `[at, at + w.len())`, from the block `w`.
unsafe fn apply_ops(
    emas: &[EmaPtr],
    ops: &[Op],
    at: usize,
    w: &[f32],
    drift: bool,
    fma: bool,
    sums: &mut [(f64, f64)],
) {
    for ((ema, op), sum) in emas.iter().zip(ops).zip(sums) {
        // SAFETY: the caller guarantees the range lies in each buffer.
        let dst = std::slice::from_raw_parts_mut(ema.0.add(at), w.len());
        match *op {
            Op::Copy => dst.copy_from_slice(w),
            Op::Lerp(weight) => lerp(dst, w, weight, fma),
            Op::Hold => {}
        }
        if drift {
            let (d, o) = drift_block(dst, w);
            sum.0 += d;
            sum.1 += o;
        }
    }
}

/// Updates elements `[offset, offset + src.len())` of every EMA.
unsafe fn update_range(
    emas: &[EmaPtr],
    ops: &[Op],
    src: Src<'_>,
    offset: usize,
    drift: bool,
) -> Vec<(f64, f64)> {
    let fma = has_fma();
    let mut sums = vec![(0.0f64, 0.0f64); emas.len()];
    let mut buf = match src {
        Src::F32(_) => Vec::new(),
        _ => vec![0f32; BLOCK.min(src.len())],
    };
    let n = src.len();
    let mut i = 0;
    while i < n {
        let len = BLOCK.min(n - i);
        let w: &[f32] = match src {
            Src::F32(s) => &s[i..i + len],
            Src::BF16(s) => {
                for (b, &x) in buf[..len].iter_mut().zip(&s[i..i + len]) {
                    *b = f32::from_bits((x as u32) << 16);
                }
                &buf[..len]
            }
            Src::F16(s) => {
                s[i..i + len].convert_to_f32_slice(&mut buf[..len]);
                &buf[..len]
            }
        };
        apply_ops(emas, ops, offset + i, w, drift, fma, &mut sums);
        i += len;
    }
    sums
}

fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn lerp(dst: &mut [f32], w: &[f32], weight: f32, fma: bool) {
    #[cfg(target_arch = "x86_64")]
    if fma {
        // SAFETY: the CPU has AVX2 and FMA (checked by the caller).
        unsafe { lerp_fma(dst, w, weight) };
        return;
    }
    let _ = fma;
    if weight.abs() < 0.5 {
        for (d, &e) in dst.iter_mut().zip(w) {
            *d += weight * (e - *d);
        }
    } else {
        let c = weight - 1.0;
        for (d, &e) in dst.iter_mut().zip(w) {
            *d = e + c * (e - *d);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn lerp_fma(dst: &mut [f32], w: &[f32], weight: f32) {
    if weight.abs() < 0.5 {
        for (d, &e) in dst.iter_mut().zip(w) {
            *d = weight.mul_add(e - *d, *d);
        }
    } else {
        let c = weight - 1.0;
        for (d, &e) in dst.iter_mut().zip(w) {
            *d = c.mul_add(e - *d, e);
        }
    }
}

/// `(sum (a - b)^2, sum b^2)` of a block, in f64.
fn drift_block(a: &[f32], b: &[f32]) -> (f64, f64) {
    a.chunks(DRIFT_CHUNK)
        .zip(b.chunks(DRIFT_CHUNK))
        .map(|(a, b)| drift_chunk(a, b))
        .fold((0.0, 0.0), |s, d| (s.0 + d.0, s.1 + d.1))
}

/// The same over a short chunk, accumulated in f32 lanes (the chunk is
/// short, so the f32 partial sums stay exact enough for a monitoring ratio).
fn drift_chunk(a: &[f32], b: &[f32]) -> (f64, f64) {
    let mut d = [0f32; 8];
    let mut o = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            let diff = x[k] - y[k];
            d[k] += diff * diff;
            o[k] += y[k] * y[k];
        }
    }
    let mut dd: f64 = d.iter().map(|&v| v as f64).sum();
    let mut oo: f64 = o.iter().map(|&v| v as f64).sum();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        dd += ((x - y) as f64).powi(2);
        oo += (*y as f64).powi(2);
    }
    (dd, oo)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(emas: &mut [Vec<f32>], ops: &[Op], src: Src<'_>, threads: usize) -> Vec<(f64, f64)> {
        let ptrs: Vec<EmaPtr> = emas.iter_mut().map(|e| EmaPtr(e.as_mut_ptr())).collect();
        // SAFETY: distinct vectors of src.len() floats.
        unsafe { update(&ptrs, ops, src, threads, true) }
    }

    #[test]
    fn matches_torch_lerp() {
        // The same update through libtorch's lerp_ on the same values.
        let n = 3 * BLOCK + 17;
        let src: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 333.0 - 1.0)
            .collect();
        let init: Vec<f32> = (0..n)
            .map(|i| ((i * 104729) % 997) as f32 / 101.0)
            .collect();
        for weight in [0.001f64, 0.1, 0.5, 0.9] {
            let mut emas = vec![init.clone()];
            run(&mut emas, &[Op::Lerp(weight as f32)], Src::F32(&src), 1);
            let mut t = tch::Tensor::from_slice(&init);
            let _ = t.lerp_(&tch::Tensor::from_slice(&src), weight);
            let want: Vec<f32> = Vec::try_from(&t).unwrap();
            let max = emas[0]
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                .fold(0f32, f32::max);
            assert!(max <= 1.2e-7, "weight {weight}: {max}");
        }
    }

    #[test]
    fn profiles_threads_and_dtypes_agree() {
        let n = PARALLEL_MIN + 3 * BLOCK + 5;
        let src: Vec<f32> = (0..n).map(|i| (i as f32 * 0.001).sin()).collect();
        let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.002).cos()).collect();
        let ops = [Op::Lerp(0.01), Op::Lerp(0.75), Op::Copy, Op::Hold];
        let mut one = vec![init.clone(); 4];
        let mut two = vec![init.clone(); 4];
        let d1 = run(&mut one, &ops, Src::F32(&src), 1);
        let d2 = run(&mut two, &ops, Src::F32(&src), 2);
        assert_eq!(one, two, "threads change nothing");
        assert_eq!(one[2], src);
        assert_eq!(one[3], init);
        for (a, b) in d1.iter().zip(&d2) {
            assert!((a.0 - b.0).abs() <= 1e-9 * a.0.max(1.0) && (a.1 - b.1).abs() <= 1e-9 * a.1);
        }
        assert_eq!(d1[2].0, 0.0, "a copy has no drift");
        let online: f64 = src.iter().map(|&x| (x as f64).powi(2)).sum();
        assert!((d1[0].1 - online).abs() <= 1e-6 * online);
        // bf16 source: the same as converting first.
        let bf: Vec<u16> = src
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let widened: Vec<f32> = bf
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        let mut a = vec![init.clone()];
        let mut b = vec![init.clone()];
        run(&mut a, &[Op::Lerp(0.3)], Src::BF16(&bf), 2);
        run(&mut b, &[Op::Lerp(0.3)], Src::F32(&widened), 2);
        assert_eq!(a, b);
        let h: Vec<half::f16> = src.iter().map(|&x| half::f16::from_f32(x)).collect();
        let hw: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
        let mut a = vec![init.clone()];
        let mut b = vec![init];
        run(&mut a, &[Op::Copy], Src::F16(&h), 1);
        run(&mut b, &[Op::Copy], Src::F32(&hw), 1);
        assert_eq!(a, b);
    }

    /// Dequantising from any element (not only a block's first) takes
    /// each value's own block scale: `float32(q) * scale[i / block]`.
    #[test]
    fn dequant_from_any_start_uses_each_values_block_scale() {
        let n = 1000usize;
        let q: Vec<u8> = (0..n).map(|i| ((i * 29) % 256) as u8 & 0xf6).collect();
        let qi: Vec<i8> = (0..n).map(|i| ((i * 31) % 255) as i8).collect();
        for block in [128usize, 256] {
            let nb = n.div_ceil(block);
            let sbytes: Vec<u8> = (0..nb)
                .flat_map(|b| (0.5f32 + b as f32 * 0.25).to_le_bytes())
                .collect();
            let scale = |i: usize| 0.5f32 + (i / block) as f32 * 0.25;
            for (start, len) in [(0, n), (1, 300), (127, 2), (200, 600), (999, 1)] {
                let mut out = vec![0f32; len];
                Delta::Fp8 {
                    q: &q,
                    scales: &sbytes,
                    block,
                }
                .dequant(start, &mut out);
                for (j, o) in out.iter().enumerate() {
                    let i = start + j;
                    assert_eq!(o.to_bits(), (FP8_E4M3[q[i] as usize] * scale(i)).to_bits());
                }
                Delta::Int8 {
                    q: &qi,
                    scales: &sbytes,
                    block,
                }
                .dequant(start, &mut out);
                for (j, o) in out.iter().enumerate() {
                    let i = start + j;
                    assert_eq!(o.to_bits(), (qi[i] as f32 * scale(i)).to_bits());
                }
            }
        }
    }

    /// The fused delta update equals torch's unfused one on the same
    /// numbers: `mirror += q.float() * scale` (per block), then `lerp_`.
    #[test]
    fn delta_update_matches_torch_dequant_add_and_lerp() {
        use tch::{Kind, Tensor};
        let block = 128usize;
        let n = 3 * BLOCK + 77; // a partial last block
        let q: Vec<u8> = (0..n).map(|i| ((i * 37) % 256) as u8 & 0xf6).collect();
        let qi: Vec<i8> = (0..n).map(|i| ((i * 53) % 255) as i8).collect();
        let nb = n.div_ceil(block);
        let scales: Vec<f32> = (0..nb).map(|b| 1e-3 * (1.0 + (b % 7) as f32)).collect();
        let sbytes: Vec<u8> = scales.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mirror0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.01).sin()).collect();
        let ema0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.02).cos()).collect();
        let padded = nb * block;
        let torch_ref = |deq: Tensor| -> (Vec<f32>, Vec<f32>) {
            let mut m = Tensor::from_slice(&mirror0);
            let _ = m.g_add_(&deq);
            let mut e = Tensor::from_slice(&ema0);
            let _ = e.lerp_(&m, 0.25);
            (Vec::try_from(&m).unwrap(), Vec::try_from(&e).unwrap())
        };
        let st = Tensor::from_slice(&scales).unsqueeze(1);
        let fp8 = Tensor::from_slice(&q)
            .view_dtype(Kind::Float8e4m3fn)
            .to_kind(Kind::Float);
        let int8 = Tensor::from_slice(&qi).to_kind(Kind::Float);
        for (delta, widened) in [
            (
                Delta::Fp8 {
                    q: &q,
                    scales: &sbytes,
                    block,
                },
                fp8,
            ),
            (
                Delta::Int8 {
                    q: &qi,
                    scales: &sbytes,
                    block,
                },
                int8,
            ),
        ] {
            let deq = widened
                .constant_pad_nd([0, (padded - n) as i64])
                .view([nb as i64, block as i64])
                .g_mul(&st)
                .view([-1])
                .narrow(0, 0, n as i64);
            let (want_m, want_e) = torch_ref(deq);
            for threads in [1, 2] {
                let mut m = mirror0.clone();
                let mut e = ema0.clone();
                // SAFETY: distinct vectors of n floats.
                unsafe {
                    update_delta(
                        &[EmaPtr(e.as_mut_ptr())],
                        &[Op::Lerp(0.25)],
                        MirrorPtr::F32(m.as_mut_ptr()),
                        delta,
                        threads,
                        false,
                    )
                };
                assert_eq!(m, want_m, "mirror bit-exact");
                let worst = e
                    .iter()
                    .zip(&want_e)
                    .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                    .fold(0f32, f32::max);
                assert!(worst <= 1.2e-7, "{worst}");
            }
        }
        // A bf16 mirror rounds the sum to bf16, as `(m.float() + d).bfloat16()`.
        let mb: Vec<u16> = mirror0
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let d: Vec<u16> = ema0
            .iter()
            .map(|&x| half::bf16::from_f32(x * 1e-2).to_bits())
            .collect();
        let want: Vec<u16> = mb
            .iter()
            .zip(&d)
            .map(|(&a, &b)| {
                let s = half::bf16::from_bits(a).to_f32() + half::bf16::from_bits(b).to_f32();
                half::bf16::from_f32(s).to_bits()
            })
            .collect();
        let mut m = mb.clone();
        let mut e = vec![0f32; n];
        // SAFETY: distinct buffers of n elements.
        unsafe {
            update_delta(
                &[EmaPtr(e.as_mut_ptr())],
                &[Op::Copy],
                MirrorPtr::BF16(m.as_mut_ptr()),
                Delta::BF16(&d),
                1,
                false,
            )
        };
        assert_eq!(m, want);
        let widened: Vec<f32> = want
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        assert_eq!(e, widened);
    }
}
