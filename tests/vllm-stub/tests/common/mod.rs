//! What the stub's process tests share: temporary directories, the binary as `python3`, and a
//! stub process whose log lines are collected.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

/// The stub binary.
pub const STUB: &str = env!("CARGO_BIN_EXE_vllm-stub");

/// A directory of the test (its path as `realpath` gives it, as huggingface_hub returns paths),
/// removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("vllm-stub-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(std::fs::canonicalize(&d).unwrap())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `python3` as the image has it: the stub binary under that name, in `dir/bin`.
pub fn python3(dir: &Path) -> PathBuf {
    let link = dir.join("bin/python3");
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(STUB, &link).unwrap();
    link
}

/// A stub process serving `--served-model-name=stub-svc` on a free loopback port, its stdout
/// lines collected; killed when dropped.
pub struct Process {
    pub child: Child,
    pub log: Arc<Mutex<Vec<String>>>,
    pub port: u16,
}

impl Process {
    /// Starts the stub with `--model=<model>` and `args`, without the caller's hub and LoRA
    /// resolver variables, with `envs` set and a 1 ms token delay.
    pub fn start<V: AsRef<OsStr>>(model: &str, args: &[&str], envs: &[(&str, V)]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut cmd = Command::new(STUB);
        cmd.args([
            &format!("--model={model}"),
            "--served-model-name=stub-svc",
            "--host=127.0.0.1",
            &format!("--port={port}"),
        ])
        .args(args)
        .env_remove("HF_HOME")
        .env_remove("HF_HUB_CACHE")
        .env_remove("MODELSCOPE_CACHE")
        .env_remove("VLLM_PLUGINS")
        .env_remove("VLLM_LORA_RESOLVER_CACHE_DIR")
        .env("STUB_TOKEN_DELAY", "1ms")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Self { child, log, port }
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
