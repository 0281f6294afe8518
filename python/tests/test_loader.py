"""The ctypes binding: search order, load errors, and the mirror of ccalloc.h."""

import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess

import pytest

import ccalloc
from ccalloc import _lib
from conftest import HEADER, PYTHON_DIR, REPO_DIR, SIM_HEADER, run_python

with open(HEADER) as _f:
    HEADER_TEXT = _f.read()
# The simulated device's controls (a library built with the `sim` feature, as the package's is).
with open(SIM_HEADER) as _f:
    SIM_HEADER_TEXT = _f.read()


# --------------------------------------------------------------------------------------------
# Search order and load errors
# --------------------------------------------------------------------------------------------


def test_default_search_order(monkeypatch):
    monkeypatch.delenv("CCALLOC_LIBRARY", raising=False)
    candidates = _lib.candidate_paths()
    assert [where for where, _ in candidates] == ["package", "target/release", "target/debug"]
    package_dir = os.path.join(PYTHON_DIR, "ccalloc")
    assert [os.path.normpath(p) for _, p in candidates] == [
        os.path.join(package_dir, "libccalloc.so"),
        os.path.join(REPO_DIR, "target", "release", "libccalloc.so"),
        os.path.join(REPO_DIR, "target", "debug", "libccalloc.so"),
    ]


def test_env_variable_is_the_only_candidate(monkeypatch):
    monkeypatch.setenv("CCALLOC_LIBRARY", "/somewhere/libccalloc.so")
    assert _lib.candidate_paths() == [("$CCALLOC_LIBRARY", "/somewhere/libccalloc.so")]


def test_first_existing_candidate_wins(monkeypatch, tmp_path):
    monkeypatch.delenv("CCALLOC_LIBRARY", raising=False)
    package = tmp_path / "python" / "ccalloc"
    release = tmp_path / "target" / "release"
    debug = tmp_path / "target" / "debug"
    for d in (package, release, debug):
        d.mkdir(parents=True)
    (tmp_path / "Cargo.toml").write_text("")
    monkeypatch.setattr(_lib, "_PACKAGE_DIR", str(package))
    monkeypatch.setattr(_lib, "_REPO_DIR", str(tmp_path))
    (debug / "libccalloc.so").write_bytes(b"")
    assert _lib._find() == str(debug / "libccalloc.so")
    (release / "libccalloc.so").write_bytes(b"")
    assert _lib._find() == str(release / "libccalloc.so")
    (package / "libccalloc.so").write_bytes(b"")
    assert _lib._find() == str(package / "libccalloc.so")


def test_nothing_found_lists_every_place(monkeypatch, tmp_path):
    monkeypatch.delenv("CCALLOC_LIBRARY", raising=False)
    (tmp_path / "Cargo.toml").write_text("")
    monkeypatch.setattr(_lib, "_PACKAGE_DIR", str(tmp_path / "pkg"))
    monkeypatch.setattr(_lib, "_REPO_DIR", str(tmp_path))
    with pytest.raises(ccalloc.LibraryNotFoundError) as info:
        _lib._find()
    message = str(info.value)
    assert "libccalloc.so not found" in message
    assert str(tmp_path / "pkg" / "libccalloc.so") in message
    assert str(tmp_path / "target" / "release" / "libccalloc.so") in message
    assert str(tmp_path / "target" / "debug" / "libccalloc.so") in message
    assert "CCALLOC_LIBRARY" in message and "cargo build" in message
    assert isinstance(info.value, OSError)


def test_installed_package_looks_only_inside_itself(monkeypatch, tmp_path):
    """Installed (no Cargo.toml two levels up): the bundled library is the only candidate, and
    the error says how to reinstall rather than listing site-packages/../target paths."""
    monkeypatch.delenv("CCALLOC_LIBRARY", raising=False)
    package = tmp_path / "site-packages" / "ccalloc"
    package.mkdir(parents=True)
    monkeypatch.setattr(_lib, "_PACKAGE_DIR", str(package))
    monkeypatch.setattr(_lib, "_REPO_DIR", str(tmp_path))
    assert _lib.candidate_paths() == [("package", str(package / "libccalloc.so"))]
    with pytest.raises(ccalloc.LibraryNotFoundError) as info:
        _lib._find()
    message = str(info.value)
    assert str(package / "libccalloc.so") in message
    assert "target" not in message
    assert "pip install" in message and "CCALLOC_LIBRARY" in message
    (package / "libccalloc.so").write_bytes(b"")
    assert _lib._find() == str(package / "libccalloc.so")


