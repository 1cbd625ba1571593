//! The stub as `python3`: the prewarm steps Hearth's controller renders.
//!
//! The controller's prewarm Job runs, in the runtime's image, the hub library vLLM itself uses
//! (controller/src/render/cache.rs, `prewarm_program`):
//!
//! ```text
//! python3 -c 'from huggingface_hub import snapshot_download
//! print(snapshot_download(repo_id="org/name"))'
//! python3 -c 'from modelscope import snapshot_download
//! print(snapshot_download("org/name"))'
//! ```
//!
//! with `HF_HOME=/models/hf` (or `MODELSCOPE_CACHE=/models/modelscope`) on the cache
//! mounted at `/models`; and, for a LoRA adapter, the same call with `local_dir`:
//!
//! ```text
//! python3 -c 'from huggingface_hub import snapshot_download
//! print(snapshot_download(repo_id="org/name-lora", local_dir="/models/adapters/hf/org/name-lora"))'
//! python3 -c 'from modelscope import snapshot_download
//! print(snapshot_download("org/name-lora", local_dir="/models/adapters/modelscope/org/name-lora"))'
//! ```
//!
//! The stub's image has no Python: its binary is also installed as `python3`, and invoked under
//! that name it runs exactly such programs: the import, then `snapshot_download(...)` (optionally
//! inside `print(...)`), with the arguments `repo_id` / `model_id` (or the first positional
//! string), `revision`, `cache_dir` and `local_dir` (string or `None`). It fetches the repository
//! from the stub's hub ([`crate::hub`]: a model, or an adapter when the name contains `lora`) into
//! the layout the hub library writes, prints what the library returns as `print` would, and exits
//! 0; anything else exits 1 with a Python-style error on stderr (2 for a command line other than
//! `-c PROGRAM`).
//!
//! | call | where the files go | printed |
//! |---|---|---|
//! | `huggingface_hub`, no `local_dir` | the cache `cache_dir`, else `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub` ([`hub::download_hf`]) | the snapshot directory |
//! | `huggingface_hub`, `local_dir` | plain files in `local_dir`, metadata in `<local_dir>/.cache/huggingface/`; the cache above gets `refs/main` and is where files already cached are copied from ([`hub::download_hf_local_dir`]) | `os.path.realpath(local_dir)` |
//! | `modelscope`, neither | `$MODELSCOPE_CACHE/models/org/name` (`MODELSCOPE_CACHE` defaults to `~/.cache/modelscope/hub`) | that directory |
//! | `modelscope`, `cache_dir` | `<cache_dir>/org/name` | that directory |
//! | `modelscope`, `local_dir` (`cache_dir` ignored) | plain files in `local_dir` ([`hub::download_modelscope`]) | `os.path.abspath(local_dir)` |
//!
//! Every layout is written file by file through a temporary name and a rename, the config file
//! (`config.json`, `adapter_config.json`) last, and a second run over a complete download fetches
//! nothing; the details are in [`crate::hub`]. `HF_HUB_OFFLINE` is honoured by `huggingface_hub`
//! calls. On stderr the stub says where it writes and lists what it fetched, copied or found
//! complete already, and the warnings the library would log.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::hub;
use crate::model;

/// Which hub library a program imports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// `from huggingface_hub import snapshot_download`.
    HuggingFaceHub,
    /// `from modelscope import snapshot_download`.
    ModelScope,
}

/// The one call a prewarm program makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotDownload {
    pub library: Library,
    pub repo: String,
    pub revision: Option<String>,
    pub cache_dir: Option<String>,
    /// `local_dir`: the directory the files go to instead of a cache.
    pub local_dir: Option<String>,
    /// Whether the result is printed (`print(snapshot_download(...))`).
    pub print: bool,
    /// The program line of the call, for error messages.
    pub line: usize,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Str(String),
    Ident(String),
    Sym(char),
}

