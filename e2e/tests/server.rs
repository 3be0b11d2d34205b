//! The server's contract with clients: bad input, readiness, shutdown.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::*;

fn review(object: Value) -> String {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "e2e-uid-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE", "userInfo": {}, "namespace": "default", "name": "x-0",
            "object": object
        }
    })
    .to_string()
}

async fn post(env: &Env, body: &str) -> (u16, String) {
    post_at(env, &env.webhook_url, body).await
}

/// Posts `body` as a pod review to the webhook at `base` (`https://HOST:PORT`).
async fn post_at(env: &Env, base: &str, body: &str) -> (u16, String) {
    let ca = env.cluster_dir.join("webhook-certs/ca.crt");
    let url = format!("{base}/mutate-pod");
    curl(&[
        "-s",
        "--cacert",
        ca.to_str().expect("path"),
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        body,
        "-w",
        "\n%{http_code}",
        &url,
    ])
    .await
}

/// Bad input: 400 with a JSON message for non-reviews; a parsed review with an unreadable pod
/// is answered with its uid, allowed, and counted; the server keeps serving.
#[tokio::test]
async fn malformed_requests_get_clear_answers_and_the_server_keeps_serving() {
    let env = env().await;
    let before = scrape(&env).await;
    for body in [
        "",
        "{",
        "[1,2]",
        r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
    ] {
        let (code, text) = post(&env, body).await;
        assert_eq!(code, 400, "{body:?}");
        let msg: Value = serde_json::from_str(&text).expect("JSON error body");
        assert!(
            msg["error"].as_str().is_some_and(|m| !m.is_empty()),
            "{text}"
        );
    }
    for object in [
        json!("not a pod"),
        json!({"spec": {"tolerations": "nope"}}),
        json!(42),
    ] {
        let (code, text) = post(&env, &review(object.clone())).await;
        assert_eq!(code, 200, "{object}");
        let answer: Value = serde_json::from_str(&text).expect("review");
        assert_eq!(answer["response"]["uid"], "e2e-uid-1");
        assert_eq!(answer["response"]["allowed"], true);
        assert!(answer["response"].get("patch").is_none());
    }
    let after = scrape(&env).await;
    let bad = r#"pps_admission_requests_total{endpoint="/mutate-pod",result="bad_request"}"#;
    let invalid = r#"pps_admission_requests_total{endpoint="/mutate-pod",result="invalid_object"}"#;
    assert!(metric(&after, bad) - metric(&before, bad) >= 4.0);
    assert!(metric(&after, invalid) - metric(&before, invalid) >= 3.0);
    let (code, _) = post(
        &env,
        &review(json!({"metadata": {"name": "x-0"}, "spec": {"containers": []}})),
    )
    .await;
    assert_eq!(code, 200, "still serving");
}

struct Instance {
    child: tokio::process::Child,
    probe: String,
}

async fn start_instance(
    env: &Env,
    webhook_port: u16,
    probe_port: u16,
    kubeconfig: &std::path::Path,
) -> Instance {
    let mut command = serve_command(env, kubeconfig, webhook_port, probe_port);
    command.env("PPS_SHUTDOWN_DELAY_SECONDS", "5");
    let probe = format!("http://127.0.0.1:{probe_port}");
    let child = spawn_until(command, &format!("{probe}/healthz")).await;
    Instance { child, probe }
}

/// Spawns the `serve` of `command` (killed when dropped) and waits until `probe` answers 200.
async fn spawn_until(command: std::process::Command, probe: &str) -> tokio::process::Child {
    let child = tokio::process::Command::from(command)
        .kill_on_drop(true)
        .spawn()
        .expect("serve starts");
    wait_for(probe, TIMEOUT, || async {
        (http_get(probe).await.0 == 200).then_some(())
    })
    .await;
    child
}

/// A kubeconfig naming an API server that is not there (written into the cluster's
/// directory).
fn dead_kubeconfig(env: &Env) -> std::path::PathBuf {
    let dead = env.cluster_dir.join("dead-kubeconfig");
    std::fs::write(
        &dead,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: d\n  cluster: {server: 'https://127.0.0.1:1'}\nusers:\n- name: u\n  user: {token: x}\ncontexts:\n- name: d\n  context: {cluster: d, user: u}\ncurrent-context: d\n",
    )
    .expect("write kubeconfig");
    dead
}

