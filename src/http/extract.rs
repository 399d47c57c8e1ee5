//! Request extraction that answers in the API's error shape: JSON bodies
//! whose failures name the field, and path segments parsed by hand.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use crate::registry::RunHandle;
use crate::run::{valid_name, MAX_STEP};
use crate::state::AppState;
use std::sync::Arc;

/// A JSON body; errors are 400 (not JSON) or 422 naming the field.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(e.status(), "body_too_large", e.body_text())
            } else if super::conn::is_body_timeout(&e) {
                ApiError::new(
                    axum::http::StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    e.body_text(),
                )
            } else {
                ApiError::bad_request("invalid_body", e.body_text())
            }
        })?;
        let de = &mut serde_json::Deserializer::from_slice(&bytes);
        let value = serde_path_to_error::deserialize(de)
            .map(ApiJson)
            .map_err(|e| {
                let field = e.path().to_string();
                let inner = e.into_inner();
                if is_number_out_of_range(&inner) {
                    // Valid JSON (RFC 8259 sets no range), but no float64
                    // holds it: a value out of its domain, like a string
                    // where a number belongs.
                    ApiError {
                        field: (field != ".").then(|| field.clone()),
                        ..ApiError::unprocessable(
                            "invalid_config",
                            format!("{field}: the number is out of range: {inner}"),
                        )
                    }
                } else if inner.is_syntax() || inner.is_eof() {
                    ApiError::bad_request(
                        "invalid_json",
                        format!("the body is not valid JSON: {inner}"),
                    )
                } else {
                    ApiError {
                        field: (field != ".").then(|| field.clone()),
                        ..ApiError::unprocessable("invalid_config", format!("{field}: {inner}"))
                    }
                }
            })?;
        refuse_control_characters(&bytes)?;
        Ok(value)
    }
}

/// serde_json's error for a number no `f64` (or integer type) holds, such
/// as `1e400`; it files it under syntax.
fn is_number_out_of_range(e: &serde_json::Error) -> bool {
    e.is_syntax() && e.to_string().starts_with("number out of range")
}

/// Whether `c` may not appear in a string a client sends: a control
/// character (C0, DEL, C1). `text` allows tab, newline and carriage return
/// (free text in a JSON body, such as a note).
pub fn forbidden_char(c: char, text: bool) -> bool {
    c.is_control() && !(text && matches!(c, '\t' | '\n' | '\r'))
}

/// `422 invalid_string` naming `field`: a string holds a control
/// character. The catalog stores and queries with these strings, and
/// PostgreSQL's text holds no NUL at all.
pub fn invalid_string(field: &str, text: bool) -> ApiError {
    let allowed = if text {
        " (tab, newline and carriage return are allowed)"
    } else {
        ""
    };
    ApiError {
        field: Some(field.to_string()),
        ..ApiError::unprocessable(
            "invalid_string",
            format!("{field}: holds a NUL or another control character{allowed}"),
        )
    }
}

/// Refuses a JSON body whose strings (keys too) hold a control character
/// other than tab, newline and carriage return. A control character can
/// only be in a JSON string escaped (`\u0000`), or as DEL or a C1 character
/// written raw, so bodies without those bytes are not parsed again.
fn refuse_control_characters(bytes: &[u8]) -> Result<(), ApiError> {
    let suspect = bytes.windows(2).any(|w| {
        (w[0] == b'\\' && w[1] == b'u')
            || w[0] == 0x7f
            || (w[0] == 0xc2 && (0x80..0xa0).contains(&w[1]))
    }) || bytes.last() == Some(&0x7f);
    if !suspect {
        return Ok(());
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return Ok(());
    };
    match control_string_at(&value, String::new()) {
        Some(field) => Err(invalid_string(&field, true)),
        None => Ok(()),
    }
}

/// The path (`a.b[2].c`, as serde_path_to_error writes it) of the first
/// string in `value` that holds a forbidden character, if any.
fn control_string_at(value: &serde_json::Value, at: String) -> Option<String> {
    let bad = |s: &str| s.chars().any(|c| forbidden_char(c, true));
    match value {
        serde_json::Value::String(s) => bad(s).then_some(at),
        serde_json::Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| control_string_at(v, format!("{at}[{i}]"))),
        serde_json::Value::Object(map) => map.iter().find_map(|(k, v)| {
            let here = if at.is_empty() {
                k.clone()
            } else {
                format!("{at}.{k}")
            };
            if bad(k) {
                return Some(here);
            }
            control_string_at(v, here)
        }),
        _ => None,
    }
}

/// Refuses a request whose path parameters or query values (or names)
/// hold a control character: `422 invalid_string` naming the parameter.
/// A route layer (it needs the matched route's parameter names).
pub async fn printable_params(
    req: Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (mut parts, body) = req.into_parts();
    if let Ok(params) = axum::extract::RawPathParams::from_request_parts(&mut parts, &()).await {
        for (name, value) in &params {
            if value.chars().any(|c| forbidden_char(c, false)) {
                return invalid_string(name, false).into_response();
            }
        }
    }
    if let Some(query) = parts.uri.query() {
        for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
            if name.chars().any(|c| forbidden_char(c, false)) {
                return invalid_string("query", false).into_response();
            }
            if value.chars().any(|c| forbidden_char(c, false)) {
                return invalid_string(&name, false).into_response();
            }
        }
    }
    next.run(Request::from_parts(parts, body)).await
}

/// A query string; a malformed one is 400 `invalid_query` in the API's
/// error shape (axum's own rejection is plain text), naming the parameter
/// (in `field` too) and the value it was given.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or_default();
        let de = serde_urlencoded::Deserializer::new(url::form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(ApiQuery)
            .map_err(|e| invalid_query(query, e))
    }
}

