//! One rank's state on the engine: its registered layout, the flat EMA
//! buffers (one per profile), copied tensors, the optional mirror, and the
//! step bookkeeping. `apply_push` is the hot path.
//!
//! Layout of the buffers: the rank's averaged (floating point) tensors are
//! laid end to end, in the order of their data in the first push, in one
//! flat tensor of the run's `ema_dtype` per profile. Copied tensors (integer,
//! bool, and names matching `copy_patterns`) live in one flat buffer per
//! dtype, shared by all profiles (every profile copies them). The mirror
//! keeps every pushed tensor in its pushed dtype, one flat buffer per dtype.
//! A push whose tensors come in the same order (every push of the Python
//! client, and any writer that sorts like the safetensors reference does)
//! maps onto each buffer as one contiguous range per dtype: one kernel call
//! updates a whole shard.

use std::sync::Arc;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use super::kernels::{self, Delta, EmaPtr, MirrorPtr, Op, Src};
use super::schedule::{decide, Action, BemaStep};
use super::EngineError;
use crate::hugepages;
use crate::run::RunConfig;
use crate::wire::check::BodyDigest;
pub use crate::wire::layout::{Group, LayoutTensor, RankLayout, Slot};
use crate::wire::quant::QuantFormat;
use crate::wire::{DType, ParsedPush, PushKind, WireTensor};

/// Applied steps a rank remembers the digests of besides the last one:
/// more than a pipelining client keeps in flight (`--pipeline-depth`).
pub const RECENT_DIGESTS: usize = 16;

/// A rank's tensors and step bookkeeping, owned by the engine thread.
pub struct RankState {
    pub layout: Arc<RankLayout>,
    /// One flat buffer of `ema_dtype` per profile.
    pub ema: Vec<Tensor>,
    /// One flat buffer per copied dtype group.
    pub copied: Vec<Tensor>,
    /// One flat buffer per pushed dtype, when the run keeps a mirror.
    pub mirror: Option<Vec<Tensor>>,
    /// Per profile: pushes averaged so far (SWA).
    pub swa_n: Vec<u64>,
    /// Per profile: a `bema` profile's hidden buffers (`None` for the
    /// other kinds).
    pub bema: Vec<Option<BemaBuffers>>,
    /// The last applied step and the digest of its body.
    pub last_step: Option<u64>,
    pub last_digest: Option<BodyDigest>,
    /// The steps applied before the last one, with their digests (at most
    /// [`RECENT_DIGESTS`], newest last; not persisted): a pipelined push
    /// whose answer was lost is retried after its successor was applied,
    /// and is answered a duplicate by these.
    pub recent: std::collections::VecDeque<(u64, BodyDigest)>,
    /// A full push was applied, so deltas have a base.
    pub has_keyframe: bool,
    /// The rank's lineage ([`super::capture::RankMeta::generation`]).
    pub generation: u64,
    /// Applied pushes since this state was created (drift sampling).
    pub applied: u64,
}

/// A `bema` profile's buffers besides the served one (which holds TRL's
/// `running_model`): flat like it, in the EMA dtype, over the averaged
/// tensors.
pub struct BemaBuffers {
    /// `w0`: the weights at the rank's first push, or at `update_after`.
    pub start: Tensor,
    /// The plain EMA the served weights are corrected from.
    pub ema: Tensor,
}

/// `||EMA - online||^2` and `||online||^2` of one profile over a rank's
/// averaged tensors, right after an update.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DriftSample {
    pub profile: String,
    pub diff_sq: f64,
    pub online_sq: f64,
    /// The same sums per averaged tensor, in the order of `tensor_names`
    /// (taken in the same pass as the totals).
    #[serde(skip)]
    pub tensors: Vec<(f64, f64)>,
    #[serde(skip)]
    pub tensor_names: Arc<Vec<String>>,
}

/// What applying a push reports besides success.
#[derive(Debug, Default)]
pub struct ApplyReport {
    /// Tensors skipped for holding NaN/Inf.
    pub skipped: Vec<String>,
    /// Present on the pushes where drift is sampled.
    pub drift: Option<Vec<DriftSample>>,
}

/// Elements per step of the drift reduction (bounds its temporaries).
const DRIFT_CHUNK: i64 = 1 << 22;

/// `[sum((a - b)^2), sum(b^2)]` in f64, left on the tensors' device: the
/// sums of every tensor of a sample come back in one transfer, not one
/// synchronisation per tensor.
fn drift_sums(a: &Tensor, b: &Tensor) -> Result<Tensor, EngineError> {
    let n = a.size()[0];
    let mut acc = Tensor::f_zeros([2], (Kind::Double, a.device()))?;
    let mut start = 0;
    while start < n {
        let len = DRIFT_CHUNK.min(n - start);
        let (x, y) = (a.f_narrow(0, start, len)?, b.f_narrow(0, start, len)?);
        let d = x.f_sub(&y)?;
        let pair = Tensor::f_stack(
            &[
                d.f_mul(&d)?.f_sum(Kind::Double)?,
                y.f_mul(&y)?.f_sum(Kind::Double)?,
            ],
            0,
        )?;
        acc = acc.f_add(&pair)?;
        start += len;
    }
    Ok(acc)
}

