//! The object store: where snapshot parts live, behind one interface over
//! local files (`file://DIR`, the embedded default under `--data-dir`) and
//! S3-compatible services (`s3://BUCKET/PREFIX` through the `object_store`
//! crate: AWS S3, GCS's S3 interface, MinIO, SeaweedFS, Garage, Ceph).
//!
//! Writes are streamed: an [`Upload`] takes the bytes in pieces as they
//! are produced, hashes them on the way (the sha256 of the whole object
//! and a CRC-32 per [`blocks::BLOCK_BYTES`] block, in the same pass), and
//! sends S3 parts of
//! [`PART_BYTES`] with at most [`PARTS_IN_FLIGHT`] uploading at once, so
//! memory stays at a few part buffers whatever the object's size. An S3
//! upload has an id from its first request on: callers record it (the
//! catalog) so an upload interrupted by a crash can be aborted at the next
//! start ([`ObjectStore::abort_upload`]). A file upload writes a temporary
//! name, fsyncs it and renames it, as the rest of the data dir does.
//!
//! Reads are ranged ([`ObjectStore::read_range`]); nothing reads a whole
//! object to serve part of it.

use std::ops::Range;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::stream::{FuturesOrdered, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey, AwsAuthorizer};
use object_store::local::LocalFileSystem;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{ClientOptions, PutPayload, RetryConfig};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

pub mod blocks;
pub mod metrics;

pub use blocks::{BlockHasher, BlockSums, BLOCK_BYTES};
pub use metrics::StoreMetrics;

/// Size of one S3 part (S3 wants at least 5 MiB for all but the last).
pub const PART_BYTES: usize = 8 << 20;
/// S3 parts uploading at once per upload.
pub const PARTS_IN_FLIGHT: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store URL `{0}`: expected file://DIR or s3://BUCKET[/PREFIX]")]
    Url(String),
    #[error("object store: {0}")]
    Backend(#[from] object_store::Error),
    #[error("object store files: {0}")]
    Io(#[from] std::io::Error),
    #[error("object `{0}` not found")]
    NotFound(String),
    #[error("object store: no answer to `{op}` within {secs:.1} s")]
    TimedOut { op: &'static str, secs: f64 },
}

impl StoreError {
    /// True when the store could not be reached or answered with a server
    /// error (an outage: retry later), as opposed to a missing object.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Backend(object_store::Error::NotFound { .. }) | StoreError::NotFound(_) => {
                false
            }
            StoreError::Backend(object_store::Error::Generic { .. })
            | StoreError::TimedOut { .. } => true,
            StoreError::Io(e) => e.kind() != std::io::ErrorKind::NotFound,
            _ => false,
        }
    }
}

enum Backend {
    File {
        root: PathBuf,
        fs: LocalFileSystem,
    },
    S3 {
        s3: Arc<AmazonS3>,
        prefix: String,
        /// The bucket's URL and region, for the one request `object_store`
        /// does not make: listing open multipart uploads.
        bucket_url: String,
        region: String,
        http: reqwest::Client,
    },
}

/// How long one object-store request may take, its retries included,
/// unless the server says otherwise (`--store-timeout-secs`).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A snapshot store (cheap to clone).
#[derive(Clone)]
pub struct ObjectStore {
    backend: Arc<Backend>,
    metrics: StoreMetrics,
    describe: Arc<str>,
    /// The most one request to S3 may take, its retries included (`None`
    /// for files): a service that stops answering (a gateway paused,
    /// a network that drops packets) fails the request instead of holding
    /// a snapshot write, a `persist` or a shutdown forever.
    deadline: Option<Duration>,
}

/// What a finished upload wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uploaded {
    pub key: String,
    pub bytes: u64,
    pub sha256: String,
    /// The object's block checksums (`None`: a file renamed into a
    /// directory store whose hashes the caller already had).
    pub blocks: Option<BlockSums>,
}

impl ObjectStore {
    /// Opens the store at `url`: `file://DIR` (created when missing) or
    /// `s3://BUCKET[/PREFIX]`, whose credentials and region come from the
    /// usual `AWS_*` environment variables; `s3_endpoint` names a
    /// non-AWS service (`http://` allowed, for a local one).
    pub fn open(url: &str, s3_endpoint: Option<&str>) -> Result<Self, StoreError> {
        Self::open_with_timeout(url, s3_endpoint, DEFAULT_REQUEST_TIMEOUT)
    }

