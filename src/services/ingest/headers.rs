//! What a push's headers declare besides its length: the body's encoding,
//! the step pipelined before it, the client's encoding time.

use crate::services::pipeline::PREV_STEP;
use crate::services::ServiceError;
use crate::wire::codec;

/// Header in which a client reports the seconds it spent encoding the body
/// (shown with the rank's wire figures; never trusted for anything else).
pub const ENCODE_SECONDS: &str = "polyak-encode-seconds";

/// What a push's headers declare besides its length.
#[derive(Debug, Clone, Copy)]
pub(super) struct PushHeaders {
    pub(super) encoding: Encoding,
    /// Pipelining: the step the client pushed before this one.
    pub(super) prev_step: Option<u64>,
    /// Client-reported encoding time.
    pub(super) encode_seconds: f64,
}

impl PushHeaders {
    pub(super) fn parse(
        step: u64,
        encoding: Option<&str>,
        prev_step: Option<&str>,
        encode_seconds: Option<&str>,
    ) -> Result<Self, ServiceError> {
        // The codings in the order they were applied (RFC 9110 §8.4);
        // `identity` applies nothing. One real coding at most is accepted.
        let applied: Vec<String> = encoding
            .unwrap_or("")
            .split(',')
            .map(|c| c.trim().to_ascii_lowercase())
            .filter(|c| !c.is_empty() && c != "identity")
            .collect();
        let encoding = match applied.as_slice() {
            [] => Encoding::Identity,
            [c] if c == "zstd" => Encoding::Zstd,
            [c] if c == codec::ENCODING => Encoding::ByteGroup,
            _ => {
                let other = encoding.unwrap_or("");
                return Err(ServiceError::new(
                    crate::services::ErrorKind::UnsupportedMedia,
                    "unsupported_encoding",
                    format!(
                        "Content-Encoding `{other}`: only zstd, {} (or none) is accepted",
                        codec::ENCODING
                    ),
                ));
            }
        };
        let prev_step = match prev_step {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&p| p < step)
                    .ok_or_else(|| {
                        ServiceError::bad_request(
                            "invalid_header",
                            format!("{PREV_STEP}: must be a step below {step}"),
                        )
                    })?,
            ),
        };
        let encode_seconds = encode_seconds
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .unwrap_or(0.0);
        Ok(PushHeaders {
            encoding,
            prev_step,
            encode_seconds,
        })
    }
}

/// How the body arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Encoding {
    Identity,
    Zstd,
    ByteGroup,
}

impl Encoding {
    pub(super) fn name(self) -> &'static str {
        match self {
            Encoding::Identity => "identity",
            Encoding::Zstd => "zstd",
            Encoding::ByteGroup => codec::ENCODING,
        }
    }
}
