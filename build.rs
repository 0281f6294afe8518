//! Builds the small C++ shim that copies, calls and drops PyTorch's std::function filters, and
//! generates the Rust side of the status list from `enum ccalloc_status` in src/ffi/types.rs.

use std::fmt::Write as _;
use std::path::Path;

/// Where the one list of statuses is written. cbindgen reads it as plain Rust (it cannot see
/// items made by macros or build scripts), so everything else is derived from it here.
const STATUS_SOURCE: &str = "src/ffi/types.rs";

fn main() {
    println!("cargo:rerun-if-changed=src/ffi/torch_filter.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/ffi/torch_filter.cpp")
        .flag_if_supported("-std=c++17")
        .warnings(true)
        .compile("ccalloc_torch_filter");

    println!("cargo:rerun-if-changed={STATUS_SOURCE}");
    let source = std::fs::read_to_string(STATUS_SOURCE).expect("read src/ffi/types.rs");
    let statuses = read_statuses(&source);
    let out = std::env::var("OUT_DIR").expect("OUT_DIR");
    write(
        &Path::new(&out).join("error_kind.rs"),
        &error_kind(&statuses),
    );
    write(
        &Path::new(&out).join("status_table.rs"),
        &status_table(&statuses),
    );
}

struct Status {
    /// The C name, e.g. `CCALLOC_OUT_OF_MEMORY`.
    name: String,
    value: u32,
    /// The doc comment's lines, without `///`.
    doc: Vec<String>,
}

impl Status {
    /// The `ErrorKind` variant of a failure status: its name without `CCALLOC_` and a final
    /// `_ERROR`, in CamelCase (`CCALLOC_OUT_OF_MEMORY` -> `OutOfMemory`, `CCALLOC_CONFIG_ERROR`
    /// -> `Config`). `CCALLOC_OK` has none.
    fn kind(&self) -> Option<String> {
        if self.name == "CCALLOC_OK" {
            return None;
        }
        let bare = &self.name["CCALLOC_".len()..];
        let bare = bare.strip_suffix("_ERROR").unwrap_or(bare);
        let mut kind = String::new();
        for word in bare.split('_') {
            let mut chars = word.chars();
            kind.extend(chars.next());
            kind.extend(chars.flat_map(char::to_lowercase));
        }
        Some(kind)
    }
}

/// The variants of `pub enum ccalloc_status { ... }`: lines of `/// doc`, `NAME = VALUE,`,
/// blank lines and `//` comments; anything else stops the build, naming the line.
fn read_statuses(source: &str) -> Vec<Status> {
    let mut lines = source.lines().enumerate();
    lines
        .by_ref()
        .find(|(_, line)| line.trim() == "pub enum ccalloc_status {")
        .unwrap_or_else(|| panic!("{STATUS_SOURCE} has no `pub enum ccalloc_status {{` line"));
    let mut statuses: Vec<Status> = Vec::new();
    let mut doc = Vec::new();
    for (index, line) in lines {
        let line = line.trim();
        let bad = |why: &str| -> ! {
            panic!("{STATUS_SOURCE}:{}: {why}: `{line}`", index + 1);
        };
        if line == "}" {
            assert!(
                doc.is_empty(),
                "{STATUS_SOURCE}: a doc comment ends the enum"
            );
            break;
        } else if let Some(text) = line.strip_prefix("///") {
            doc.push(text.strip_prefix(' ').unwrap_or(text).to_string());
        } else if line.is_empty() || line.starts_with("//") {
            continue;
        } else {
            let Some((name, value)) = line.strip_suffix(',').and_then(|l| l.split_once(" = "))
            else {
                bad("expected `CCALLOC_NAME = VALUE,`");
            };
            let Ok(value) = value.parse::<u32>() else {
                bad("the value is not a decimal number");
            };
            if !name.starts_with("CCALLOC_")
                || !name[8..]
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b == b'_')
            {
                bad("the name is not CCALLOC_ and capitals");
            }
            if statuses.iter().any(|s| s.name == name || s.value == value) {
                bad("the name or the value is used twice");
            }
            statuses.push(Status {
                name: name.to_string(),
                value,
                doc: std::mem::take(&mut doc),
            });
        }
    }
    assert!(
        statuses
            .iter()
            .any(|s| s.name == "CCALLOC_OK" && s.value == 0),
        "{STATUS_SOURCE}: ccalloc_status has no CCALLOC_OK = 0"
    );
    // Python lists the statuses by asking `ccalloc_status_name` for 0, 1, ... until it
    // answers CCALLOC_UNKNOWN_STATUS: the values have no gaps.
    statuses.sort_by_key(|s| s.value);
    for (index, s) in statuses.iter().enumerate() {
        assert!(
            s.value as usize == index,
            "{STATUS_SOURCE}: ccalloc_status skips {index}: values run 0, 1, 2, ... without gaps"
        );
    }
    statuses
}