def test_missing_env_library_fails_on_first_use_not_on_import():
    result = run_python(
        """
        import ccalloc
        print("imported")
        try:
            ccalloc.version()
        except ccalloc.LibraryNotFoundError as e:
            assert isinstance(e, OSError)
            print("error:", e)
        else:
            print("no error")
        """,
        env={"CCALLOC_LIBRARY": "/nonexistent/dir/libccalloc.so"},
    )
    assert result.returncode == 0, result.stderr
    assert "imported" in result.stdout
    assert "error: ccalloc: CCALLOC_LIBRARY='/nonexistent/dir/libccalloc.so' does not name an existing file" in result.stdout
    # The explicit path is not silently replaced by the checkout's build.
    assert "no error" not in result.stdout


def test_env_library_that_is_not_a_library(tmp_path):
    bogus = tmp_path / "libccalloc.so"
    bogus.write_text("not an ELF file\n")
    result = run_python(
        """
        import ccalloc
        try:
            ccalloc.memory_allocated()
        except ccalloc.LibraryNotFoundError as e:
            print("error:", e)
        """,
        env={"CCALLOC_LIBRARY": str(bogus)},
    )
    assert result.returncode == 0, result.stderr
    assert f"error: ccalloc: found {bogus} but could not load it" in result.stdout


