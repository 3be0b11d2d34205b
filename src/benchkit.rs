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
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat
        .get(stat.rfind(')').context("/proc/PID/stat")? + 2..)
        .context("/proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11).context("utime")?.parse::<f64>()?
        + fields.get(12).context("stime")?.parse::<f64>()?;
    // USER_HZ is 100 on Linux.
    Ok(ticks / 100.0)
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
