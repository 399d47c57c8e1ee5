//! The wire format: safetensors in (pushes) and out (EMA reads).
//!
//! - [`push`]: parse and validate a push body in place.
//! - [`nonfinite`]: NaN/Inf scans on raw bytes.
//! - [`check`]: a body's digest and NaN/Inf scan in one pass.
//! - [`writer`]: safetensors headers for streamed responses.
//! - [`dtype`]: the dtypes polyak keeps.

pub mod bodies;
pub mod check;
pub mod dtype;
pub mod nonfinite;
pub mod push;
pub mod writer;

pub use dtype::DType;
pub use push::{parse_push, Chunk, ParsedPush, PushKind, WireError, WireLimits, WireTensor};
pub use writer::{HeaderEntry, SafetensorsHeader};
