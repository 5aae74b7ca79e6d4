//! What the tests of `tinygpt serve` share (tests/serve.rs, tests/serve_hostile.rs):
//! a tiny trained model, the real server on a free loopback port, a plain HTTP client.
//! Included by path (`#[path = "common/server.rs"] mod server;`), so the other test
//! crates that use `common` do not build it.
#![allow(dead_code)] // each test crate uses some of these

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::common::succeeds;

/// A folder with a tiny trained char model in checkpoints/exp.
pub fn trained() -> tempfile::TempDir {
    let text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\nThe slings and arrows of outrageous fortune,\nUser: Who is there?\n\nAssistant: Nay, answer me.\n\n".repeat(60);
    let dir = super::common::char_experiment(
        &text,
        "n_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32",
        "batch_size = 8\nmax_iters = 40\nwarmup_iters = 2\neval_interval = 20\neval_iters = 1\ncheckpoint_interval = 20",
    );
    succeeds(dir.path(), &["train", "--config", "exp.toml"]);
    dir
}

/// The server, started on a free port; killed when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    pub fn start(dir: &Path, extra: &[&str]) -> Server {
        Self::start_with(dir, extra, &[])
    }

    pub fn start_with(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
            .args(["serve", "--checkpoint", "checkpoints/exp", "--port", "0"])
            .args(extra)
            .envs(env.iter().copied())
            .current_dir(dir)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let log_w = std::sync::Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log_w.lock().unwrap().push_str(&format!("{line}\n"));
                if let Some(at) = line.find("at http://") {
                    let url = line[at + 3..].split_whitespace().next().unwrap();
                    let _ = tx.send(url.trim_end_matches('/').to_string());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| {
                panic!("the server said where it listens: {}", log.lock().unwrap())
            });
        Server { child, base, log }
    }

    /// host:port, for raw sockets.
    pub fn address(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// The server's resident memory, in KiB (Linux's /proc/PID/status VmRSS).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the server runs (on Linux)");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    #[cfg(unix)]
    pub fn signal(&self, signal: i32) {
        // Safety: sends a signal to our own child process.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Waits for the exit; its code (128 + signal for a polite stop).
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let started = Instant::now();
        while started.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::new_with_config(
        ureq::config::Config::builder()
            .http_status_as_error(false)
            .build(),
    )
}

/// POSTs JSON text; (status, body as JSON).
pub fn post(url: &str, body: &str) -> (u16, Value) {
    post_with(url, body, &[])
}

pub fn post_with(url: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut request = agent().post(url).header("content-type", "application/json");
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let mut response = request.send(body).unwrap();
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn get(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut request = agent().get(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let mut response = request.call().unwrap();
    let status = response.status().as_u16();
    (status, response.body_mut().read_to_string().unwrap())
}

/// The row of run `name` in a `/api/runs` answer (the test fails where it is not
/// listed).
pub fn run_row(listed: &Value, name: &str) -> Value {
    listed["runs"]
        .as_array()
        .expect("a list of runs")
        .iter()
        .find(|r| r["run"] == name)
        .unwrap_or_else(|| panic!("{name} is listed: {listed}"))
        .clone()
}
