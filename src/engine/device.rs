//! Device names (`cpu`, `cuda`, `cuda:N`) and whether this machine has them.

use tch::Device;

/// Canonical name of a device: `cpu` or `cuda:N`.
pub fn name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Mps => "mps".into(),
        Device::Vulkan => "vulkan".into(),
    }
}

/// Parses `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
pub fn parse(s: &str) -> Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(Device::Cuda(i)),
            _ => Err(format!(
                "unknown device `{other}`: expected `cpu`, `cuda` or `cuda:N`"
            )),
        },
    }
}

/// Number of CUDA devices torch sees.
///
/// The linker may drop `libtorch_cuda.so` from the binary's needed
/// libraries, since no symbol of it is referenced directly; loading it
/// registers torch's CUDA backend. The rpath set by `build.rs` lets the
/// loader find it next to `libtorch.so`.
pub fn cuda_device_count() -> i64 {
    static LOADED: std::sync::Once = std::sync::Once::new();
    LOADED.call_once(|| {
        let name = c"libtorch_cuda.so";
        // SAFETY: dlopen with a valid NUL-terminated name; the handle is
        // intentionally leaked so the library stays loaded.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            tracing::debug!("libtorch_cuda.so could not be loaded; CUDA is off");
        }
    });
    if tch::Cuda::is_available() {
        tch::Cuda::device_count()
    } else {
        0
    }
}

/// Resolves a device request against this machine: `auto` picks `cuda:0`
/// when present, else `cpu`; a CUDA device that is not there is an error
/// that says so.
pub fn resolve(request: &str) -> Result<Device, String> {
    if request == "auto" {
        return Ok(if cuda_device_count() > 0 {
            Device::Cuda(0)
        } else {
            Device::Cpu
        });
    }
    let device = parse(request)?;
    if let Device::Cuda(i) = device {
        let count = cuda_device_count();
        if count == 0 {
            return Err(format!(
                "device `{request}` was asked for, but torch sees no CUDA device on this machine (use `cpu`)"
            ));
        }
        if i as i64 >= count {
            return Err(format!(
                "device `{request}` was asked for, but this machine has {count} CUDA device(s)"
            ));
        }
    }
    Ok(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!(parse("cpu"), Ok(Device::Cpu));
        assert_eq!(parse("cuda"), Ok(Device::Cuda(0)));
        assert_eq!(parse("cuda:3"), Ok(Device::Cuda(3)));
        assert!(parse("cuda:x").is_err());
        assert!(parse("tpu").is_err());
        assert_eq!(name(Device::Cuda(1)), "cuda:1");
        assert_eq!(resolve("cpu"), Ok(Device::Cpu));
    }
}