/// `invalid_query` naming the parameter that failed and the value it had
/// (the last one given, as the query is read).
fn invalid_query(
    query: &str,
    e: serde_path_to_error::Error<serde_urlencoded::de::Error>,
) -> ApiError {
    let field = e.path().to_string();
    let inner = e.into_inner();
    if field == "." {
        return ApiError::bad_request("invalid_query", format!("query: {inner}"));
    }
    let given = url::form_urlencoded::parse(query.as_bytes())
        .filter(|(k, _)| *k == field)
        .last()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default();
    ApiError {
        field: Some(field.clone()),
        ..ApiError::bad_request(
            "invalid_query",
            format!("query parameter {field}=`{given}`: {inner}"),
        )
    }
}

/// Like [`ApiJson`], but an empty body means `T::default()`.
pub struct MaybeJson<T>(pub T);

impl<T: DeserializeOwned + Default> FromRequest<AppState> for MaybeJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let empty = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() == b"0");
        if empty {
            return Ok(MaybeJson(T::default()));
        }
        let ApiJson(value) = ApiJson::<T>::from_request(req, state).await?;
        Ok(MaybeJson(value))
    }
}

/// Looks up a run by a path segment: 400 for a name that can never be a
/// run, 404 for one that is not.
pub fn run_named(state: &AppState, name: &str) -> Result<Arc<RunHandle>, ApiError> {
    if !valid_name(name) {
        return Err(ApiError::bad_request(
            "invalid_run_name",
            "run names match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        ));
    }
    let run = state
        .run(name)
        .ok_or_else(|| ApiError::not_found("run_not_found", format!("no run `{name}`")))?;
    super::vanished::note_run(&run);
    Ok(run)
}

/// Parses a rank segment and checks it against the world size.
pub fn rank_of(run: &RunHandle, segment: &str) -> Result<u32, ApiError> {
    let rank: u32 = segment.parse().map_err(|_| {
        ApiError::bad_request("invalid_rank", format!("rank `{segment}` is not a number"))
    })?;
    if rank >= run.config.world_size {
        return Err(ApiError::not_found(
            "rank_not_found",
            format!(
                "rank {rank} is out of range: run `{}` has world_size {}",
                run.config.name, run.config.world_size
            ),
        ));
    }
    Ok(rank)
}

/// Parses a step segment (at most [`MAX_STEP`]): the canonical decimal
/// only, so one step has one path (`01` and `+1` are not step 1).
pub fn step_of(segment: &str) -> Result<u64, ApiError> {
    let canonical = !segment.is_empty()
        && segment.bytes().all(|c| c.is_ascii_digit())
        && (segment == "0" || !segment.starts_with('0'));
    let step = segment.parse().ok().filter(|_| canonical).ok_or_else(|| {
        ApiError::bad_request(
            "invalid_step",
            format!("step `{segment}` is not a non-negative integer in canonical decimal"),
        )
    })?;
    bounded_step("step", step)
}

/// A step taken from a body or a query, named `what` in the error: `400
/// invalid_step` past [`MAX_STEP`] (beyond it a step would wrap or round).
pub fn bounded_step(what: &str, step: u64) -> Result<u64, ApiError> {
    if step > MAX_STEP {
        return Err(ApiError::bad_request(
            "invalid_step",
            format!("{what}: {step} is past the largest step, 2^53 = {MAX_STEP}"),
        ));
    }
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_canonical_decimals() {
        assert_eq!(step_of("0").unwrap(), 0);
        assert_eq!(step_of("10").unwrap(), 10);
        assert_eq!(step_of("9007199254740992").unwrap(), MAX_STEP);
        for segment in [
            "01",
            "+1",
            "00",
            "",
            " 1",
            "1 ",
            "-0",
            "0x1",
            "1e3",
            "9007199254740993",
        ] {
            assert_eq!(
                step_of(segment).unwrap_err().code,
                "invalid_step",
                "{segment:?}"
            );
        }
    }

    #[test]
    fn control_strings_are_found_with_their_path() {
        let v = serde_json::json!({"note": "ok\n\tfine\r", "tags": ["a", "b\u{0}"]});
        assert_eq!(
            control_string_at(&v, String::new()).as_deref(),
            Some("tags[1]")
        );
        let v = serde_json::json!({"alerts": {"metrics": [{"metric": "x\u{7f}"}]}});
        assert_eq!(
            control_string_at(&v, String::new()).as_deref(),
            Some("alerts.metrics[0].metric")
        );
        let v = serde_json::json!({"values": {"l\u{85}": 1}});
        assert_eq!(
            control_string_at(&v, String::new()).as_deref(),
            Some("values.l\u{85}")
        );
        let v = serde_json::json!({"note": "line\nline", "n": 1});
        assert_eq!(control_string_at(&v, String::new()), None);
        assert!(refuse_control_characters(br#"{"note": "a\u0000b"}"#).is_err());
        assert!(refuse_control_characters(br#"{"note": "a\nb\u00e9"}"#).is_ok());
        assert!(refuse_control_characters("{\"note\": \"a\u{85}\"}".as_bytes()).is_err());
    }

    #[test]
    fn numbers_past_f64_are_told_from_syntax_errors() {
        let e = serde_json::from_str::<serde_json::Value>("{\"x\": 1e400}").unwrap_err();
        assert!(is_number_out_of_range(&e));
        let e = serde_json::from_str::<serde_json::Value>("{\"x\": NaN}").unwrap_err();
        assert!(!is_number_out_of_range(&e));
    }
}
