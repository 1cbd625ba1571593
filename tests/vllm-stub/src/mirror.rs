//! The hub over HTTP: a mirror serving the stub's hub ([`crate::hub`]) in the Hugging Face
//! Hub's HTTP API, and the client the stub's `snapshot_download` uses when `HF_ENDPOINT` names
//! one, as `huggingface_hub` does.
//!
//! The API, as `huggingface_hub` calls it (`HfApi.model_info`, `hf_hub_download`):
//!
//! | request | answer |
//! |---|---|
//! | `GET /api/models/{org}/{name}/revision/{revision}` (also without `/revision/...`: `main`) | `{"id", "modelId", "sha", "siblings": [{"rfilename"}], "private": false}`; `404` with `X-Error-Code: RepoNotFound` or `RevisionNotFound` |
//! | `GET` or `HEAD /{org}/{name}/resolve/{revision}/{file}` | the file, `ETag` (its SHA-256, quoted), `X-Repo-Commit` (the revision), `Content-Length`; `404` with `X-Error-Code: EntryNotFound` |
//! | `GET /mirror/requests` | the mirror's own: every request it answered so far, `["GET /api/... 200", ...]`, so a test can tell what went through it |
//!
//! `vllm-stub hub-mirror [--port 8080]` runs the mirror; the client speaks plain HTTP only (the
//! test network's mirror), and a `HF_ENDPOINT` it cannot reach fails the download, never
//! falling back to the built-in hub.

use std::{
    io::{Read, Write},
    net::{TcpStream, ToSocketAddrs},
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderValue, Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
};

use crate::hub::{self, HubError, RepoFile};

/// How long the client waits to connect, and for each read.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The requests a mirror answered, in order (`"GET /path 200"`).
#[derive(Clone, Default)]
pub struct Served(Arc<Mutex<Vec<String>>>);

impl Served {
    fn push(&self, line: String) {
        if let Ok(mut v) = self.0.lock() {
            v.push(line);
        }
    }

    fn list(&self) -> Vec<String> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

/// The mirror's routes ([module docs](self)).
pub fn router(served: Served) -> Router {
    Router::new().fallback(answer).with_state(served)
}

/// Serves the mirror on `port` of every address until the process is stopped.
///
/// # Errors
/// The port cannot be bound.
pub async fn serve(port: u16) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(("0.0.0.0", port)).await?;
    tracing::info!(port, "hub mirror serving the stub's hub");
    axum::serve(listener, router(Served::default())).await
}

async fn answer(State(served): State<Served>, method: Method, uri: Uri) -> Response {
    let path = uri.path().to_owned();
    let resp = route(&served, &method, &path);
    let line = format!("{method} {path} {}", resp.status().as_u16());
    tracing::info!(request = %line, "hub mirror");
    if path != "/mirror/requests" {
        served.push(line);
    }
    resp
}

fn not_found(code: &'static str, message: String) -> Response {
    let mut r = (
        StatusCode::NOT_FOUND,
        axum::Json(serde_json::json!({ "error": message })),
    )
        .into_response();
    r.headers_mut()
        .insert("x-error-code", HeaderValue::from_static(code));
    r
}

/// The repository `repo` at `revision` (`main` or its commit), or the mirror's `404` (its
/// `X-Error-Code` and message).
fn repository(
    repo: &str,
    revision: &str,
) -> Result<(Vec<RepoFile>, String), (&'static str, String)> {
    if !crate::model::is_repo_id(repo) || !repo.contains('/') {
        return Err(("RepoNotFound", format!("Repository {repo:?} not found")));
    }
    let files = hub::repo_files(repo);
    let sha = hub::revision(&files);
    if revision != "main" && revision != sha {
        return Err(("RevisionNotFound", format!("Invalid rev id: {revision}")));
    }
    Ok((files, sha))
}

