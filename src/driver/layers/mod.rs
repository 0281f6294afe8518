//! Driver adaptors the allocator stacks over the driver it is given, each wrapping the one
//! below and only calling downward (as `traced::Traced` does): `limit` enforces a device's
//! memory limit.

pub mod limit;
