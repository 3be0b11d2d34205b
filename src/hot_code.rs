//! The binary's hot code on one 2 MiB page (issue 22.1, bench/NOTEBOOK.md part 3).
//!
//! The functions a review runs are linked first in the code and together (`link/`), and the
//! code's segment starts on a 2 MiB boundary (`-z separate-code` with `-z max-page-size` of
//! 2 MiB, `link/hot-first.sh`), so they lie in its first 2 MiB. [`place`] copies those 2 MiB to one transparent huge page and puts
//! the copy in their place: the processor then finds a review's code through one TLB entry
//! instead of about 140, which other processes and guests evict between two reviews.
//!
//! It gives up, leaving the code as the kernel mapped it, wherever a step is refused: code not
//! 2 MiB-aligned in memory, no huge page to be had (transparent huge pages off, or memory too
//! fragmented), executable memory refused (SELinux's `execmem`, for one). Should the last step,
//! the move over the code, fail after the kernel has unmapped the code (it unmaps first), the
//! binary's pages are mapped back from its file before any of its functions runs. It costs 2 MiB of
//! anonymous memory in place of the file's pages. `perf` names no function of the page by
//! itself (it is no longer the file's); [`write_perf_map`] writes the map it reads for such
//! code (`--hot-code-perf-map`), as a JIT does for its own.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::fs;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;

use object::{Object, ObjectSymbol, SymbolKind};

/// A huge page on x86-64 (a page table's middle level).
pub const HUGE_PAGE: usize = 2 << 20;

/// `MADV_COLLAPSE` (Linux 6.1 on): makes a range huge pages at once (the `libc` crate names it
/// only for glibc).
const MADV_COLLAPSE: libc::c_int = 25;

/// Puts the first 2 MiB of this binary's code on a huge page; returns their address, or why
/// not. Call while the process has one thread (first in `main`): the code is replaced under
/// it, and another thread running those bytes at that instant could fault.
pub fn place() -> Result<usize, String> {
    let here = place as *const () as usize;
    let maps =
        fs::read_to_string("/proc/self/maps").map_err(|e| format!("/proc/self/maps: {e}"))?;
    let (start, end, offset) = maps
        .lines()
        .filter_map(|line| Some((range(line)?, file_offset(line)?)))
        .find(|((start, end), _)| (*start..*end).contains(&here))
        .map(|((start, end), offset)| (start, end, offset))
        .ok_or("its code is not in /proc/self/maps")?;
    if (start..start.saturating_add(HUGE_PAGE)).contains(&here) {
        // This function must run on while the range is replaced, and after a failed move.
        return Err("the function that moves the code lies in its first 2 MiB".into());
    }
    if start % HUGE_PAGE != 0 {
        return Err(format!(
            "its code starts at {start:#x}, not 2 MiB-aligned (not linked by link/hot-first.sh, \
             or loaded by a kernel before 5.10)"
        ));
    }
    if end - start < HUGE_PAGE {
        return Err("its code is smaller than 2 MiB".into());
    }
    // What maps the code back should the move fail: the binary, open, and the code's offset in it.
    let exe = fs::File::open("/proc/self/exe").map_err(|e| format!("/proc/self/exe: {e}"))?;
    let (fd, offset) = (
        exe.as_raw_fd(),
        libc::off_t::try_from(offset).map_err(|_| "its code's offset in the file")?,
    );
    let copy = huge_copy(start)?;
    // SAFETY: `copy` is a mapping of ours of HUGE_PAGE bytes; making it read-only and
    // executable touches nothing else.
    if unsafe { libc::mprotect(copy, HUGE_PAGE, libc::PROT_READ | libc::PROT_EXEC) } != 0 {
        let error = std::io::Error::last_os_error();
        unmap(copy);
        return Err(format!("executable memory refused: {error}"));
    }
    // SAFETY: moves our mapping `copy` over [start, start + HUGE_PAGE), the first 2 MiB of the
    // binary's code, which the copy holds byte for byte. The caller has no other thread, and
    // this function returns into the same bytes, now the copy's. Both ends are 2 MiB-aligned,
    // so the kernel moves the huge page whole.
    let moved = unsafe {
        libc::mremap(
            copy,
            HUGE_PAGE,
            HUGE_PAGE,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            start as *mut c_void,
        )
    };
    if moved == libc::MAP_FAILED {
        // SAFETY: reads this thread's errno (a libc function, called through the GOT).
        let errno = unsafe { *libc::__errno_location() };
        // The range may be unmapped: no function of the binary runs before it is mapped back.
        if map_back(start, HUGE_PAGE, fd, offset).is_err() {
            let message = b"persistent-pod-state: its code could not be mapped back from its \
                file after a failed mremap\n";
            // SAFETY: libc's write and abort (through the GOT) on a static message.
            unsafe {
                libc::write(2, message.as_ptr().cast(), message.len());
                libc::abort();
            }
        }
        unmap(copy);
        drop(exe);
        return Err(format!(
            "mremap: {}; the code is mapped from the binary's file as before",
            std::io::Error::from_raw_os_error(errno)
        ));
    }
    Ok(start)
}

