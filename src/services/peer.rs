//! Requests between the nodes of a service: one HTTP client, and the mark
//! of a forwarded request.

use std::time::Duration;

/// How long a node waits to connect to a peer.
const PEER_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a control call between nodes (sync, a cut's parts, a finish
/// phase, held steps) may take in all. Each answers at once on a live
/// peer; a peer cut off mid-connection (packets lost, no reset) must not
/// hold the caller, nor a sync that holds the cluster's lock.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a streamed answer from a peer (a forwarded read) may go
/// without a byte before it is given up.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Header set on a request one node forwards to another (a forwarded
/// request is never forwarded again).
pub const FORWARDED: &str = "polyak-forwarded";

/// A control request from this node to a peer: marked forwarded (never
/// forwarded again), with the service's admin token when it has one, and
/// bounded by [`CONTROL_TIMEOUT`].
pub fn peer_request(
    token: Option<&str>,
    method: reqwest::Method,
    url: &str,
) -> reqwest::RequestBuilder {
    let req = peer_client()
        .request(method, url)
        .header(FORWARDED, "1")
        .timeout(CONTROL_TIMEOUT);
    match token {
        Some(token) => req.bearer_auth(token),
        None => req,
    }
}

/// The HTTP client nodes reach each other with. A read that stalls is
/// given up after [`READ_TIMEOUT`]; TCP keep-alive probes find a peer
/// gone silent on an idle pooled connection, so the next request opens a
/// new one (and fails to connect within [`PEER_TIMEOUT`]) instead of
/// waiting on a dead one.
pub fn peer_client() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            reqwest::Client::builder()
                .connect_timeout(PEER_TIMEOUT)
                .read_timeout(READ_TIMEOUT)
                .tcp_keepalive(Duration::from_secs(5))
                .tcp_keepalive_interval(Duration::from_secs(1))
                .tcp_keepalive_retries(3)
                .pool_idle_timeout(Duration::from_secs(30))
                .build()
                .expect("an HTTP client")
        })
        .clone()
}
