//! The real `polyak` binary on a free loopback port, for integration tests.

#![allow(dead_code)]

pub mod s3;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TestServer {
    child: Option<Child>,
    pub url: String,
    pub data_dir: PathBuf,
    args: Vec<String>,
}

impl TestServer {
    pub fn start(data_dir: &Path, args: &[&str]) -> Self {
        let mut server = TestServer {
            child: None,
            url: String::new(),
            data_dir: data_dir.to_path_buf(),
            args: args.iter().map(|s| s.to_string()).collect(),
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_polyak"))
            .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
            .arg(&self.data_dir)
            .args(&self.args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start polyak");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(url) = line.strip_prefix("polyak listening on ") {
                        self.url = url.trim().to_string();
                        break;
                    }
                }
                _ => break,
            }
        }
        assert!(!self.url.is_empty(), "polyak did not print its address");
        self.child = Some(child);
    }

    /// SIGTERM and wait: a graceful stop.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: signalling our own child by its pid.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub fn client(&self) -> reqwest::blocking::Client {
        reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client")
    }

    pub fn get(&self, path: &str) -> reqwest::blocking::Response {
        self.client()
            .get(format!("{}{path}", self.url))
            .send()
            .expect("GET")
    }

    pub fn post_json(&self, path: &str, body: serde_json::Value) -> reqwest::blocking::Response {
        self.client()
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .expect("POST")
    }

    pub fn put(&self, path: &str, body: Vec<u8>) -> reqwest::blocking::Response {
        self.client()
            .put(format!("{}{path}", self.url))
            .body(body)
            .send()
            .expect("PUT")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A safetensors body of f32 tensors, with optional metadata.
pub fn f32_body(tensors: &[(&str, Vec<usize>, Vec<f32>)], metadata: &[(&str, &str)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            (
                name.to_string(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    let meta = if metadata.is_empty() {
        None
    } else {
        Some(
            metadata
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    safetensors::serialize(views, meta).unwrap()
}

/// Reads the f32 tensor `name` from a safetensors file.
pub fn read_f32(file: &[u8], name: &str) -> Vec<f32> {
    let st = safetensors::SafeTensors::deserialize(file).unwrap();
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
