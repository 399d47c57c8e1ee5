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

/// The GPUs this node's engines use: `--devices` (`cuda:0,cuda:2`), else
/// every CUDA device torch sees (none on a machine without CUDA). A device
/// named that is not there is an error that says so.
pub fn visible_gpus(list: Option<&str>) -> Result<Vec<Device>, String> {
    let count = cuda_device_count();
    gpus_of(list, count)
}

/// [`visible_gpus`] on a machine with `count` CUDA devices.
pub fn gpus_of(list: Option<&str>, count: i64) -> Result<Vec<Device>, String> {
    let Some(list) = list.map(str::trim).filter(|l| !l.is_empty()) else {
        return Ok((0..count.max(0) as usize).map(Device::Cuda).collect());
    };
    let mut out: Vec<Device> = Vec::new();
    for item in list.split(',').map(str::trim) {
        let device = match parse(item)? {
            Device::Cuda(i) if (i as i64) < count => Device::Cuda(i),
            Device::Cuda(_) if count == 0 => {
                return Err(format!(
                    "--devices names `{item}`, but torch sees no CUDA device on this machine"
                ))
            }
            Device::Cuda(_) => {
                return Err(format!(
                    "--devices names `{item}`, but this machine has {count} CUDA device(s)"
                ))
            }
            _ => return Err(format!("--devices lists GPUs (`cuda:N`), not `{item}`")),
        };
        if out.contains(&device) {
            return Err(format!("--devices names `{item}` twice"));
        }
        out.push(device);
    }
    Ok(out)
}

/// The canonical device of a run from what was asked (`auto`, `cpu`,
/// `cuda`, `cuda:N`), given this node's GPUs: `auto` is `cuda` where the
/// node has a GPU, else `cpu`; `cuda` spreads a run's ranks over every
/// GPU of `--devices`; `cuda:N` keeps them on that one.
pub fn canonical(request: &str, gpus: &[Device]) -> Result<String, String> {
    match request {
        "auto" => Ok(if gpus.is_empty() { "cpu" } else { "cuda" }.into()),
        "cuda" if gpus.is_empty() => {
            Err("device `cuda` was asked for, but this node has no CUDA device (use `cpu`)".into())
        }
        "cuda" => Ok("cuda".into()),
        other => match parse(other)? {
            Device::Cuda(_) if gpus.is_empty() => Err(format!(
                "device `{other}` was asked for, but this node has no CUDA device (use `cpu`)"
            )),
            d @ Device::Cuda(_) if !gpus.contains(&d) => Err(format!(
                "device `{other}` was asked for, but this node's GPUs are {}",
                gpus.iter().map(|&g| name(g)).collect::<Vec<_>>().join(", ")
            )),
            d => Ok(name(d)),
        },
    }
}

/// The engines a run on `device` (canonical) is spread over, as (label,
/// device): one per GPU of `gpus` for `cuda`, the one GPU for `cuda:N`,
/// and `cpu_engines` threads on the CPU (`cpu#0`, `cpu#1`, ...; `cpu`
/// alone when there is one).
pub fn engines_of(
    device: &str,
    gpus: &[Device],
    cpu_engines: usize,
) -> Result<Vec<(String, Device)>, String> {
    match device {
        "cuda" if gpus.is_empty() => Err("this node has no CUDA device".into()),
        "cuda" => Ok(gpus.iter().map(|&g| (name(g), g)).collect()),
        other => match parse(other)? {
            Device::Cpu if cpu_engines > 1 => Ok((0..cpu_engines)
                .map(|i| (format!("cpu#{i}"), Device::Cpu))
                .collect()),
            d => Ok(vec![(name(d), d)]),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--devices` and the devices runs ask for, on machines with none,
    /// one and four GPUs (no GPU is needed: only the count matters).
    #[test]
    fn gpus_runs_and_engines_follow_devices() {
        assert_eq!(gpus_of(None, 0), Ok(vec![]));
        assert_eq!(gpus_of(None, 2), Ok(vec![Device::Cuda(0), Device::Cuda(1)]));
        assert_eq!(
            gpus_of(Some("cuda:3, cuda:1"), 4),
            Ok(vec![Device::Cuda(3), Device::Cuda(1)])
        );
        assert!(gpus_of(Some("cuda:4"), 4)
            .unwrap_err()
            .contains("4 CUDA device(s)"));
        assert!(gpus_of(Some("cuda:0"), 0)
            .unwrap_err()
            .contains("no CUDA device"));
        assert!(gpus_of(Some("cpu"), 2).unwrap_err().contains("not `cpu`"));
        assert!(gpus_of(Some("cuda:1,cuda:1"), 2)
            .unwrap_err()
            .contains("twice"));

        let none: Vec<Device> = vec![];
        let four: Vec<Device> = (0..4).map(Device::Cuda).collect();
        let some = vec![Device::Cuda(1), Device::Cuda(3)];
        assert_eq!(canonical("auto", &none).as_deref(), Ok("cpu"));
        assert_eq!(canonical("auto", &four).as_deref(), Ok("cuda"));
        assert_eq!(canonical("cuda", &four).as_deref(), Ok("cuda"));
        assert_eq!(canonical("cuda:3", &some).as_deref(), Ok("cuda:3"));
        assert_eq!(canonical("cpu", &four).as_deref(), Ok("cpu"));
        assert!(canonical("cuda", &none).is_err());
        assert!(canonical("cuda:0", &some)
            .unwrap_err()
            .contains("cuda:1, cuda:3"));

        let labels = |d: &str, gpus: &[Device], cpus| {
            engines_of(d, gpus, cpus).map(|e| e.into_iter().map(|(l, _)| l).collect::<Vec<_>>())
        };
        assert_eq!(
            labels("cuda", &some, 4),
            Ok(vec!["cuda:1".into(), "cuda:3".into()])
        );
        assert_eq!(
            engines_of("cuda", &some, 4).unwrap()[1].1,
            Device::Cuda(3),
            "each GPU engine runs on its own device"
        );
        assert_eq!(labels("cuda:3", &some, 4), Ok(vec!["cuda:3".into()]));
        assert_eq!(
            labels("cpu", &some, 2),
            Ok(vec!["cpu#0".into(), "cpu#1".into()])
        );
        assert_eq!(labels("cpu", &none, 1), Ok(vec!["cpu".into()]));
        assert!(engines_of("cuda", &none, 1).is_err());
    }

    #[test]
    fn parses_device_names() {
        assert_eq!(parse("cpu"), Ok(Device::Cpu));
        assert_eq!(parse("cuda"), Ok(Device::Cuda(0)));
        assert_eq!(parse("cuda:3"), Ok(Device::Cuda(3)));
        assert!(parse("cuda:x").is_err());
        assert!(parse("tpu").is_err());
        assert_eq!(name(Device::Cuda(1)), "cuda:1");
    }
}
