//! The allocator of the serving binaries: mimalloc (set as `#[global_allocator]` in
//! `src/main.rs` and `bench/server.rs`), with freed memory returned to the OS at once until
//! the caches have synced (and [`SYNC_SETTLES`] after), and in batches from then on.
//!
//! On the admission path (many small short-lived allocations per review beside a large
//! long-lived cache) mimalloc takes 10-25 % less CPU per review than glibc's malloc; by default
//! it returns freed pages only after a delay (1 s), which left the initial sync's garbage in the RSS
//! of an idle replica (95 MB where glibc had 72-89 MB, bench/NOTEBOOK.md). Purging at once during
//! the sync keeps the smallest RSS. While serving it does not pay: each page emptied by a review
//! was returned at once (an `madvise`, and a TLB shootdown: an IPI to the other cores, which a
//! virtual machine pays as an exit), and reviews then took 1.6 x the CPU in runs where the heap
//! fell into that pattern (bench/NOTEBOOK.md, part 1, "The allocator").

/// `mi_option_purge_delay` in the vendored mimalloc 3 (libmimalloc-sys 0.1.49, pinned): its
/// bindings name the options around it but not this one.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc 3's own purge delay, in milliseconds (`options.c`).
const DEFAULT_PURGE_DELAY_MS: std::os::raw::c_long = 1000;

/// Makes mimalloc return freed memory to the OS at once (purge delay 0). Call first in `main`.
pub fn purge_at_once() {
    // SAFETY: mi_option_set only stores the value of an option; any option index and value
    // are accepted (an unknown index is ignored).
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, 0) };
}

/// How long after the caches have synced memory is still returned at once: what is freed as the
/// sync ends (list buffers, the first reconciles) is returned with the sync's own garbage.
/// (Switched at Ready, the RSS read then was about 5 MB higher at 100,000 pods.)
pub const SYNC_SETTLES: std::time::Duration = std::time::Duration::from_secs(10);

/// Makes mimalloc return freed memory in batches again (its default delay, 1 s): call once the
/// caches have synced and settled ([`SYNC_SETTLES`]).
pub fn purge_batched() {
    // SAFETY: as in `purge_at_once`. The option is one machine word, read by mimalloc where it
    // schedules a purge: a thread allocating meanwhile sees the delay before or after, both
    // valid.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, DEFAULT_PURGE_DELAY_MS) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_set_is_the_purge_delay_and_batched_is_its_default() {
        // SAFETY: reading an option's value.
        let before = unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) };
        assert_eq!(
            before, 1000,
            "option {PURGE_DELAY} has the purge delay's default in mimalloc 3 (1000 ms, options.c)"
        );
        purge_at_once();
        // SAFETY: as above.
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }, 0);
        purge_batched();
        // SAFETY: as above.
        assert_eq!(
            unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) },
            DEFAULT_PURGE_DELAY_MS
        );
    }
}
