//! What the benchmark binaries (bench/) share (feature `bench`): flags, statistics, a plain
//! HTTP GET, reading a metric.

use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The value after `name` on the command line.
pub fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The `q` quantile (0..=1) of `values`, by nearest rank; NaN when there are none.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// User plus system CPU seconds process `pid` has spent (from `/proc/PID/stat`).
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    cpu_times(pid).map(|(user, system)| user + system)
}

/// User and system CPU seconds process `pid` has spent, apart (from `/proc/PID/stat`, read as
/// the process metrics read it).
pub fn cpu_times(pid: u32) -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let parsed = crate::metrics::parse_proc_stat(&stat).context("/proc/PID/stat")?;
    Ok((parsed.user_seconds, parsed.system_seconds))
}

/// Minor page faults process `pid` has taken (`/proc/PID/stat`, field 10): pages it touched
/// that the kernel had to map, zeroed when new to it.
pub fn minor_faults(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    minor_faults_of(&stat).context("/proc/PID/stat: minor faults")
}

/// Field 10 of a `/proc/PID/stat` text; counted after the command name's last `)`, which may
/// hold spaces and parentheses.
fn minor_faults_of(stat: &str) -> Option<u64> {
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    // `rest` starts at field 3 (state).
    rest.split_whitespace().nth(10 - 3)?.parse().ok()
}

/// User plus system CPU seconds the threads of process `pid` named `name` (as
/// `/proc/PID/task/TID/comm` gives it) alive now have spent (from `/proc/PID/task/*/stat`; a
/// thread that exits meanwhile no longer counts: meant for threads that live as long as the
/// process, such as a server's admission threads).
pub fn thread_cpu_seconds(pid: u32, name: &str) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for (task, comm) in task_files(pid, "comm")? {
        if comm.trim_end() != name {
            continue;
        }
        // A thread may exit between the reads.
        let Ok(stat) = std::fs::read_to_string(task.join("stat")) else {
            continue;
        };
        total += crate::metrics::parse_proc_stat(&stat)
            .context("/proc/PID/task/TID/stat")?
            .cpu_seconds;
    }
    Ok(total)
}

/// The file `file` of each thread of process `pid` alive now, read whole, with the thread's
/// directory (`/proc/PID/task/TID`); a thread that exits between the listing and the read is
/// left out.
fn task_files(pid: u32, file: &str) -> anyhow::Result<Vec<(std::path::PathBuf, String)>> {
    let mut read = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?.path();
        if let Ok(text) = std::fs::read_to_string(task.join(file)) {
            read.push((task, text));
        }
    }
    Ok(read)
}

/// User plus system CPU seconds each process alive now has spent, by pid (from
/// `/proc/PID/stat`; a process that exits meanwhile is left out).
pub fn cpu_by_process() -> anyhow::Result<std::collections::HashMap<u32, f64>> {
    let mut spent = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Ok(seconds) = cpu_seconds(pid) {
            spent.insert(pid, seconds);
        }
    }
    Ok(spent)
}

/// Context switches (voluntary and not) of the threads of process `pid` alive now, summed
/// (from `/proc/PID/task/*/status`; a thread that has exited no longer counts).
pub fn context_switches(pid: u32) -> anyhow::Result<u64> {
    let mut total = 0u64;
    for (_, status) in task_files(pid, "status")? {
        for line in status.lines() {
            if let Some(n) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total += n.trim().parse::<u64>().context("ctxt_switches")?;
            }
        }
    }
    Ok(total)
}

/// Seconds the threads of process `pid` alive now have spent runnable but waiting for a CPU,
/// summed (the second field of `/proc/PID/task/*/schedstat`, in ns; a thread that has exited no
/// longer counts).
pub fn run_delay_seconds(pid: u32) -> anyhow::Result<f64> {
    let mut total = 0u64;
    for (_, schedstat) in task_files(pid, "schedstat")? {
        total += schedstat
            .split_whitespace()
            .nth(1)
            .and_then(|ns| ns.parse::<u64>().ok())
            .context("/proc/PID/task/TID/schedstat")?;
    }
    Ok(total as f64 / 1e9)
}

/// TLB shootdowns the whole machine has taken so far (the `TLB` row of `/proc/interrupts`,
/// summed over the CPUs; x86 only, 0 where the row is absent). A process that returns memory
/// to the kernel while its other threads run interrupts the cores they run on.
pub fn tlb_shootdowns() -> anyhow::Result<u64> {
    Ok(tlb_row(&std::fs::read_to_string("/proc/interrupts")?))
}

/// The `TLB` row of `/proc/interrupts` text, summed over its CPUs' columns.
fn tlb_row(interrupts: &str) -> u64 {
    interrupts
        .lines()
        .find_map(|line| line.trim_start().strip_prefix("TLB:"))
        .map_or(0, |row| {
            row.split_whitespace()
                .map_while(|f| f.parse::<u64>().ok())
                .sum()
        })
}

/// The median of `values` (mean of the middle two for an even count); NaN when there are none.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// A plain HTTP/1.0 GET of `path` at `addr` (`HOST:PORT`): status and body.
pub async fn http_get(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let fetch = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.write_all(format!("GET {path} HTTP/1.0\r\nhost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut raw = Vec::new();
        tcp.read_to_end(&mut raw).await?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status: u16 = text.get(9..12).context("status line")?.parse()?;
        let body = text
            .split_once("\r\n\r\n")
            .map_or(String::new(), |(_, b)| b.to_owned());
        anyhow::Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), fetch)
        .await
        .context("GET timed out")?
}