def test_env_library_is_used(tmp_path):
    real = _lib.library_path()
    copy = tmp_path / "libccalloc.so"
    shutil.copyfile(real, copy)
    result = run_python(
        "import ccalloc; print(ccalloc.library_path()); print(ccalloc.backend())",
        env={"CCALLOC_LIBRARY": str(copy)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [os.path.realpath(copy), "sim"]


def test_library_missing_a_symbol():
    """A library from another version names the symbol it lacks (tested with libc)."""
    libc = ctypes.util.find_library("c")
    if not libc:
        pytest.skip("no libc to stand in for a wrong library")
    with pytest.raises(ccalloc.LibraryNotFoundError, match="has no symbol ccalloc_init"):
        _lib._bind(ctypes.CDLL(libc), libc)


def test_library_path_is_absolute_and_loaded():
    path = ccalloc.library_path()
    assert os.path.isabs(path) and os.path.isfile(path)


# --------------------------------------------------------------------------------------------
# ccalloc.h mirrored exactly
# --------------------------------------------------------------------------------------------

_DECL = re.compile(r"^\s*([A-Za-z_][\w \*]*?)\s*\b(ccalloc_\w+)\(([^)]*)\);", re.M)


def _normalize(c_type):
    return re.sub(r"\s+", " ", c_type).replace(" *", "*").strip()


def header_functions():
    """name -> (return type, [parameter types]) for every function declared in ccalloc.h and
    ccalloc_sim.h (declarations spanning several lines included). `extern` declarations are
    left out: they are functions the library imports, not exports (see HEADER_INTERNAL)."""
    functions = {}
    for ret, name, params in _DECL.findall(HEADER_TEXT + SIM_HEADER_TEXT):
        if ret.split()[0] == "extern":
            continue
        params = " ".join(params.split())
        types = [] if params in ("", "void") else [
            _normalize(re.sub(r"\s*\b\w+$", "", p.strip())) for p in params.split(",")
        ]
        functions[name] = (_normalize(ret), types)
    return functions


_C_TO_CTYPES = {
    "void": None,
    "ccalloc_status": ctypes.c_uint32,
    "uint32_t": ctypes.c_uint32,
    "int32_t": ctypes.c_int32,
    "int": ctypes.c_int,
    "size_t": ctypes.c_size_t,
    "double": ctypes.c_double,
    "bool": ctypes.c_bool,
    "void*": ctypes.c_void_p,
    "const void*": ctypes.c_void_p,
    "cudaStream_t": ctypes.c_void_p,
    "const char*": ctypes.c_char_p,
    "const char**": ctypes.POINTER(ctypes.c_char_p),
    "int32_t*": ctypes.POINTER(ctypes.c_int32),
    "uint64_t*": ctypes.POINTER(ctypes.c_uint64),
    "double*": ctypes.POINTER(ctypes.c_double),
    "void**": ctypes.POINTER(ctypes.c_void_p),
    "ccalloc_stats*": ctypes.POINTER(_lib.ccalloc_stats),
    "ccalloc_paging_stats*": ctypes.POINTER(_lib.ccalloc_paging_stats),
    "ccalloc_lock_stats*": ctypes.POINTER(_lib.ccalloc_lock_stats),
    "ccalloc_memory_breakdown*": ctypes.POINTER(_lib.ccalloc_memory_breakdown),
    "ccalloc_pool_id": _lib.ccalloc_pool_id,
    "uint32_t*": ctypes.POINTER(ctypes.c_uint32),
    "uint64_t": ctypes.c_uint64,
    "size_t*": ctypes.POINTER(ctypes.c_size_t),
    # The opaque snapshot handle travels as a void pointer.
    "ccalloc_snapshot*": ctypes.c_void_p,
    "const ccalloc_snapshot*": ctypes.c_void_p,
    "ccalloc_snapshot**": ctypes.POINTER(ctypes.c_void_p),
    "ccalloc_segment_info*": ctypes.POINTER(_lib.ccalloc_segment_info),
    "ccalloc_block_info*": ctypes.POINTER(_lib.ccalloc_block_info),
    "ccalloc_trace_entry*": ctypes.POINTER(_lib.ccalloc_trace_entry),
    "ccalloc_stream_filter": _lib.ccalloc_stream_filter,
    "ccalloc_release_fn": _lib.ccalloc_release_fn,
    "ccalloc_trace_observer": _lib.ccalloc_trace_observer,
    "ccalloc_restore_fn": _lib.ccalloc_restore_fn,
    "const ccalloc_block_info*": ctypes.POINTER(_lib.ccalloc_block_info),
}


def test_header_parse_is_sane():
    functions = header_functions()
    assert len(functions) >= 25
    assert functions["ccalloc_malloc"] == ("ccalloc_status", ["size_t", "int32_t", "cudaStream_t", "void**"])
    assert functions["ccalloc_version"] == ("const char*", [])


def test_every_header_function_has_argtypes_and_restype():
    functions = header_functions()
    assert set(functions) == set(_lib.FUNCTIONS), "ccalloc.h and _lib.FUNCTIONS differ"
    lib = _lib.load()
    for name, (ret, params) in functions.items():
        argtypes, restype = _lib.FUNCTIONS[name]
        assert [_C_TO_CTYPES[p] for p in params] == argtypes, name
        assert _C_TO_CTYPES[ret] is restype, name
        fn = getattr(lib, name)
        assert fn.argtypes == argtypes, name
        assert fn.restype is restype, name


def test_function_pointer_typedefs_match_header():
    filter_decl = re.search(r"typedef bool \(\*ccalloc_stream_filter\)\(void \*ctx, cudaStream_t stream\);", HEADER_TEXT)
    release_decl = re.search(r"typedef void \(\*ccalloc_release_fn\)\(void \*ctx\);", HEADER_TEXT)
    assert filter_decl and release_decl
    assert _lib.ccalloc_stream_filter._restype_ is ctypes.c_bool
    assert _lib.ccalloc_stream_filter._argtypes_ == (ctypes.c_void_p, ctypes.c_void_p)
    assert _lib.ccalloc_release_fn._restype_ is None
    assert _lib.ccalloc_release_fn._argtypes_ == (ctypes.c_void_p,)


def test_header_internal_declarations_are_not_bound():
    declared = set(re.findall(r"^extern \S.*?\b(ccalloc_\w+)\(", HEADER_TEXT, re.M))
    assert declared <= set(_lib.HEADER_INTERNAL)
    assert not declared & set(_lib.FUNCTIONS)


def _header_struct(name):
    match = re.search(r"typedef struct \{([^{}]*)\} " + name + ";", HEADER_TEXT)
    assert match, name
    fields = []
    for line in match.group(1).splitlines():
        line = line.split("//")[0].strip()
        if line:
            ctype, field = line.rstrip(";").split()
            fields.append((field, ctype))
    return fields


_FIELD_TYPES = {
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "double": ctypes.c_double,
    "ccalloc_stat": _lib.ccalloc_stat,
    "ccalloc_stat_array": _lib.ccalloc_stat_array,
}


# The plain-data structs the header declares and _lib mirrors.
_STRUCTS = (
    _lib.ccalloc_stat,
    _lib.ccalloc_stat_array,
    _lib.ccalloc_stats,
    _lib.ccalloc_paging_stats,
    _lib.ccalloc_lock_stats,
    _lib.ccalloc_memory_breakdown,
    _lib.ccalloc_pool_id,
)


@pytest.mark.parametrize("struct", _STRUCTS)
def test_structs_mirror_header_field_by_field(struct):
    header = _header_struct(struct.__name__)
    assert [(n, _FIELD_TYPES[t]) for n, t in header] == list(struct._fields_)


def test_struct_layout_matches_a_c_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "ccalloc.h"', "int main(void) {"]
    expected = []
    for struct in _STRUCTS:
        name = struct.__name__
        lines.append(f'printf("%zu\\n", sizeof({name}));')
        expected.append(ctypes.sizeof(struct))
        for field, _ in struct._fields_:
            lines.append(f'printf("%zu\\n", offsetof({name}, {field}));')
            expected.append(getattr(struct, field).offset)
    lines += ["return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", os.path.dirname(HEADER), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert [int(x) for x in out.split()] == expected


def test_status_enum_matches_header_and_library():
    enum_body = re.search(r"enum ccalloc_status.*?\{(.*?)\};", HEADER_TEXT, re.S).group(1)
    header = {name: int(value) for name, value in re.findall(r"(CCALLOC_\w+) = (\d+)", enum_body)}
    assert header == {s.c_name: int(s) for s in ccalloc.Status}
    for status in ccalloc.Status:
        assert _lib.status_name(status) == status.c_name
    assert _lib.status_name(999) == "CCALLOC_UNKNOWN_STATUS"
    for wrapped in (2**32 + 3, -1):  # were cut to 32 bits: 2**32 + 3 read as SHUT_DOWN
        with pytest.raises(ValueError):
            _lib.status_name(wrapped)


def test_every_status_has_an_error_class():
    """Fails when the library has a status this package has no exception class for."""
    for status in ccalloc.Status:
        if status == ccalloc.Status.OK:
            continue
        error = _lib.error_for(status, "message")
        assert type(error) is not ccalloc.CcallocError, status
        assert isinstance(error, ccalloc.CcallocError)
        assert error.status is status
        assert str(error) == f"message [{status.c_name}]"


def test_every_error_class_names_a_library_status():
    """Fails when this package has an exception class for a status the library lacks."""
    library = {s.c_name for s in ccalloc.Status}
    assert set(_lib.ERROR_CLASSES) <= library
    assert set(_lib.ERROR_CLASSES) == library - {"CCALLOC_OK"}
    for name, cls in _lib.ERROR_CLASSES.items():
        assert getattr(ccalloc, cls.__name__) is cls, name


class _FakeLibrary:
    """Stands in for the library's ``ccalloc_status_name``."""

    def __init__(self, names):
        self.names = names

    def ccalloc_status_name(self, value):
        return (self.names[value] if value < len(self.names) else "CCALLOC_UNKNOWN_STATUS").encode()


def test_status_is_read_from_the_library():
    names = [s.c_name for s in ccalloc.Status] + ["CCALLOC_FROM_THE_FUTURE"]
    status = _lib._read_statuses(_FakeLibrary(names), "fake")
    assert [(s.c_name, int(s)) for s in status] == [(n, i) for i, n in enumerate(names)]
    assert status.FROM_THE_FUTURE == len(names) - 1


@pytest.mark.parametrize(
    "names",
    [
        [],
        ["CCALLOC_INVALID_ARGUMENT"],
        ["CCALLOC_OK", "not a status"],
        ["CCALLOC_OK", "CCALLOC_BUSY", "CCALLOC_BUSY"],
        ["CCALLOC_OK"] * (_lib._MAX_STATUSES + 1),
    ],
)
def test_a_library_with_unreadable_statuses_is_refused(names):
    with pytest.raises(ccalloc.LibraryNotFoundError, match="fake"):
        _lib._read_statuses(_FakeLibrary(names), "fake")


def test_status_without_an_error_class_gives_base_class(monkeypatch):
    """A status the library knows and this package has no class for raises CcallocError."""
    monkeypatch.delitem(_lib._ERROR_CLASSES, "CCALLOC_BUSY")
    error = _lib.error_for(ccalloc.Status.BUSY, "newer library")
    assert type(error) is ccalloc.CcallocError
    assert error.status is ccalloc.Status.BUSY
    assert str(error) == "newer library [CCALLOC_BUSY]"


def test_status_is_not_read_on_import():
    result = run_python(
        """
        import ccalloc
        from ccalloc import *
        print("imported")
        try:
            ccalloc.Status
        except ccalloc.LibraryNotFoundError:
            print("status needs the library")
        """,
        env={"CCALLOC_LIBRARY": "/nonexistent/dir/libccalloc.so"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["imported", "status needs the library"]
