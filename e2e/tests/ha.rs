//! High availability: two replicas serve the webhooks; the Lease holder runs the controllers;
//! when the leader dies the other takes over within the lease duration, and nothing is lost.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use crate::support::*;

/// A StatefulSet whose generated PersistentPodState prefers each pod's recorded node, as these
/// tests use.
fn generated_statefulset(name: &str, replicas: i32) -> StatefulSet {
    statefulset(
        name,
        replicas,
        &[
            ("kruise.io/auto-generate-persistent-pod-state", "true"),
            ("kruise.io/preferred-persistent-topology", HOST),
        ],
    )
}

/// Starts a replica again the way e2e/lib.sh does, recording its pid where the teardown finds it,
/// and waits until it is ready.
async fn restart(env: &Env, replica: &Replica) {
    restart_with_delay(env, replica, 0).await;
}

/// [`restart`] with `--shutdown-delay-seconds` at `delay` (the suite's replicas run with 0).
async fn restart_with_delay(env: &Env, replica: &Replica, delay: u64) {
    let log = std::fs::File::create(env.cluster_dir.join(format!(
        "logs/persistent-pod-state-{}-restarted.log",
        replica.name
    )))
    .expect("log file");
    let mut child = serve_command(
        env,
        &env.sa_kubeconfig,
        replica.webhook_port,
        replica.probe_port,
    )
    .env("PPS_SHUTDOWN_DELAY_SECONDS", delay.to_string())
    .env("PPS_LEADER_IDENTITY", replica.identity())
    .env(
        "PPS_LEASE_DURATION_SECONDS",
        env.lease_duration.as_secs().to_string(),
    )
    .env("PPS_LEASE_RENEW_DEADLINE_SECONDS", "5")
    .env("PPS_LEASE_RETRY_PERIOD_SECONDS", "1")
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
    wait_for("the restarted replica to be ready", TIMEOUT, || async {
        (http_get(&format!("{}/readyz", replica.probe_url())).await.0 == 200).then_some(())
    })
    .await;
}

/// Issue 3.7: kill the leader; the other replica takes over within the lease duration; states
/// recorded before survive, and recording (and injection) goes on.
#[tokio::test]
async fn the_other_replica_takes_over_when_the_leader_dies_and_nothing_is_lost() {
    let env = env().await;
    let c = &env.client;
    assert_eq!(env.replicas.len(), 2, "the suite runs two replicas");
    let ns = namespace(c, "e2e-ha").await;
    let (before, states_before) = start_recorded(c, &ns, &generated_statefulset("ha", 2)).await;

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
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            "{}",
            &format!("https://127.0.0.1:{}/mutate-pod", r.webhook_port),
        ])
        .await;
        assert_eq!(code, 400, "replica {} answers", r.name);
    }

    let (leader, follower) = leader_and_follower(&env).await;
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
    // Issue 22.4: a change made right after the kill is written by the new leader within the
    // lease duration (and its look, a retry period) plus 2 s.
    spec_change_written(c, &ns, "ha", "e2e.example/handover").await;
    let first_write = killed.elapsed();
    println!(
        "leader killed (SIGKILL): the new leader's first status write {:.2}s after the kill",
        first_write.as_secs_f64()
    );
    assert!(
        first_write <= env.lease_duration + Duration::from_secs(2),
        "first status write {first_write:?} after the kill (lease duration {:?} + 2 s)",
        env.lease_duration
    );
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
    // The follower takes the Lease once its record has not changed for the lease duration
    // (counted from its last renewal, at most one retry period before the kill), at its next
    // look (one retry period, 1 s here): allowed one retry period and a second of API calls.
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
    scale(c, &ns, "ha", 3).await;
    let (_, states) = wait_recorded(c, &ns, "ha", &pod_names("ha", 3), "ha").await;
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

    restart(&env, &leader).await;
    delete_namespace(c, &ns).await;
}

