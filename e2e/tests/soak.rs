//! Chaos soak (issue 20.7): a random schedule of faults on the local control plane for a set
//! time (`SOAK_SECONDS`, 120 s in the suite; `make soak` runs 30 minutes; `SOAK_SEED` replays a
//! schedule), with the invariants checked all along:
//! - no pod waits unscheduled because of a pin of ours (pinned to a node that is not Ready or
//!   gone) longer than `--node-lost-after` + 30 s;
//! - no recorded state is lost (a live ordinal's state, once recorded, stays);
//! - no write by a replica that did not hold the Lease (its write counters move only while it
//!   holds it, sampled every second);
//! - every replica is Ready again within 90 s of each fault.
//!
//! Not ours, and counted apart: kube-scheduler v1.37 can stop scheduling after repeated API
//! server and etcd restarts (it logs "Scheduler cache is corrupted" and never tries new pods:
//! no `PodScheduled` condition, whatever their constraints). A pod the scheduler has not tried
//! for 90 s is such a stall: the soak restarts kube-scheduler (a restart schedules every such
//! pod at once onto its pinned node) and reports how often.
//!
//! Faults: a replica SIGKILLed (and restarted), a replica SIGSTOPped for 3-12 s, the API server
//! or etcd restarted (down 0-3 s), a node's kubelet stopped for 5-20 s (within the grace
//! period), a pod deleted, a rollout started.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use persistent_pod_state::api::INJECTED_REQUIRED_ANNOTATION;
use serde_json::json;

use crate::support::*;

/// A small deterministic generator (xorshift64*), seeded per run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn secs(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_secs(from + self.below(to - from + 1))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    ReplicaKilled,
    ReplicaPaused,
    ApiServerRestarted,
    EtcdRestarted,
    NodeFlap,
    PodDeleted,
    Rollout,
}

const FAULTS: [Fault; 7] = [
    Fault::ReplicaKilled,
    Fault::ReplicaPaused,
    Fault::ApiServerRestarted,
    Fault::EtcdRestarted,
    Fault::NodeFlap,
    Fault::PodDeleted,
    Fault::Rollout,
];

impl Fault {
    fn describe(self) -> &'static str {
        match self {
            Self::ReplicaKilled => "a replica SIGKILLed and restarted",
            Self::ReplicaPaused => "a replica paused (SIGSTOP) 3-12 s",
            Self::ApiServerRestarted => "the API server restarted (down 0-3 s)",
            Self::EtcdRestarted => "etcd restarted (down 0-3 s)",
            Self::NodeFlap => "a node NotReady 5-20 s (kubelet stopped)",
            Self::PodDeleted => "a pod deleted",
            Self::Rollout => "a rollout started",
        }
    }
}

/// The StatefulSets of the soak: name and replicas.
const SETS: [(&str, i32); 2] = [("alpha", 3), ("beta", 2)];

/// What the invariant checks saw.
#[derive(Default)]
struct Watch {
    /// Per StatefulSet: the live ordinals' states recorded so far.
    recorded: BTreeMap<String, BTreeSet<String>>,
    /// Pods pinned by us and unscheduled: since when (by uid).
    pending_since: BTreeMap<String, (String, Instant)>,
    /// Per replica: its write counters at the last sample, and whether it held the Lease then.
    writes: BTreeMap<String, (f64, bool)>,
    violations: BTreeMap<&'static str, Vec<String>>,
    /// When the last sample was taken.
    last: Option<Instant>,
    /// kube-scheduler stalls seen (and restarts made), and when the last restart was.
    scheduler_restarts: u32,
    restarted_at: Option<Instant>,
}

/// How long a pod may go untried by the scheduler before the scheduler counts as stalled.
const STALL: Duration = Duration::from_secs(90);

/// How often the invariants are sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);

impl Watch {
    fn violation(&mut self, invariant: &'static str, what: String) {
        println!("VIOLATION {invariant}: {what}");
        self.violations.entry(invariant).or_default().push(what);
    }

