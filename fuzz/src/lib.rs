//! The server's push parser and validation (`src/wire`), compiled alone so
//! that the fuzz target needs neither libtorch nor the HTTP stack. The
//! files are the server's own, included by path: what is fuzzed is what
//! runs.

/// The one type the wire parser takes from the server's `run` module. A
/// variant added there and matched in `wire/push.rs` fails this build,
/// which keeps the two in step.
pub mod run {
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub enum NonfinitePolicy {
        #[default]
        Reject,
        SkipTensor,
        Allow,
    }
}

/// The one function the body pool (`wire/bodies.rs`) takes from the
/// server's `hugepages` module: advice only, so none is given here.
pub mod hugepages {
    pub fn advise(_ptr: *const u8, _len: usize) -> usize {
        0
    }
}

pub mod wire;
