use clap::Parser;
use polyak::config::{Cli, Command};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            polyak::telemetry::init_logging(args.log_format);
            fixed_mmap_threshold();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("polyak-io")
                .build()?;
            let served = runtime.block_on(polyak::server::serve(args));
            // A blocking task stuck in a read of an object store that hangs
            // must not hold the exit: serve() already bounded the stop.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            served
        }
        Command::Verify(args) => {
            polyak::telemetry::init_logging(args.serve.log_format);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            if !runtime.block_on(polyak::server::verify(args))? {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

/// Bytes from which glibc's malloc maps each allocation on its own, so that
/// freeing it gives the memory back to the system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 1 << 20;

/// glibc raises its mmap threshold to the size of each mapped block freed
/// (up to 32 MiB), after which blocks of that size come from the heap
/// arenas of the threads that allocated them and stay there once freed.
/// The snapshot writers, state persistence and downloads allocate and free
/// such blocks on many threads: in a soak (4 ranks of 16 MB, `benches/soak.py`)
/// the server's anonymous memory sat at 1.1–1.5 GB, and 0.45–0.55 GB with
/// the threshold fixed. An explicit `MALLOC_MMAP_THRESHOLD_` wins.
fn fixed_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt changes allocator parameters under malloc's own
        // locks; no memory is touched.
        let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
        if ok != 1 {
            tracing::warn!("could not fix malloc's mmap threshold");
        }
    }
}