/// Maps `len` bytes of the file `fd` from `offset` at `start`, readable and executable, private,
/// in place of whatever lies there (or nothing): the binary's code as the kernel maps it. Makes
/// no call into this binary's own code, which may be missing from that range when it runs
/// (inlined into its caller, so that it is not itself such code).
#[inline(always)]
fn map_back(start: usize, len: usize, fd: RawFd, offset: libc::off_t) -> Result<(), ()> {
    // SAFETY: replaces [start, start + len) only, with the file's bytes (the caller's code
    // range, or a test's mapping of its own).
    let mapped = unsafe {
        libc::mmap(
            start as *mut c_void,
            len,
            libc::PROT_READ | libc::PROT_EXEC,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            fd,
            offset,
        )
    };
    if mapped as usize == start {
        Ok(())
    } else {
        Err(())
    }
}

/// Writes `/tmp/perf-PID.map`, where `perf` (and the profilers that read its maps) looks up the
/// functions of anonymous executable memory: every function of this binary on the page at
/// `start` (where [`place`] put it), as its address, size and name, one a line. Returns the
/// file and how many functions it names. The file is left when the process ends, so that a
/// profile can be reported after it.
pub fn write_perf_map(start: usize) -> Result<(PathBuf, usize), String> {
    let functions = functions_in(start, HUGE_PAGE)?;
    let mut text = String::new();
    for function in &functions {
        let _ = writeln!(
            text,
            "{:x} {:x} {}",
            function.start, function.size, function.name
        );
    }
    let path = PathBuf::from(format!("/tmp/perf-{}.map", std::process::id()));
    fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((path, functions.len()))
}

/// A function of this binary: where it lies in memory, and its name, demangled.
#[derive(Debug)]
struct Function {
    start: usize,
    size: usize,
    name: String,
}

/// The functions of this binary (its symbol table) that lie, at least in part, in
/// `[start, start + len)` of memory, by address.
fn functions_in(start: usize, len: usize) -> Result<Vec<Function>, String> {
    let exe = fs::File::open("/proc/self/exe").map_err(|e| format!("/proc/self/exe: {e}"))?;
    let cache = object::ReadCache::new(exe);
    let file = object::File::parse(&cache).map_err(|e| format!("reading its binary: {e}"))?;
    // Where the binary was loaded: its entry point in memory (the kernel's auxiliary vector)
    // less the entry point's address in the file.
    // SAFETY: getauxval only reads the process's auxiliary vector.
    let entry = unsafe { libc::getauxval(libc::AT_ENTRY) };
    let bias = entry.wrapping_sub(file.entry());
    let end = start.saturating_add(len);
    let mut symbols = file.symbols().peekable();
    if symbols.peek().is_none() {
        return Err("its binary has no symbol table (stripped)".into());
    }
    let mut functions: Vec<Function> = symbols
        .filter(|symbol| symbol.kind() == SymbolKind::Text && symbol.size() > 0)
        .filter_map(|symbol| {
            let at = usize::try_from(symbol.address().wrapping_add(bias)).ok()?;
            let size = usize::try_from(symbol.size()).ok()?;
            let name = symbol.name().ok()?;
            (at < end && at.saturating_add(size) > start).then(|| Function {
                start: at,
                size,
                name: format!("{:#}", rustc_demangle::demangle(name)),
            })
        })
        .collect();
    functions.sort_by_key(|function| function.start);
    functions.dedup_by_key(|function| function.start);
    Ok(functions)
}