    /// [`ObjectStore::open`] whose S3 requests each end within `timeout`:
    /// the HTTP client's timeout and its retries' budget are `timeout`,
    /// and every single-request call is cut at twice that (one try
    /// started at the end of the budget) with [`StoreError::TimedOut`].
    pub fn open_with_timeout(
        url: &str,
        s3_endpoint: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let mut deadline = None;
        let backend = if let Some(dir) = url.strip_prefix("file://") {
            let root = PathBuf::from(dir);
            std::fs::create_dir_all(&root)?;
            let fs = LocalFileSystem::new_with_prefix(&root)?;
            Backend::File { root, fs }
        } else if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(StoreError::Url(url.to_string()));
            }
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(RetryConfig {
                    max_retries: 3,
                    retry_timeout: timeout,
                    ..RetryConfig::default()
                })
                .with_client_options(
                    ClientOptions::new()
                        .with_connect_timeout(timeout.min(Duration::from_secs(5)))
                        .with_timeout(timeout),
                );
            deadline = Some(timeout * 2);
            if let Some(endpoint) = s3_endpoint {
                builder = builder
                    .with_endpoint(endpoint)
                    .with_allow_http(endpoint.starts_with("http://"))
                    .with_virtual_hosted_style_request(false);
            }
            let region = builder
                .get_config_value(&AmazonS3ConfigKey::Region)
                .unwrap_or_else(|| "us-east-1".to_string());
            let bucket_url = match s3_endpoint {
                Some(endpoint) => format!("{}/{bucket}", endpoint.trim_end_matches('/')),
                None => format!("https://{bucket}.s3.{region}.amazonaws.com"),
            };
            Backend::S3 {
                s3: Arc::new(builder.build()?),
                prefix: prefix.trim_matches('/').to_string(),
                bucket_url,
                region,
                http: reqwest::Client::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .timeout(Duration::from_secs(60))
                    .build()
                    .map_err(|e| StoreError::Url(format!("{url}: {e}")))?,
            }
        } else {
            return Err(StoreError::Url(url.to_string()));
        };
        Ok(ObjectStore {
            backend: Arc::new(backend),
            metrics: StoreMetrics::new(),
            describe: url.into(),
            deadline,
        })
    }

    /// `file://<data_dir>`: the default.
    pub fn default_url(data_dir: &FsPath) -> String {
        format!("file://{}", data_dir.display())
    }

    /// `file` or `s3`.
    pub fn kind(&self) -> &'static str {
        match &*self.backend {
            Backend::File { .. } => "file",
            Backend::S3 { .. } => "s3",
        }
    }

    pub fn url(&self) -> &str {
        &self.describe
    }

    pub fn metrics(&self) -> &StoreMetrics {
        &self.metrics
    }

    fn path(&self, key: &str) -> Path {
        match &*self.backend {
            Backend::S3 { prefix, .. } if !prefix.is_empty() => {
                Path::from(format!("{prefix}/{key}"))
            }
            _ => Path::from(key),
        }
    }

    /// Times `op`, counting its outcome in the metrics.
    async fn timed<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let out = fut.await;
        self.metrics.observe(op, started.elapsed(), out.is_ok());
        out
    }

    /// [`ObjectStore::timed`] for a call that is one request: cut at the
    /// store's deadline.
    async fn timed_request<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let deadline = self.deadline;
        self.timed(op, within(deadline, op, fut)).await
    }

    /// Starts writing `key`; nothing is visible under it until
    /// [`Upload::finish`].
    pub async fn begin_upload(&self, key: &str) -> Result<Upload, StoreError> {
        let sink = match &*self.backend {
            Backend::File { root, .. } => {
                let dest = root.join(key);
                if let Some(dir) = dest.parent() {
                    tokio::fs::create_dir_all(dir).await?;
                }
                let tmp = tmp_name(&dest);
                let file = tokio::fs::File::create(&tmp).await?;
                Sink::File { file, tmp, dest }
            }
            Backend::S3 { s3, .. } => {
                let path = self.path(key);
                let id = self
                    .timed_request("create_upload", async {
                        Ok(s3.create_multipart(&path).await?)
                    })
                    .await?;
                Sink::S3 {
                    s3: s3.clone(),
                    path,
                    id,
                    in_flight: FuturesOrdered::new(),
                    parts: Vec::new(),
                }
            }
        };
        Ok(Upload {
            store: self.clone(),
            key: key.to_string(),
            sink,
            buffer: BytesMut::new(),
            hasher: Sha256::new(),
            blocks: BlockHasher::default(),
            bytes: 0,
        })
    }

    /// Aborts an S3 upload left open (by a crash, or a failure whose abort
    /// did not reach the service). Unknown ids are not an error.
    pub async fn abort_upload(&self, key: &str, upload_id: &str) -> Result<(), StoreError> {
        if let Backend::S3 { s3, .. } = &*self.backend {
            let path = self.path(key);
            let id = upload_id.to_string();
            let out = self
                .timed_request("abort_upload", async {
                    Ok(s3.abort_multipart(&path, &id).await?)
                })
                .await;
            match out {
                Err(StoreError::Backend(object_store::Error::NotFound { .. })) => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// Bytes `range` of `key`.
    pub async fn read_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, StoreError> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let path = self.path(key);
        let len = range.end - range.start;
        let out = self
            .timed_request("get", async {
                let store = self.dyn_store();
                store
                    .get_range(&path, range)
                    .await
                    .map_err(|e| not_found(e, key))
            })
            .await?;
        self.metrics.read_bytes.inc_by(len);
        Ok(out)
    }

    /// The size of `key` in bytes.
    pub async fn size(&self, key: &str) -> Result<u64, StoreError> {
        let path = self.path(key);
        self.timed_request("head", async {
            let meta = self
                .dyn_store()
                .head(&path)
                .await
                .map_err(|e| not_found(e, key))?;
            Ok(meta.size)
        })
        .await
    }

    /// Deletes `key` (a missing one is not an error).
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let path = self.path(key);
        self.timed_request("delete", async {
            match self.dyn_store().delete(&path).await {
                Err(object_store::Error::NotFound { .. }) | Ok(()) => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    /// Deletes every object under `prefix` (a snapshot's or a run's keys);
    /// returns how many.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let base = self.path(prefix.trim_end_matches('/'));
        self.timed("delete", async {
            let store = self.dyn_store();
            let found: Vec<Path> = store
                .list(Some(&base))
                .map_ok(|m| m.location)
                .try_collect()
                .await?;
            let n = found.len() as u64;
            for location in found {
                match store.delete(&location).await {
                    Err(object_store::Error::NotFound { .. }) | Ok(()) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(n)
        })
        .await
    }

    /// Keys under `prefix` with their sizes.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let base = self.path(prefix.trim_end_matches('/'));
        let strip = match &*self.backend {
            Backend::S3 { prefix, .. } if !prefix.is_empty() => prefix.len() + 1,
            _ => 0,
        };
        self.timed("list", async {
            let metas: Vec<_> = self.dyn_store().list(Some(&base)).try_collect().await?;
            Ok(metas
                .into_iter()
                .map(|m| (m.location.as_ref()[strip..].to_string(), m.size))
                .collect())
        })
        .await
    }

    /// The file behind `key` when the store is a directory (readers then
    /// use the file itself: `pread`, `mmap`); `None` for S3.
    pub fn local_path(&self, key: &str) -> Option<PathBuf> {
        match &*self.backend {
            Backend::File { root, .. } => Some(root.join(key)),
            Backend::S3 { .. } => None,
        }
    }

    /// Stores the local file `src` under `key` and removes `src`: a rename
    /// when the store is a directory on the same filesystem, else a
    /// streamed upload (the file is read a part at a time). `on_open`
    /// hears the S3 upload id (`known_sha256` spares a rename re-reading
    /// the file) as soon as it exists, for the caller to
    /// record until this returns.
    pub async fn put_file(
        &self,
        key: &str,
        src: &FsPath,
        known_sha256: Option<&str>,
        on_open: impl AsyncFnOnce(&str) -> Result<(), StoreError>,
    ) -> Result<Uploaded, StoreError> {
        if let Some(dest) = self.local_path(key) {
            if let Some(dir) = dest.parent() {
                tokio::fs::create_dir_all(dir).await?;
            }
            if tokio::fs::rename(src, &dest).await.is_ok() {
                let bytes = tokio::fs::metadata(&dest).await?.len();
                let (sha256, blocks) = match known_sha256 {
                    Some(sha) => (sha.to_string(), None),
                    None => {
                        let path = dest.clone();
                        let (sha, blocks) = tokio::task::spawn_blocking(move || hashes_of(&path))
                            .await
                            .map_err(|e| StoreError::Io(std::io::Error::other(e)))??;
                        (sha, Some(blocks))
                    }
                };
                if let Some(dir) = dest.parent() {
                    tokio::fs::File::open(dir).await?.sync_all().await?;
                }
                self.metrics.written_bytes.inc_by(bytes);
                return Ok(Uploaded {
                    key: key.to_string(),
                    bytes,
                    sha256,
                    blocks,
                });
            }
        }
        let mut upload = self.begin_upload(key).await?;
        if let Some(id) = upload.id() {
            let id = id.to_string();
            if let Err(e) = on_open(&id).await {
                let _ = upload.abort().await;
                return Err(e);
            }
        }
        let copied = async {
            let mut file = tokio::fs::File::open(src).await?;
            let mut buf = vec![0u8; PART_BYTES];
            loop {
                let n = tokio::io::AsyncReadExt::read(&mut file, &mut buf).await?;
                if n == 0 {
                    return Ok::<(), StoreError>(());
                }
                upload.write(&buf[..n]).await?;
            }
        }
        .await;
        if let Err(e) = copied {
            let _ = upload.abort().await;
            return Err(e);
        }
        let done = upload.finish().await?;
        let _ = tokio::fs::remove_file(src).await;
        Ok(done)
    }

    /// The multipart uploads under `prefix` that are neither completed nor
    /// aborted, as `(key, upload id)` (S3's `ListMultipartUploads`; a
    /// directory has none). Unlike ids recorded by the caller, this also
    /// finds an upload whose process died before it could record the id.
    pub async fn open_uploads(&self, prefix: &str) -> Result<Vec<(String, String)>, StoreError> {
        let Backend::S3 {
            s3,
            prefix: root,
            bucket_url,
            region,
            http,
        } = &*self.backend
        else {
            return Ok(Vec::new());
        };
        let full = self.path(prefix.trim_end_matches('/')).to_string();
        let strip = if root.is_empty() { 0 } else { root.len() + 1 };
        let mut found = Vec::new();
        let mut markers: Option<(String, String)> = None;
        loop {
            let mut url = url::Url::parse(&format!("{bucket_url}/"))
                .map_err(|e| StoreError::Url(format!("{bucket_url}: {e}")))?;
            {
                let mut q = url.query_pairs_mut();
                q.append_pair("prefix", &full);
                q.append_pair("uploads", "");
                if let Some((key, id)) = &markers {
                    q.append_pair("key-marker", key);
                    q.append_pair("upload-id-marker", id);
                }
            }
            let credential = s3.credentials().get_credential().await?;
            let mut request = http::Request::builder()
                .method("GET")
                .uri(url.as_str())
                .body(object_store::client::HttpRequestBody::empty())
                .map_err(|e| StoreError::Url(e.to_string()))?;
            AwsAuthorizer::new(&credential, "s3", region).authorize(&mut request, None);
            let body = self
                .timed("list_uploads", async {
                    let answer = http
                        .get(url.as_str())
                        .headers(request.headers().clone())
                        .send()
                        .await
                        .map_err(|e| StoreError::Io(std::io::Error::other(e)))?;
                    let status = answer.status();
                    let text = answer
                        .text()
                        .await
                        .map_err(|e| StoreError::Io(std::io::Error::other(e)))?;
                    if !status.is_success() {
                        return Err(StoreError::Io(std::io::Error::other(format!(
                            "listing multipart uploads: {status}: {text}"
                        ))));
                    }
                    Ok(text)
                })
                .await?;
            for upload in xml_blocks(&body, "Upload") {
                if let (Some(key), Some(id)) =
                    (xml_text(upload, "Key"), xml_text(upload, "UploadId"))
                {
                    if key.len() >= strip {
                        found.push((key[strip..].to_string(), id));
                    }
                }
            }
            let truncated = xml_text(&body, "IsTruncated").is_some_and(|t| t == "true");
            match (
                truncated,
                xml_text(&body, "NextKeyMarker"),
                xml_text(&body, "NextUploadIdMarker"),
            ) {
                (true, Some(key), Some(id))
                    if markers.as_ref() != Some(&(key.clone(), id.clone())) =>
                {
                    markers = Some((key, id))
                }
                _ => return Ok(found),
            }
        }
    }

    /// A cheap request that needs the service: listing one key.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let base = self.path("");
        self.timed_request("ping", async {
            let mut listing = self.dyn_store().list(Some(&base));
            if let Some(item) = listing.next().await {
                item?;
            }
            Ok(())
        })
        .await
    }

    fn dyn_store(&self) -> &dyn object_store::ObjectStore {
        match &*self.backend {
            Backend::File { fs, .. } => fs,
            Backend::S3 { s3, .. } => s3.as_ref(),
        }
    }
}

fn not_found(e: object_store::Error, key: &str) -> StoreError {
    match e {
        object_store::Error::NotFound { .. } => StoreError::NotFound(key.to_string()),
        other => other.into(),
    }
}

/// The contents of every `<tag>…</tag>` in `xml` (S3's answers are flat
/// enough that no XML parser is needed for the fields read here).
fn xml_blocks<'a>(xml: &'a str, tag: &str) -> Vec<&'a str> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let after = &rest[start + open.len()..];
        let Some(end) = after.find(&close) else { break };
        out.push(&after[..end]);
        rest = &after[end + close.len()..];
    }
    out
}

