//! An API server whose process hangs while its kernel still answers: its connections stay open,
//! what is sent to it is acknowledged, nothing comes back. TCP keepalive cannot see that. A
//! replica reaching the API server through a proxy that stops forwarding (both ways, new
//! connections included) gives its watches up once they bring nothing past their timeout (60 s,
//! the API server ending each watch after a bookmark) and a margin, and turns unready rather
//! than serving a frozen cache as current; once the proxy forwards again, the replica lists
//! again and is ready.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::support::*;

/// The replica's ports (unused by the suite's other instances).
const WEBHOOK_PORT: u16 = 19463;
const PROBE_PORT: u16 = 18097;

/// The longest a replica may take to turn unready once its API server hangs: a watch's timeout
/// (60 s) and its margin (15 s), 5 s for the watch asked again to bring nothing, and slack.
/// Before watches were ended every minute, it stayed ready for 330 s.
const UNREADY_WITHIN: Duration = Duration::from_secs(100);

/// A TCP proxy on loopback to `upstream` that forwards nothing while `frozen` holds true.
async fn proxy(upstream: SocketAddr, frozen: watch::Receiver<bool>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let frozen = frozen.clone();
            tokio::spawn(async move {
                // A hung process does not serve a new connection either.
                if frozen.clone().wait_for(|f| !*f).await.is_err() {
                    return;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let (from_client, to_client) = client.into_split();
                let (from_server, to_server) = server.into_split();
                tokio::join!(
                    pipe(from_client, to_server, frozen.clone()),
                    pipe(from_server, to_client, frozen),
                );
            });
        }
    });
    address
}

/// Copies `from` to `to`, reading nothing while `frozen` holds true.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut frozen: watch::Receiver<bool>) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        if frozen.wait_for(|f| !*f).await.is_err() {
            break;
        }
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            // Frozen while waiting to read: the read is dropped (nothing was taken).
            _ = frozen.wait_for(|f| *f) => continue,
        };
        match read {
            Ok(n) if n > 0 => {
                if to.write_all(&buffer[..n]).await.is_err() {
                    break;
                }
            }
            _ => break,
        }
    }
    let _ = to.shutdown().await;
}

/// Where the API server's URL stands in the replicas' kubeconfig `text`.
fn server_url(text: &str) -> std::ops::Range<usize> {
    let start = text.find("server: '").expect("a server") + "server: '".len();
    start..start + text[start..].find('\'').expect("the server's end")
}

/// The replicas' kubeconfig.
fn replicas_kubeconfig(env: &Env) -> String {
    std::fs::read_to_string(&env.sa_kubeconfig).expect("the replicas' kubeconfig")
}

/// The API server's address, as the replicas reach it.
fn api_server(env: &Env) -> SocketAddr {
    let text = replicas_kubeconfig(env);
    text[server_url(&text)]
        .strip_prefix("https://")
        .expect("an https URL")
        .parse()
        .expect("an address")
}

/// The replicas' kubeconfig with the API server reached through `proxy`.
fn through(env: &Env, proxy: SocketAddr) -> std::path::PathBuf {
    let mut text = replicas_kubeconfig(env);
    text.replace_range(server_url(&text), &format!("https://{proxy}"));
    let path = env.cluster_dir.join("hung-kubeconfig");
    std::fs::write(&path, text).expect("write kubeconfig");
    path
}

async fn readyz() -> (u16, String) {
    http_get(&format!("http://127.0.0.1:{PROBE_PORT}/readyz")).await
}

#[tokio::test]
async fn a_replica_whose_api_server_hangs_turns_unready_and_is_ready_once_it_answers() {
    let env = env().await;
    let (freeze, frozen) = watch::channel(false);
    let kubeconfig = through(&env, proxy(api_server(&env), frozen).await);
    let log = std::fs::File::create(env.cluster_dir.join("logs/persistent-pod-state-hung.log"))
        .expect("log file");
    let mut command = serve_command(&env, &kubeconfig, WEBHOOK_PORT, PROBE_PORT);
    command
        // A follower on the suite's Lease, with the suite's timings (should it ever take the
        // Lease, the next test waits no longer than after a replica's death).
        .env("PPS_LEADER_IDENTITY", "e2e-hung")
        .env(
            "PPS_LEASE_DURATION_SECONDS",
            env.lease_duration.as_secs().to_string(),
        )
        .env("PPS_LEASE_RENEW_DEADLINE_SECONDS", "5")
        .env("PPS_LEASE_RETRY_PERIOD_SECONDS", "1")
        .env("RUST_LOG", "info")
        .stderr(log);
    let mut replica = tokio::process::Command::from(command)
        .kill_on_drop(true)
        .spawn()
        .expect("serve starts");
    wait_for("the replica to be ready", TIMEOUT, || async {
        (readyz().await.0 == 200).then_some(())
    })
    .await;

    freeze.send_replace(true);
    let hung = Instant::now();
    let said = wait_for("the replica to turn unready", UNREADY_WITHIN, || async {
        let (status, body) = readyz().await;
        (status != 200).then_some(body)
    })
    .await;
    let unready = hung.elapsed();
    assert!(said.contains("caches not current"), "{said}");
    println!(
        "API server hung: the replica unready after {:.1} s ({said})",
        unready.as_secs_f64()
    );

    freeze.send_replace(false);
    let answers = Instant::now();
    wait_for("the replica to be ready again", TIMEOUT, || async {
        (readyz().await.0 == 200).then_some(())
    })
    .await;
    println!(
        "API server answering again: the replica ready after {:.1} s",
        answers.elapsed().as_secs_f64()
    );
    replica.kill().await.expect("kill");
}
