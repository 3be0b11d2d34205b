//! A TCP load balancer on loopback for the e2e suite, standing in for the Service in front of
//! the webhook replicas: each connection goes to the next backend that accepts it, so the API
//! server keeps reaching the webhooks while one replica is down.
//!
//! A `--ready-backend` is one whose readiness probe is asked first, for each connection: it is
//! passed over unless `GET /readyz` on its probe address answers 200 (a Service's endpoints hold
//! only ready pods, unless it publishes not-ready addresses: a `--backend` stands for one that
//! does). With no backend to go to, the connection is closed, and a line says so on stderr.
//!
//! Usage: loopback-lb --listen 127.0.0.1:PORT [--backend 127.0.0.1:PORT]...
//!        [--ready-backend 127.0.0.1:PORT=127.0.0.1:PROBE_PORT]...

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A backend, and the probe address whose `/readyz` says whether it takes connections.
type Backend = (SocketAddr, Option<SocketAddr>);

/// Whether `GET /readyz` at `probe` answers 200 within a second.
async fn ready(probe: SocketAddr) -> bool {
    let ask = async {
        let mut stream = TcpStream::connect(probe).await?;
        stream
            .write_all(b"GET /readyz HTTP/1.0\r\nHost: probe\r\n\r\n")
            .await?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await?;
        std::io::Result::Ok(head.ends_with(b" 200"))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), ask).await,
        Ok(Ok(true))
    )
}

async fn connect_any(backends: &[Backend], start: usize) -> Option<TcpStream> {
    for i in 0..backends.len() {
        let (addr, probe) = backends[(start + i) % backends.len()];
        if let Some(probe) = probe
            && !ready(probe).await
        {
            continue;
        }
        if let Ok(Ok(stream)) =
            tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await
        {
            return Some(stream);
        }
    }
    None
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut listen = None;
    let mut backends = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{arg} needs a value"))?;
        match arg.as_str() {
            "--listen" => listen = Some(value.parse::<SocketAddr>()?),
            "--backend" => backends.push((value.parse::<SocketAddr>()?, None)),
            "--ready-backend" => {
                let (addr, probe) = value
                    .split_once('=')
                    .context("--ready-backend needs ADDRESS=PROBE_ADDRESS")?;
                backends.push((addr.parse()?, Some(probe.parse()?)));
            }
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    let listen = listen.context("--listen is required")?;
    anyhow::ensure!(!backends.is_empty(), "at least one backend");
    let backends: Arc<[Backend]> = backends.into();
    let next = Arc::new(AtomicUsize::new(0));
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (mut client, _) = listener.accept().await?;
        let (backends, next) = (backends.clone(), next.clone());
        tokio::spawn(async move {
            let start = next.fetch_add(1, Ordering::Relaxed);
            match connect_any(&backends, start).await {
                Some(mut backend) => {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut backend).await;
                }
                None => eprintln!("no backend to go to: connection closed"),
            }
        });
    }
}