/// A copy of the 2 MiB at `start` (readable) on a huge page of a writable mapping of its own.
fn huge_copy(start: usize) -> Result<*mut c_void, String> {
    // Twice the size, to cut a 2 MiB-aligned range out of it.
    let base = anonymous(2 * HUGE_PAGE)?;
    let aligned = base.next_multiple_of(HUGE_PAGE);
    // The parts before and after the aligned range are given back.
    if aligned > base {
        unmap_range(base, aligned - base);
    }
    if base + 2 * HUGE_PAGE > aligned + HUGE_PAGE {
        unmap_range(
            aligned + HUGE_PAGE,
            base + 2 * HUGE_PAGE - (aligned + HUGE_PAGE),
        );
    }
    let copy = aligned as *mut c_void;
    // SAFETY: advice on our own mapping.
    if unsafe { libc::madvise(copy, HUGE_PAGE, libc::MADV_HUGEPAGE) } != 0 {
        let error = std::io::Error::last_os_error();
        unmap(copy);
        return Err(format!("no transparent huge pages (madvise: {error})"));
    }
    // SAFETY: [start, start + HUGE_PAGE) is mapped readable (the caller found it in the
    // binary's code mapping), and `copy` is a writable mapping of ours of that size; they do
    // not overlap.
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, copy.cast::<u8>(), HUGE_PAGE) };
    if huge_kib(aligned) != Some(HUGE_PAGE / 1024) {
        // The fault took small pages (memory fragmented): ask for the collapse at once.
        // SAFETY: advice on our own mapping.
        unsafe { libc::madvise(copy, HUGE_PAGE, MADV_COLLAPSE) };
    }
    match huge_kib(aligned) {
        Some(kib) if kib == HUGE_PAGE / 1024 => Ok(copy),
        kib => {
            unmap(copy);
            Err(format!(
                "no huge page to be had ({} KiB of 2048 huge; transparent huge pages off, or memory \
                 fragmented)",
                kib.unwrap_or(0)
            ))
        }
    }
}

/// A new private anonymous mapping of `len` bytes, readable and writable: its address.
fn anonymous(len: usize) -> Result<usize, String> {
    // SAFETY: a new private anonymous mapping; nothing else is touched.
    let area = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if area == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    Ok(area as usize)
}

/// The address range of a line of `/proc/PID/maps`: its start and end.
fn range(line: &str) -> Option<(usize, usize)> {
    let (start, end) = line.split_whitespace().next()?.split_once('-')?;
    Some((
        usize::from_str_radix(start, 16).ok()?,
        usize::from_str_radix(end, 16).ok()?,
    ))
}

/// The file offset of a line of `/proc/PID/maps` (its third field).
fn file_offset(line: &str) -> Option<u64> {
    u64::from_str_radix(line.split_whitespace().nth(2)?, 16).ok()
}

/// How many KiB of the mapping that starts at `start` are on huge pages (`AnonHugePages` in
/// `/proc/self/smaps`).
fn huge_kib(start: usize) -> Option<usize> {
    let smaps = fs::read_to_string("/proc/self/smaps").ok()?;
    anon_huge_kib(&smaps, start)
}