/// 6: not ready and 503 on /mutate-pod while the caches cannot sync (API server unreachable).
#[tokio::test]
async fn before_caches_sync_readiness_fails_and_admission_answers_503() {
    let env = env().await;
    let dead = dead_kubeconfig(&env);
    let instance = start_instance(&env, 19446, 18083, &dead).await;
    assert_eq!(http_get(&format!("{}/readyz", instance.probe)).await.0, 503);
    let ca = env.cluster_dir.join("webhook-certs/ca.crt");
    let (code, body) = curl(&[
        "-s",
        "--cacert",
        ca.to_str().expect("path"),
        "--data-binary",
        &review(json!({})),
        "-w",
        "\n%{http_code}",
        "https://127.0.0.1:19446/mutate-pod",
    ])
    .await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("not synced"), "{body}");
}

/// 6: SIGTERM turns readiness off at once, then the process drains and exits 0. Meanwhile (the
/// shutdown delay) a review on a kept-alive connection is answered and says `connection:
/// close`, so that the API server sends its next one, through the Service, to a replica that
/// stays.
#[tokio::test]
async fn sigterm_turns_readiness_off_then_exits_zero() {
    use tokio::io::AsyncReadExt;
    let env = env().await;
    let kubeconfig = env.cluster_dir.join("kubeconfig");
    let mut instance = start_instance(&env, 19445, 18082, &kubeconfig).await;
    let readyz = format!("{}/readyz", instance.probe);
    wait_for("the second instance to be ready", TIMEOUT, || async {
        (http_get(&readyz).await.0 == 200).then_some(())
    })
    .await;
    // Kept alive, as the API server keeps a webhook's connection.
    let mut kept = connect(&tls_connector(&env), 19445).await;
    let head = kept_alive_exchange(&mut kept, &review(json!({}))).await;
    assert!(
        head.starts_with("HTTP/1.1 200")
            && !head.to_ascii_lowercase().contains("connection: close"),
        "ready: {head}"
    );
    let pid = instance.child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(status.success());
    wait_for(
        "readiness to fail after SIGTERM",
        Duration::from_secs(2),
        || async { (http_get(&readyz).await.0 == 503).then_some(()) },
    )
    .await;
    let head = kept_alive_exchange(&mut kept, &review(json!({}))).await;
    assert!(
        head.starts_with("HTTP/1.1 200") && head.to_ascii_lowercase().contains("connection: close"),
        "readiness off: answered, saying the connection closes: {head}"
    );
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(2), kept.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(0))),
        "closed after that answer: {read:?}"
    );
    let exit = tokio::time::timeout(Duration::from_secs(30), instance.child.wait())
        .await
        .expect("exits within the drain deadline")
        .expect("exit status");
    assert_eq!(exit.code(), Some(0), "clean exit");
}