/// What happened to a push.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PushOutcome {
    pub applied: bool,
    pub duplicate: bool,
    pub step: u64,
    /// The rank's last applied step after this push.
    pub last_step: Option<u64>,
    /// Tensors skipped for holding NaN/Inf (policy `skip_tensor`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
    /// Set when this push registered the rank's layout.
    #[serde(skip)]
    pub registered: Option<Arc<RankLayout>>,
    /// Bytes the rank's buffers hold on the device.
    pub resident_bytes: u64,
    /// Seconds the engine spent applying it.
    pub apply_seconds: f64,
    /// EMA drift per profile, on the pushes where it is sampled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift: Option<Vec<DriftSample>>,
    /// The push's size in the registered dtypes, uncompressed (see the
    /// wire ratio).
    #[serde(skip)]
    pub logical_bytes: u64,
    /// Set on a keyframe whose `polyak.mirror_crc32` did not match the
    /// mirror it replaced (the keyframe repaired it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mirror_mismatch: Option<MirrorMismatch>,
}

/// A keyframe found the mirror other than the client held it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct MirrorMismatch {
    pub client_crc32: String,
    pub server_crc32: String,
}

/// Where the source of one tensor's update lives.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// Byte offset in the push body.
    Body(usize),
    /// Mirror group and element offset.
    Mirror(usize, i64),
}

/// A delta's values in the body: where, stored how.
#[derive(Debug, Clone, Copy)]
struct DeltaSrc {
    offset: usize,
    /// The storage dtype on the wire (`U8` for fp8 e4m3).
    wire: DType,
    quant: Option<QuantSrc>,
}

/// A quantised delta's format and the byte offset of its scales.
#[derive(Debug, Clone, Copy)]
struct QuantSrc {
    format: QuantFormat,
    block: usize,
    scales: usize,
}

impl DeltaSrc {
    fn of(t: &WireTensor) -> Self {
        DeltaSrc {
            offset: t.range.start,
            wire: t.dtype,
            quant: t.quant.as_ref().map(|q| QuantSrc {
                format: q.format,
                block: q.block,
                scales: q.scales.start,
            }),
        }
    }
}

/// A maximal run of tensors contiguous in both source and destination.
#[derive(Debug, Clone, Copy)]
struct Segment {
    src: Source,
    dst: i64,
    numel: i64,
    dtype: DType,
    /// Mirror updates: the delta added to (or XOR'd into) the mirror range.
    /// Averaged segments: a delta the fused kernel adds to the mirror
    /// range it reads, in the same pass.
    delta: Option<DeltaSrc>,
}

impl Segment {
    fn extends(&self, next: &Segment) -> bool {
        if self.dtype != next.dtype
            || self.dst + self.numel != next.dst
            || self.delta.is_some()
            || next.delta.is_some()
        {
            return false;
        }
        match (self.src, next.src) {
            (Source::Body(a), Source::Body(b)) => {
                a + (self.numel as usize) * self.dtype.size() == b
            }
            (Source::Mirror(ga, a), Source::Mirror(gb, b)) => ga == gb && a + self.numel == b,
            _ => false,
        }
    }
}

/// What one push does, sorted by the buffer it writes.
struct Plan {
    /// Per mirror group: ranges copied from the body.
    mirror_copy: Vec<Vec<Segment>>,
    /// Per mirror group: deltas added through libtorch (the fused kernel
    /// takes the rest, see `Segment::delta`).
    mirror_add: Vec<Vec<Segment>>,
    /// Per mirror group: XOR pushes undone against the mirror.
    mirror_xor: Vec<Vec<Segment>>,
    /// The EMA buffers' segments.
    averaged: Vec<Segment>,
    /// Per copied group.
    copied: Vec<Vec<Segment>>,
    /// Averaged tensors' names, in `averaged` order (drift samples only).
    tensor_names: Vec<String>,
}

/// Merges consecutive segments into maximal contiguous ones.
fn coalesce(mut items: Vec<Segment>) -> Vec<Segment> {
    items.sort_by_key(|s| s.dst);
    let mut out: Vec<Segment> = Vec::with_capacity(items.len().min(8));
    for s in items {
        if s.numel == 0 {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.extends(&s) => last.numel += s.numel,
            _ => out.push(s),
        }
    }
    out
}

/// The push body as the device sees it.
struct DeviceBody {
    /// Host: tensors are views of the body bytes. CUDA: the body's data
    /// section copied once to the device, as bytes.
    on_device: Option<(Tensor, usize)>,
    base: *const u8,
    len: usize,
}

