//! The tensor dtypes polyak accepts, and how they map to safetensors and torch.

use serde::{Deserialize, Serialize};

/// A dtype a pushed tensor may have. Floating point tensors are averaged;
/// integer and bool tensors are copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    BOOL,
}

impl DType {
    /// Maps a safetensors dtype; `None` for the ones polyak does not keep
    /// (fp8 and sub-byte floats, complex, unsigned wider than a byte).
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        use safetensors::Dtype as S;
        Some(match dtype {
            S::F64 => DType::F64,
            S::F32 => DType::F32,
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::I64 => DType::I64,
            S::I32 => DType::I32,
            S::I16 => DType::I16,
            S::I8 => DType::I8,
            S::U8 => DType::U8,
            S::BOOL => DType::BOOL,
            _ => return None,
        })
    }

    /// Name in a safetensors header.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::BOOL => "BOOL",
        }
    }

    pub fn kind(self) -> tch::Kind {
        match self {
            DType::F64 => tch::Kind::Double,
            DType::F32 => tch::Kind::Float,
            DType::F16 => tch::Kind::Half,
            DType::BF16 => tch::Kind::BFloat16,
            DType::I64 => tch::Kind::Int64,
            DType::I32 => tch::Kind::Int,
            DType::I16 => tch::Kind::Int16,
            DType::I8 => tch::Kind::Int8,
            DType::U8 => tch::Kind::Uint8,
            DType::BOOL => tch::Kind::Bool,
        }
    }

    pub fn from_kind(kind: tch::Kind) -> Option<Self> {
        Some(match kind {
            tch::Kind::Double => DType::F64,
            tch::Kind::Float => DType::F32,
            tch::Kind::Half => DType::F16,
            tch::Kind::BFloat16 => DType::BF16,
            tch::Kind::Int64 => DType::I64,
            tch::Kind::Int => DType::I32,
            tch::Kind::Int16 => DType::I16,
            tch::Kind::Int8 => DType::I8,
            tch::Kind::Uint8 => DType::U8,
            tch::Kind::Bool => DType::BOOL,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::BOOL => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }

    /// The dtype a safetensors header names (`F32`, `BF16`, ...).
    pub fn from_name(name: &str) -> Option<Self> {
        const ALL: [DType; 10] = [
            DType::F64,
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::I32,
            DType::I16,
            DType::I8,
            DType::U8,
            DType::BOOL,
        ];
        ALL.into_iter().find(|d| d.safetensors_name() == name)
    }

    /// Parses the names clients use in query strings (`bf16`, `bfloat16`,
    /// `fp32`, `float32`, `F32`, ...). Only floating point dtypes.
    pub fn parse_float(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "f64" | "fp64" | "float64" | "double" => DType::F64,
            "f32" | "fp32" | "float32" | "float" => DType::F32,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            _ => return None,
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.safetensors_name())
    }
}