/// A TLS client of the suite's webhook certificate.
fn tls_connector(env: &Env) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(
        env.cluster_dir.join("webhook-certs/ca.crt"),
    )
    .expect("ca")
    {
        roots.add(cert.expect("cert")).expect("root");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

async fn connect(
    connector: &tokio_rustls::TlsConnector,
    port: u16,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    connector
        .connect(
            rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
            tcp,
        )
        .await
        .expect("handshake")
}

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// Issue 10.1: a replica's peak memory stays under 256 MB while 24 clients each send a 2.9 MB
/// review at once and 500 idle TLS connections are open; each idle connection is closed by the
/// server's idle bound (120 s: it never sends a request, and the header deadline starts only
/// with a request's first byte, as a client may hold a fresh connection for its next request).
#[tokio::test]
async fn memory_stays_bounded_under_big_reviews_and_idle_connections_are_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CLIENTS: usize = 24;
    const IDLE: usize = 500;
    let env = env().await;
    let kubeconfig = env.cluster_dir.join("kubeconfig");
    let (port, probe_port) = (19448, 18085);
    let instance = start_instance(&env, port, probe_port, &kubeconfig).await;
    let ready = format!("{}/readyz", instance.probe);
    wait_for("the instance to be ready", TIMEOUT, || async {
        (http_get(&ready).await.0 == 200).then_some(())
    })
    .await;
    let pid = instance.child.id().expect("running");
    let connector = tls_connector(&env);
    let idle_since = std::time::Instant::now();
    let mut idle = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        idle.push(connect(&connector, port).await);
    }
    // A 2.9 MB review: a StatefulSet pod with a big annotation.
    let big = json!({"metadata": {"name": "x-0", "annotations": {"e2e/padding": "p".repeat(2_900_000)},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "x", "uid": "u", "controller": true}]},
        "spec": {"containers": [{"name": "c"}]}});
    let body = review(big);
    let request = format!(
        "POST /mutate-pod HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let sends = (0..CLIENTS).map(|_| {
        let (connector, request) = (connector.clone(), request.clone());
        tokio::spawn(async move {
            let mut stream = connect(&connector, port).await;
            stream.write_all(request.as_bytes()).await.expect("send");
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer).await;
            String::from_utf8_lossy(&answer)
                .get(9..12)
                .and_then(|c| c.parse::<u16>().ok())
                .unwrap_or(0)
        })
    });
    let mut statuses = Vec::new();
    for send in futures::future::join_all(sends).await {
        statuses.push(send.expect("client"));
    }
    let hwm_mb = vm_hwm_kib(pid) as f64 / 1024.0;
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let shed = statuses.iter().filter(|s| **s == 503).count();
    assert_eq!(
        ok + shed,
        CLIENTS,
        "every big review answered 200 or shed with 503: {statuses:?}"
    );

    // Every idle connection is closed by the server: read until it ends.
    let closes = idle.into_iter().map(|mut stream| {
        tokio::spawn(async move {
            let mut buf = [0u8; 64];
            let _ = tokio::time::timeout(Duration::from_secs(180), stream.read(&mut buf)).await;
            idle_since.elapsed()
        })
    });
    let mut slowest = Duration::ZERO;
    for close in futures::future::join_all(closes).await {
        slowest = slowest.max(close.expect("reader"));
    }
    println!(
        "| clients x review | idle TLS connections | peak RSS (VmHWM) | answered 200 | shed 503 | idle connections closed after |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| {CLIENTS} x {:.1} MB | {IDLE} | {hwm_mb:.0} MB | {ok} | {shed} | {:.1} s (slowest) |",
        body.len() as f64 / 1e6,
        slowest.as_secs_f64()
    );
    assert!(hwm_mb < 256.0, "peak RSS {hwm_mb:.0} MB");
    assert!(
        slowest < Duration::from_secs(150),
        "idle connections closed by the idle bound (120 s), the slowest after {slowest:?}"
    );
    drop(instance);
}

/// One review on `stream`, kept alive: the head of the answer (its body read to its length;
/// empty if the server closed the connection instead).
async fn kept_alive_exchange(
    stream: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    body: &str,
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "POST /mutate-pod HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    if stream.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut read = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&read).into_owned();
        if let Some((head, rest)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if rest.len() >= length {
                return head.to_owned();
            }
        }
        match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => read.extend_from_slice(&chunk[..n]),
            _ => return String::new(),
        }
    }
}

/// One request on a new TLS connection: the status and the body of the answer.
async fn exchange(
    connector: &tokio_rustls::TlsConnector,
    port: u16,
    path: &str,
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = connect(connector, port).await;
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    if stream.write_all(request.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Nearly 3 MiB of one-entry maps.
fn tree() -> Value {
    Value::Array(vec![json!({"": 0}); 2_900_000 / 7])
}

fn admission(uid: &str, kind: Value, object: Value) -> String {
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": kind, "operation": "CREATE", "namespace": "default", "name": "x-0",
        "object": object}})
    .to_string()
}