impl DeviceBody {
    fn new(push: &ParsedPush, device: Device) -> Result<Self, EngineError> {
        let base = push.body.as_ptr();
        let len = push.body.len();
        let on_device = if device == Device::Cpu {
            None
        } else {
            // One host-to-device copy of the whole data section.
            let start = push
                .tensors
                .iter()
                .map(|t| t.range.start)
                .min()
                .unwrap_or(0);
            let data = &push.body[start..];
            // SAFETY: `data` outlives the temporary host tensor, which is
            // consumed by the copy below before this function returns.
            let host = unsafe {
                Tensor::f_from_blob(
                    data.as_ptr(),
                    &[data.len() as i64],
                    &[],
                    Kind::Uint8,
                    Device::Cpu,
                )?
            };
            Some((host.f_to_device(device)?, start))
        };
        Ok(DeviceBody {
            on_device,
            base,
            len,
        })
    }

    /// A flat view of `numel` elements of `dtype` at byte `offset` of the body.
    fn view(&self, offset: usize, numel: i64, dtype: DType) -> Result<Tensor, EngineError> {
        let nbytes = numel as usize * dtype.size();
        assert!(offset + nbytes <= self.len, "validated range");
        match &self.on_device {
            None => {
                let ptr = self.base.wrapping_add(offset);
                if (ptr as usize) % dtype.size() == 0 {
                    // SAFETY: the range lies in the body, which the caller
                    // keeps alive for as long as this view is used (the
                    // whole of `apply_push`), and is aligned for `dtype`.
                    Ok(unsafe {
                        Tensor::f_from_blob(ptr, &[numel], &[], dtype.kind(), Device::Cpu)?
                    })
                } else {
                    // A writer that did not align its data: copy it.
                    // SAFETY: as above; the copy is made before returning.
                    let bytes = unsafe { std::slice::from_raw_parts(ptr, nbytes) };
                    Ok(Tensor::f_from_data_size(bytes, &[numel], dtype.kind())?)
                }
            }
            Some((data, start)) => {
                let rel = (offset - start) as i64;
                let bytes = data.f_narrow(0, rel, nbytes as i64)?;
                if rel as usize % dtype.size() == 0 {
                    Ok(bytes.f_view_dtype(dtype.kind())?)
                } else {
                    Ok(super::deep_copy(&bytes)?.f_view_dtype(dtype.kind())?)
                }
            }
        }
    }
}

impl RankState {
    /// The host memory of a segment's source (body or mirror) as a typed
    /// slice, when its dtype has a fused kernel and it is aligned.
    fn host_source<'a>(&'a self, s: &Segment, push: &'a ParsedPush) -> Option<Src<'a>> {
        let n = s.numel as usize;
        let ptr: *const u8 = match s.src {
            Source::Body(offset) => push.body[offset..offset + n * s.dtype.size()].as_ptr(),
            Source::Mirror(g, offset) => {
                let m = &self.mirror.as_ref()?[g];
                // SAFETY: offset + n is within the mirror group.
                unsafe { (m.data_ptr() as *const u8).add(offset as usize * s.dtype.size()) }
            }
        };
        if (ptr as usize) % s.dtype.size() != 0 {
            return None;
        }
        // SAFETY: `ptr` is aligned and `n` elements long, in memory that
        // outlives the update (the body, or the rank's mirror).
        unsafe {
            match s.dtype {
                DType::F32 => Some(Src::F32(std::slice::from_raw_parts(ptr as *const f32, n))),
                DType::BF16 => Some(Src::BF16(std::slice::from_raw_parts(ptr as *const u16, n))),
                DType::F16 => Some(Src::F16(std::slice::from_raw_parts(
                    ptr as *const half::f16,
                    n,
                ))),
                _ => None,
            }
        }
    }