/// Changes what StatefulSet `sts` asks its generated PersistentPodState to keep (the pod
/// annotations to persist, to `keys`, which its pods do not carry: the recorded states stay as
/// they are): the generator rewrites the PersistentPodState's spec, and the recorder then writes
/// its status (`observedGeneration`). Returns once that status is written, polled every 20 ms.
async fn spec_change_written(c: &kube::Client, ns: &str, sts: &str, keys: &str) {
    let pps = pps_api(c, ns);
    // Reads go through the conversion webhook (this suite reads v1alpha1): right after a
    // replica was killed one may fail (the load balancer tried the dead one); read again.
    let before = wait_for("the PersistentPodState", TIMEOUT, || async {
        pps.get(sts).await.ok()?.metadata.generation
    })
    .await;
    Api::<StatefulSet>::namespaced(c.clone(), ns)
        .patch(
            sts,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "kruise.io/persistent-pod-annotations": keys}}})),
        )
        .await
        .expect("annotate");
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let now = pps.get(sts).await.ok();
        let generation = now
            .as_ref()
            .and_then(|p| p.metadata.generation)
            .unwrap_or_default();
        let observed = now
            .as_ref()
            .and_then(|p| p.status.as_ref())
            .map(|s| s.observed_generation)
            .unwrap_or_default();
        if generation > before && observed == generation {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the status of {ns}/{sts} did not follow its new spec (generation {generation}, observed {observed})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 22.4: the leader stopped with SIGTERM releases the Lease on its way out; the other
/// replica, watching the Lease, takes it at once, and its first status write (of a change made
/// after the old leader had gone) comes within 2 s of the SIGTERM. Nothing recorded is lost.
#[tokio::test]
async fn a_leader_stopped_with_sigterm_hands_over_within_two_seconds() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-handover").await;
    let (_, states_before) = start_recorded(c, &ns, &generated_statefulset("handover", 2)).await;
    // The leader to stop keeps the shipped shutdown delay (3 s of serving with readiness off):
    // the follower is restarted with it, then made the leader.
    let delay = 3;
    let (leader, follower) = leader_and_follower(&env).await;
    let (pid, _) = replica_process(&env, &follower);
    signal(&pid, "-TERM");
    wait_for("the follower to exit", TIMEOUT, || async {
        exited(&pid).then_some(())
    })
    .await;
    restart_with_delay(&env, &follower, delay).await;
    let (pid, _) = replica_process(&env, &leader);
    signal(&pid, "-TERM");
    wait_for("the delayed replica to lead", TIMEOUT, || async {
        (holder(c).await.as_deref() == Some(follower.identity().as_str())).then_some(())
    })
    .await;
    wait_for("the old leader to exit", TIMEOUT, || async {
        exited(&pid).then_some(())
    })
    .await;
    restart(&env, &leader).await;
    let (leader, follower) = (follower, leader);

    let (pid, _) = replica_process(&env, &leader);
    signal(&pid, "-TERM");
    let stopped = Instant::now();
    // The Lease changes hands while the old leader still serves (its shutdown delay): it stops
    // its controllers (its fence closed) before it releases the Lease, so a write after that
    // can only be the new leader's.
    wait_for("the Lease to change hands", TIMEOUT, || async {
        (holder(c).await.as_deref() == Some(follower.identity().as_str())).then_some(())
    })
    .await;
    let handed_over = stopped.elapsed();
    spec_change_written(c, &ns, "handover", "e2e.example/handover").await;
    let written = stopped.elapsed();
    let still_serving = !exited(&pid);
    println!(
        "leader {} stopped (SIGTERM, shutdown delay {delay} s): the Lease changed hands after {:.2}s; {} wrote its first status {:.2}s after the SIGTERM (the old leader still serving then: {still_serving})",
        leader.identity(),
        handed_over.as_secs_f64(),
        follower.identity(),
        written.as_secs_f64()
    );
    assert!(
        written <= Duration::from_secs(2),
        "first status write of the new leader {written:?} after the SIGTERM (at most 2 s)"
    );
    assert!(
        written < Duration::from_secs(delay),
        "handed over within the old leader's shutdown delay"
    );
    wait_for("the old leader to exit", TIMEOUT, || async {
        exited(&pid).then_some(())
    })
    .await;
    let (_, states) =
        wait_recorded(c, &ns, "handover", &pod_names("handover", 2), "handover").await;
    assert_eq!(states, states_before, "nothing recorded was lost");

    restart(&env, &leader).await;
    delete_namespace(c, &ns).await;
}

/// The pid and log file of a replica as the suite runs it now.
fn replica_process(env: &Env, replica: &Replica) -> (String, std::path::PathBuf) {
    let pid = std::fs::read_to_string(
        env.cluster_dir
            .join(format!("persistent-pod-state-{}.pid", replica.name)),
    )
    .expect("pid");
    let logs = env.cluster_dir.join("logs");
    let restarted = logs.join(format!(
        "persistent-pod-state-{}-restarted.log",
        replica.name
    ));
    let log = if restarted.exists() {
        restarted
    } else {
        logs.join(format!("persistent-pod-state-{}.log", replica.name))
    };
    (pid.trim().to_owned(), log)
}

fn signal(pid: &str, sig: &str) {
    assert!(
        std::process::Command::new("kill")
            .args([sig, pid])
            .status()
            .expect("kill")
            .success(),
        "kill {sig} {pid}"
    );
}

