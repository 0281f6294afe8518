//! The C API as C programs see it: builds tests/c/test_api.c against include/ccalloc_sim.h
//! (which includes ccalloc.h) and the cdylib (as C11, and once as C++ to prove the headers
//! are C++-clean), runs it on the simulated backend with paged segments (the default) and
//! with plain ones (`CCALLOC_CONF=expandable_segments:False`), and requires its
//! "N passed, 0 failed" summary.
//!
//! Library lookup: `CCALLOC_LIB_DIR` if set; else the cdylib cargo built next to this test
//! (target/<profile>/deps, same sources as the test); else target/<profile>; else
//! `cargo build --features sim`.
//! Compilers: `CC` (default `cc`) and `CXX` (default `g++`). Build outputs go to
//! `CARGO_TARGET_TMPDIR/c_api`.
#![cfg(feature = "sim")]

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const LIB_FILE: &str = "libccalloc.so";
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn work_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_api");
    fs::create_dir_all(&dir).expect("create the C test build directory");
    dir
}

/// target/<profile>, from this test executable's path (target/<profile>/deps/c_api-HASH).
fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    Some(if deps.file_name()? == "deps" {
        deps.parent()?.to_path_buf()
    } else {
        deps.to_path_buf()
    })
}

fn cargo_build(release: bool) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["build", "--lib", "--features", "sim", "--manifest-path"])
        .arg(root().join("Cargo.toml"));
    if release {
        cmd.arg("--release");
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running `{cargo} build`: {e}"));
    assert!(status.success(), "`{cargo} build --lib` failed: {status}");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"));
    target.join(if release { "release" } else { "debug" })
}

/// The directory holding libccalloc.so (found or built once per test process).
fn library_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("CCALLOC_LIB_DIR") {
            let dir = PathBuf::from(dir);
            assert!(
                dir.join(LIB_FILE).is_file(),
                "CCALLOC_LIB_DIR={} has no {LIB_FILE}",
                dir.display()
            );
            return dir;
        }
        let profile = profile_dir();
        let candidates = profile
            .iter()
            .flat_map(|p| [p.join("deps"), p.clone()])
            .chain(["debug", "release"].map(|p| root().join("target").join(p)));
        for dir in candidates {
            if dir.join(LIB_FILE).is_file() {
                return dir;
            }
        }
        let release = profile
            .as_deref()
            .and_then(Path::file_name)
            .is_some_and(|n| n == "release");
        let dir = cargo_build(release);
        assert!(
            dir.join(LIB_FILE).is_file(),
            "`cargo build` did not produce {}",
            dir.join(LIB_FILE).display()
        );
        dir
    })
}

fn run_logged(mut cmd: Command, what: &str) {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{cmd:?}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Compiles tests/c/test_api.c with `compiler` and `flags` into `exe`.
fn compile(compiler: &str, flags: &[&str], exe: &Path) {
    let lib = library_dir();
    let _ = fs::remove_file(exe);
    let mut cmd = Command::new(compiler);
    cmd.args(flags)
        .arg("-I")
        .arg(root().join("include"))
        .arg(root().join("tests/c/test_api.c"))
        .arg("-o")
        .arg(exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lccalloc")
        .arg("-lpthread")
        .arg(format!("-Wl,-rpath,{}", lib.display()));
    run_logged(cmd, &format!("compiling test_api.c with {compiler}"));
}

/// Runs the test program on the simulated backend with `conf` as `CCALLOC_CONF` (None: unset);
/// returns its exit status and output.
fn run_on_sim(exe: &Path, conf: Option<&str>, log_name: &str) -> (ExitStatus, String) {
    let log = work_dir().join(log_name);
    let out = File::create(&log).expect("create the log file");
    let err = out.try_clone().expect("clone the log file");
    let mut cmd = Command::new(exe);
    cmd.env("CCALLOC_BACKEND", "sim")
        .env("CCALLOC_SIM_CAPACITY", "1GiB")
        .env("CCALLOC_SIM_DEVICES", "2")
        .env_remove("CCALLOC_CONF")
        .env_remove("CCALLOC_SIM_VMM");
    if let Some(conf) = conf {
        cmd.env("CCALLOC_CONF", conf);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the test program") {
            break status;
        }
        if start.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            let text = fs::read_to_string(&log).unwrap_or_default();
            panic!(
                "{} ran past {RUN_TIMEOUT:?} (hung?); output so far:\n{text}",
                exe.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, fs::read_to_string(&log).unwrap_or_default())
}

/// Parses the last line, "N passed, M failed".
fn summary(output: &str) -> Option<(u32, u32)> {
    let last = output.lines().rev().find(|l| !l.trim().is_empty())?;
    let (passed, failed) = last.trim().split_once(" passed, ")?;
    Some((
        passed.parse().ok()?,
        failed.strip_suffix(" failed")?.parse().ok()?,
    ))
}

/// The C program, compiled once for both runs.
fn c_program() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let exe = work_dir().join("test_api_c");
        compile(
            &cc,
            &[
                "-std=c11",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
                "-O2",
                "-g",
            ],
            &exe,
        );
        exe
    })
}

fn run_and_require_success(conf: Option<&str>, log_name: &str) {
    let (status, output) = run_on_sim(c_program(), conf, log_name);
    print!("{output}");
    let failures: Vec<&str> = output.lines().filter(|l| l.starts_with("FAIL")).collect();
    let counts = summary(&output);
    assert!(
        status.success() && failures.is_empty() && matches!(counts, Some((p, 0)) if p > 0),
        "test_api.c on the sim backend (CCALLOC_CONF={conf:?}): exit {status}, summary {counts:?}; \
         failed checks:\n{}\n(full output above and in {}; library from {})",
        failures.join("\n"),
        work_dir().join(log_name).display(),
        library_dir().display()
    );
}

#[test]
fn c_api_test_program_passes_on_sim() {
    run_and_require_success(None, "test_api_paged.log");
}

#[test]
fn c_api_test_program_passes_on_sim_with_plain_segments() {
    run_and_require_success(Some("expandable_segments:False"), "test_api_plain.log");
}

/// Compiled and linked only: running it would repeat the C program's checks.
#[test]
fn header_and_test_program_are_cpp_clean() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let exe = work_dir().join("test_api_cpp");
    compile(
        &cxx,
        &[
            "-x",
            "c++",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-O1",
        ],
        &exe,
    );
    assert!(exe.is_file(), "{} was not produced", exe.display());
}

#[test]
fn summary_line_is_parsed() {
    assert_eq!(summary("PASS  x\n12 passed, 0 failed\n"), Some((12, 0)));
    assert_eq!(summary("3 passed, 2 failed"), Some((3, 2)));
    assert_eq!(summary("3 passed, 2 failed\nSegmentation fault\n"), None);
    assert_eq!(summary(""), None);
}