    /// One look at every invariant that is checked continuously.
    async fn sample(&mut self, env: &Env, ns: &str, bound: Duration) {
        // The sampling period (not a synchronisation: each sample stands alone).
        if let Some(last) = self.last {
            tokio::time::sleep(SAMPLE_EVERY.saturating_sub(last.elapsed())).await;
        }
        self.last = Some(Instant::now());
        let c = &env.client;
        // No recorded state lost.
        let pps = pps_api(c, ns);
        for (name, replicas) in SETS {
            let Ok(Some(p)) = pps.get_opt(name).await else {
                continue;
            };
            let now: BTreeSet<String> = p
                .status
                .map(|s| s.pod_states.into_keys().collect())
                .unwrap_or_default();
            let live: BTreeSet<String> = (0..replicas).map(|i| format!("{name}-{i}")).collect();
            let seen = self.recorded.entry(name.to_owned()).or_default();
            let lost: Vec<String> = seen.difference(&now).cloned().collect();
            seen.extend(now.intersection(&live).cloned());
            for pod in lost {
                self.violation("no recorded state lost", format!("{pod}'s state is gone"));
                if let Some(s) = self.recorded.get_mut(name) {
                    s.remove(&pod);
                }
            }
        }
        // No pod pinned by us waits unscheduled beyond the bound.
        if let Ok(pods) = Api::<Pod>::namespaced(c.clone(), ns)
            .list(&ListParams::default())
            .await
        {
            let mut waiting = BTreeSet::new();
            let untried: Vec<String> = pods
                .items
                .iter()
                .filter(|p| {
                    let status = p.status.as_ref();
                    let tried = status
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "PodScheduled"));
                    let age = p
                        .metadata
                        .creation_timestamp
                        .as_ref()
                        .map(|t| k8s_openapi::jiff::Timestamp::now().duration_since(t.0));
                    !tried
                        && p.metadata.deletion_timestamp.is_none()
                        && age.is_some_and(|a| a.as_secs() > STALL.as_secs() as i64)
                })
                .map(ResourceExt::name_any)
                .collect();
            if !untried.is_empty() && self.restarted_at.is_none_or(|at| at.elapsed() > STALL) {
                println!(
                    "control plane: kube-scheduler has not tried {untried:?} for {STALL:?}; restarting it"
                );
                report(env, ns).await;
                restart_component(env, "kube-scheduler", false, Duration::ZERO).await;
                self.scheduler_restarts += 1;
                self.restarted_at = Some(Instant::now());
            }
            for pod in pods.items {
                let pinned = pod.annotations().contains_key(INJECTED_REQUIRED_ANNOTATION);
                let unscheduled = pod
                    .spec
                    .as_ref()
                    .is_none_or(|s| s.node_name.as_deref().is_none_or(str::is_empty));
                let (Some(uid), true, true) = (pod.uid(), pinned, unscheduled) else {
                    continue;
                };
                // Because of us only while the node it is pinned to is not usable: a pod pinned
                // to a Ready node waits for the scheduler, not for a pin of ours.
                let pinned_to = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_selector.as_ref())
                    .and_then(|s| s.get(HOST))
                    .cloned()
                    .unwrap_or_default();
                let usable = match Api::<Node>::all(c.clone()).get_opt(&pinned_to).await {
                    Ok(Some(node)) => persistent_pod_state::placement::Health::now(Duration::ZERO)
                        .lost_at(&node)
                        .is_none(),
                    Ok(None) => false,
                    // Unknown (the API server is away): not judged now.
                    Err(_) => true,
                };
                if usable {
                    continue;
                }
                waiting.insert(uid.clone());
                let since = self
                    .pending_since
                    .entry(uid)
                    .or_insert_with(|| (pod.name_any(), Instant::now()));
                if since.1.elapsed() > bound {
                    let what = format!(
                        "{} pinned and unscheduled for {:?}",
                        since.0,
                        since.1.elapsed()
                    );
                    since.1 = Instant::now();
                    self.violation("no pod stranded by us", what);
                    report(env, ns).await;
                }
            }
            self.pending_since.retain(|uid, _| waiting.contains(uid));
        }
        // No write by a replica that does not hold the Lease (only when the Lease can be read:
        // an unanswered read says nothing about who holds it).
        let Ok(lease) = Api::<Lease>::namespaced(c.clone(), "persistent-pod-state")
            .get("persistent-pod-state")
            .await
        else {
            return;
        };
        let leader = lease.spec.and_then(|s| s.holder_identity);
        for r in &env.replicas {
            let scraped = probe(&format!("{}/metrics", r.probe_url())).await;
            if scraped.0 != 200 {
                // Paused or restarting: its counters are read at its next answer.
                continue;
            }
            let writes = metric(&scraped.1, "pps_status_writes_total")
                + metric(&scraped.1, "pps_generator_writes_total{action=\"apply\"}")
                + metric(&scraped.1, "pps_generator_writes_total{action=\"delete\"}");
            let holds = leader.as_deref() == Some(r.identity().as_str());
            if let Some((before, held)) = self.writes.get(&r.name).copied()
                && writes > before
                && !held
                && !holds
            {
                self.violation(
                    "no write by a non-leader",
                    format!(
                        "{} wrote {} times without the Lease",
                        r.name,
                        writes - before
                    ),
                );
            }
            // A restarted replica counts from zero.
            self.writes.insert(r.name.clone(), (writes, holds));
        }
    }
}

