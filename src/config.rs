//! Command line and environment configuration of `polyak serve`.
//!
//! Every flag can also be given as a `POLYAK_*` environment variable, which is
//! what container deployments use.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "polyak",
    version,
    about = "A network-served EMA service for PyTorch training"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP server.
    Serve(ServeArgs),
    /// Reread every part of every complete snapshot in the store and
    /// report (JSON on stdout) those whose size or sha256 is not the one
    /// recorded; exits 1 when any does not match. Takes the server's
    /// `--data-dir`, `--catalog`, `--store` and `--s3-endpoint`.
    Verify(VerifyArgs),
}

#[derive(Debug, Clone, Args)]
pub struct VerifyArgs {
    /// Only this run's snapshots (default every run's).
    #[arg(long)]
    pub run: Option<String>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on. Port 0 picks a free port; the chosen address is
    /// printed on stdout as `polyak listening on http://ADDR`.
    #[arg(long, env = "POLYAK_BIND", default_value = "127.0.0.1:8080")]
    pub bind: SocketAddr,

    /// Directory for the SQLite catalog and snapshot files (the embedded
    /// defaults of `--catalog` and `--store`).
    #[arg(long, env = "POLYAK_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,

    /// The catalog database: `sqlite://PATH` or `postgres://USER[:PASSWORD]@HOST[:PORT]/DB`.
    /// Default: SQLite at `<data-dir>/polyak.db`. Its migrations are applied at start.
    #[arg(long, env = "POLYAK_CATALOG", hide_env_values = true)]
    pub catalog: Option<String>,

    /// Where snapshot parts live: `file://DIR` or `s3://BUCKET[/PREFIX]`
    /// (credentials and region from the usual `AWS_*` variables). Default:
    /// files under `<data-dir>`.
    #[arg(long, env = "POLYAK_STORE")]
    pub store: Option<String>,

    /// The S3 endpoint of a service other than AWS (MinIO, SeaweedFS,
    /// Garage, Ceph, GCS's S3 interface); `http://` is allowed.
    #[arg(long, env = "POLYAK_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,

    /// Default device for new runs' EMA: `auto` (CUDA when available, else
    /// CPU), `cpu`, `cuda` (a run's ranks spread over every GPU of
    /// `--devices`) or `cuda:N` (all on that one). Asking for CUDA on a
    /// machine without it fails at start.
    #[arg(long, env = "POLYAK_DEVICE", default_value = "auto")]
    pub device: String,

    /// The GPUs this node's engines use, one engine each: `cuda:0,cuda:1`.
    /// Default: every CUDA device torch sees.
    #[arg(long, env = "POLYAK_DEVICES")]
    pub devices: Option<String>,

    /// This server's name among the nodes of one service (placement
    /// answers name it). Default: generated once and kept in the data dir
    /// (`node-id`).
    #[arg(long, env = "POLYAK_NODE_ID")]
    pub node_id: Option<String>,

    /// The URL clients and other nodes reach this server at (placement
    /// answers give it). Default: `http://` and the address bound.
    #[arg(long, env = "POLYAK_ADVERTISE_URL")]
    pub advertise_url: Option<String>,

    /// Seconds a node's lease in the catalog lasts; it is renewed three
    /// times in that span. A node whose lease ran out counts as gone.
    #[arg(long, env = "POLYAK_LEASE_SECS", default_value_t = 10.0)]
    pub lease_secs: f64,

    /// Bytes of EMA state this node offers (placement balances on it).
    /// Default: the machine's memory.
    #[arg(long, env = "POLYAK_MEMORY_BUDGET")]
    pub memory_budget: Option<ByteSize>,

    /// Engine threads a CPU run's ranks are spread over (each applies its
    /// ranks' pushes on its own core). Default: one per two cores, at
    /// least one. A GPU has one engine each.
    #[arg(long, env = "POLYAK_ENGINES")]
    pub engines: Option<usize>,

    /// Admin token. When set, every request needs a bearer token: the admin
    /// token, or a run's write token (pushes) or read token (reads).
    #[arg(long, env = "POLYAK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Allow binding a non-loopback address without a token.
    #[arg(long, env = "POLYAK_INSECURE", default_value_t = false)]
    pub insecure: bool,