    /// Allocates the buffers of a freshly registered layout.
    pub fn new(
        layout: Arc<RankLayout>,
        config: &RunConfig,
        device: Device,
    ) -> Result<Self, EngineError> {
        let ema_kind = config.ema_dtype.kind();
        let ema = (0..config.profiles.len())
            .map(|_| hugepages::zeros(layout.ema_numel, ema_kind, device))
            .collect::<Result<Vec<_>, _>>()?;
        let bema = config
            .profiles
            .iter()
            .map(|p| {
                p.is_bema()
                    .then(|| {
                        Ok::<_, EngineError>(BemaBuffers {
                            start: hugepages::zeros(layout.ema_numel, ema_kind, device)?,
                            ema: hugepages::zeros(layout.ema_numel, ema_kind, device)?,
                        })
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let copied = layout
            .copied_groups
            .iter()
            .map(|g| hugepages::zeros(g.numel, g.dtype.kind(), device))
            .collect::<Result<Vec<_>, _>>()?;
        let mirror = if config.mirror {
            Some(
                layout
                    .mirror_groups
                    .iter()
                    .map(|g| hugepages::zeros(g.numel, g.dtype.kind(), device))
                    .collect::<Result<Vec<_>, _>>()?,
            )
        } else {
            None
        };
        Ok(RankState {
            layout,
            ema,
            copied,
            mirror,
            swa_n: vec![0; config.profiles.len()],
            bema,
            last_step: None,
            last_digest: None,
            recent: Default::default(),
            has_keyframe: false,
            generation: 0,
            applied: 0,
        })
    }

    /// Bytes this rank holds on the device.
    pub fn resident_bytes(&self, config: &RunConfig) -> u64 {
        let l = &self.layout;
        let hidden = 2 * self.bema.iter().flatten().count();
        l.ema_bytes(config.ema_dtype.size()) * (self.ema.len() + hidden) as u64
            + l.copied_bytes()
            + if self.mirror.is_some() {
                l.mirror_bytes()
            } else {
                0
            }
    }

    /// Applies a validated push whose step rules and layout were checked.
    /// `order[i]` is the layout index of `push.tensors[i]`.
    pub fn apply_push(
        &mut self,
        config: &RunConfig,
        push: &ParsedPush,
        order: &[usize],
        step: u64,
        device: Device,
    ) -> Result<ApplyReport, EngineError> {
        let body = DeviceBody::new(push, device)?;
        // BEMA's three buffers per profile take the libtorch path.
        let fused = device == Device::Cpu
            && config.ema_dtype.kind() == Kind::Float
            && self.bema.iter().all(Option::is_none);
        self.applied += 1;
        let sample_drift = config.drift_every > 0 && self.applied % config.drift_every == 0;
        let plan = self.plan(push, order, fused, sample_drift);

        // 1. The mirror takes the new weights (copied, deltas added, XOR
        //    undone), except the deltas the fused kernel adds in step 2.
        self.update_mirror(&body, &plan)?;
        // 2. Averaged tensors: per segment, read the source once and update
        //    every profile.
        let decisions: Vec<_> = config
            .profiles
            .iter()
            .zip(&self.swa_n)
            .map(|(p, &n)| decide(p, step, self.last_step, n))
            .collect();
        let sums = self.update_averaged(config, push, &body, &plan, &decisions, fused)?;
        // 3. Copied tensors.
        for (g, segs) in plan.copied.iter().enumerate() {
            for s in coalesce(segs.clone()) {
                let src = self.view(&body, &s)?;
                self.copied[g].f_narrow(0, s.dst, s.numel)?.f_copy_(&src)?;
            }
        }
        for (n, d) in self.swa_n.iter_mut().zip(&decisions) {
            *n = d.swa_n;
        }
        if push.kind == PushKind::Full {
            self.has_keyframe = true;
        }
        if let (Some(last), Some(digest)) = (self.last_step, self.last_digest) {
            if self.recent.len() == RECENT_DIGESTS {
                self.recent.pop_front();
            }
            self.recent.push_back((last, digest));
        }
        self.last_step = Some(step);
        self.last_digest = Some(BodyDigest::Blocks(push.digest));
        Ok(ApplyReport {
            skipped: push
                .tensors
                .iter()
                .filter(|t| t.nonfinite)
                .map(|t| t.name.clone())
                .collect(),
            drift: sample_drift.then(|| sums.into_samples(config, plan.tensor_names)),
        })
    }

    /// Sorts the push's tensors into the buffers they update. With a
    /// mirror, the EMA reads the mirror (after the push is applied to it);
    /// without, the body.
    fn plan(&self, push: &ParsedPush, order: &[usize], fused: bool, sample_drift: bool) -> Plan {
        let groups = self.mirror.as_ref().map_or(0, |m| m.len());
        let mut plan = Plan {
            mirror_copy: vec![Vec::new(); groups],
            mirror_add: vec![Vec::new(); groups],
            mirror_xor: vec![Vec::new(); groups],
            averaged: Vec::new(),
            copied: vec![Vec::new(); self.copied.len()],
            tensor_names: Vec::new(),
        };
        let base = push.body.as_ptr() as usize;
        for (t, &i) in push.tensors.iter().zip(order).filter(|(t, _)| !t.nonfinite) {
            let l = &self.layout.tensors[i];
            let relative = push.kind.is_relative() && l.dtype.is_float();
            let averaged = matches!(l.slot, Slot::Averaged { .. });
            // A delta the fused kernel adds while it averages.
            let fused_delta = relative
                && push.kind == PushKind::Delta
                && fused
                && averaged
                && self.mirror.is_some()
                && fusable(l.dtype, t, base);
            if self.mirror.is_some() {
                let seg = Segment {
                    src: Source::Body(t.range.start),
                    dst: l.mirror.1,
                    numel: l.numel,
                    dtype: l.dtype,
                    delta: relative.then(|| DeltaSrc::of(t)),
                };
                match (relative, push.kind) {
                    (false, _) => plan.mirror_copy[l.mirror.0].push(seg),
                    (true, PushKind::Xor) => plan.mirror_xor[l.mirror.0].push(seg),
                    (true, _) if !fused_delta => plan.mirror_add[l.mirror.0].push(seg),
                    (true, _) => {}
                }
            }
            let src = if self.mirror.is_some() {
                Source::Mirror(l.mirror.0, l.mirror.1)
            } else {
                Source::Body(t.range.start)
            };
            let mut seg = Segment {
                src,
                dst: 0,
                numel: l.numel,
                dtype: l.dtype,
                delta: fused_delta.then(|| DeltaSrc::of(t)),
            };
            match l.slot {
                Slot::Averaged { offset } => {
                    seg.dst = offset;
                    if sample_drift {
                        plan.tensor_names.push(l.name.clone());
                    }
                    plan.averaged.push(seg);
                }
                Slot::Copied { group, offset } => {
                    seg.dst = offset;
                    plan.copied[group].push(seg);
                }
            }
        }
        // On drift samples the segments stay one per tensor (not coalesced)
        // so the same pass yields each tensor's sums.
        if !sample_drift {
            plan.averaged = coalesce(std::mem::take(&mut plan.averaged));
        }
        plan
    }

    /// Step 1 of [`Self::apply_push`]: the mirror's copies, libtorch deltas
    /// and XORs.
    fn update_mirror(&mut self, body: &DeviceBody, plan: &Plan) -> Result<(), EngineError> {
        let Some(mirror) = &mut self.mirror else {
            return Ok(());
        };
        for (g, segs) in plan.mirror_copy.iter().enumerate() {
            for s in coalesce(segs.clone()) {
                let Source::Body(offset) = s.src else {
                    unreachable!("mirror copies come from the body")
                };
                let src = body.view(offset, s.numel, s.dtype)?;
                mirror[g].f_narrow(0, s.dst, s.numel)?.f_copy_(&src)?;
            }
        }
        for (g, segs) in plan.mirror_add.iter().enumerate() {
            for s in segs {
                let mut dst = mirror[g].f_narrow(0, s.dst, s.numel)?;
                add_delta(&mut dst, body, s)?;
            }
        }
        for (g, segs) in plan.mirror_xor.iter().enumerate() {
            for s in segs {
                let Source::Body(offset) = s.src else {
                    unreachable!("XOR pushes come from the body")
                };
                let bits = bits_kind(s.dtype);
                let src = body.view(offset, s.numel, s.dtype)?.f_view_dtype(bits)?;
                let _ = mirror[g]
                    .f_narrow(0, s.dst, s.numel)?
                    .f_view_dtype(bits)?
                    .f_bitwise_xor_tensor_(&src)?;
            }
        }
        Ok(())
    }

    /// A segment's source as a tensor (body or mirror).
    fn view(&self, body: &DeviceBody, s: &Segment) -> Result<Tensor, EngineError> {
        match s.src {
            Source::Body(offset) => body.view(offset, s.numel, s.dtype),
            Source::Mirror(g, offset) => {
                let m = self.mirror.as_ref().expect("mirror source without mirror");
                Ok(m[g].f_narrow(0, offset, s.numel)?)
            }
        }
    }

    /// Step 2 of [`Self::apply_push`]: every profile's update of every
    /// averaged segment, fused on the CPU where the dtypes allow, through
    /// libtorch otherwise; with the drift sums on sampled pushes.
    fn update_averaged(
        &mut self,
        config: &RunConfig,
        push: &ParsedPush,
        body: &DeviceBody,
        plan: &Plan,
        decisions: &[super::schedule::Decision],
        fused: bool,
    ) -> Result<DriftSums, EngineError> {
        let sample = !plan.tensor_names.is_empty();
        let mut sums = DriftSums::new(self.ema.len(), plan.averaged.len(), sample);
        let ema_kind = config.ema_dtype.kind();
        let threads = super::kernel_threads();
        let ops: Vec<Op> = decisions
            .iter()
            .map(|d| match d.action {
                Action::Copy => Op::Copy,
                // ATen's opmath weight for float tensors.
                Action::Lerp { weight } => Op::Lerp(weight as f32),
                Action::Hold => Op::Hold,
                // Never read: a run with a bema profile is not fused.
                Action::Bema(_) => Op::Hold,
            })
            .collect();
        // Drift sums still on the device: (profile, tensor, [diff_sq, online_sq]).
        let mut pending: Vec<(usize, usize, Tensor)> = Vec::new();
        for (si, s) in plan.averaged.iter().enumerate() {
            if fused {
                if let Some(found) = self.fused_update(s, push, &ops, threads, sample) {
                    sums.add_segment(si, found);
                    continue;
                }
            }
            if let (Some(_), Source::Mirror(g, offset)) = (s.delta, s.src) {
                // Planned for the fused kernel, which did not take it.
                let mirror = self.mirror.as_mut().expect("delta segment without mirror");
                add_delta(&mut mirror[g].f_narrow(0, offset, s.numel)?, body, s)?;
            }
            let mut src = self.view(body, s)?;
            if src.kind() != ema_kind {
                src = src.f_to_kind(ema_kind)?;
            }
            for (p, (ema, d)) in self.ema.iter_mut().zip(decisions).enumerate() {
                let mut dst = ema.f_narrow(0, s.dst, s.numel)?;
                match d.action {
                    Action::Copy => dst.f_copy_(&src)?,
                    Action::Lerp { weight } => {
                        let _ = dst.f_lerp_(&src, weight)?;
                    }
                    Action::Hold => {}
                    Action::Bema(step) => {
                        let bufs = self.bema[p]
                            .as_mut()
                            .expect("a bema profile has its buffers");
                        bema_update(&mut dst, bufs, s.dst, s.numel, &src, step)?;
                    }
                }
                if sample {
                    pending.push((p, si, drift_sums(&dst, &src)?));
                }
            }
        }
        if !pending.is_empty() {
            let all: Vec<&Tensor> = pending.iter().map(|(_, _, t)| t).collect();
            let host = Tensor::f_stack(&all, 0)?
                .f_to(Device::Cpu)?
                .f_flatten(0, -1)?;
            let values = Vec::<f64>::try_from(&host)?;
            for ((p, si, _), pair) in pending.iter().zip(values.chunks_exact(2)) {
                sums.add_one(*p, *si, (pair[0], pair[1]));
            }
        }
        Ok(sums)
    }

    /// The fused CPU kernel on one segment, when its memory allows it
    /// (float32 EMA, a source dtype with a kernel, aligned); `None` to fall
    /// back to libtorch.
    fn fused_update(
        &mut self,
        s: &Segment,
        push: &ParsedPush,
        ops: &[Op],
        threads: usize,
        drift: bool,
    ) -> Option<Vec<(f64, f64)>> {
        let ptrs: Vec<EmaPtr> = self
            .ema
            .iter()
            // SAFETY: `s.dst + s.numel` is within each flat buffer.
            .map(|e| EmaPtr(unsafe { (e.data_ptr() as *mut f32).add(s.dst as usize) }))
            .collect();
        if let Some(d) = s.delta {
            let Source::Mirror(g, offset) = s.src else {
                return None;
            };
            let m = &self.mirror.as_ref()?[g];
            // SAFETY: offset + numel is within the mirror group.
            let at = unsafe { (m.data_ptr() as *mut u8).add(offset as usize * s.dtype.size()) };
            let mirror = match s.dtype {
                DType::F32 => MirrorPtr::F32(at as *mut f32),
                DType::BF16 => MirrorPtr::BF16(at as *mut u16),
                _ => return None,
            };
            let delta = delta_slice(push, d, s.numel as usize)?;
            // SAFETY: the EMA buffers, the mirror and the body are distinct
            // allocations; the plan checked alignment and dtypes.
            return Some(unsafe {
                kernels::update_delta(&ptrs, ops, mirror, delta, threads, drift)
            });
        }
        let src = self.host_source(s, push)?;
        // SAFETY: each profile's buffer is a distinct contiguous float
        // tensor owned by this rank; the source is the body or the mirror,
        // neither of which aliases them.
        Some(unsafe { kernels::update(&ptrs, ops, src, threads, drift) })
    }

    /// CRC-32 of the mirror's bytes of the push's tensors, in body order:
    /// what a keyframe's `polyak.mirror_crc32` claims.
    pub fn mirror_crc32(&self, order: &[usize]) -> Result<u32, EngineError> {
        let Some(mirror) = &self.mirror else {
            return Ok(0);
        };
        let mut hasher = crc32fast::Hasher::new();
        for &i in order {
            let l = &self.layout.tensors[i];
            if l.numel == 0 {
                // No bytes, and no data pointer to make a slice from.
                continue;
            }
            let host = mirror[l.mirror.0]
                .f_narrow(0, l.mirror.1, l.numel)?
                .f_to(Device::Cpu)?
                .f_contiguous()?;
            // SAFETY: a contiguous host tensor of numel elements of its dtype.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    host.data_ptr() as *const u8,
                    l.numel as usize * l.dtype.size(),
                )
            };
            hasher.update(bytes);
        }
        Ok(hasher.finalize())
    }

    /// For each tensor of an XOR push, whether the weights it encodes (its
    /// bits XOR the mirror's) hold NaN or Inf. Reads, changes nothing.
    pub fn xor_nonfinite(
        &self,
        push: &ParsedPush,
        order: &[usize],
        device: Device,
    ) -> Result<Vec<bool>, EngineError> {
        let Some(mirror) = &self.mirror else {
            return Ok(vec![false; push.tensors.len()]);
        };
        let body = DeviceBody::new(push, device)?;
        push.tensors
            .iter()
            .zip(order)
            .map(|(t, &i)| {
                let l = &self.layout.tensors[i];
                if !l.dtype.is_float() || l.numel == 0 {
                    return Ok(false);
                }
                let bits = bits_kind(l.dtype);
                let weights = mirror[l.mirror.0]
                    .f_narrow(0, l.mirror.1, l.numel)?
                    .f_view_dtype(bits)?
                    .f_bitwise_xor_tensor(
                        &body
                            .view(t.range.start, l.numel, l.dtype)?
                            .f_view_dtype(bits)?,
                    )?
                    .f_view_dtype(l.dtype.kind())?;
                Ok(!weights.f_isfinite()?.f_all()?.f_is_nonzero()?)
            })
            .collect()
    }
}

/// One segment of a `bema` profile: `served` is the segment of its served
/// buffer, `bufs` its hidden buffers (the segment at `dst`, `numel` long),
/// `w` the pushed weights in the EMA dtype. The update is TRL's own
/// arithmetic (`ema.mul_(1 - beta).add_(w * beta)`, then
/// `served = ema + alpha * (w - w0)`), so the served weights are TRL's
/// `running_model` to float round-off.
fn bema_update(
    served: &mut Tensor,
    bufs: &mut BemaBuffers,
    dst: i64,
    numel: i64,
    w: &Tensor,
    step: BemaStep,
) -> Result<(), EngineError> {
    let mut start = bufs.start.f_narrow(0, dst, numel)?;
    let mut ema = bufs.ema.f_narrow(0, dst, numel)?;
    match step {
        BemaStep::Start => {
            start.f_copy_(w)?;
            ema.f_copy_(w)?;
            served.f_copy_(w)?;
        }
        BemaStep::Restart => {
            start.f_copy_(w)?;
            ema.f_copy_(w)?;
        }
        BemaStep::Update { beta, alpha } => {
            let _ = ema.f_mul_scalar_(1.0 - beta)?;
            let _ = ema.f_add_(&w.f_mul_scalar(beta)?)?;
            let corrected = ema.f_add(&w.f_sub(&start)?.f_mul_scalar(alpha)?)?;
            served.f_copy_(&corrected)?;
        }
    }
    Ok(())
}

/// Whether the fused kernel can add this delta: a float32 or bf16 mirror,
/// and wire values it reads in place (aligned for their dtype).
fn fusable(mirror: DType, t: &WireTensor, base: usize) -> bool {
    if !matches!(mirror, DType::F32 | DType::BF16) {
        return false;
    }
    let aligned = (base + t.range.start) % t.dtype.size() == 0;
    match &t.quant {
        Some(_) => aligned,
        None => aligned && t.dtype == mirror,
    }
}

/// The delta of a fused segment as the kernel reads it.
fn delta_slice<'a>(push: &'a ParsedPush, d: DeltaSrc, n: usize) -> Option<Delta<'a>> {
    fn scales_of<'a>(body: &'a [u8], q: &QuantSrc, n: usize) -> &'a [u8] {
        &body[q.scales..q.scales + 4 * n.div_ceil(q.block)]
    }
    let bytes = &push.body[d.offset..d.offset + n * d.wire.size()];
    let ptr = bytes.as_ptr();
    // SAFETY: `bytes` is `n` elements of `d.wire`, aligned (checked by
    // `fusable`), in the body, which outlives the update.
    unsafe {
        Some(match (d.quant, d.wire) {
            (Some(q), _) if q.format == QuantFormat::Fp8E4m3 => Delta::Fp8 {
                q: bytes,
                scales: scales_of(&push.body, &q, n),
                block: q.block,
            },
            (Some(q), _) if q.format == QuantFormat::Int8 => Delta::Int8 {
                q: std::slice::from_raw_parts(ptr as *const i8, n),
                scales: scales_of(&push.body, &q, n),
                block: q.block,
            },
            (_, DType::BF16) => Delta::BF16(std::slice::from_raw_parts(ptr as *const u16, n)),
            (_, DType::F32) => Delta::F32(std::slice::from_raw_parts(ptr as *const f32, n)),
            _ => return None,
        })
    }
}