/// The unescaped text of the first `<tag>` in `xml`.
fn xml_text(xml: &str, tag: &str) -> Option<String> {
    let raw = xml_blocks(xml, tag).into_iter().next()?;
    Some(
        raw.replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&amp;", "&"),
    )
}

/// The sha256 and block checksums of a file, in one pass.
fn hashes_of(path: &FsPath) -> std::io::Result<(String, BlockSums)> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut blocks = BlockHasher::default();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        blocks.update(&buf[..n]);
    }
    Ok((hex::encode(hasher.finalize()), blocks.finish()))
}

/// Marks a file being written by an upload (removed at start when left).
pub const TMP_MARK: &str = ".tmp-";

fn tmp_name(dest: &FsPath) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(format!("{TMP_MARK}{:08x}", rand::random::<u32>()));
    dest.with_file_name(name)
}

type PartFuture = futures::future::BoxFuture<'static, Result<PartId, StoreError>>;

/// `fut`, failed with [`StoreError::TimedOut`] when `deadline` passes first
/// (no deadline: as it is).
async fn within<T>(
    deadline: Option<Duration>,
    op: &'static str,
    fut: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let Some(deadline) = deadline else {
        return fut.await;
    };
    match tokio::time::timeout(deadline, fut).await {
        Ok(out) => out,
        Err(_) => Err(StoreError::TimedOut {
            op,
            secs: deadline.as_secs_f64(),
        }),
    }
}