    /// Largest push body accepted (after decompression), e.g. `16GiB`.
    #[arg(long, env = "POLYAK_PUSH_BODY_LIMIT", default_value = "16GiB")]
    pub push_body_limit: ByteSize,

    /// Largest safetensors header accepted in a push.
    #[arg(long, env = "POLYAK_HEADER_LIMIT", default_value = "16MiB")]
    pub header_limit: ByteSize,

    /// Largest body of any other request.
    #[arg(long, env = "POLYAK_BODY_LIMIT", default_value = "1MiB")]
    pub body_limit: ByteSize,

    /// Push body bytes held in memory at once (received, not yet applied);
    /// past it pushes are answered with 429.
    #[arg(long, env = "POLYAK_INFLIGHT_BYTES", default_value = "4GiB")]
    pub inflight_bytes: ByteSize,

    /// Bytes a run's periodic snapshots may hold captured and not yet
    /// written. A periodic snapshot that would pass it is skipped (and
    /// reported as an event and in /metrics); one is always allowed.
    #[arg(long, env = "POLYAK_PERIODIC_BACKLOG", default_value = "1GiB")]
    pub periodic_backlog: ByteSize,

    /// Bytes the state snapshots of every run together may hold captured
    /// and not yet written (one is always allowed). A due state snapshot
    /// that would pass it is skipped (counted in
    /// `polyak_state_persist_skipped_total`); an explicit persist or the one
    /// at shutdown waits for room.
    #[arg(long, env = "POLYAK_CAPTURE_BACKLOG", default_value = "2GiB")]
    pub capture_backlog: ByteSize,

    /// Seconds a request waits for a catalog connection before it is
    /// answered `503 catalog_unavailable` (`/readyz`: `503 unavailable`).
    #[arg(long, env = "POLYAK_CATALOG_TIMEOUT_SECS", default_value_t = 2.0)]
    pub catalog_timeout_secs: f64,

    /// Seconds one request to an S3 store may take, its retries included,
    /// before it fails (a snapshot writing to a store that stopped
    /// answering then fails with the reason instead of waiting forever).
    #[arg(long, env = "POLYAK_STORE_TIMEOUT_SECS", default_value_t = 30.0)]
    pub store_timeout_secs: f64,

    /// Commands the engine queue holds before pushes are answered with 429.
    #[arg(long, env = "POLYAK_QUEUE_DEPTH", default_value_t = 16)]
    pub queue_depth: usize,

    /// Pipelined pushes (`Polyak-Prev-Step`): seconds a push whose
    /// predecessor step has not been answered yet waits for it before it is
    /// refused (`409 predecessor_timeout`).
    #[arg(long, env = "POLYAK_PIPELINE_TIMEOUT", default_value_t = 30.0)]
    pub pipeline_timeout_secs: f64,

    /// Pipelined pushes of one rank that may wait for their predecessor at
    /// once; past it pushes are answered with 429.
    #[arg(long, env = "POLYAK_PIPELINE_DEPTH", default_value_t = 4)]
    pub pipeline_depth: usize,

    /// Seconds a client is told to wait (`Retry-After`) when the queue is full.
    #[arg(long, env = "POLYAK_RETRY_AFTER", default_value_t = 1)]
    pub retry_after_secs: u64,

    /// Log format on stderr.
    #[arg(long, env = "POLYAK_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Events kept per run in the catalog (older ones are pruned).
    #[arg(long, env = "POLYAK_EVENTS_RETAINED", default_value_t = 10_000)]
    pub events_retained: u64,

    /// Points kept per metric series in the catalog (older ones are pruned).
    #[arg(long, env = "POLYAK_METRICS_RETAINED", default_value_t = 100_000)]
    pub metrics_retained: u64,

    /// Seconds between retention passes over events and metrics.
    #[arg(long, env = "POLYAK_PRUNE_INTERVAL", default_value_t = 60)]
    pub prune_interval_secs: u64,

    /// Seconds to wait for in-flight requests on shutdown.
    #[arg(long, env = "POLYAK_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout_secs: u64,

    /// Seconds a client has to send a request's head (request line and
    /// headers), counted from the connection's start or from the first byte
    /// of a later request. A slower client is disconnected (slow-loris).
    #[arg(long, env = "POLYAK_HEADER_TIMEOUT", default_value_t = 30)]
    pub header_timeout_secs: u64,

