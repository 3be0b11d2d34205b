//! The allocator of the serving binaries: mimalloc (set as `#[global_allocator]` in
//! `src/main.rs` and `bench/server.rs`). Freed memory is returned to the OS in batches (mimalloc's
//! default delay, 1 s) while the caches sync, all of it as they become synced ([`synced`]), at
//! once for [`SYNC_SETTLES`] after, and in batches again from then on ([`purge_batched`]).
//!
//! On the admission path (many small short-lived allocations per review beside a large
//! long-lived cache) mimalloc takes 10-25 % less CPU per review than glibc's malloc; by default
//! it returns freed pages only after a delay, which left the initial sync's garbage in the RSS
//! of an idle replica (95 MB where glibc had 72-89 MB, bench/NOTEBOOK.md): hence the collection
//! as the caches sync and purging at once while the sync settles. Purging at once through the
//! sync itself cost the start its CPU: every page the decoding freed was returned and then
//! faulted in again, zeroed (page faults were 22 % of a replica's start CPU at 100,000 pods,
//! bench/NOTEBOOK.md, part 5). While serving it does not pay either: each page emptied by a
//! review was returned at once (an `madvise`, and a TLB shootdown: an IPI to the other cores,
//! which a virtual machine pays as an exit), and reviews then took 1.6 x the CPU in runs where
//! the heap fell into that pattern (bench/NOTEBOOK.md, part 1, "The allocator").

/// `mi_option_purge_delay` in the vendored mimalloc 3 (libmimalloc-sys 0.1.49, pinned): its
/// bindings name the options around it but not this one.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc 3's own purge delay, in milliseconds (`options.c`).
const DEFAULT_PURGE_DELAY_MS: std::os::raw::c_long = 1000;

/// Returns to the OS every freed range mimalloc holds, then makes it return freed memory at
/// once (purge delay 0): call as the caches become synced.
pub fn synced() {
    // SAFETY: mi_collect may be called from any thread at any time; forced, it purges every
    // range scheduled for a purge. It comes first: with the delay at 0, mimalloc 3 skips the
    // scheduled ranges (`mi_arenas_try_purge` returns early), which would stay in the RSS.
    unsafe { libmimalloc_sys::mi_collect(true) };
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
    // SAFETY: as in `synced`. The option is one machine word, read by mimalloc where it
    // schedules a purge: a thread allocating meanwhile sees the delay before or after, both
    // valid.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, DEFAULT_PURGE_DELAY_MS) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_set_is_the_purge_delay_at_once_when_synced_then_batched() {
        // SAFETY: reading an option's value.
        let before = unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) };
        assert_eq!(
            before, 1000,
            "option {PURGE_DELAY} has the purge delay's default in mimalloc 3 (1000 ms, options.c)"
        );
        synced();
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
