//! Requests between the nodes of a service: one HTTP client, and the mark
//! of a forwarded request.

use std::time::Duration;

/// How long a node waits to connect to a peer.
const PEER_TIMEOUT: Duration = Duration::from_secs(3);

/// Header set on a request one node forwards to another (a forwarded
/// request is never forwarded again).
pub const FORWARDED: &str = "polyak-forwarded";

/// A request from this node to a peer: marked forwarded (never forwarded
/// again), with the service's admin token when it has one.
pub fn peer_request(
    token: Option<&str>,
    method: reqwest::Method,
    url: &str,
) -> reqwest::RequestBuilder {
    let req = peer_client().request(method, url).header(FORWARDED, "1");
    match token {
        Some(token) => req.bearer_auth(token),
        None => req,
    }
}

/// The HTTP client nodes reach each other with.
pub fn peer_client() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            reqwest::Client::builder()
                .connect_timeout(PEER_TIMEOUT)
                .timeout(Duration::from_secs(300))
                .build()
                .expect("an HTTP client")
        })
        .clone()
}