/// Issue 10.3: the leader is paused (SIGSTOP) past its renew deadline; the other replica takes
/// over and changes the world (a scale-in prunes states); when the old leader resumes it finds
/// its renew deadline passed, writes nothing (fenced) and steps down: no pruned state comes
/// back.
#[tokio::test]
async fn a_paused_leader_steps_down_and_no_pruned_state_comes_back() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-fence").await;
    start_recorded(c, &ns, &generated_statefulset("fenced", 3)).await;

    let (leader, follower) = leader_and_follower(&env).await;
    let (pid, log) = replica_process(&env, &leader);
    let log_before = std::fs::read_to_string(&log).unwrap_or_default().len();

    signal(&pid, "-STOP");
    let paused = Instant::now();
    wait_for(
        "the follower to take the Lease from the paused leader",
        env.lease_duration + TIMEOUT,
        || async {
            (holder(c).await.as_deref() == Some(follower.identity().as_str())).then_some(())
        },
    )
    .await;
    let takeover = paused.elapsed();
    Api::<StatefulSet>::namespaced(c.clone(), &ns)
        .patch(
            "fenced",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .expect("scale in");
    wait_sts_rolled(c, &ns, "fenced", 1).await;
    wait_state_names(c, &ns, "fenced", &["fenced-0"]).await;

    signal(&pid, "-CONT");
    let resumed = Instant::now();
    let stepped_down = wait_for(
        "the old leader to log that it stepped down",
        TIMEOUT,
        || async {
            let text = std::fs::read_to_string(&log).ok()?;
            text.get(log_before..)?
                .contains("stepped down")
                .then(|| resumed.elapsed())
        },
    )
    .await;
    // For two renew periods after it resumed, the pruned states stay pruned and the old leader
    // does not lead.
    let watch = Duration::from_secs(10);
    let api = pps_api(c, &ns);
    while resumed.elapsed() < watch {
        let states: Vec<String> = api
            .get("fenced")
            .await
            .expect("pps")
            .status
            .map(|s| s.pod_states.into_keys().collect())
            .unwrap_or_default();
        assert_eq!(states, ["fenced-0"], "a pruned state came back");
        assert_eq!(
            holder(c).await.as_deref(),
            Some(follower.identity().as_str()),
            "the new leader keeps the Lease"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let text = http_get(&format!("{}/metrics", leader.probe_url())).await.1;
    assert_eq!(
        metric(&text, "pps_leader "),
        0.0,
        "the old leader does not lead"
    );
    println!(
        "leader {} paused; {} took over after {:.1}s; the old leader stepped down {:.1}s after it resumed; no pruned state came back",
        leader.identity(),
        follower.identity(),
        takeover.as_secs_f64(),
        stepped_down.as_secs_f64()
    );
    delete_namespace(c, &ns).await;
}

/// The shipped FlowSchema, created again if the test fails while it is deleted: the other tests
/// run with it.
struct SchemaBack(Option<DynamicObject>, ApiResource);

impl SchemaBack {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for SchemaBack {
    fn drop(&mut self) {
        if let Some(schema) = self.0.take() {
            let resource = self.1.clone();
            put_back(move |client| async move {
                let schemas: Api<DynamicObject> = Api::all_with(client, &resource);
                let _ = schemas.create(&PostParams::default(), &schema).await;
            });
        }
    }
}

/// The priority level and flow schema (their uids) the API server put a request of `client` for
/// `path` in, from API Priority and Fairness' answer headers.
async fn priority_of(client: &kube::Client, path: &str) -> Option<(String, String)> {
    let request = http::Request::get(path).body(Vec::new()).ok()?;
    let answer = client
        .send(request.map(kube::client::Body::from))
        .await
        .ok()?;
    let header = |name: &str| {
        answer
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    Some((
        header("X-Kubernetes-PF-PriorityLevel-UID")?,
        header("X-Kubernetes-PF-FlowSchema-UID")?,
    ))
}

/// The shipped FlowSchema (the chart's, rendered for this server's version, which the kustomize
/// base is rendered from) puts the replicas' Lease requests in the API server's leader-election
/// priority level, as the control plane's own leaders' are: a leader's renewals do not queue
/// behind the cluster's other service accounts. Without it the same request lands elsewhere,
/// shown first; the replicas' other requests stay where they were.
#[tokio::test]
async fn lease_requests_go_in_the_leader_election_priority_level() {
    let env = env().await;
    let c = &env.client;
    let minor = server_minor(c).await;
    let version = match minor {
        ..=22 => "v1beta1",
        23..=25 => "v1beta2",
        26..=28 => "v1beta3",
        _ => "v1",
    };
    let resource = |kind: &str| {
        ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "flowcontrol.apiserver.k8s.io",
            version,
            kind,
        ))
    };
    let levels: Api<DynamicObject> =
        Api::all_with(c.clone(), &resource("PriorityLevelConfiguration"));
    let leader_election = levels
        .get("leader-election")
        .await
        .expect("the API server's leader-election priority level")
        .uid()
        .expect("uid");
    let schemas: Api<DynamicObject> = Api::all_with(c.clone(), &resource("FlowSchema"));
    let name = "persistent-pod-state-leader-election";
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(&env.sa_kubeconfig).expect("the replicas' kubeconfig"),
        &Default::default(),
    )
    .await
    .expect("config");
    let replicas = kube::Client::try_from(config).expect("client");
    let lease =
        "/apis/coordination.k8s.io/v1/namespaces/persistent-pod-state/leases/persistent-pod-state";

    // The chart's FlowSchema, in the version this server serves.
    let kube_version = format!("--kube-version=1.{minor}.0");
    let chart =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/persistent-pod-state");
    let (ok, out) = helm(
        &env,
        &[
            "template",
            "persistent-pod-state",
            chart.to_str().expect("path"),
            "--namespace",
            "persistent-pod-state",
            &kube_version,
            "--show-only",
            "templates/flowschema.yaml",
        ],
    )
    .await;
    assert!(ok, "helm template: {out}");
    let rendered = yaml_documents(&out);
    let [schema] = rendered.as_slice() else {
        panic!("one FlowSchema rendered: {out}")
    };
    assert_eq!(
        schema["apiVersion"],
        format!("flowcontrol.apiserver.k8s.io/{version}")
    );
    let schema: DynamicObject = serde_json::from_value(schema.clone()).expect("a FlowSchema");
    // Without the FlowSchema: the Lease's requests go with the service accounts'.
    // Put back as rendered should the test fail before it is created again.
    let back = SchemaBack(Some(schema.clone()), resource("FlowSchema"));
    match schemas.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("deleting the FlowSchema: {e}"),
    }
    let (without, _) = wait_for(
        "the Lease's requests out of leader-election",
        TIMEOUT,
        || async {
            let (level, schema) = priority_of(&replicas, lease).await?;
            (level != leader_election).then_some((level, schema))
        },
    )
    .await;

    let uid = schemas
        .create(&PostParams::default(), &schema)
        .await
        .expect("the FlowSchema accepted by this API server")
        .uid()
        .expect("uid");
    back.disarm();
    wait_for(
        "the Lease's requests in leader-election",
        TIMEOUT,
        || async {
            let placed = priority_of(&replicas, lease).await?;
            (placed == (leader_election.clone(), uid.clone())).then_some(())
        },
    )
    .await;
    // Only the Lease's: the replicas' other requests stay in the level they were in.
    let (level, _) = priority_of(
        &replicas,
        "/apis/apps.kruise.io/v1beta1/persistentpodstates?limit=1",
    )
    .await
    .expect("priority headers");
    assert_eq!(level, without, "a PersistentPodState list");
}

