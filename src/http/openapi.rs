//! What the handlers' annotations cannot say once per operation: the bearer
//! scheme, and the error statuses every endpoint can answer (a bad run name
//! is 400, a missing or unknown token 401, a token without the right 403,
//! a missing run 404, a slow body 408...). Added here so that
//! `/openapi.json` lists every status the server sends, which schemathesis
//! checks in the test suite.

use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::path::Operation;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{OpenApi, Ref, RefOr};
use utoipa::Modify;

/// Name of the security scheme.
const BEARER: &str = "bearer";

/// Endpoints that answer without a token even when auth is on.
const PUBLIC: [&str; 2] = ["/livez", "/readyz"];

pub struct Contract;

impl Modify for Contract {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The admin token, or a run's write or read token. Only when the server runs \
                         with --token; GET on event streams and downloads also takes ?access_token=.",
                    ))
                    .build(),
            ),
        );
        // A token, or none when the server runs without auth.
        openapi.security = Some(vec![
            SecurityRequirement::new(BEARER, Vec::<String>::new()),
            SecurityRequirement::default(),
        ]);
        for (path, item) in openapi.paths.paths.iter_mut() {
            let public = PUBLIC.contains(&path.as_str());
            let ops = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
                &mut item.head,
            ];
            for op in ops.into_iter().flatten() {
                if public {
                    op.security = Some(vec![SecurityRequirement::default()]);
                    continue;
                }
                add_errors(op, path.starts_with("/v1/"));
            }
        }
    }
}

fn add_errors(op: &mut Operation, under_v1: bool) {
    let mut statuses = vec![
        (
            "401",
            "no token, or one that is neither the admin's nor any run's (auth on)",
        ),
        ("403", "the token may not do this"),
    ];
    if under_v1 {
        statuses.push((
            "400",
            "a malformed path segment, query or body (invalid_run_name, invalid_query, ...)",
        ));
        statuses.push(("404", "no such run (or rank, snapshot, profile)"));
        statuses.push((
            "422",
            "a path segment, query value or body string holds a control character (invalid_string), \
             or a well-formed body the server cannot take",
        ));
    }
    if op.request_body.is_some() {
        statuses.push(("408", "the body arrived too slowly (body_timeout)"));
        statuses.push(("413", "the body is over the limit"));
        statuses.push(("422", "a well-formed body the server cannot take"));
    }
    for (status, description) in statuses {
        op.responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| error_response(description));
    }
}

fn error_response(description: &str) -> RefOr<utoipa::openapi::Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build(),
    )
}