/// Issue 20.1-20.3: bodies of every shape keep a replica's peak memory under 256 MB (16 at
/// once, each nearly 3 MiB: a tree of tiny maps in a small field, hundreds of thousands of
/// objects to convert, a PersistentPodState with a tree in its spec, a pod with a huge
/// tolerations array), each answered (with its uid, or 503); while 24 clients trickle
/// `/convert` bodies a byte every half second, 10 pod reviews are answered with their uid in
/// their usual time; with 200 idle sockets held on the probe port, the probes answer.
#[tokio::test]
async fn every_body_shape_stays_bounded_slow_uploads_shed_nothing_and_probes_answer() {
    use tokio::io::AsyncWriteExt;
    let env = env().await;
    let kubeconfig = env.cluster_dir.join("kubeconfig");
    let (port, probe_port) = (19449, 18086);
    let instance = start_instance(&env, port, probe_port, &kubeconfig).await;
    let ready = format!("{}/readyz", instance.probe);
    wait_for("the instance to be ready", TIMEOUT, || async {
        (http_get(&ready).await.0 == 200).then_some(())
    })
    .await;
    let pid = instance.child.id().expect("running");
    let connector = tls_connector(&env);
    let pod_kind = json!({"group": "", "version": "v1", "kind": "Pod"});
    let pps_kind =
        json!({"group": "apps.kruise.io", "version": "v1beta1", "kind": "PersistentPodState"});
    let shapes: Vec<(&str, &str, String)> = vec![
        (
            "a tree in the kind",
            "/mutate-pod",
            admission("shape-1", tree(), json!({})),
        ),
        (
            "objects to convert",
            "/convert",
            json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
                "request": {"uid": "shape-2", "desiredAPIVersion": "apps.kruise.io/v1beta1",
                "objects": vec![json!({}); 2_900_000 / 3]}})
            .to_string(),
        ),
        (
            "a tree in a PersistentPodState's spec",
            "/validate-persistentpodstate",
            admission(
                "shape-3",
                pps_kind,
                json!({"metadata": {"name": "p"}, "spec": {"targetRef": tree()}}),
            ),
        ),
        (
            "huge tolerations",
            "/mutate-pod",
            admission(
                "shape-4",
                pod_kind.clone(),
                json!({"metadata": {"name": "x-0"},
                "spec": {"tolerations": vec![json!({}); 2_900_000 / 3]}}),
            ),
        ),
    ];
    println!("| shape | body | 16 at once: answered with the uid | shed 503 |");
    println!("|---|---|---|---|");
    for (what, path, body) in &shapes {
        assert!(body.len() < 3 << 20, "{what}: {} bytes", body.len());
        let uid = serde_json::from_str::<Value>(body).expect("json")["request"]["uid"]
            .as_str()
            .expect("uid")
            .to_owned();
        let sends = (0..16).map(|_| {
            let (connector, body, path) = (connector.clone(), body.clone(), path.to_string());
            tokio::spawn(async move { exchange(&connector, port, &path, &body).await })
        });
        let (mut answered, mut shed) = (0, 0);
        for sent in futures::future::join_all(sends).await {
            let (status, answer) = sent.expect("client");
            match status {
                200 if answer.contains(&format!("\"uid\":\"{uid}\"")) => answered += 1,
                503 => shed += 1,
                other => panic!("{what}: {other} {answer}"),
            }
        }
        println!(
            "| {what} | {:.1} MB | {answered} | {shed} |",
            body.len() as f64 / 1e6
        );
        assert!(answered > 0, "{what}: some answered");
    }
    let hwm_mb = vm_hwm_kib(pid) as f64 / 1024.0;
    println!("peak RSS (VmHWM) after every shape: {hwm_mb:.0} MB");
    assert!(hwm_mb <= 256.0, "peak RSS {hwm_mb:.0} MB");

    // Fairness: the usual time of a pod review, then 24 trickling uploads and 10 more reviews.
    let small = |i: usize| {
        admission(
            &format!("fair-{i}"),
            pod_kind.clone(),
            json!({"metadata": {"name": "x-0"}, "spec": {"containers": [{"name": "c"}]}}),
        )
    };
    let mut usual = Duration::ZERO;
    for i in 0..5 {
        let started = std::time::Instant::now();
        let (status, _) = exchange(&connector, port, "/mutate-pod", &small(100 + i)).await;
        assert_eq!(status, 200);
        usual = usual.max(started.elapsed());
    }
    let trickle = json!({"request": {"uid": "slow", "desiredAPIVersion": "apps.kruise.io/v1beta1",
        "objects": []}})
    .to_string();
    let mut trickling = Vec::new();
    for _ in 0..24 {
        let mut stream = connect(&connector, port).await;
        let head = format!(
            "POST /convert HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            trickle.len()
        );
        stream.write_all(head.as_bytes()).await.expect("head");
        let body = trickle.clone().into_bytes();
        trickling.push(tokio::spawn(async move {
            for b in body {
                if stream.write_all(&[b]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }));
    }
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = std::time::Instant::now();
        let (status, answer) = exchange(&connector, port, "/mutate-pod", &small(i)).await;
        let took = started.elapsed();
        assert_eq!(status, 200, "review {i} while uploads trickle: {answer}");
        assert!(
            answer.contains(&format!("\"uid\":\"fair-{i}\"")),
            "{answer}"
        );
        slowest = slowest.max(took);
    }
    println!(
        "pod reviews: usual {:.1} ms (slowest of 5), with 24 trickling uploads {:.1} ms (slowest of 10)",
        usual.as_secs_f64() * 1e3,
        slowest.as_secs_f64() * 1e3
    );
    assert!(
        slowest <= (usual * 5).max(Duration::from_millis(250)),
        "reviews slowed by trickling uploads: {slowest:?} against {usual:?}"
    );
    for t in trickling {
        t.abort();
    }

    // The probe port with 200 idle sockets held on it.
    let mut idle = Vec::new();
    for _ in 0..200 {
        if let Ok(tcp) = tokio::net::TcpStream::connect(("127.0.0.1", probe_port)).await {
            idle.push(tcp);
        }
    }
    for path in ["healthz", "readyz"] {
        for attempt in 0..5 {
            let (status, _) = http_get(&format!("{}/{path}", instance.probe)).await;
            assert_eq!(
                status, 200,
                "/{path} attempt {attempt} with 200 idle sockets held"
            );
        }
    }
    println!("probes: /healthz and /readyz answered 5 of 5 each with 200 idle sockets held");
    drop(idle);
    drop(instance);
}