fn doc(out: &mut String, indent: &str, lines: &[String]) {
    for line in lines {
        writeln!(out, "{indent}#[doc = {:?}]", format!(" {line}")).unwrap();
    }
}

/// `ErrorKind`, one variant per failure status, and its status.
fn error_kind(statuses: &[Status]) -> String {
    let mut out = String::new();
    out.push_str("/// What went wrong, coarse enough to become one C status code.\n");
    out.push_str("#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]\npub enum ErrorKind {\n");
    for s in statuses {
        if let Some(kind) = s.kind() {
            doc(&mut out, "    ", &s.doc);
            writeln!(out, "    #[doc = \" (`{}`)\"]\n    {kind},", s.name).unwrap();
        }
    }
    out.push_str("}\n\nimpl ErrorKind {\n");
    out.push_str("    /// The status a call that fails this way returns.\n");
    out.push_str("    pub const fn status(self) -> crate::ffi::types::ccalloc_status {\n");
    out.push_str("        match self {\n");
    for s in statuses {
        if let Some(kind) = s.kind() {
            writeln!(
                out,
                "            Self::{kind} => crate::ffi::types::ccalloc_status::{},",
                s.name
            )
            .unwrap();
        }
    }
    out.push_str("        }\n    }\n}\n");
    out
}

/// `ccalloc_status::ALL`, `from_u32`, `name` and `error_kind`.
fn status_table(statuses: &[Status]) -> String {
    let mut out = String::new();
    out.push_str("impl ccalloc_status {\n");
    writeln!(
        out,
        "    /// Every status, in order of value.\n    pub const ALL: [ccalloc_status; {}] = [",
        statuses.len()
    )
    .unwrap();
    for s in statuses {
        writeln!(out, "        ccalloc_status::{},", s.name).unwrap();
    }
    out.push_str("    ];\n\n");
    out.push_str("    /// The status with this value, if there is one.\n");
    out.push_str("    pub const fn from_u32(value: u32) -> Option<Self> {\n");
    out.push_str("        match value {\n");
    for s in statuses {
        writeln!(out, "            {} => Some(Self::{}),", s.value, s.name).unwrap();
    }
    out.push_str("            _ => None,\n        }\n    }\n\n");
    out.push_str("    /// The name in the header, e.g. `CCALLOC_OUT_OF_MEMORY`.\n");
    out.push_str("    pub const fn name(self) -> &'static std::ffi::CStr {\n");
    out.push_str("        match self {\n");
    for s in statuses {
        writeln!(out, "            Self::{0} => c\"{0}\",", s.name).unwrap();
    }
    out.push_str("        }\n    }\n\n");
    out.push_str("    /// The error kind of a failure status; `None` for `CCALLOC_OK`.\n");
    out.push_str("    pub const fn error_kind(self) -> Option<crate::error::ErrorKind> {\n");
    out.push_str("        match self {\n");
    for s in statuses {
        match s.kind() {
            Some(kind) => writeln!(
                out,
                "            Self::{} => Some(crate::error::ErrorKind::{kind}),",
                s.name
            ),
            None => writeln!(out, "            Self::{} => None,", s.name),
        }
        .unwrap();
    }
    out.push_str("        }\n    }\n}\n");
    out
}

/// Writes `text` unless the file already holds it (an unchanged file keeps its time stamp).
fn write(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}