/// The integer kind of a float dtype's width (XOR works on bits).
fn bits_kind(dtype: DType) -> Kind {
    match dtype.size() {
        8 => Kind::Int64,
        4 => Kind::Int,
        2 => Kind::Int16,
        _ => Kind::Uint8,
    }
}

/// `mirror += dequant(delta)` through libtorch (CUDA, and dtypes the fused
/// kernel does not take): `float32(q) * scale` per block, added in float32
/// and rounded to the mirror's dtype, as the client computes it.
fn add_delta(mirror: &mut Tensor, body: &DeviceBody, s: &Segment) -> Result<(), EngineError> {
    let d = s.delta.expect("a mirror delta segment carries its delta");
    let n = s.numel;
    if d.quant.is_none() && d.wire == s.dtype {
        let src = body.view(d.offset, n, d.wire)?;
        let _ = mirror.f_add_(&src)?;
        return Ok(());
    }
    let raw = body.view(d.offset, n, d.wire)?;
    let mut deq = match d.quant.map(|q| q.format) {
        Some(QuantFormat::Fp8E4m3) => raw
            .f_view_dtype(Kind::Float8e4m3fn)?
            .f_to_kind(Kind::Float)?,
        _ => raw.f_to_kind(Kind::Float)?,
    };
    if let Some(q) = d.quant.filter(|q| q.format.scaled()) {
        let blocks = (n as usize).div_ceil(q.block) as i64;
        let scales = body.view(q.scales, blocks, DType::F32)?;
        deq = deq
            .f_constant_pad_nd([0, blocks * q.block as i64 - n])?
            .f_view([blocks, q.block as i64])?
            .f_mul(&scales.f_unsqueeze(1)?)?
            .f_view([-1])?
            .f_narrow(0, 0, n)?;
    }
    if mirror.kind() == Kind::Float {
        let _ = mirror.f_add_(&deq)?;
    } else {
        let sum = mirror.f_to_kind(Kind::Float)?.f_add(&deq)?;
        mirror.f_copy_(&sum)?;
    }
    Ok(())
}