/// A thread's custom slice (EEVDF's `sched_runtime`, in ns; 0 on a kernel before 6.12) and
/// nice value.
type Sched = (u64, i32);

/// The scheduling attributes of the thread `tid`; none once it has exited.
fn slice_and_nice(tid: &str) -> Option<Sched> {
    let attr = persistent_pod_state::serving::sched_getattr(tid.parse().ok()?).ok()?;
    Some((attr.sched_runtime, attr.sched_nice))
}

/// The slice and nice value of each of `pid`'s threads named `pps-admission` and
/// `pps-background` (the others are the process's main thread and the libraries').
fn threads_of(pid: &str) -> (Vec<Sched>, Vec<Sched>) {
    let (mut admission, mut background) = (Vec::new(), Vec::new());
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads") {
        let task = task.expect("a thread");
        let tid = task.file_name().to_string_lossy().into_owned();
        // A blocking-pool thread may exit between the listing and these reads.
        let Ok(comm) = std::fs::read_to_string(task.path().join("comm")) else {
            continue;
        };
        let Some(sched) = slice_and_nice(&tid) else {
            continue;
        };
        match comm.trim() {
            "pps-admission" => admission.push(sched),
            "pps-background" => background.push(sched),
            _ => {}
        }
    }
    (admission, background)
}

