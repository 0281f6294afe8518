//! ccalloc's own log for users without Rust: the `tracing` events (segments reserved and
//! released, page growth, OOMs, settings changes) go to stderr, or to the file named by
//! `CCALLOC_LOG_FILE`, when `CCALLOC_LOG` names a level or filter (`debug`, `info`,
//! `ccalloc=debug,warn`). Silent when unset. A host that installed a tracing subscriber of
//! its own keeps it: ccalloc's events then go there.

use std::sync::Once;
use tracing_subscriber::EnvFilter;

/// Installs the log subscriber once per process, as `CCALLOC_LOG` asks. A bad filter or an
/// unwritable file is reported on stderr once and leaves logging off: logging never stops
/// the allocator from starting.
pub(crate) fn init_from_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = std::env::var("CCALLOC_LOG").unwrap_or_default();
        if filter.trim().is_empty() {
            return;
        }
        let filter = match EnvFilter::try_new(filter.trim()) {
            Ok(f) => f,
            Err(e) => {
                report(&format!(
                    "CCALLOC_LOG={filter:?} is not a level or filter ({e}); logging stays off"
                ));
                return;
            }
        };
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_target(false)
            .with_ansi(false);
        let installed = match std::env::var_os("CCALLOC_LOG_FILE") {
            Some(path) => match std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
            {
                Ok(file) => builder.with_writer(std::sync::Mutex::new(file)).try_init(),
                Err(e) => {
                    report(&format!(
                        "CCALLOC_LOG_FILE={path:?} cannot be opened ({e}); logging stays off"
                    ));
                    return;
                }
            },
            None => builder.with_writer(std::io::stderr).try_init(),
        };
        // An error here means the host has a subscriber of its own: it gets the events.
        let _ = installed;
    });
}

fn report(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "ccalloc: {message}");
}
