//! Builds the small C++ shim that copies, calls and drops PyTorch's std::function filters.

fn main() {
    println!("cargo:rerun-if-changed=src/ffi/torch_filter.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/ffi/torch_filter.cpp")
        .flag_if_supported("-std=c++17")
        .warnings(true)
        .compile("ccalloc_torch_filter");
}