/// Issue 22.2: serve's admission threads run at the process's priority and ask for a short
/// EEVDF slice (0.1 ms by default, `--admission-slice-micros`; honoured from Linux 6.12, where
/// a kernel before it reports and keeps none), while everything else runs `--background-nice`
/// steps below (5 by default): in the suite's replica as shipped, and in instances told
/// otherwise (250 µs and 2 steps; 0, the kernel's slice, and the same priority).
#[tokio::test]
async fn admission_threads_ask_for_their_slice_and_the_rest_runs_below_them() {
    let env = env().await;
    let check = |pid: &str, slice_micros: u64, nice_steps: i32| {
        // The main thread keeps the process's priority and the kernel's slice.
        let (default, own) = slice_and_nice(pid).expect("the main thread");
        let (admission, background) = threads_of(pid);
        // Two admission threads by default, and the main runtime has a worker per core.
        assert!(admission.len() >= 2, "admission threads: {admission:?}");
        assert!(!background.is_empty(), "no pps-background thread");
        let lowered = (own + nice_steps).min(19);
        let slice = match (default, slice_micros) {
            (0, _) => 0,
            (default, 0) => default,
            (_, micros) => micros * 1_000,
        };
        for (got, nice) in &admission {
            assert_eq!(
                (*got, *nice),
                (slice, own),
                "an admission thread of {pid} (the main thread: {default} ns, nice {own})"
            );
        }
        for (_, nice) in &background {
            assert_eq!(*nice, lowered, "a pps-background thread of {pid}");
        }
        println!(
            "{pid}: {} admission threads at a {slice} ns slice, nice {own}; {} others at nice \
             {lowered} (the kernel's slice: {default} ns)",
            admission.len(),
            background.len(),
        );
    };
    check(&pid_of(&env, "persistent-pod-state-a"), 100, 5);

    // No API server is needed to start the threads: the instances stay unready.
    let dead = dead_kubeconfig(&env);
    for (port, probe_port, slice_micros, nice_steps) in
        [(19454, 18091, 250, 2), (19455, 18092, 0, 0)]
    {
        let mut command = serve_command(&env, &dead, port, probe_port);
        command
            .env("PPS_ADMISSION_SLICE_MICROS", slice_micros.to_string())
            .env("PPS_BACKGROUND_NICE", nice_steps.to_string());
        let child = spawn_until(command, &format!("http://127.0.0.1:{probe_port}/healthz")).await;
        check(
            &child.id().expect("running").to_string(),
            slice_micros,
            nice_steps,
        );
    }
}

/// Whether the kernel gives transparent huge pages (not `[never]`), with its setting as it reads.
fn transparent_huge_pages() -> (bool, String) {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    (!thp.is_empty() && !thp.contains("[never]"), thp)
}

/// Asserts that the instance listening on `port` answers a pod review with its uid.
async fn answers_a_review(env: &Env, port: u16) {
    let (status, body) = post_at(
        env,
        &format!("https://127.0.0.1:{port}"),
        &review(json!({"metadata": {"name": "x-0"}})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("e2e-uid-1"), "{body}");
}

/// The anonymous executable mappings of process `pid` (`/proc/PID/smaps`), each with its start,
/// end and the KiB of it on huge pages, and the start of the mapping of its binary's code.
fn code_mappings(pid: &str) -> (Vec<(u64, u64, u64)>, Option<u64>) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps");
    // As the kernel names the binary, " (deleted)" included once it was rebuilt.
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("the process's binary");
    let (mut anonymous, mut code) = (Vec::new(), None);
    let mut current: Option<(u64, u64)> = None;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let header = fields.first().and_then(|f| f.split_once('-'));
        match (header, fields.as_slice()) {
            (Some((start, end)), [_, perms, ..]) if perms.starts_with("r-x") => {
                let start = u64::from_str_radix(start, 16).expect("hex");
                let end = u64::from_str_radix(end, 16).expect("hex");
                current = (fields.len() == 5).then_some((start, end));
                if fields.len() > 5 && Path::new(&fields[5..].join(" ")) == exe {
                    code = code.or(Some(start));
                }
            }
            (Some(_), [_, _, _, _, _, ..]) => current = None,
            (_, ["AnonHugePages:", kib, "kB"]) => {
                if let Some((start, end)) = current.take() {
                    anonymous.push((start, end, kib.parse().expect("kB")));
                }
            }
            _ => {}
        }
    }
    (anonymous, code)
}