enum Sink {
    File {
        file: tokio::fs::File,
        tmp: PathBuf,
        dest: PathBuf,
    },
    S3 {
        s3: Arc<AmazonS3>,
        path: Path,
        id: String,
        in_flight: FuturesOrdered<PartFuture>,
        parts: Vec<PartId>,
    },
}

/// An object being written. Dropping it without [`Upload::finish`] or
/// [`Upload::abort`] leaves an S3 upload open (and a temporary file):
/// the recorded id lets the next start abort it.
pub struct Upload {
    store: ObjectStore,
    key: String,
    sink: Sink,
    buffer: BytesMut,
    hasher: Sha256,
    blocks: BlockHasher,
    bytes: u64,
}

impl Upload {
    /// The S3 upload id (`None` for files), to record until finished.
    pub fn id(&self) -> Option<&str> {
        match &self.sink {
            Sink::S3 { id, .. } => Some(id),
            Sink::File { .. } => None,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Appends `data`. S3 parts go out as the buffer fills; this waits
    /// while [`PARTS_IN_FLIGHT`] are uploading.
    pub async fn write(&mut self, data: &[u8]) -> Result<(), StoreError> {
        self.hasher.update(data);
        self.blocks.update(data);
        self.bytes += data.len() as u64;
        match &mut self.sink {
            Sink::File { file, .. } => {
                file.write_all(data).await?;
                Ok(())
            }
            Sink::S3 { .. } => {
                let mut rest = data;
                while !rest.is_empty() {
                    let room = PART_BYTES - self.buffer.len();
                    let take = room.min(rest.len());
                    self.buffer.extend_from_slice(&rest[..take]);
                    rest = &rest[take..];
                    if self.buffer.len() == PART_BYTES {
                        self.send_part().await?;
                    }
                }
                Ok(())
            }
        }
    }

    async fn send_part(&mut self) -> Result<(), StoreError> {
        let part = self.buffer.split().freeze();
        let Sink::S3 {
            s3,
            path,
            id,
            in_flight,
            parts,
        } = &mut self.sink
        else {
            return Ok(());
        };
        while in_flight.len() >= PARTS_IN_FLIGHT {
            if let Some(done) = in_flight.next().await {
                parts.push(done?);
            }
        }
        let index = parts.len() + in_flight.len();
        let (s3, path, id) = (s3.clone(), path.clone(), id.clone());
        let metrics = self.store.metrics.clone();
        let deadline = self.store.deadline;
        let len = part.len() as u64;
        in_flight.push_back(Box::pin(async move {
            let started = Instant::now();
            let put = async {
                Ok(s3
                    .put_part(&path, &id, index, PutPayload::from(part))
                    .await?)
            };
            let out = within(deadline, "put_part", put).await;
            metrics.observe("put_part", started.elapsed(), out.is_ok());
            if out.is_ok() {
                metrics.written_bytes.inc_by(len);
            }
            out
        }));
        Ok(())
    }

    /// Completes the object; returns its size, sha256 and block checksums.
    /// On an error the upload is aborted before the error is returned.
    pub async fn finish(mut self) -> Result<Uploaded, StoreError> {
        match self.complete().await {
            Ok(()) => Ok(Uploaded {
                key: self.key.clone(),
                bytes: self.bytes,
                sha256: hex::encode(self.hasher.clone().finalize()),
                blocks: Some(self.blocks.clone().finish()),
            }),
            Err(e) => {
                let _ = self.abort_inner().await;
                Err(e)
            }
        }
    }

    async fn complete(&mut self) -> Result<(), StoreError> {
        if matches!(self.sink, Sink::S3 { .. }) && (!self.buffer.is_empty() || self.bytes == 0) {
            self.send_part().await?;
        }
        let store = self.store.clone();
        match &mut self.sink {
            Sink::File { file, tmp, dest } => {
                let started = Instant::now();
                file.flush().await?;
                file.sync_all().await?;
                tokio::fs::rename(&*tmp, &*dest).await?;
                if let Some(dir) = dest.parent() {
                    tokio::fs::File::open(dir).await?.sync_all().await?;
                }
                store.metrics.observe("put", started.elapsed(), true);
                store.metrics.written_bytes.inc_by(self.bytes);
                Ok(())
            }
            Sink::S3 {
                s3,
                path,
                id,
                in_flight,
                parts,
            } => {
                while let Some(done) = in_flight.next().await {
                    parts.push(done?);
                }
                let parts = std::mem::take(parts);
                store
                    .timed_request("complete_upload", async {
                        Ok(s3.complete_multipart(path, id, parts).await?)
                    })
                    .await?;
                Ok(())
            }
        }
    }

    /// Gives the upload up: the S3 upload is aborted, the file removed.
    pub async fn abort(mut self) -> Result<(), StoreError> {
        self.abort_inner().await
    }

    async fn abort_inner(&mut self) -> Result<(), StoreError> {
        match &mut self.sink {
            Sink::File { tmp, .. } => match tokio::fs::remove_file(&*tmp).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
                _ => Ok(()),
            },
            Sink::S3 { in_flight, .. } => {
                // Parts still sending would land after the abort.
                while in_flight.next().await.is_some() {}
                let id = self.id().unwrap_or_default().to_string();
                self.store.abort_upload(&self.key, &id).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_past_its_deadline_fails_as_an_outage() {
        let hung = std::future::pending::<Result<(), StoreError>>();
        let err = within(Some(Duration::from_millis(20)), "put_part", hung)
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::TimedOut { op: "put_part", .. }));
        assert!(err.is_unavailable(), "{err}");
        let quick = async { Ok::<_, StoreError>(7) };
        assert_eq!(within(None, "get", quick).await.unwrap(), 7);
    }
}
