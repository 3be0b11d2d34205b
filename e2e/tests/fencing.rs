//! Fencing proven by a test that can fail (issue 20.5). Two extra replicas, A and B, run their
//! own leader election and are the only ones that handle a workload kind of the test's own
//! (FenceSet, in kube-system, where the registered webhooks do not reach). A, the leader, is
//! stopped (SIGSTOP) in the middle of a write: it has planned to create the PersistentPodState
//! a new FenceSet asks for and is held by the e2e hook right before the write. B takes the Lease,
//! creates the PersistentPodState, and deletes it when the FenceSet's annotations are removed:
//! the newer state is "no PersistentPodState". A resumes and goes on with its write. With the
//! fence its stale write is never sent; without it (`PPS_E2E_NO_FENCE`, the negative control
//! run in the same test) the stale create lands and brings back what B deleted: the test
//! detects the lost change, so it would fail on a build without the fence.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use persistent_pod_state::api::{AUTO_GENERATE_ANNOTATION, PREFERRED_TOPOLOGY_ANNOTATION};
use serde_json::json;

use crate::support::*;

const GROUP: &str = "fence.e2e.example.com";
const NS: &str = "kube-system";

async fn fence_set_crd(c: &Client) -> ApiResource {
    install_crd(c, GROUP, "FenceSet", "fencesets", &[("v1", true)]).await;
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", "FenceSet"), "fencesets")
}

/// One extra replica of its own election `lease`, handling FenceSets.
fn replica(
    env: &Env,
    name: &str,
    ports: (u16, u16),
    lease: &str,
    hook: &[(&str, String)],
) -> std::process::Child {
    let mut command = serve_command(env, &env.cluster_dir.join("kubeconfig"), ports.0, ports.1);
    command
        .env("PPS_LEASE_NAME", lease)
        .env("PPS_LEADER_IDENTITY", name)
        .env("PPS_LEASE_DURATION_SECONDS", "6")
        .env("PPS_LEASE_RENEW_DEADLINE_SECONDS", "4")
        .env("PPS_LEASE_RETRY_PERIOD_SECONDS", "1")
        .env("PPS_SHUTDOWN_DELAY_SECONDS", "0")
        .env("PPS_CUSTOM_WORKLOADS", format!("{GROUP}/FenceSet"));
    for (k, v) in hook {
        command.env(k, v);
    }
    command.spawn().expect("replica starts")
}

async fn lease_holder(c: &Client, lease: &str) -> Option<String> {
    Api::<Lease>::namespaced(c.clone(), "persistent-pod-state")
        .get_opt(lease)
        .await
        .ok()??
        .spec?
        .holder_identity
}

fn signal(pid: u32, sig: &str) {
    assert!(
        std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("kill")
            .success()
    );
}

/// Runs the scenario once; whether the stale write brought back the deleted PersistentPodState
/// (watched for 10 s after A resumed).
async fn stale_write_lands(env: &Env, fence_set: &ApiResource, fenced: bool) -> bool {
    let c = &env.client;
    let run = if fenced { "fenced" } else { "unfenced" };
    let (workload, lease) = (format!("stale-{run}"), format!("e2e-stale-{run}"));
    let hold = env.cluster_dir.join(format!("hold-{run}"));
    let held = hold.with_extension("held");
    let _ = std::fs::remove_file(&held);
    std::fs::write(&hold, "").expect("hold file");
    let mut hook = vec![
        ("PPS_E2E_HOLD_WRITES_IN", NS.to_owned()),
        ("PPS_E2E_HOLD_FILE", hold.display().to_string()),
    ];
    if !fenced {
        hook.push(("PPS_E2E_NO_FENCE", "1".to_owned()));
    }
    let mut a = replica(env, &format!("{lease}-a"), (19452, 18089), &lease, &hook);
    wait_for("A to lead", TIMEOUT, || async {
        (lease_holder(c, &lease).await.as_deref() == Some(&format!("{lease}-a"))).then_some(())
    })
    .await;
    // A plans the PersistentPodState the new FenceSet asks for, and is held before writing it.
    let sets: Api<DynamicObject> = Api::namespaced_with(c.clone(), NS, fence_set);
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"), "kind": "FenceSet",
        "metadata": {"name": workload, "annotations": {
            AUTO_GENERATE_ANNOTATION: "true", PREFERRED_TOPOLOGY_ANNOTATION: HOST}},
        "spec": {"replicas": 1}}))
    .expect("fenceset");
    sets.create(&PostParams::default(), &object)
        .await
        .expect("fenceset");
    wait_for("A's write to be held", TIMEOUT, || async {
        held.exists().then_some(())
    })
    .await;
    // A stops in the middle of its write; B takes over and records the newer state.
    signal(a.id(), "-STOP");
    let mut b = replica(env, &format!("{lease}-b"), (19453, 18090), &lease, &[]);
    wait_for("B to take the Lease", TIMEOUT, || async {
        (lease_holder(c, &lease).await.as_deref() == Some(&format!("{lease}-b"))).then_some(())
    })
    .await;
    let ppss = pps_api(c, NS);
    wait_for("B to create the PersistentPodState", TIMEOUT, || async {
        ppss.get_opt(&workload).await.ok()?.map(|_| ())
    })
    .await;
    sets.patch(
        &workload,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {AUTO_GENERATE_ANNOTATION: null}}})),
    )
    .await
    .expect("annotations removed");
    wait_for("B to delete the PersistentPodState", TIMEOUT, || async {
        ppss.get_opt(&workload).await.ok()?.is_none().then_some(())
    })
    .await;
    // A resumes and goes on with the write it was in the middle of.
    std::fs::remove_file(&hold).expect("release the hold");
    signal(a.id(), "-CONT");
    let resumed = Instant::now();
    let mut came_back = false;
    while resumed.elapsed() < Duration::from_secs(10) {
        if ppss.get_opt(&workload).await.expect("get").is_some() {
            came_back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for child in [&mut a, &mut b] {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = sets.delete(&workload, &DeleteParams::default()).await;
    let _ = ppss.delete(&workload, &DeleteParams::default()).await;
    let _ = Api::<Lease>::namespaced(c.clone(), "persistent-pod-state")
        .delete(&lease, &DeleteParams::default())
        .await;
    came_back
}

#[tokio::test]
async fn a_leader_stopped_in_the_middle_of_a_write_never_sends_it_stale() {
    let env = env().await;
    let fence_set = fence_set_crd(&env.client).await;
    assert!(
        !stale_write_lands(&env, &fence_set, true).await,
        "with the fence, the stale leader's write brought back a deleted PersistentPodState"
    );
    // The negative control: the same run without the fence loses B's change, so this test
    // fails on a build whose writes are not fenced.
    assert!(
        stale_write_lands(&env, &fence_set, false).await,
        "without the fence the stale write should have landed; the scenario did not reach it"
    );
    println!(
        "a leader stopped in the middle of a write: fenced, its stale write was never sent; unfenced (control), it brought back what the new leader had deleted"
    );
}