/// Prints what the cluster looks like (the soak's pods: node, phase, why unscheduled; the
/// nodes: Ready condition), to tell a violation of ours from one of the control plane's.
async fn report(env: &Env, ns: &str) {
    let c = &env.client;
    if let Ok(pods) = Api::<Pod>::namespaced(c.clone(), ns)
        .list(&ListParams::default())
        .await
    {
        for pod in pods.items {
            let spec = pod.spec.as_ref();
            let status = pod.status.as_ref();
            let scheduled = status
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "PodScheduled"))
                .map(|c| format!("{} {}", c.status, c.message.as_deref().unwrap_or_default()));
            println!(
                "  pod {} uid {} node {:?} phase {:?} pinned to {:?} scheduled {:?}",
                pod.name_any(),
                pod.uid().unwrap_or_default(),
                spec.and_then(|s| s.node_name.as_deref()),
                status.and_then(|s| s.phase.as_deref()),
                spec.and_then(|s| s.node_selector.as_ref())
                    .and_then(|s| s.get(HOST)),
                scheduled,
            );
        }
    }
    if let Ok(nodes) = Api::<Node>::all(c.clone())
        .list(&ListParams::default())
        .await
    {
        for node in nodes.items {
            let ready = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
                .map(|c| format!("{} since {:?}", c.status, c.last_transition_time));
            let taints: Vec<String> = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .map(|ts| {
                    ts.iter()
                        .map(|t| format!("{}:{}", t.key, t.effect))
                        .collect()
                })
                .unwrap_or_default();
            println!(
                "  node {} ready {:?} taints {:?}",
                node.name_any(),
                ready,
                taints
            );
        }
    }
}

/// A GET that gives up after 2 s (a paused replica does not answer): status and body.
async fn probe(url: &str) -> (u16, String) {
    curl(&["-s", "-m", "2", "-w", "\n%{http_code}", url]).await
}