fn route(served: &Served, method: &Method, path: &str) -> Response {
    if path == "/mirror/requests" {
        return axum::Json(served.list()).into_response();
    }
    if let Some(rest) = path.strip_prefix("/api/models/") {
        if method != Method::GET {
            return StatusCode::METHOD_NOT_ALLOWED.into_response();
        }
        let (repo, revision) = rest.split_once("/revision/").unwrap_or((rest, "main"));
        return match repository(repo, revision) {
            Ok((files, sha)) => axum::Json(serde_json::json!({
                "id": repo,
                "modelId": repo,
                "sha": sha,
                "private": false,
                "siblings": files.iter().map(|f| serde_json::json!({"rfilename": f.name})).collect::<Vec<_>>(),
            }))
            .into_response(),
            Err((code, message)) => not_found(code, message),
        };
    }
    let Some((repo, rest)) = path.trim_start_matches('/').split_once("/resolve/") else {
        return not_found("RepoNotFound", format!("no route {path}"));
    };
    if method != Method::GET && method != Method::HEAD {
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    let Some((revision, file)) = rest.split_once('/') else {
        return not_found("EntryNotFound", format!("no file in {path}"));
    };
    let (files, sha) = match repository(repo, revision) {
        Ok(r) => r,
        Err((code, message)) => return not_found(code, message),
    };
    let Some(f) = files.into_iter().find(|f| f.name == file) else {
        return not_found(
            "EntryNotFound",
            format!("{file} does not exist in {repo} at {sha}"),
        );
    };
    let etag = format!("\"{}\"", crate::sha256::hex(&f.content));
    let len = f.content.len();
    let body = if method == Method::HEAD {
        Body::empty()
    } else {
        Body::from(f.content)
    };
    let mut r = Response::new(body);
    let h = r.headers_mut();
    for (name, value) in [
        (header::ETAG.as_str(), etag),
        ("x-repo-commit", sha),
        (header::CONTENT_LENGTH.as_str(), len.to_string()),
        (
            header::CONTENT_TYPE.as_str(),
            "application/octet-stream".to_owned(),
        ),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
    r
}

/// `snapshot_download`'s view of repository `repo` at `revision` (`None`: `main`) on the hub at
/// `endpoint` (`HF_ENDPOINT`): its files and commit, read with the API's model info and one
/// `resolve` download per file.
///
/// # Errors
/// [`HubError::Http`]: the endpoint cannot be reached, or answers other than `200` (its
/// `X-Error-Code` named, as `huggingface_hub` names `RepositoryNotFoundError` and the others).
pub fn fetch(
    endpoint: &str,
    repo: &str,
    revision: Option<&str>,
) -> Result<(Vec<RepoFile>, String), HubError> {
    let base = endpoint.trim_end_matches('/');
    let rev = revision.unwrap_or("main");
    let info_url = format!("{base}/api/models/{repo}/revision/{rev}");
    let info = get(&info_url)?;
    let info: serde_json::Value = serde_json::from_slice(&info).map_err(|e| HubError::Http {
        url: info_url.clone(),
        message: format!("the model info is not JSON: {e}"),
    })?;
    let sha = info["sha"]
        .as_str()
        .ok_or_else(|| HubError::Http {
            url: info_url.clone(),
            message: "the model info has no sha".to_owned(),
        })?
        .to_owned();
    let mut files = Vec::new();
    for s in info["siblings"].as_array().into_iter().flatten() {
        let Some(name) = s["rfilename"].as_str() else {
            continue;
        };
        let content = get(&format!("{base}/{repo}/resolve/{sha}/{name}"))?;
        files.push(RepoFile {
            name: name.to_owned(),
            content,
        });
    }
    Ok((files, sha))
}

/// A plain-HTTP `GET` of `url`: the body of a `200`.
fn get(url: &str) -> Result<Vec<u8>, HubError> {
    let err = |message: String| HubError::Http {
        url: url.to_owned(),
        message,
    };
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        err("only http:// endpoints are supported by the stub's hub client".to_owned())
    })?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let path = if path.is_empty() { "/" } else { path };
    // A port after the host (after the `]` of an IPv6 literal), else 80.
    let has_port = authority
        .rsplit_once(']')
        .map_or(authority, |(_, rest)| rest)
        .contains(':');
    let addr = if has_port {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let sockets: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| err(format!("ConnectionError: cannot resolve {authority}: {e}")))?
        .collect();
    // Every address in turn, as a client library does (`localhost` may be ::1 first).
    let mut last = err(format!("ConnectionError: {authority} has no address"));
    let mut connected = None;
    for socket in sockets {
        match TcpStream::connect_timeout(&socket, CLIENT_TIMEOUT) {
            Ok(c) => {
                connected = Some(c);
                break;
            }
            Err(e) => last = err(format!("ConnectionError: {e}")),
        }
    }
    let mut conn = connected.ok_or(last)?;
    conn.set_read_timeout(Some(CLIENT_TIMEOUT))
        .map_err(|e| err(e.to_string()))?;
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: huggingface_hub/vllm-stub\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| err(format!("ConnectionError: {e}")))?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw)
        .map_err(|e| err(format!("ReadTimeout or reset: {e}")))?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| err("the answer has no header section".to_owned()))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let body = &raw[split + 4..];
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| err(format!("not an HTTP answer: {head:?}")))?;
    let field = |name: &str| {
        head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    };
    let body = if field("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(body).ok_or_else(|| err("a broken chunked body".to_owned()))?
    } else {
        match field("content-length").and_then(|v| v.parse::<usize>().ok()) {
            Some(n) if n <= body.len() => body[..n].to_vec(),
            Some(n) => return Err(err(format!("{} of {n} bytes arrived", body.len()))),
            None => body.to_vec(),
        }
    };
    if status != 200 {
        let code = field("x-error-code").unwrap_or_else(|| "HfHubHTTPError".to_owned());
        return Err(err(format!(
            "{code}: {status} {}",
            String::from_utf8_lossy(&body)
        )));
    }
    Ok(body)
}

