//! Builds tests/cpp/torch_hooks.cpp against the cdylib and runs it on the sim backend: the
//! graph-pool hooks must work when called through PyTorch's C++ function types.
#![cfg(feature = "sim")]

use std::path::{Path, PathBuf};
use std::process::Command;

fn cdylib(root: &Path) -> PathBuf {
    let profile_dir = root.join("target").join("debug");
    let lib = profile_dir.join("libccalloc.so");
    if !lib.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = Command::new(cargo)
            .args(["build", "--lib", "--features", "sim"])
            .current_dir(root)
            .status()
            .unwrap();
        assert!(ok.success(), "cargo build failed");
    }
    lib
}

#[test]
fn graph_pool_hooks_work_through_pytorch_function_types() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = cdylib(root);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("torch_hooks");
    let libdir = lib.parent().unwrap();
    let status = Command::new("c++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&out)
        .arg(root.join("tests/cpp/torch_hooks.cpp"))
        .arg(format!("-I{}", root.join("include").display()))
        .arg(format!("-L{}", libdir.display()))
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-lccalloc")
        .status()
        .expect("a C++ compiler (c++) is installed");
    assert!(status.success(), "compiling torch_hooks.cpp failed");
    let run = Command::new(&out)
        .env("CCALLOC_BACKEND", "sim")
        .env("CCALLOC_SIM_CAPACITY", "1GiB")
        .env_remove("CCALLOC_CONF")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "torch_hooks failed");
    assert!(stdout.contains(" passed, 0 failed"), "no summary line");
}
