//! A TCP load balancer on loopback for the e2e suite, standing in for the Service in front of
//! the webhook replicas: each connection goes to the next backend that accepts it, so the API
//! server keeps reaching the webhooks while one replica is down.
//!
//! Usage: loopback-lb --listen 127.0.0.1:PORT --backend 127.0.0.1:PORT [--backend ...]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};

async fn connect_any(backends: &[SocketAddr], start: usize) -> Option<TcpStream> {
    for i in 0..backends.len() {
        let addr = backends[(start + i) % backends.len()];
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
            "--backend" => backends.push(value.parse::<SocketAddr>()?),
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    let listen = listen.context("--listen is required")?;
    anyhow::ensure!(!backends.is_empty(), "at least one --backend");
    let backends: Arc<[SocketAddr]> = backends.into();
    let next = Arc::new(AtomicUsize::new(0));
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (mut client, _) = listener.accept().await?;
        let (backends, next) = (backends.clone(), next.clone());
        tokio::spawn(async move {
            let start = next.fetch_add(1, Ordering::Relaxed);
            if let Some(mut backend) = connect_any(&backends, start).await {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut backend).await;
            }
        });
    }
}