/// A state naming a pod the leader's pod watch never saw (as a predecessor whose watch was
/// ahead of this one records it) is written over only once the pod is read live and is the one
/// cached: `pps_pod_reads_total{result="current"}` counts the read. (The lagging watch itself
/// cannot be made here; the in-process test
/// `a_state_recorded_for_a_pod_this_cache_never_saw_is_not_written_over_from_a_lagging_cache`
/// shows the state kept while the live pod is another.)
#[tokio::test]
async fn a_state_naming_a_pod_never_seen_is_written_over_only_after_a_live_read() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-unseen").await;
    let sts = generated_statefulset("web", 1);
    let (_, states) = start_recorded(c, &ns, &sts).await;
    let uid = states["web-0"].pod_uid.clone().expect("podUID recorded");
    let series = "pps_pod_reads_total{result=\"current\"}";
    let before = metric(&scrape(&env).await, series);
    pps_api(c, &ns)
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"podStates": {"web-0": {"podUID": "never-seen"}}}})),
        )
        .await
        .expect("status");
    wait_for("the live pod's uid recorded again", TIMEOUT, || async {
        let pps = pps_api(c, &ns).get("web").await.ok()?;
        let state = pps.status?.pod_states.remove("web-0")?;
        (state.pod_uid.as_deref() == Some(uid.as_str())).then_some(())
    })
    .await;
    let after = metric(&scrape(&env).await, series);
    assert!(after > before, "{series}: {before} -> {after}");
    delete_namespace(c, &ns).await;
}
