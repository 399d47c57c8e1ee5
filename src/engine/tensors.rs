//! Tensor helpers shared by the engine and what serialises its copies:
//! device-side copies, and host tensors streamed as bytes without a copy.

use tch::{Device, Tensor};

/// A new tensor with the same values, on the same device.
pub fn deep_copy(t: &Tensor) -> Result<Tensor, tch::TchError> {
    let mut out = t.f_empty_like()?;
    out.f_copy_(t)?;
    Ok(out)
}

/// A contiguous host tensor viewed as bytes, kept alive by the `Bytes` that
/// owns it: responses stream tensor memory without copying it.
struct HostTensorBytes {
    tensor: Tensor,
    len: usize,
}

// SAFETY: the tensor is only read through `as_ref`; tch tensors are `Send`.
impl AsRef<[u8]> for HostTensorBytes {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `tensor` is a contiguous CPU tensor of `len` bytes, owned
        // by `self` and never written while shared.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.len) }
    }
}

/// The bytes of a contiguous CPU tensor, without a copy.
pub fn host_bytes(tensor: Tensor) -> bytes::Bytes {
    debug_assert!(tensor.device() == Device::Cpu && tensor.is_contiguous());
    let len = tensor.numel() * tensor.kind().elt_size_in_bytes();
    bytes::Bytes::from_owner(HostTensorBytes { tensor, len })
}