/// Issue 22.1: `serve`, built and linked as shipped (the release build, `link/`), runs the code a
/// review runs, linked into the first 2 MiB of its code, from one transparent huge page: an
/// instance of it over the suite's cluster holds a 2 MiB anonymous executable mapping, all of it
/// on a huge page, right before the rest of its binary's code, and answers a review. Where the
/// kernel has transparent huge pages off it keeps the code as mapped, and so does an instance
/// started with `PPS_HOT_CODE_HUGE_PAGE=false`. Both are asked for perf's map of the page
/// (`PPS_HOT_CODE_PERF_MAP=true`): the first writes `/tmp/perf-PID.map`, naming the functions
/// on the page and among them the pod webhook's handler; the second, with no page, writes none.
/// (The suite's replicas are debug builds, linked once: they keep theirs as mapped.)
#[tokio::test]
async fn the_hot_code_runs_from_a_huge_page_where_the_kernel_gives_one() {
    let env = env().await;
    let (huge_pages, thp) = transparent_huge_pages();
    for (port, probe_port, on) in [(19456, 18093, true), (19457, 18094, false)] {
        let mut command =
            serve_command_of(&env, &env.release_bin, &env.sa_kubeconfig, port, probe_port);
        command
            .env("PPS_HOT_CODE_HUGE_PAGE", on.to_string())
            .env("PPS_HOT_CODE_PERF_MAP", "true");
        let child = spawn_until(command, &format!("http://127.0.0.1:{probe_port}/readyz")).await;
        let pid = child.id().expect("running").to_string();
        let (anonymous, code) = code_mappings(&pid);
        let code = code.expect("the binary's code mapping");
        let perf_map = Path::new("/tmp").join(format!("perf-{pid}.map"));
        let map = std::fs::read_to_string(&perf_map);
        let _ = std::fs::remove_file(&perf_map);
        if on && huge_pages {
            let huge = 2 << 20;
            assert_eq!(
                anonymous,
                [(code - huge, code, huge / 1024)],
                "one 2 MiB huge page right before the rest of the code at {code:#x}"
            );
            println!("the hot code runs from {:#x}, on a huge page", code - huge);
            let map = map.expect("perf's map of the page");
            let functions: Vec<(u64, u64, &str)> = map
                .lines()
                .map(|line| {
                    let mut fields = line.splitn(3, ' ');
                    let mut hex = || u64::from_str_radix(fields.next().expect("field"), 16);
                    let (start, size) = (hex().expect("start"), hex().expect("size"));
                    (start, size, fields.next().expect("name"))
                })
                .collect();
            assert!(
                functions
                    .iter()
                    .all(|(start, size, _)| *start < code && start + size > code - huge),
                "every function named lies on the page"
            );
            let handler = "persistent_pod_state::webhook::mutate_pod::mutate_pod";
            assert!(
                functions.iter().any(|(_, _, name)| *name == handler),
                "{handler} named in {perf_map:?}"
            );
            println!("perf's map names {} functions on it", functions.len());
        } else {
            assert!(anonymous.is_empty(), "{anonymous:x?}: on {on}, {thp}");
            assert!(map.is_err(), "no page, no map: {perf_map:?}");
            println!(
                "the code stays as mapped (PPS_HOT_CODE_HUGE_PAGE={on}; {})",
                thp.trim()
            );
        }
        answers_a_review(&env, port).await;
    }
}

/// Issue 22.1, the huge page's failure path: when the move of the copy over the code fails
/// (`mremap`; here made to fail with `ENOMEM` by a seccomp filter set on `serve` before it
/// starts), `serve`, built and linked as shipped, maps its code back from its binary's file
/// over the range, says so, keeps no copy, and answers a review with that code. The filter
/// stops the call before the kernel unmaps anything, so what this shows is that the pages
/// mapped back are the binary's very code (a wrong offset would crash the first review), not
/// the kernel's state after a partial move. Where the kernel has transparent huge pages off,
/// `serve` gives up before the move and the path cannot run: the test says so and checks that
/// `serve` still answers.
#[tokio::test]
async fn the_code_is_mapped_back_from_its_file_when_the_move_fails() {
    use std::os::unix::process::CommandExt;
    let env = env().await;
    let (huge_pages, thp) = transparent_huge_pages();
    let filter = seccompiler::SeccompFilter::new(
        [(libc::SYS_mremap, vec![])].into_iter().collect(),
        seccompiler::SeccompAction::Allow,
        seccompiler::SeccompAction::Errno(libc::ENOMEM as u32),
        seccompiler::TargetArch::x86_64,
    )
    .expect("the filter");
    let program: seccompiler::BpfProgram = filter.try_into().expect("compiled");
    let (port, probe_port) = (19458, 18095);
    let log = env.cluster_dir.join("serve-mremap-refused.log");
    let mut command =
        serve_command_of(&env, &env.release_bin, &env.sa_kubeconfig, port, probe_port);
    command
        .env("PPS_HOT_CODE_HUGE_PAGE", "true")
        .stderr(std::fs::File::create(&log).expect("the log"));
    // SAFETY: between fork and exec the child only sets its own seccomp filter (two system
    // calls on a program compiled before the fork; no allocation on success).
    unsafe {
        command.pre_exec(move || {
            seccompiler::apply_filter(&program)
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::PermissionDenied))
        });
    }
    let child = spawn_until(command, &format!("http://127.0.0.1:{probe_port}/readyz")).await;
    let pid = child.id().expect("running").to_string();
    let (anonymous, code) = code_mappings(&pid);
    let code = code.expect("the binary's code mapping");
    let said = std::fs::read_to_string(&log).expect("the log");
    if huge_pages {
        assert!(
            said.contains("mremap: Cannot allocate memory")
                && said.contains("the code is mapped from the binary's file as before"),
            "the failed move and the mapping back are said: {said}"
        );
        assert!(anonymous.is_empty(), "no copy kept: {anonymous:x?}");
        assert_eq!(
            code % (2 << 20),
            0,
            "the code mapped from the file at {code:#x}"
        );
        println!("mremap refused: the code at {code:#x} is mapped from the binary's file again");
    } else {
        assert!(said.contains("the hot code stays on small pages"), "{said}");
        println!(
            "transparent huge pages off ({}): no move to fail",
            thp.trim()
        );
    }
    answers_a_review(&env, port).await;
}

