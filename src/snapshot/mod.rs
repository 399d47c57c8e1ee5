//! Snapshots on disk and what is read out of them: the format of one
//! rank's part, durable writes, downloads as streamed recipes, compare, and
//! the post-hoc arithmetic. Nothing here knows the registry or the catalog;
//! the snapshot lifecycle (cuts, persistence, retention, recovery) is the
//! service in `services/snapshots`.
//!
//! - [`format`]: the safetensors layout of one rank's part (encoding
//!   only, no tensors).
//! - [`convert`]: host tensors to parts, and ranks restored from parts.
//! - [`meta`]: the versioned metadata stored with every part (the layout
//!   and step bookkeeping a restore needs), and the compatibility rule.
//! - [`files`]: durable writes (tmp, fsync, rename, dir fsync) and clean-up.
//! - [`source`]: where a part's bytes are read from (a file, or an object
//!   of the store, by ranges).
//! - [`vfile`]: downloads as recipes of pieces, streamed with `Range`.
//! - [`assemble`]: `full`, `hf`, `sharded` and `rank` downloads.
//! - [`digests`]: the CRC-32 per 8 MiB of a served file, stated to clients.
//! - [`compare`]: per-tensor statistics over whole tensors.
//! - [`posthoc`]: EDM2 post-hoc EMA: the weights of the stored power
//!   profiles that synthesise another length.
//! - [`combine`]: weighted sums of stored parts, streamed in one pass.

pub mod assemble;
pub mod combine;
pub mod compare;
pub mod convert;
pub mod digests;
pub mod files;
pub mod format;
pub mod meta;
pub mod posthoc;
pub mod source;
pub mod vfile;
