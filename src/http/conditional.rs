//! Conditional requests and codings read as RFC 9110 and 9112 say:
//! `If-None-Match` (lists, weak comparison), `If-Range` (strong
//! comparison), `Content-Encoding` and `Transfer-Encoding` lists (several
//! header lines are one comma-separated list).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// The members of a list header over all its lines (RFC 9110 §5.3: lines
/// of one field are one list), trimmed, empty members dropped. A line that
/// is not visible ASCII becomes one member `?`, which matches nothing.
pub fn list_members(headers: &HeaderMap, name: &HeaderName) -> Vec<String> {
    let mut out = Vec::new();
    for value in headers.get_all(name) {
        match value.to_str() {
            Ok(text) => out.extend(
                text.split(',')
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .map(str::to_string),
            ),
            Err(_) => out.push("?".into()),
        }
    }
    out
}

/// An entity tag without its weakness prefix, and whether it was weak.
fn opaque(tag: &str) -> (&str, bool) {
    match tag.strip_prefix("W/") {
        Some(rest) => (rest, true),
        None => (tag, false),
    }
}

/// Whether `If-None-Match` matches `etag` (RFC 9110 §13.1.2: `*`, or any
/// listed tag equal to it under the weak comparison, which ignores `W/`).
pub fn none_match(headers: &HeaderMap, etag: &str) -> bool {
    let (ours, _) = opaque(etag);
    list_members(headers, &header::IF_NONE_MATCH)
        .iter()
        .any(|m| m == "*" || opaque(m).0 == ours)
}

/// Whether a `Range` may be served (RFC 9110 §13.1.5): no `If-Range`, or
/// one naming `etag` under the strong comparison. A weak tag never
/// matches, and neither does a date (downloads send no `Last-Modified`):
/// the whole representation is sent instead.
pub fn range_allowed(headers: &HeaderMap, etag: &str) -> bool {
    let Some(value) = headers.get(header::IF_RANGE) else {
        return true;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let value = value.trim();
    !value.starts_with("W/") && !etag.starts_with("W/") && value == etag
}

/// Refuses a request whose `Transfer-Encoding` names a coding other than
/// `chunked`: `501` (RFC 9112 §6.1). The connection decodes chunked alone;
/// `gzip, chunked` would otherwise reach the handler still gzipped.
pub async fn transfer_codings(req: Request<Body>, next: Next) -> Response {
    let unknown: Vec<String> = list_members(req.headers(), &header::TRANSFER_ENCODING)
        .into_iter()
        .filter(|c| !c.eq_ignore_ascii_case("chunked"))
        .collect();
    if !unknown.is_empty() {
        let mut resp = ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported_transfer_coding",
            format!(
                "Transfer-Encoding `{}`: only chunked is accepted",
                unknown.join(", ")
            ),
        )
        .into_response();
        // The body's framing is unknown: the connection cannot be reused.
        resp.headers_mut().insert(
            header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
        return resp;
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(name: HeaderName, lines: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for l in lines {
            h.append(name.clone(), HeaderValue::from_str(l).unwrap());
        }
        h
    }

    #[test]
    fn if_none_match_compares_weakly_over_lists() {
        let tag = "\"abc\"";
        for lines in [
            &["\"abc\""][..],
            &["W/\"abc\""],
            &["\"x\", \"abc\""],
            &["\"x\"", "W/\"abc\""],
            &["*"],
        ] {
            assert!(
                none_match(&headers(header::IF_NONE_MATCH, lines), tag),
                "{lines:?}"
            );
        }
        for lines in [&["\"abd\""][..], &["\"x\", \"y\""], &["abc"]] {
            assert!(
                !none_match(&headers(header::IF_NONE_MATCH, lines), tag),
                "{lines:?}"
            );
        }
    }

    #[test]
    fn if_range_compares_strongly() {
        let tag = "\"abc\"";
        assert!(range_allowed(&HeaderMap::new(), tag));
        assert!(range_allowed(&headers(header::IF_RANGE, &["\"abc\""]), tag));
        for v in ["W/\"abc\"", "\"abd\"", "Sun, 06 Nov 1994 08:49:37 GMT"] {
            assert!(!range_allowed(&headers(header::IF_RANGE, &[v]), tag), "{v}");
        }
    }

    #[test]
    fn list_lines_are_one_list() {
        let one = headers(header::CONTENT_ENCODING, &["identity, zstd"]);
        let two = headers(header::CONTENT_ENCODING, &["identity", "zstd"]);
        assert_eq!(
            list_members(&one, &header::CONTENT_ENCODING),
            list_members(&two, &header::CONTENT_ENCODING)
        );
    }
}
