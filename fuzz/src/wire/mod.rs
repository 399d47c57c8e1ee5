//! The server's `src/wire` parser files, by path (the byte-buffer pool and
//! the header writer are left out: the parser does not use them).

#[path = "../../../src/wire/check.rs"]
pub mod check;
#[path = "../../../src/wire/dtype.rs"]
pub mod dtype;
#[path = "../../../src/wire/nonfinite.rs"]
pub mod nonfinite;
#[path = "../../../src/wire/push.rs"]
pub mod push;
#[path = "../../../src/wire/quant.rs"]
pub mod quant;

pub use dtype::DType;