fn tokenize(s: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if c == '"' || c == '\'' {
            chars.next();
            let mut v = String::new();
            loop {
                match chars.next() {
                    None => return Err("EOL while scanning string literal".into()),
                    Some(q) if q == c => break,
                    Some('\\') => match chars.next() {
                        Some('n') => v.push('\n'),
                        Some('t') => v.push('\t'),
                        Some(e @ ('\\' | '"' | '\'')) => v.push(e),
                        Some(e) => {
                            v.push('\\');
                            v.push(e);
                        }
                        None => return Err("EOL while scanning string literal".into()),
                    },
                    Some(x) => v.push(x),
                }
            }
            out.push(Tok::Str(v));
        } else if c.is_alphanumeric() || c == '_' || c == '.' {
            let mut v = String::new();
            while let Some(&x) = chars.peek() {
                if x.is_alphanumeric() || x == '_' || x == '.' {
                    v.push(x);
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(Tok::Ident(v));
        } else {
            out.push(Tok::Sym(c));
            chars.next();
        }
    }
    Ok(out)
}

fn ident(t: &Tok) -> Option<&str> {
    match t {
        Tok::Ident(s) => Some(s),
        _ => None,
    }
}

/// Parses a prewarm program (see the module docs).
pub fn parse_program(src: &str) -> Result<SnapshotDownload, String> {
    let mut library = None;
    let mut call = None;
    for (i, raw) in src.split('\n').enumerate() {
        let line = i + 1;
        for stmt in raw.split(';') {
            let stmt = stmt.trim();
            if stmt.is_empty() || stmt.starts_with('#') {
                continue;
            }
            let toks = tokenize(stmt).map_err(|e| format!("line {line}: SyntaxError: {e}"))?;
            let words: Vec<&str> = toks.iter().filter_map(ident).collect();
            if words.len() == toks.len() && words.first() == Some(&"from") {
                library = Some(match words.as_slice() {
                    ["from", "huggingface_hub", "import", "snapshot_download"] => {
                        Library::HuggingFaceHub
                    }
                    ["from", "modelscope", "import", "snapshot_download"]
                    | [
                        "from",
                        "modelscope.hub.snapshot_download",
                        "import",
                        "snapshot_download",
                    ] => Library::ModelScope,
                    _ => {
                        return Err(format!(
                            "line {line}: ModuleNotFoundError: the stub's python3 imports only snapshot_download from huggingface_hub or modelscope, not {stmt:?}"
                        ));
                    }
                });
                continue;
            }
            if call.is_some() {
                return Err(format!(
                    "line {line}: the stub's python3 runs one snapshot_download call, found another statement: {stmt:?}"
                ));
            }
            let lib = library.ok_or_else(|| {
                format!(
                    "line {line}: NameError: {stmt:?} before `from ... import snapshot_download`"
                )
            })?;
            call = Some(parse_call(&toks, lib, line).map_err(|e| format!("line {line}: {e}"))?);
        }
    }
    call.ok_or_else(|| "the program calls no snapshot_download".to_owned())
}

fn parse_call(toks: &[Tok], library: Library, line: usize) -> Result<SnapshotDownload, String> {
    let unsupported = || {
        format!(
            "the stub's python3 runs only `snapshot_download(...)` or `print(snapshot_download(...))`, not {toks:?}"
        )
    };
    let (print, inner) = match toks {
        [Tok::Ident(p), Tok::Sym('('), inner @ .., Tok::Sym(')')] if p == "print" => (true, inner),
        _ => (false, toks),
    };
    let args = match inner {
        [Tok::Ident(f), Tok::Sym('('), args @ .., Tok::Sym(')')] if f == "snapshot_download" => {
            args
        }
        _ => return Err(unsupported()),
    };
    let mut repo = None;
    let mut revision = None;
    let mut cache_dir = None;
    let mut local_dir = None;
    for (n, arg) in args.split(|t| *t == Tok::Sym(',')).enumerate() {
        match arg {
            [] if n > 0 => {} // trailing comma
            [Tok::Str(v)] if n == 0 => repo = Some(v.clone()),
            [Tok::Ident(k), Tok::Sym('='), value] => {
                let value = match value {
                    Tok::Str(v) => Some(v.clone()),
                    Tok::Ident(none) if none == "None" => None,
                    other => return Err(format!("TypeError: {k}={other:?} is not a string")),
                };
                match (k.as_str(), library) {
                    ("repo_id", Library::HuggingFaceHub) | ("model_id", Library::ModelScope) => {
                        repo = value
                    }
                    ("revision", _) => revision = value,
                    ("cache_dir", _) => cache_dir = value,
                    ("local_dir", _) => local_dir = value,
                    ("repo_type", Library::HuggingFaceHub)
                        if value.as_deref().is_none_or(|v| v == "model") => {}
                    _ => {
                        return Err(format!(
                            "TypeError: the stub's snapshot_download() does not take {k}="
                        ));
                    }
                }
            }
            _ => return Err(unsupported()),
        }
    }
    let repo = repo.ok_or_else(|| {
        "TypeError: snapshot_download() missing 1 required positional argument: 'repo_id'"
            .to_owned()
    })?;
    Ok(SnapshotDownload {
        library,
        repo,
        revision,
        cache_dir,
        local_dir,
        print,
        line,
    })
}

fn truthy(v: Option<String>) -> bool {
    v.is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// Runs `python3 <args>` (the arguments after the program name). Returns the exit code.
pub fn python_main(
    args: &[OsString],
    env: &dyn Fn(&str) -> Option<String>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> i32 {
    // Interpreter flags that change nothing here (-u unbuffered, -B no .pyc, ...), then -c.
    let mut rest = args.iter().map(|a| a.to_string_lossy().into_owned());
    let program = loop {
        match rest.next().as_deref() {
            Some("-u" | "-B" | "-s" | "-E" | "-I") => continue,
            Some("-c") => match rest.next() {
                Some(p) => break p,
                None => {
                    let _ = writeln!(err, "Argument expected for the -c option");
                    return 2;
                }
            },
            other => {
                let _ = writeln!(
                    err,
                    "vllm-stub as python3: only `python3 -c PROGRAM` (the prewarm program Hearth renders) is supported, got {:?}",
                    other.unwrap_or("no arguments")
                );
                return 2;
            }
        }
    };
    let fail = |err: &mut dyn Write, line: usize, msg: &str| {
        let _ = writeln!(
            err,
            "Traceback (most recent call last):\n  File \"<string>\", line {line}, in <module>\n{msg}"
        );
        1
    };
    // A program of nothing but blank lines and comments does nothing, as in Python: the
    // controller's image pre-pull runs `python3 -c ''` to start the image once.
    if program
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        return 0;
    }
    let call = match parse_program(&program) {
        Ok(c) => c,
        Err(e) => return fail(err, 1, &e),
    };
    let home = || env("HOME").filter(|h| !h.is_empty()).unwrap_or("/".into());
    let local_dir = call.local_dir.as_ref().map(PathBuf::from);
    let result = match call.library {
        Library::HuggingFaceHub => {
            let cache = call
                .cache_dir
                .as_ref()
                .map(PathBuf::from)
                .or_else(|| model::hf_cache_from_env(env))
                .unwrap_or_else(|| Path::new(&home()).join(".cache/huggingface/hub"));
            let offline = truthy(env("HF_HUB_OFFLINE"));
            let into = local_dir.as_ref().unwrap_or(&cache);
            // HF_ENDPOINT (a mirror) as huggingface_hub reads it; without it the built-in hub.
            let source = match env("HF_ENDPOINT").filter(|e| !e.is_empty()) {
                Some(e) => hub::Hub::Endpoint(e),
                None => hub::Hub::BuiltIn,
            };
            let from = match &source {
                hub::Hub::Endpoint(e) => format!(" from {e}"),
                hub::Hub::BuiltIn => String::new(),
            };
            let _ = writeln!(
                err,
                "vllm-stub hub: snapshot_download({:?}) into {}{from}",
                call.repo,
                into.display()
            );
            match &local_dir {
                Some(dir) => hub::download_hf_local_dir_via(
                    &source,
                    &cache,
                    dir,
                    &call.repo,
                    call.revision.as_deref(),
                    offline,
                ),
                None => hub::download_hf_via(
                    &source,
                    &cache,
                    &call.repo,
                    call.revision.as_deref(),
                    offline,
                ),
            }
        }
        Library::ModelScope => {
            let dest = match (&local_dir, &call.cache_dir) {
                (Some(dir), _) => hub::ModelScopeDest::LocalDir(dir.clone()),
                (None, Some(dir)) => hub::ModelScopeDest::CacheDir(PathBuf::from(dir)),
                (None, None) => hub::ModelScopeDest::Cache(
                    env("MODELSCOPE_CACHE")
                        .filter(|v| !v.is_empty())
                        .map(PathBuf::from)
                        .unwrap_or_else(|| Path::new(&home()).join(".cache/modelscope/hub")),
                ),
            };
            let _ = writeln!(
                err,
                "vllm-stub hub: modelscope snapshot_download({:?}) into {}",
                call.repo,
                dest.dirs(&call.repo).0.display()
            );
            hub::download_modelscope(&dest, &call.repo)
        }
    };
    match result {
        Ok(d) => {
            for w in &d.warnings {
                let _ = writeln!(err, "{w}");
            }
            if d.fetched.is_empty() && d.copied.is_empty() {
                let state = if local_dir.is_some() {
                    format!("is in {} already", d.path.display())
                } else {
                    "is cached already".to_owned()
                };
                let _ = writeln!(
                    err,
                    "vllm-stub hub: {} revision {} {state}, nothing to fetch",
                    call.repo, d.revision
                );
            }
            for (name, bytes) in &d.copied {
                let _ = writeln!(
                    err,
                    "vllm-stub hub: copied {name} ({bytes} bytes) from the Hugging Face cache"
                );
            }
            for (name, bytes) in &d.fetched {
                let _ = writeln!(err, "vllm-stub hub: fetched {name} ({bytes} bytes)");
            }
            if call.print {
                let _ = writeln!(out, "{}", d.path.display());
            }
            let _ = out.flush();
            0
        }
        Err(e) => fail(err, call.line, &e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_the_controller_renders() {
        // controller/src/render/cache.rs, prewarm_program (Rust's {:?} quoting of the repository).
        let hf = format!(
            "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id={:?}))\n",
            "hearth/stub-model"
        );
        assert_eq!(
            parse_program(&hf).unwrap(),
            SnapshotDownload {
                library: Library::HuggingFaceHub,
                repo: "hearth/stub-model".into(),
                revision: None,
                cache_dir: None,
                local_dir: None,
                print: true,
                line: 2,
            }
        );
        let ms = format!(
            "from modelscope import snapshot_download\nprint(snapshot_download({:?}))\n",
            "Qwen/Qwen2.5-7B-Instruct"
        );
        let call = parse_program(&ms).unwrap();
        assert_eq!(call.library, Library::ModelScope);
        assert_eq!(call.repo, "Qwen/Qwen2.5-7B-Instruct");
        let kw = "from huggingface_hub import snapshot_download; snapshot_download('a/b', revision='main', cache_dir=\"/c\",)";
        let call = parse_program(kw).unwrap();
        assert_eq!(
            (
                call.repo.as_str(),
                call.revision.as_deref(),
                call.cache_dir.as_deref(),
                call.print
            ),
            ("a/b", Some("main"), Some("/c"), false)
        );
    }

    #[test]
    fn parses_the_adapter_programs_with_local_dir() {
        let hf = format!(
            "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id={:?}, local_dir={:?}))",
            "acme/sql-lora", "/models/adapters/hf/acme/sql-lora"
        );
        assert_eq!(
            parse_program(&hf).unwrap(),
            SnapshotDownload {
                library: Library::HuggingFaceHub,
                repo: "acme/sql-lora".into(),
                revision: None,
                cache_dir: None,
                local_dir: Some("/models/adapters/hf/acme/sql-lora".into()),
                print: true,
                line: 2,
            }
        );
        let ms = format!(
            "from modelscope import snapshot_download\nprint(snapshot_download({:?}, local_dir={:?}))",
            "acme/sql-lora", "/models/adapters/modelscope/acme/sql-lora"
        );
        let call = parse_program(&ms).unwrap();
        assert_eq!(
            (call.library, call.repo.as_str(), call.local_dir.as_deref()),
            (
                Library::ModelScope,
                "acme/sql-lora",
                Some("/models/adapters/modelscope/acme/sql-lora")
            )
        );
        let both = "from modelscope import snapshot_download\nsnapshot_download(model_id='a/b', cache_dir='/c', local_dir=None)";
        let call = parse_program(both).unwrap();
        assert_eq!(
            (call.cache_dir.as_deref(), call.local_dir.as_deref()),
            (Some("/c"), None)
        );
    }

    #[test]
    fn runs_an_adapter_prewarm_into_local_dir() {
        let root = std::env::temp_dir().join(format!("vllm-stub-py-local-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let hf_home = root.join("hf").to_string_lossy().into_owned();
        let env = |k: &str| (k == "HF_HOME").then(|| hf_home.clone());
        let local = root.join("adapters/hf/acme/sql-lora-r16");
        let program = format!(
            "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id=\"acme/sql-lora-r16\", local_dir={:?}))",
            local.display().to_string()
        );
        let args: Vec<OsString> = vec!["-c".into(), program.into()];
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(python_main(&args, &env, &mut out, &mut err), 0);
        // os.path.realpath(local_dir).
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{}\n", std::fs::canonicalize(&local).unwrap().display())
        );
        let err = String::from_utf8(err).unwrap();
        assert!(err.contains("fetched adapter_model.safetensors"), "{err}");
        assert!(local.join("adapter_config.json").is_file());
        // Again: nothing fetched.
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(python_main(&args, &env, &mut out, &mut err), 0);
        let err = String::from_utf8(err).unwrap();
        assert!(err.contains("already, nothing to fetch"), "{err}");
        assert!(!err.contains("fetched"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn refuses_other_programs() {
        for bad in [
            "print('hello')",
            "import os\nos.system('rm -rf /')",
            "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id='a/b', token='x'))",
            "from huggingface_hub import snapshot_download\nsnapshot_download()",
            "from huggingface_hub import snapshot_download\nsnapshot_download('a/b')\nsnapshot_download('c/d')",
            "from huggingface_hub import hf_hub_download",
            "snapshot_download('a/b')",
            "from huggingface_hub import snapshot_download\nprint(snapshot_download('a/b)",
        ] {
            assert!(parse_program(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn runs_a_prewarm_into_hf_home() {
        let home = std::env::temp_dir().join(format!("vllm-stub-py-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&home);
        let hf_home = home.join("huggingface").to_string_lossy().into_owned();
        let env = |k: &str| (k == "HF_HOME").then(|| hf_home.clone());
        let program = "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id=\"hearth/stub-model\"))\n";
        let args: Vec<OsString> = vec!["-c".into(), program.into()];
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(python_main(&args, &env, &mut out, &mut err), 0);
        let printed = String::from_utf8(out).unwrap();
        let snapshot = PathBuf::from(printed.trim_end());
        assert!(
            snapshot.starts_with(home.join("huggingface/hub/models--hearth--stub-model/snapshots")),
            "{printed}"
        );
        assert!(snapshot.join("config.json").is_file());
        let err = String::from_utf8(err).unwrap();
        assert!(err.contains("fetched model.safetensors"), "{err}");

        let (mut out, mut err) = (Vec::new(), Vec::new());
        let bad: Vec<OsString> = vec!["-c".into(), "print(1)".into()];
        assert_eq!(python_main(&bad, &env, &mut out, &mut err), 1);
        assert!(String::from_utf8(err).unwrap().contains("Traceback"));
        let none: Vec<OsString> = vec!["script.py".into()];
        assert_eq!(python_main(&none, &env, &mut out, &mut Vec::new()), 2);
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn an_empty_program_does_nothing_and_succeeds() {
        for program in ["", "\n", "# nothing\n"] {
            let args: Vec<OsString> = vec!["-c".into(), program.into()];
            let (mut out, mut err) = (Vec::new(), Vec::new());
            assert_eq!(python_main(&args, &|_| None, &mut out, &mut err), 0);
            assert!(out.is_empty() && err.is_empty());
        }
    }
}
