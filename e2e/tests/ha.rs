//! High availability: two replicas serve the webhooks; the Lease holder runs the controllers;
//! when the leader dies the other takes over within the lease duration, and nothing is lost.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

use crate::support::*;

const HOST: &str = "kubernetes.io/hostname";

async fn holder(c: &Client) -> Option<String> {
    let lease = Api::<Lease>::namespaced(c.clone(), "default")
        .get_opt("persistent-pod-state")
        .await
        .ok()??;
    lease.spec?.holder_identity
}

/// Starts a replica again the way e2e/lib.sh does, recording its pid where the teardown finds it.
fn restart(env: &Env, replica: &Replica) {
    let log = std::fs::File::create(env.cluster_dir.join(format!(
        "logs/persistent-pod-state-{}-restarted.log",
        replica.name
    )))
    .expect("log file");
    let kubeconfig = env.cluster_dir.join("kubeconfig");
    let mut child = serve_command(env, &kubeconfig, replica.webhook_port, replica.probe_port)
        .env("PPS_SHUTDOWN_DELAY_SECONDS", "0")
        .env("PPS_LEADER_IDENTITY", replica.identity())
        .env(
            "PPS_LEASE_DURATION_SECONDS",
            env.lease_duration.as_secs().to_string(),
        )
        .env("PPS_LEASE_GRACE_SECONDS", "3")
        .env(
            "PPS_CUSTOM_WORKLOAD_CONFIG",
            env.cluster_dir.join("custom-workloads.yaml"),
        )
        .stderr(log)
        .spawn()
        .expect("serve restarts");
    std::fs::write(
        env.cluster_dir
            .join(format!("persistent-pod-state-{}.pid", replica.name)),
        child.id().to_string(),
    )
    .expect("pid file");
    // It outlives the test; the suite's teardown stops it by its pid file. Reap it if it ends.
    std::thread::spawn(move || child.wait());
}

/// Issue 3.7: kill the leader; the other replica takes over within the lease duration; states
/// recorded before survive, and recording (and injection) goes on.
#[tokio::test]
async fn the_other_replica_takes_over_when_the_leader_dies_and_nothing_is_lost() {
    let env = env().await;
    let c = &env.client;
    assert_eq!(env.replicas.len(), 2, "the suite runs two replicas");
    let ns = namespace(c, "e2e-ha").await;
    create_sts(
        c,
        &ns,
        &statefulset(
            "ha",
            2,
            &[
                ("kruise.io/auto-generate-persistent-pod-state", "true"),
                ("kruise.io/preferred-persistent-topology", HOST),
            ],
        ),
    )
    .await;
    wait_sts_rolled(c, &ns, "ha", 2).await;
    let before = placements(c, &ns, &pod_names("ha", 2)).await;
    let states_before = wait_states(c, &ns, "ha", &before).await;

    // Both replicas answer webhooks.
    for r in &env.replicas {
        let ca = env.cluster_dir.join("webhook-certs/ca.crt");
        let (code, _) = curl(&[
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "\n%{http_code}",
            "--cacert",
            ca.to_str().expect("path"),
            "--data-binary",
            "{}",
            &format!("https://127.0.0.1:{}/mutate-pod", r.webhook_port),
        ])
        .await;
        assert_eq!(code, 400, "replica {} answers", r.name);
    }

    let leader_id = wait_for("a Lease holder", TIMEOUT, || holder(c)).await;
    let leader = env
        .replicas
        .iter()
        .find(|r| r.identity() == leader_id)
        .expect("a replica leads")
        .clone();
    let follower = env
        .replicas
        .iter()
        .find(|r| r.identity() != leader_id)
        .expect("a follower")
        .clone();
    assert!(
        metric(
            &http_get(&format!("{}/metrics", follower.probe_url()))
                .await
                .1,
            "pps_leader "
        ) == 0.0
    );

    let pid = std::fs::read_to_string(
        env.cluster_dir
            .join(format!("persistent-pod-state-{}.pid", leader.name)),
    )
    .expect("pid");
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .expect("kill")
            .success()
    );
    let killed = Instant::now();
    wait_for(
        "the follower to hold the Lease",
        env.lease_duration + Duration::from_secs(10),
        || async {
            (holder(c).await.as_deref() == Some(follower.identity().as_str())).then_some(())
        },
    )
    .await;
    let takeover = killed.elapsed();
    println!(
        "leader {} killed; {} took over after {:.1}s (lease duration {}s)",
        leader.identity(),
        follower.identity(),
        takeover.as_secs_f64(),
        env.lease_duration.as_secs()
    );
    // The dead leader's Lease expires at most one lease duration after its last renewal; the
    // follower takes it at its next check (allowed: the 3 s renewal grace the replicas run with).
    assert!(
        takeover <= env.lease_duration + Duration::from_secs(3),
        "takeover within the lease duration: {takeover:?}"
    );
    wait_for("the follower to report leading", TIMEOUT, || async {
        (metric(
            &http_get(&format!("{}/metrics", follower.probe_url()))
                .await
                .1,
            "pps_leader ",
        ) == 1.0)
            .then_some(())
    })
    .await;

    // Nothing lost, and recording continues: scale out, and a re-created pod still comes back.
    Api::<StatefulSet>::namespaced(c.clone(), &ns)
        .patch(
            "ha",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await
        .expect("scale out");
    wait_sts_rolled(c, &ns, "ha", 3).await;
    let now = placements(c, &ns, &pod_names("ha", 3)).await;
    let states = wait_states(c, &ns, "ha", &now).await;
    for (pod, state) in &states_before {
        assert_eq!(
            states.get(pod),
            Some(state),
            "{pod}'s state survived the failover"
        );
    }
    let pod = recreate_pod(c, &ns, "ha-0").await;
    let after = placement(&pod).expect("placed");
    assert_eq!(
        (after.node.as_str(), after.ip.as_str()),
        (before["ha-0"].node.as_str(), before["ha-0"].ip.as_str())
    );

    restart(&env, &leader);
    wait_for("the restarted replica to be ready", TIMEOUT, || async {
        (http_get(&format!("{}/readyz", leader.probe_url())).await.0 == 200).then_some(())
    })
    .await;
    delete_namespace(c, &ns).await;
}