/// The value of the sample `name` (with its labels, if any, exactly as exposed) in a
/// Prometheus text exposition.
pub fn metric(exposition: &str, name: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// The floor's handler (issue 22.1), as `bench-floor` serves it and `cargo bench --bench
/// admission` calls it in process: it deserializes only `request.uid` (serde skips the rest
/// without building it) and answers a fixed review carrying [`floor::ONE_LABEL`] (or the
/// patch set instead).
pub mod floor {
    use std::sync::OnceLock;

    use axum::body::Bytes;
    use axum::http::{StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use base64::Engine as _;
    use serde::Deserialize;

    /// The patch the floor answers, base64 as the API documents it: set once at the start
    /// ([`set_patch`]).
    static PATCH: OnceLock<String> = OnceLock::new();

    /// The patch answered unless another is set: one label.
    pub const ONE_LABEL: &[u8] =
        br#"[{"op":"add","path":"/metadata/labels/bench-floor","value":"answered"}]"#;

    /// Sets the JSON patch every answer carries (the first call wins).
    pub fn set_patch(patch: &[u8]) {
        let _ = PATCH.set(base64::engine::general_purpose::STANDARD.encode(patch));
    }

    #[derive(Deserialize)]
    struct Review {
        request: Request,
    }

    #[derive(Deserialize)]
    struct Request {
        uid: String,
    }

    /// Answers a review body: its uid read, the rest skipped.
    pub async fn answer(body: Bytes) -> Response {
        let Ok(review) = serde_json::from_slice::<Review>(&body) else {
            return (StatusCode::BAD_REQUEST, "{}").into_response();
        };
        fixed(&review.request.uid)
    }

    /// The fixed answer, for review `uid`.
    pub fn fixed(uid: &str) -> Response {
        let answer = serde_json::json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": PATCH.get()}});
        (
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::to_vec(&answer).unwrap_or_default(),
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minor_faults_are_field_ten_whatever_the_command_name_holds() {
        let stat = "4242 (a) (b c) S 1 4242 4242 0 -1 4194560 93125 0 7 0 120 40 0 0 20 0 9 0                     5000 300000000 30000 18446744073709551615";
        assert_eq!(minor_faults_of(stat), Some(93125));
        assert_eq!(
            minor_faults_of(&std::fs::read_to_string("/proc/self/stat").expect("own stat"))
                .map(|n| n > 0),
            Some(true),
            "this process has faulted pages in"
        );
        assert_eq!(minor_faults_of("4242 (cut) S 1 2"), None);
    }

    #[test]
    fn the_tlb_row_is_summed_over_its_cpus_and_absent_is_none() {
        let interrupts = "           CPU0       CPU1\n LOC:   21988822   22569659   Local timer interrupts\n TLB:    3673044    3619177   TLB shootdowns\n";
        assert_eq!(tlb_row(interrupts), 3_673_044 + 3_619_177);
        assert_eq!(tlb_row(" LOC:   1   2   Local timer interrupts\n"), 0);
    }

    #[test]
    fn a_named_threads_cpu_is_counted_and_no_other_threads() {
        const NAME: &str = "cpu-counted";
        let pid = std::process::id();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinning = stop.clone();
        let worker = std::thread::Builder::new()
            .name(NAME.into())
            .spawn(move || {
                let mut x = 0u64;
                while !spinning.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            })
            .expect("thread");
        // Polled until the kernel's tick accounting shows five ticks of the spinning thread's
        // CPU, more than the two by which the process's may fall short of it (below).
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut counted = 0.0;
        while counted < 0.05 && std::time::Instant::now() < deadline {
            counted = thread_cpu_seconds(pid, NAME).expect("read");
            std::thread::yield_now();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        worker.join().expect("joined");
        assert!(
            counted >= 0.05,
            "the named thread's CPU did not reach 5 ticks: {counted}"
        );
        // No thread of this name: nothing, however busy the others.
        assert_eq!(
            thread_cpu_seconds(pid, "no-such-thread").expect("read"),
            0.0
        );
        // The named thread's CPU is part of the process's, within two clock ticks: the kernel
        // truncates user and system time to ticks apart, for the thread and for the process.
        let process = cpu_seconds(pid).expect("read");
        assert!(process + 0.02 >= counted, "{process} against {counted}");
    }

    #[test]
    fn each_threads_files_are_read_and_summed() {
        const NAME: &str = "task-listed";
        let pid = std::process::id();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (started, start) = std::sync::mpsc::channel::<()>();
        let waiting = std::thread::Builder::new()
            .name(NAME.into())
            .spawn(move || {
                // The thread names itself before it runs this: once it says so, it is listed.
                started.send(()).expect("the test waits");
                wait.recv()
            })
            .expect("thread");
        start.recv().expect("started");
        let comms = task_files(pid, "comm").expect("read");
        assert!(
            comms.iter().any(|(_, comm)| comm.trim_end() == NAME),
            "{comms:?}"
        );
        // Every thread listed is one of this process's.
        let dir = std::path::PathBuf::from(format!("/proc/{pid}/task"));
        assert!(
            comms
                .iter()
                .all(|(task, _)| task.parent() == Some(dir.as_path()))
        );
        // Each thread's status and schedstat read and summed without an error.
        assert!(context_switches(pid).is_ok());
        assert!(run_delay_seconds(pid).is_ok_and(|seconds| seconds >= 0.0));
        release.send(()).expect("the thread waits");
        waiting.join().expect("joined").expect("released");
        // A process that is not there: an error, not nothing.
        assert!(task_files(u32::MAX, "comm").is_err());
    }
}
