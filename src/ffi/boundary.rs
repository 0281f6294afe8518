//! The panic boundary and the thread-local last-error message behind every export.

use super::types::ccalloc_status;
use crate::error::{Error, ErrorKind};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Said by `last_error_ptr` on a thread whose own message is gone: a call made from a
/// thread-local destructor, after ccalloc's thread-local was destroyed.
const MESSAGE_GONE: &std::ffi::CStr =
    c"the last error message is gone: this thread is exiting (its thread-local storage was destroyed)";

/// Stores this thread's last error message. During thread exit, once the thread-local is
/// destroyed, the message is dropped (the status code still says what failed): a panic here
/// would abort the host.
pub(crate) fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = text;
        }
    });
}

/// The current thread's last error message; valid until its next failing ccalloc call.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        .unwrap_or(MESSAGE_GONE.as_ptr())
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs `body` so that no panic crosses into C; failures become a status plus a message.
/// Recording the message (logging, the thread-local) is kept inside the boundary too: during
/// thread exit either may fail, and the status must still come back.
///
/// In a child process forked after ccalloc was initialized, every call fails at once with
/// `CCALLOC_DRIVER_UNAVAILABLE` (`runtime::FORKED_MESSAGE`), before any lock is taken or
/// anything is logged: a parent thread that held a lock at the fork does not exist in the
/// child, and would never release it.
#[inline]
pub(crate) fn guard(body: impl FnOnce() -> Result<(), Error>) -> ccalloc_status {
    if crate::runtime::is_forked_child() {
        return forked();
    }
    let Some(_scope) = crate::runtime::CallScope::enter() else {
        return from_observer();
    };
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ccalloc_status::CCALLOC_OK,
        Ok(Err(error)) => record_failure(error.kind.status(), error.message, false),
        Err(payload) => record_failure(
            ccalloc_status::CCALLOC_INTERNAL_ERROR,
            format!(
                "internal error (panic caught at the C boundary): {}",
                panic_message(&*payload)
            ),
            true,
        ),
    }
}

/// `guard`'s answer to a call from a segment observer (`ccalloc_add_segment_observer`),
/// which runs with ccalloc's locks held: the call would wait for its own thread.
#[cold]
#[inline(never)]
fn from_observer() -> ccalloc_status {
    record_failure(
        ccalloc_status::CCALLOC_INVALID_ARGUMENT,
        "ccalloc was called from a segment observer, which runs with ccalloc's locks held: \
         the call would wait for its own thread. Observers must not call ccalloc; record the \
         event and act on it after the observer returns"
            .into(),
        false,
    )
}

/// `guard`'s answer in a forked child.
#[cold]
#[inline(never)]
fn forked() -> ccalloc_status {
    set_last_error(crate::runtime::FORKED_MESSAGE);
    ccalloc_status::CCALLOC_DRIVER_UNAVAILABLE
}

/// Logs a failed call's message and keeps it as the thread's last error; returns `status`.
#[cold]
#[inline(never)]
fn record_failure(status: ccalloc_status, message: String, panicked: bool) -> ccalloc_status {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if panicked {
            tracing::error!("{message}");
        } else {
            tracing::debug!(?status, "{message}");
        }
        set_last_error(&message);
    }));
    status
}

/// An error for a null or out-of-range argument.
pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

/// Writes `value` through a caller's out-pointer after checking it is not null.
pub(super) fn write_out<T>(out: *mut T, name: &str, value: T) -> Result<(), Error> {
    if out.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-null and, per the API contract, pointing at writable storage for a T.
    unsafe { out.write(value) };
    Ok(())
}

/// Checks an out-pointer before any work is done, so failures leave nothing half-written.
pub(super) fn require_out<T>(out: *mut T, name: &str) -> Result<(), Error> {
    if out.is_null() {
        Err(invalid(format!("{name} is NULL")))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last_error() -> String {
        // SAFETY: this thread's NUL-terminated last error.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn guard_turns_errors_and_panics_into_a_status_and_the_last_error() {
        assert_eq!(guard(|| Ok(())), ccalloc_status::CCALLOC_OK);
        let status = guard(|| Err(invalid("size is 0")));
        assert_eq!(status, ccalloc_status::CCALLOC_INVALID_ARGUMENT);
        assert_eq!(last_error(), "size is 0");
        // A success leaves the last error as it was.
        assert_eq!(guard(|| Ok(())), ccalloc_status::CCALLOC_OK);
        assert_eq!(last_error(), "size is 0");
        let status = guard(|| panic!("a bug in the body"));
        assert_eq!(status, ccalloc_status::CCALLOC_INTERNAL_ERROR);
        assert_eq!(
            last_error(),
            "internal error (panic caught at the C boundary): a bug in the body"
        );
    }
}
