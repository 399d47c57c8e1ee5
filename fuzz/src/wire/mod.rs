//! The server's `src/wire` parser and codec files, by path (the header
//! writer is left out: neither uses it).

#[path = "../../../src/wire/bodies.rs"]
pub mod bodies;
#[path = "../../../src/wire/check.rs"]
pub mod check;
#[path = "../../../src/wire/codec.rs"]
pub mod codec;
#[path = "../../../src/wire/dtype.rs"]
pub mod dtype;
#[path = "../../../src/wire/nonfinite.rs"]
pub mod nonfinite;
#[path = "../../../src/wire/push.rs"]
pub mod push;
#[path = "../../../src/wire/quant.rs"]
pub mod quant;

pub use dtype::DType;
