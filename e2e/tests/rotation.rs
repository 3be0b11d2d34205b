//! Certificate rotation without restart, under continuous admission traffic.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

use crate::support::*;

/// SHA-256 fingerprint of a PEM certificate file, or of what a TLS server presents.
async fn fingerprint(shell: &str) -> Option<String> {
    let out = tokio::process::Command::new("bash")
        .args(["-c", shell])
        .output()
        .await
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && text.contains('=')).then_some(text)
}

/// Issue 4.2: new certificate files, swapped in as a Secret volume swaps them (the `..data`
/// symlink), are served on new connections by every replica with zero failed admissions.
#[tokio::test]
async fn rotating_the_serving_certificate_under_traffic_fails_no_admission() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-rotation").await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    let (ok, failures, stop) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(AtomicBool::new(false)),
    );
    let traffic = tokio::spawn({
        let (ok, failures, stop, pods) = (ok.clone(), failures.clone(), stop.clone(), pods.clone());
        async move {
            let pod: Pod = serde_json::from_value(json!({"metadata": {"generateName": "traffic-"},
                "spec": {"containers": [{"name": "c", "image": "cilium/echoserver:latest"}]}}))
            .expect("pod");
            let dry = PostParams {
                dry_run: true,
                ..PostParams::default()
            };
            while !stop.load(Ordering::Relaxed) {
                match pods.create(&dry, &pod).await {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        failures.lock().expect("lock").push(e.to_string());
                        0
                    }
                };
            }
        }
    });
    let count = || ok.load(Ordering::Relaxed);
    wait_for("admission traffic", TIMEOUT, || async {
        (count() >= 20).then_some(())
    })
    .await;

    // Renew under the same CA, for the names the first certificate has (the host the API
    // server calls, and the replicas' own), then swap the Secret-volume symlink atomically.
    let certs = env.cluster_dir.join("webhook-certs");
    let mut hosts = vec!["--host", env.webhook_host(), "--host", "localhost"];
    if env.webhook_host() != "127.0.0.1" {
        hosts.extend(["--host", "127.0.0.1"]);
    }
    let status = tokio::process::Command::new(&env.pps_bin)
        .args(["certs", "--out-dir", certs.to_str().expect("path")])
        .args(&hosts)
        .status()
        .await
        .expect("certs runs");
    assert!(status.success());
    let volume = env.cluster_dir.join("webhook-tls");
    let version = volume.join("..v2");
    std::fs::create_dir_all(&version).expect("mkdir");
    for f in ["tls.crt", "tls.key"] {
        std::fs::copy(certs.join(f), version.join(f)).expect("copy");
    }
    std::os::unix::fs::symlink("..v2", volume.join("..data_tmp")).expect("symlink");
    std::fs::rename(volume.join("..data_tmp"), volume.join("..data")).expect("swap");
    let rotated_at = count();

    let new = fingerprint(&format!(
        "openssl x509 -in {} -noout -fingerprint -sha256",
        certs.join("tls.crt").display()
    ))
    .await
    .expect("fingerprint");
    for r in &env.replicas {
        let served = format!(
            "openssl s_client -connect 127.0.0.1:{} -servername localhost </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256",
            r.webhook_port
        );
        wait_for(
            &format!("replica {} to serve the new certificate", r.name),
            TIMEOUT,
            || async {
                (fingerprint(&served).await.as_deref() == Some(new.as_str())).then_some(())
            },
        )
        .await;
    }
    wait_for("admission traffic after the rotation", TIMEOUT, || async {
        (count() >= rotated_at + 20).then_some(())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    traffic.await.expect("traffic task");
    let failures = failures.lock().expect("lock").clone();
    println!(
        "certificate rotated under traffic: {} admissions, {} failed",
        count(),
        failures.len()
    );
    assert!(failures.is_empty(), "failed admissions: {failures:?}");
    delete_namespace(c, &ns).await;
}
