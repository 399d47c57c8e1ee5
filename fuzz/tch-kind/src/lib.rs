//! `tch::Kind`, the element types `src/wire/dtype.rs` names, without
//! libtorch.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Double,
    Float,
    Half,
    BFloat16,
    Int64,
    Int,
    Int16,
    Int8,
    Uint8,
    Bool,
    /// Kinds the server does not keep.
    Other,
}