/// Drift sums of one push: per profile the totals, and per averaged
/// segment the pair (on sampled pushes, where segments are tensors).
struct DriftSums {
    totals: Vec<(f64, f64)>,
    per_tensor: Vec<Vec<(f64, f64)>>,
}

impl DriftSums {
    fn new(profiles: usize, segments: usize, sample: bool) -> Self {
        DriftSums {
            totals: vec![(0.0, 0.0); profiles],
            per_tensor: if sample {
                vec![vec![(0.0, 0.0); segments]; profiles]
            } else {
                Vec::new()
            },
        }
    }

    fn add_segment(&mut self, segment: usize, per_profile: Vec<(f64, f64)>) {
        for (p, one) in per_profile.into_iter().enumerate() {
            self.add_one(p, segment, one);
        }
    }

    fn add_one(&mut self, profile: usize, segment: usize, (d, o): (f64, f64)) {
        self.totals[profile].0 += d;
        self.totals[profile].1 += o;
        if let Some(t) = self.per_tensor.get_mut(profile) {
            t[segment] = (d, o);
        }
    }

    fn into_samples(self, config: &RunConfig, names: Vec<String>) -> Vec<DriftSample> {
        let names = Arc::new(names);
        let mut per_tensor = self.per_tensor.into_iter();
        config
            .profiles
            .iter()
            .zip(self.totals)
            .map(|(p, (diff_sq, online_sq))| DriftSample {
                profile: p.name().to_string(),
                diff_sq,
                online_sq,
                tensors: per_tensor.next().unwrap_or_default(),
                tensor_names: names.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TRL `BEMACallback`'s arithmetic on one segment: a start sets all
    /// three buffers, a restart `w0` and the EMA only, an update the EMA
    /// and then the served weights from it.
    #[test]
    fn bema_update_is_trls_arithmetic() {
        let t = |v: &[f32]| Tensor::from_slice(v);
        let mut served = t(&[0.0, 0.0, 0.0]);
        let mut bufs = BemaBuffers {
            start: t(&[0.0, 0.0, 0.0]),
            ema: t(&[0.0, 0.0, 0.0]),
        };
        let values = |x: &Tensor| Vec::<f32>::try_from(x).unwrap();
        let w0 = t(&[1.0, -2.0, 0.5]);
        bema_update(&mut served, &mut bufs, 0, 3, &w0, BemaStep::Start).unwrap();
        for x in [&served, &bufs.start, &bufs.ema] {
            assert_eq!(values(x), vec![1.0, -2.0, 0.5]);
        }
        let w1 = t(&[3.0, 0.0, -1.5]);
        bema_update(&mut served, &mut bufs, 0, 3, &w1, BemaStep::Restart).unwrap();
        assert_eq!(values(&served), vec![1.0, -2.0, 0.5]);
        assert_eq!(values(&bufs.start), vec![3.0, 0.0, -1.5]);
        assert_eq!(values(&bufs.ema), vec![3.0, 0.0, -1.5]);
        // A segment of one element: the others stay.
        let w2 = t(&[5.0]);
        let (beta, alpha) = (0.25, 0.5);
        let mut one = served.narrow(0, 1, 1);
        bema_update(
            &mut one,
            &mut bufs,
            1,
            1,
            &w2,
            BemaStep::Update { beta, alpha },
        )
        .unwrap();
        // ema = 0.75 * 0 + 0.25 * 5; served = ema + 0.5 * (5 - 0).
        assert_eq!(values(&bufs.ema), vec![3.0, 1.25, -1.5]);
        assert_eq!(values(&served), vec![1.0, 3.75, 0.5]);
        assert_eq!(values(&bufs.start), vec![3.0, 0.0, -1.5]);
    }

    #[test]
    fn coalesce_merges_only_contiguous_runs() {
        let seg = |src: usize, dst: i64, numel: i64| Segment {
            src: Source::Body(src),
            dst,
            numel,
            dtype: DType::F32,
            delta: None,
        };
        // Three tensors back to back in both body and buffer: one segment.
        let merged = coalesce(vec![seg(100, 0, 4), seg(116, 4, 2), seg(124, 6, 3)]);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].numel, 9);
        // A gap in the body splits the run.
        let split = coalesce(vec![seg(100, 0, 4), seg(120, 4, 2)]);
        assert_eq!(split.len(), 2);
        // Out of order in the body: no merge, but every element covered.
        let swapped = coalesce(vec![seg(116, 0, 4), seg(100, 4, 4)]);
        assert_eq!(swapped.iter().map(|s| s.numel).sum::<i64>(), 8);
        assert_eq!(swapped.len(), 2);
        // Empty tensors vanish.
        assert!(coalesce(vec![seg(0, 0, 0)]).is_empty());
    }
}