/// A chunked body decoded (RFC 9112 §7.1; extensions and trailers skipped).
fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size_field = std::str::from_utf8(&raw[..line_end]).ok()?;
        let size = usize::from_str_radix(size_field.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(..size)?);
        raw = raw.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_client_reads_the_mirror_as_the_hub_library_would() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = Served::default();
        tokio::spawn(axum::serve(listener, router(served.clone())).into_future());
        let endpoint = format!("http://127.0.0.1:{port}");
        let (files, sha) = tokio::task::spawn_blocking({
            let endpoint = endpoint.clone();
            move || fetch(&endpoint, "hearth/mirror-model", None)
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(files, hub::repo_files("hearth/mirror-model"));
        assert_eq!(sha, hub::revision(&files));
        let lines = served.list();
        assert_eq!(
            lines[0],
            "GET /api/models/hearth/mirror-model/revision/main 200"
        );
        assert_eq!(lines.len(), 1 + files.len(), "{lines:?}");
        // Named errors: an unknown revision, a closed port.
        let e = tokio::task::spawn_blocking({
            let endpoint = endpoint.clone();
            move || fetch(&endpoint, "hearth/mirror-model", Some("v9"))
        })
        .await
        .unwrap()
        .unwrap_err();
        assert!(e.to_string().contains("RevisionNotFound"), "{e}");
        let e = fetch("http://127.0.0.1:9", "hearth/mirror-model", None).unwrap_err();
        assert!(e.to_string().contains("ConnectionError"), "{e}");
        let e = fetch("https://huggingface.co", "hearth/mirror-model", None).unwrap_err();
        assert!(e.to_string().contains("only http://"), "{e}");
    }

    #[test]
    fn chunked_bodies_decode() {
        assert_eq!(
            dechunk(b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n").as_deref(),
            Some(&b"abcde"[..])
        );
        assert_eq!(dechunk(b"5\r\nab"), None);
    }
}
