//! The load generator of `bench-https`: HTTP/1.1 keep-alive over rustls (as the API server
//! calls a webhook), closed-loop for maximum throughput or open-loop at a fixed rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// One load run.
pub struct Spec<'a> {
    /// Server address.
    pub addr: &'a str,
    /// PEM file of the CA that signed the server's certificate.
    pub ca: &'a std::path::Path,
    /// Keep-alive connections (one request in flight on each).
    pub connections: usize,
    /// Measured time (after a warm-up of a tenth of it).
    pub seconds: f64,
    /// Requests per second in total; `None` for closed-loop (as fast as answered).
    pub rate: Option<f64>,
    /// The server's pid, for its CPU time.
    pub pid: u32,
    /// Request bodies, sent round-robin.
    pub bodies: Arc<Vec<Vec<u8>>>,
}

/// What one load run measured.
#[derive(Clone, Copy, Debug)]
pub struct Outcome {
    /// Requests answered 200 in the measured time.
    pub requests: u64,
    /// Requests that failed (any status but 200, or a broken connection).
    pub errors: u64,
    /// Answered requests per second.
    pub throughput: f64,
    /// Median latency, µs (at a fixed rate, from the scheduled time of a request whose connection
    /// was still busy then: queueing counts).
    pub p50_us: u32,
    /// 99th percentile latency, µs.
    pub p99_us: u32,
    /// Server CPU time (user + system) per answered request, µs.
    pub cpu_per_request_us: f64,
}

/// User plus system CPU seconds of a process.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on Linux.
    Some(ticks / 100.0)
}

/// POST requests of the given JSON bodies to `path`.
pub fn requests(path: &str, bodies: impl Iterator<Item = Vec<u8>>) -> Arc<Vec<Vec<u8>>> {
    Arc::new(
        bodies
            .map(|body| {
                let mut r = format!(
                    "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                r.extend_from_slice(&body);
                r
            })
            .collect(),
    )
}

/// Reads one HTTP/1.1 response (headers and a Content-Length body); returns its status.
async fn read_response(
    stream: &mut TlsStream<TcpStream>,
    buf: &mut Vec<u8>,
) -> anyhow::Result<u16> {
    buf.clear();
    let mut chunk = [0u8; 16 * 1024];
    let header_end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = stream.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..header_end])?;
    let status: u16 = head.get(9..12).context("status line")?.parse()?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .context("content-length")?;
    while buf.len() < header_end + length {
        let n = stream.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(status)
}

fn connector(ca: &std::path::Path) -> anyhow::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca)? {
        roots.add(cert?)?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

/// Sends one request on a new connection; the status and the body of the answer.
pub async fn once(
    addr: &str,
    ca: &std::path::Path,
    request: &[u8],
) -> anyhow::Result<(u16, Vec<u8>)> {
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
    let mut stream = connector(ca)?.connect(name, tcp).await?;
    stream.write_all(request).await?;
    let mut buf = Vec::new();
    let status = read_response(&mut stream, &mut buf).await?;
    let body_at = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(buf.len(), |end| end + 4);
    Ok((status, buf.split_off(body_at)))
}

/// Sends requests over `spec.connections` connections for the warm-up and then the measured
/// time; every figure is of the measured time only.
pub async fn run(spec: &Spec<'_>) -> anyhow::Result<Outcome> {
    let connector = connector(spec.ca)?;
    let mut streams = Vec::with_capacity(spec.connections);
    for _ in 0..spec.connections {
        let tcp = TcpStream::connect(spec.addr).await?;
        tcp.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
        streams.push(connector.connect(name, tcp).await?);
    }
    let warm_up = Duration::from_secs_f64(spec.seconds / 10.0);
    let start = Instant::now();
    let measured_from = start + warm_up;
    let deadline = measured_from + Duration::from_secs_f64(spec.seconds);
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let rate = spec.rate;
    let tasks: Vec<_> = streams
        .into_iter()
        .map(|mut stream| {
            let (requests, next, errors) = (spec.bodies.clone(), next.clone(), errors.clone());
            tokio::spawn(async move {
                let mut latencies: Vec<u32> = Vec::new();
                let mut buf = Vec::with_capacity(64 * 1024);
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let scheduled = match rate {
                        Some(r) => start + Duration::from_secs_f64(k as f64 / r),
                        None => Instant::now(),
                    };
                    if scheduled >= deadline {
                        break;
                    }
                    // Latency counts from the scheduled time when this connection was still
                    // busy then (the server held it: queueing counts), else from when the
                    // request is sent (the timer's lateness is the generator's, not the server's).
                    let sent = if Instant::now() < scheduled {
                        tokio::time::sleep_until(tokio::time::Instant::from_std(scheduled)).await;
                        Instant::now()
                    } else {
                        scheduled
                    };
                    let request = &requests[k as usize % requests.len()];
                    let answered = async {
                        stream.write_all(request).await?;
                        read_response(&mut stream, &mut buf).await
                    }
                    .await;
                    match answered {
                        Ok(200) if scheduled >= measured_from => latencies
                            .push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX)),
                        Ok(200) => {}
                        _ => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    }
                }
                latencies
            })
        })
        .collect();
    tokio::time::sleep_until(tokio::time::Instant::from_std(measured_from)).await;
    let cpu_before = cpu_seconds(spec.pid).context("server CPU time")?;
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await?);
    }
    let elapsed = measured_from.elapsed().as_secs_f64();
    let cpu = cpu_seconds(spec.pid).context("server CPU time")? - cpu_before;
    latencies.sort_unstable();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    let n = latencies.len() as u64;
    Ok(Outcome {
        requests: n,
        errors: errors.load(Ordering::Relaxed),
        throughput: n as f64 / elapsed,
        p50_us: at(0.50),
        p99_us: at(0.99),
        cpu_per_request_us: cpu * 1e6 / n.max(1) as f64,
    })
}
