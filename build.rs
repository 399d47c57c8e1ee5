//! Embeds an rpath to the libtorch that torch-sys linked against, so the
//! built binary (and every test and bench binary) finds `libtorch*.so` by
//! itself, without `LD_LIBRARY_PATH`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
        println!("cargo:rustc-env=POLYAK_LIBTORCH_LIB={lib_dir}");
    }
}
