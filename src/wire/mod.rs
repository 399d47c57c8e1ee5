//! The wire format: safetensors in (pushes) and out (EMA reads).
//!
//! - [`push`]: parse and validate a push body in place.
//! - [`nonfinite`]: NaN/Inf scans on raw bytes.
//! - [`check`]: a body's digest and NaN/Inf scan in one pass.
//! - [`codec`]: the byte-grouped zstd codec (`Content-Encoding: polyak-bgz`).
//! - [`quant`]: quantised delta payloads (bf16, fp8 e4m3, int8 with block scales).
//! - [`stats`]: per-rank wire bytes, logical bytes and codec time.
//! - [`writer`]: safetensors headers for streamed responses.
//! - [`dtype`]: the dtypes polyak keeps.
//! - [`layout`]: the layout a rank registers with its first push.

pub mod bodies;
pub mod check;
pub mod codec;
pub mod dtype;
pub mod layout;
pub mod nonfinite;
pub mod push;
pub mod quant;
pub mod stats;
pub mod writer;

pub use dtype::DType;
pub use push::{parse_push, Chunk, ParsedPush, PushKind, WireError, WireLimits, WireTensor};
pub use writer::{HeaderEntry, SafetensorsHeader};