    /// Seconds a request body may take beyond what `--body-min-rate` allows
    /// for its size: a body must be complete within this time plus one
    /// second per `--body-min-rate` bytes received, else the request is
    /// answered 408 and the connection closed.
    #[arg(long, env = "POLYAK_BODY_TIMEOUT", default_value_t = 30)]
    pub body_timeout_secs: u64,

    /// The slowest body upload that keeps extending `--body-timeout-secs`, in
    /// bytes per second.
    #[arg(long, env = "POLYAK_BODY_MIN_RATE", default_value = "64KiB")]
    pub body_min_rate: ByteSize,

    /// Seconds an idle keep-alive connection (no request in flight, no byte
    /// of a next one) is kept open.
    #[arg(long, env = "POLYAK_IDLE_TIMEOUT", default_value_t = 60)]
    pub idle_timeout_secs: u64,

    /// Connections served at once; further ones wait in the listen backlog
    /// until one closes.
    #[arg(long, env = "POLYAK_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,

    /// Snapshot downloads sent at once. A download gives its connection's
    /// `--max-connections` slot back, so downloads nobody reads cannot
    /// keep probes and control calls out; one past this budget is answered
    /// 503 `too_many_downloads`. Default: `--max-connections`.
    #[arg(long, env = "POLYAK_MAX_DOWNLOADS")]
    pub max_downloads: Option<usize>,

    /// Seconds the client may leave a response unread (its socket refusing
    /// bytes) beyond what `--send-min-rate` earns; then the connection is
    /// closed.
    #[arg(long, env = "POLYAK_SEND_TIMEOUT", default_value_t = 30)]
    pub send_timeout_secs: u64,

    /// Bytes per second a response's reader must keep up with: each such
    /// amount sent extends `--send-timeout-secs` by one second.
    #[arg(long, env = "POLYAK_SEND_MIN_RATE", default_value = "64KiB")]
    pub send_min_rate: ByteSize,

    /// Hosts (`host` or `host:port`, comma-separated) alert webhooks may be
    /// sent to; empty: any host (only the admin token sets a webhook).
    #[arg(long, env = "POLYAK_WEBHOOK_ALLOW", value_delimiter = ',')]
    pub webhook_allow: Vec<String>,

    /// Free space to keep on the data dir's filesystem: a snapshot or state
    /// write that would leave less is refused before it starts.
    #[arg(long, env = "POLYAK_DISK_RESERVE", default_value = "512MiB")]
    pub disk_reserve: ByteSize,

    /// Evaluations a run may hold: a new one past it is `409
    /// too_many_evaluations` (the catalog and every listing stay bounded).
    #[arg(long, env = "POLYAK_MAX_EVALS_PER_RUN", default_value_t = 100_000)]
    pub max_evals_per_run: u64,

    /// Also serve `/metrics`, without a token, on this address (e.g.
    /// `127.0.0.1:9090`). It must be loopback unless `--insecure` is given.
    /// With auth on, `/metrics` on the main address needs the admin token.
    #[arg(long, env = "POLYAK_METRICS_BIND")]
    pub metrics_bind: Option<SocketAddr>,
}

/// Shortest admin token accepted: a guessable token on a network address
/// is no protection.
pub const MIN_TOKEN_LEN: usize = 16;