fn seconds(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test]
async fn a_random_schedule_of_faults_keeps_every_invariant() {
    let env = env().await;
    let c = &env.client;
    let length = Duration::from_secs(seconds("SOAK_SECONDS", 120));
    let seed = seconds(
        "SOAK_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1),
    )
    .max(1);
    println!("soak: {length:?}, seed {seed} (SOAK_SEED={seed} replays the schedule)");
    let mut rng = Rng(seed);
    let ns = namespace(c, "e2e-soak").await;
    for (name, replicas) in SETS {
        let sts = pinned_statefulset(name, replicas);
        start_recorded(c, &ns, &sts).await;
    }
    let lost_after = {
        let text = env.node_lost_after.trim();
        let (n, unit) = text.split_at(text.len() - 1);
        let n: u64 = n.parse().expect("a duration like 45s");
        Duration::from_secs(if unit == "m" { n * 60 } else { n })
    };
    let bound = lost_after + Duration::from_secs(30);
    let mut watch = Watch::default();
    let mut injected: BTreeMap<Fault, u32> = BTreeMap::new();
    let started = Instant::now();
    while started.elapsed() < length {
        let fault = FAULTS[rng.below(FAULTS.len() as u64) as usize];
        *injected.entry(fault).or_default() += 1;
        println!(
            "[{:>5.0}s] {}",
            started.elapsed().as_secs_f64(),
            fault.describe()
        );
        let replica = env.replicas[rng.below(env.replicas.len() as u64) as usize].clone();
        let process = format!("persistent-pod-state-{}", replica.name);
        match fault {
            Fault::ReplicaKilled => {
                restart_component(&env, &process, true, Duration::ZERO).await;
            }
            Fault::ReplicaPaused => {
                let pid = pid_of(&env, &process);
                let pause = rng.secs(3, 12);
                let kill = |sig: &str| {
                    std::process::Command::new("kill")
                        .args([sig, &pid])
                        .status()
                        .expect("kill")
                };
                assert!(kill("-STOP").success());
                // The fault's length.
                let until = Instant::now() + pause;
                while Instant::now() < until {
                    watch.sample(&env, &ns, bound).await;
                }
                assert!(kill("-CONT").success());
            }
            Fault::ApiServerRestarted => {
                restart_component(&env, "kube-apiserver", false, rng.secs(0, 3)).await;
            }
            Fault::EtcdRestarted => {
                restart_component(&env, "etcd", false, rng.secs(0, 3)).await;
            }
            Fault::NodeFlap => {
                let node = NODES[rng.below(NODES.len() as u64) as usize];
                let kubelet = stop_kubelet(node);
                let until = Instant::now() + rng.secs(5, 20);
                while Instant::now() < until {
                    watch.sample(&env, &ns, bound).await;
                }
                drop(kubelet);
            }
            Fault::PodDeleted => {
                let (name, replicas) = SETS[rng.below(SETS.len() as u64) as usize];
                let pod = format!("{name}-{}", rng.below(replicas as u64));
                let _ = Api::<Pod>::namespaced(c.clone(), &ns)
                    .delete(&pod, &DeleteParams::default())
                    .await;
            }
            Fault::Rollout => {
                let (name, _) = SETS[rng.below(SETS.len() as u64) as usize];
                let _ = Api::<StatefulSet>::namespaced(c.clone(), &ns)
                    .patch(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"template": {"metadata": {"annotations": {
                            "e2e/rollout": rng.next().to_string()}}}}})),
                    )
                    .await;
            }
        }
        // Every replica Ready again within 90 s, the invariants sampled meanwhile.
        let ready_by = Instant::now() + Duration::from_secs(90);
        loop {
            watch.sample(&env, &ns, bound).await;
            let mut all = true;
            for r in &env.replicas {
                let url = format!("{}/readyz", r.probe_url());
                all &= probe(&url).await.0 == 200;
            }
            if all {
                break;
            }
            if Instant::now() > ready_by {
                watch.violation(
                    "every replica Ready within 90 s",
                    format!("after {}", fault.describe()),
                );
                break;
            }
        }
        // The schedule: 1-5 s between faults.
        let next = Instant::now() + rng.secs(1, 5);
        while Instant::now() < next {
            watch.sample(&env, &ns, bound).await;
        }
    }
    // At the end every pod runs and every live ordinal's state is there.
    println!("faults over; the cluster now:");
    report(&env, &ns).await;
    // Sampled meanwhile, so that a stalled scheduler is seen and restarted here too. Every pod
    // is asked after too: a StatefulSet's status can still count a pod deleted a moment ago.
    let settle_by = Instant::now() + TIMEOUT + STALL + Duration::from_secs(30);
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    loop {
        watch.sample(&env, &ns, bound).await;
        let mut all = true;
        for (name, replicas) in SETS {
            all &= sts_rolled(c, &ns, name, replicas).await;
            for pod in pod_names(name, replicas) {
                let ready = pods.get_opt(&pod).await.ok().flatten().is_some_and(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.status.and_then(|s| s.conditions).is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
                });
                all &= ready;
            }
        }
        if all {
            break;
        }
        assert!(
            Instant::now() < settle_by,
            "the StatefulSets did not settle after the faults"
        );
    }
    for (name, replicas) in SETS {
        let names: Vec<String> = pod_names(name, replicas);
        wait_recorded(c, &ns, name, &names, name).await;
    }
    watch.sample(&env, &ns, bound).await;
    println!("| fault | injected |");
    println!("|---|---|");
    for (fault, n) in &injected {
        println!("| {} | {n} |", fault.describe());
    }
    println!("| invariant | violations |");
    println!("|---|---|");
    for invariant in [
        "no pod stranded by us",
        "no recorded state lost",
        "no write by a non-leader",
        "every replica Ready within 90 s",
    ] {
        let n = watch.violations.get(invariant).map_or(0, Vec::len);
        println!("| {invariant} | {n} |");
    }
    println!(
        "\ncontrol plane: kube-scheduler stalls (pods it had not tried for {STALL:?}; restarted): {}",
        watch.scheduler_restarts
    );
    assert!(
        watch.violations.is_empty(),
        "violations (seed {seed}): {:?}",
        watch.violations
    );
    delete_namespace(c, &ns).await;
}