/// `AnonHugePages` of the mapping of `smaps` (`/proc/PID/smaps`) that starts at `start`.
fn anon_huge_kib(smaps: &str, start: usize) -> Option<usize> {
    let head = format!("{start:x}-");
    let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&head));
    lines.next()?;
    lines
        .take_while(|line| {
            line.split_whitespace()
                .next()
                .is_some_and(|key| key.ends_with(':'))
        })
        .find_map(|line| line.strip_prefix("AnonHugePages:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

fn unmap(copy: *mut c_void) {
    unmap_range(copy as usize, HUGE_PAGE);
}

fn unmap_range(start: usize, len: usize) {
    // SAFETY: only ever called on (parts of) a mapping `anonymous` made, not yet moved
    // (`huge_copy`'s, or a test's).
    unsafe { libc::munmap(start as *mut c_void, len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_perf_map_names_each_function_of_a_range_at_its_address_in_memory() {
        let here = place as *const () as usize;
        let page = here - here % HUGE_PAGE;
        let (path, count) = write_perf_map(page).expect("the test binary's symbols");
        let text = fs::read_to_string(&path).expect("the map");
        let _ = fs::remove_file(&path);
        assert_eq!(
            path,
            PathBuf::from(format!("/tmp/perf-{}.map", std::process::id()))
        );
        let lines: Vec<(usize, usize, &str)> = text
            .lines()
            .map(|line| {
                let mut fields = line.splitn(3, ' ');
                let mut hex = || usize::from_str_radix(fields.next().expect("a field"), 16);
                let (start, size) = (hex().expect("start"), hex().expect("size"));
                (start, size, fields.next().expect("a name"))
            })
            .collect();
        assert_eq!(lines.len(), count);
        assert!(count > 1, "{text}");
        // The function at `place`'s address in memory is named `place`.
        let holder = lines
            .iter()
            .find(|(start, size, _)| (*start..start + size).contains(&here))
            .expect("a function at place's address");
        assert_eq!(holder.2, "persistent_pod_state::hot_code::place");
        // Each lies on the page, by address, once.
        assert!(
            lines
                .iter()
                .all(|(start, size, _)| *start < page + HUGE_PAGE && start + size > page)
        );
        assert!(lines.windows(2).all(|pair| pair[0].0 < pair[1].0));
    }

    #[test]
    fn reads_the_range_of_a_maps_line() {
        assert_eq!(
            range("56248a800000-56248aa00000 r-xp 00000000 00:00 0 "),
            Some((0x5624_8a80_0000, 0x5624_8aa0_0000))
        );
        assert_eq!(
            range("7ffd1000-7ffd2000 r--p 00000000 00:00 0  [vvar]"),
            Some((0x7ffd_1000, 0x7ffd_2000))
        );
        assert_eq!(range("56248a800000 r-xp"), None);
        assert_eq!(range("5624z-56248 r-xp"), None);
        assert_eq!(range(""), None);
    }

    #[test]
    fn reads_the_file_offset_of_a_maps_line() {
        assert_eq!(
            file_offset("55d2c8600000-55d2c954b000 r-xp 00600000 08:01 1234 /bin/pps"),
            Some(0x60_0000)
        );
        assert_eq!(file_offset("55d2c8600000-55d2c954b000 r-xp"), None);
        assert_eq!(file_offset("55d2c8600000-55d2c954b000 r-xp 0060z000"), None);
    }

    #[test]
    fn maps_a_files_pages_back_over_a_range() {
        let page = 4096;
        // A file of three pages, each of one byte value; the range: two pages of zeros.
        let bytes: Vec<u8> = (1..=3u8)
            .flat_map(|value| std::iter::repeat_n(value, page))
            .collect();
        let path = std::env::temp_dir().join(format!("pps-map-back-{}", std::process::id()));
        fs::write(&path, &bytes).expect("the file");
        let file = fs::File::open(&path).expect("open");
        let _ = fs::remove_file(&path);
        let start = anonymous(2 * page).expect("a mapping");
        // The file's second and third pages over both.
        map_back(start, 2 * page, file.as_raw_fd(), 4096).expect("mapped back");
        // SAFETY: the range is mapped readable, 2 pages long.
        let seen = unsafe { std::slice::from_raw_parts(start as *const u8, 2 * page) };
        assert_eq!(seen, &bytes[page..]);
        // An offset the file does not have to give (not page-aligned) is refused.
        assert_eq!(map_back(start, page, file.as_raw_fd(), 1), Err(()));
        unmap_range(start, 2 * page);
    }

    #[test]
    fn reads_the_huge_pages_of_the_mapping_that_starts_at_an_address() {
        let smaps = "\
5624888000-5624890000 r--p 00000000 08:01 12 /bin/persistent-pod-state
Size:                 32 kB
AnonHugePages:         0 kB
VmFlags: rd mr mw me
56248a800000-56248aa00000 rw-p 00000000 00:00 0 
Size:               2048 kB
AnonHugePages:      2048 kB
VmFlags: rd wr mr mw me ac hg
56248aa00000-56248ab00000 rw-p 00000000 00:00 0 
Size:               1024 kB
VmFlags: rd wr mr mw me ac
";
        assert_eq!(anon_huge_kib(smaps, 0x5624_8a80_0000), Some(2048));
        assert_eq!(anon_huge_kib(smaps, 0x56_2488_8000), Some(0));
        // A mapping without the line is not read as the next one's, and an address that
        // starts no mapping (only inside one) has none.
        assert_eq!(anon_huge_kib(smaps, 0x5624_8aa0_0000), None);
        assert_eq!(anon_huge_kib(smaps, 0x5624_8a90_0000), None);
        assert_eq!(anon_huge_kib(smaps, 0x1000), None);
    }
}