impl ServeArgs {
    /// Checks what clap cannot: the token's strength and which addresses
    /// may be bound without one.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(token) = &self.token {
            if token.trim().len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "the admin token (--token or POLYAK_TOKEN) is empty or shorter than {MIN_TOKEN_LEN} characters; \
                     give a longer one (e.g. `openssl rand -hex 24`), or leave it unset to serve without auth on loopback"
                ));
            }
            if token.trim() != token {
                return Err(
                    "the admin token (--token or POLYAK_TOKEN) has leading or trailing whitespace"
                        .into(),
                );
            }
        }
        if !self.bind.ip().is_loopback() && self.token.is_none() && !self.insecure {
            return Err(format!(
                "refusing to bind {} without a token: pass --token (or POLYAK_TOKEN), or --insecure to serve without auth",
                self.bind
            ));
        }
        if let Some(addr) = self.metrics_bind {
            if !addr.ip().is_loopback() && !self.insecure {
                return Err(format!(
                    "refusing to serve /metrics without a token on {addr}: bind it to loopback, or pass --insecure"
                ));
            }
        }
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        if self.max_downloads == Some(0) {
            return Err("--max-downloads must be at least 1".into());
        }
        if self.send_min_rate.0 == 0 {
            return Err("--send-min-rate must be at least 1 byte per second".into());
        }
        if self.body_min_rate.0 == 0 {
            return Err("--body-min-rate must be at least 1 byte per second".into());
        }
        if !(self.store_timeout_secs >= 0.1 && self.store_timeout_secs <= 3600.0) {
            return Err("--store-timeout-secs must be between 0.1 and 3600".into());
        }
        if !(self.catalog_timeout_secs >= 0.1 && self.catalog_timeout_secs <= 600.0) {
            return Err("--catalog-timeout-secs must be between 0.1 and 600".into());
        }
        if !(self.lease_secs >= 0.3 && self.lease_secs <= 3600.0) {
            return Err("--lease-secs must be between 0.3 and 3600".into());
        }
        if self.engines == Some(0) {
            return Err("--engines must be at least 1".into());
        }
        if let Some(url) = &self.advertise_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "--advertise-url `{url}`: give an http:// or https:// URL"
                ));
            }
        }
        Ok(())
    }

    /// CPU engine threads: `--engines`, else one per two cores (at least one).
    pub fn cpu_engines(&self) -> usize {
        self.engines.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / 2).max(1)
        })
    }

    /// Defaults as `polyak serve` would have them, with a given data dir and
    /// bind address (tests and embedding).
    pub fn with(bind: SocketAddr, data_dir: PathBuf) -> Self {
        let cli = Cli::parse_from(["polyak", "serve"]);
        let Command::Serve(mut args) = cli.command else {
            unreachable!("`polyak serve` parses as serve")
        };
        args.bind = bind;
        args.data_dir = data_dir;
        args
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// A byte count written with an optional unit: `1024`, `64KiB`, `16MiB`,
/// `16GiB`, `100MB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let value: u64 = digits
            .parse()
            .map_err(|_| format!("`{s}` is not a byte size (e.g. 16MiB)"))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "kib" => 1 << 10,
            "m" | "mb" => 1_000_000,
            "mib" => 1 << 20,
            "g" | "gb" => 1_000_000_000,
            "gib" => 1 << 30,
            "t" | "tb" => 1_000_000_000_000,
            "tib" => 1 << 40,
            other => return Err(format!("unknown byte unit `{other}`")),
        };
        value
            .checked_mul(scale)
            .map(ByteSize)
            .ok_or_else(|| format!("`{s}` overflows"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_with_units() {
        assert_eq!("1024".parse::<ByteSize>().unwrap(), ByteSize(1024));
        assert_eq!("16MiB".parse::<ByteSize>().unwrap(), ByteSize(16 << 20));
        assert_eq!("16GiB".parse::<ByteSize>().unwrap(), ByteSize(16 << 30));
        assert_eq!("100MB".parse::<ByteSize>().unwrap(), ByteSize(100_000_000));
        assert!("12XB".parse::<ByteSize>().is_err());
        assert!("GiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn defaults_bind_loopback() {
        let args = ServeArgs::with("127.0.0.1:0".parse().unwrap(), "d".into());
        assert_eq!(args.push_body_limit, ByteSize(16 << 30));
        assert_eq!(args.body_limit, ByteSize(1 << 20));
        assert!(!args.insecure);
        assert_eq!(args.validate(), Ok(()));
    }

    #[test]
    fn weak_tokens_and_open_binds_are_refused() {
        let mut args = ServeArgs::with("0.0.0.0:0".parse().unwrap(), "d".into());
        assert!(args.validate().unwrap_err().contains("without a token"));
        for weak in ["", "   ", "short-token"] {
            args.token = Some(weak.into());
            assert!(
                args.validate().unwrap_err().contains("shorter than 16"),
                "{weak:?}"
            );
        }
        args.token = Some(" 0123456789abcdef ".into());
        assert!(args.validate().unwrap_err().contains("whitespace"));
        args.token = Some("0123456789abcdef".into());
        assert_eq!(args.validate(), Ok(()));
        args.metrics_bind = Some("0.0.0.0:9090".parse().unwrap());
        assert!(args.validate().unwrap_err().contains("/metrics"));
        args.insecure = true;
        assert_eq!(args.validate(), Ok(()));
    }
}