/// An HTTP/1 client that sends reviews one after another on its connection and reads none of
/// the answers (its receive buffer a few KiB, never read) is closed by the send bound (10 s
/// without the socket taking a byte), not held to the idle bound (120 s), and the replica says
/// why; other clients are answered meanwhile.
#[tokio::test]
async fn a_client_that_reads_none_of_its_answers_is_closed_at_the_send_bound() {
    use tokio::io::AsyncWriteExt;
    let env = env().await;
    let (port, probe_port) = (19464, 18098);
    let log = env
        .cluster_dir
        .join("logs/persistent-pod-state-slow-reader.log");
    let mut command = serve_command(&env, &env.cluster_dir.join("kubeconfig"), port, probe_port);
    command.stderr(std::fs::File::create(&log).expect("log"));
    let _instance = spawn_until(command, &format!("http://127.0.0.1:{probe_port}/readyz")).await;
    let connector = tls_connector(&env);

    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let tcp = socket
        .connect(([127, 0, 0, 1], port).into())
        .await
        .expect("connect");
    let mut stream = connector
        .connect(
            rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
            tcp,
        )
        .await
        .expect("handshake");
    let review = admission(
        "slow-reader",
        json!({"group": "", "version": "v1", "kind": "Pod"}),
        json!({"metadata": {"name": "x-0"}, "spec": {"containers": [{"name": "c"}]}}),
    );
    let request = format!(
        "POST /mutate-pod HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{review}",
        review.len()
    );
    let started = std::time::Instant::now();
    let mut writing = tokio::spawn(async move {
        let mut sent = 0_usize;
        while stream.write_all(request.as_bytes()).await.is_ok() && stream.flush().await.is_ok() {
            sent += 1;
        }
        sent
    });
    // Others are answered while it sends.
    let (status, answer) = exchange(
        &connector,
        port,
        "/mutate-pod",
        &admission(
            "other",
            json!({"group": "", "version": "v1", "kind": "Pod"}),
            json!({"metadata": {"name": "x-0"}, "spec": {"containers": [{"name": "c"}]}}),
        ),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    // Its writes fail once the replica closes the connection (with requests unread, the close
    // resets it), well before the idle bound.
    let sent = tokio::time::timeout(Duration::from_secs(60), &mut writing)
        .await
        .unwrap_or_else(|_| {
            writing.abort();
            panic!("the connection still open after 60 s")
        })
        .expect("the writer");
    let took = started.elapsed();
    let said = std::fs::read_to_string(&log).expect("log");
    println!(
        "a client reading none of its answers: closed after {:.1} s and {sent} reviews sent",
        took.as_secs_f64()
    );
    assert!(
        said.contains("closing a connection whose client reads none of its answers"),
        "the replica does not say why:\n{said}"
    );
    assert!(
        took >= Duration::from_secs(10),
        "closed after {took:?}, before the send bound"
    );
}
