//! Command line: `serve`, `crd`, `certs`. Every flag has an environment variable fallback.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::discovery::parse_group_kind;
use crate::workload::GroupKind;

/// Parses a duration such as `5m`, `90s`, `1h 30m` or `PT5M`; it must not be negative.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let d: k8s_openapi::jiff::SignedDuration = text
        .trim()
        .parse()
        .map_err(|e| format!("{text:?} is not a duration such as 5m, 90s or 1h: {e}"))?;
    Duration::try_from(d).map_err(|_| format!("{text:?} is negative"))
}

/// A node label's key, as Kubernetes accepts one.
pub fn parse_label_key(text: &str) -> Result<String, String> {
    let key = text.trim();
    match crate::api::keys::qualified_name_error(key) {
        None => Ok(key.to_owned()),
        Some(why) => Err(format!("{key:?} is not a label key: {why}")),
    }
}

/// Keeps StatefulSet pods on their node, zone and IP across re-creation (PersistentPodState).
#[derive(Debug, Parser)]
#[command(name = "persistent-pod-state", version, about)]
pub struct Cli {
    /// Log line format.
    #[arg(long, env = "PPS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain, global = true)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log line formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the admission webhook server and the controller in one process.
    Serve(Box<ServeArgs>),
    /// Print the PersistentPodState CustomResourceDefinition as YAML.
    Crd(CrdArgs),
    /// Write a self-signed CA (ca.crt, ca.key) and a serving certificate (tls.crt, tls.key); with a
    /// CA already in the directory, renew only the serving certificate under it.
    Certs(CertsArgs),
    /// Show what a re-created pod would get now (uses $KUBECONFIG): the PersistentPodState in
    /// force, the recorded state, the exact patch, and every part left out and why.
    Explain(ExplainArgs),
    /// Release a pod that waits unscheduled for a node that is gone, on an operator's word:
    /// delete its own claims bound to node-local volumes of a node that is not ready (by uid)
    /// and the pod (by uid and resourceVersion), so its workload re-creates both elsewhere
    /// (uses $KUBECONFIG). Prints what it deletes.
    Release(ReleaseArgs),
    /// Remove an installation's webhook registrations before its server goes away (the Helm
    /// chart's pre-delete hook): the Mutating and Validating configurations NAME, only when
    /// Helm's annotations say they belong to the release, by uid (uses $KUBECONFIG or the
    /// in-cluster service account).
    Unregister(UnregisterArgs),
}

/// Flags of `unregister`.
#[derive(Debug, Args)]
pub struct UnregisterArgs {
    /// Name of the two webhook configurations.
    pub name: String,
    /// The Helm release they must belong to.
    #[arg(long)]
    pub release: String,
    /// The release's namespace.
    #[arg(long)]
    pub release_namespace: String,
}

/// Flags of `release`.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// The waiting pod.
    pub pod: String,
    /// Its namespace.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// Delete nothing; print what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
    /// As `serve --node-local-volume-key` (what the controller is run with).
    #[arg(long = "node-local-volume-key", env = "PPS_NODE_LOCAL_VOLUME_KEYS", value_delimiter = ',',
          value_parser = parse_label_key)]
    pub node_local_volume_keys: Vec<String>,
    /// Output: human-readable text or JSON.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

/// Flags of `explain`.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The pod (it may be gone, e.g. scaled down, if a PersistentPodState records it).
    pub pod: String,
    /// Its namespace.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// As `serve --node-lost-after` (what the webhook is run with).
    #[arg(long, env = "PPS_NODE_LOST_AFTER", default_value = "5m", value_parser = parse_duration)]
    pub node_lost_after: Duration,
    /// As `serve --node-local-volume-key` (what the controller is run with).
    #[arg(long = "node-local-volume-key", env = "PPS_NODE_LOCAL_VOLUME_KEYS", value_delimiter = ',',
          value_parser = parse_label_key)]
    pub node_local_volume_keys: Vec<String>,
    /// As `serve --mode` (what the replicas are run with).
    #[arg(long, env = "PPS_MODE", value_enum, default_value_t = Mode::Active)]
    pub mode: Mode,
    /// As `serve --max-releases-per-minute` (0: the replicas release nothing).
    #[arg(long, env = "PPS_MAX_RELEASES_PER_MINUTE", default_value_t = 10)]
    pub max_releases_per_minute: u32,
    /// Output: human-readable text or JSON.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

/// `serve --mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Inject what is recorded (and release what was pinned).
    Active,
    /// Inject nothing; report what would be injected.
    Observe,
}

/// Output formats of `explain` and `release`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Human-readable.
    Text,
    /// One JSON document.
    Json,
}

/// Flags of `serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// HTTPS address of the admission webhooks (`[::]`: every address, IPv4 and IPv6; IPv4
    /// alone on a host without IPv6).
    #[arg(long, env = "PPS_LISTEN", default_value = "[::]:9443")]
    pub listen: SocketAddr,
    /// PEM serving certificate (re-read when it changes).
    #[arg(long, env = "PPS_TLS_CERT", default_value = "certs/tls.crt")]
    pub tls_cert: PathBuf,
    /// PEM private key of the serving certificate.
    #[arg(long, env = "PPS_TLS_KEY", default_value = "certs/tls.key")]
    pub tls_key: PathBuf,
    /// PEM CA bundle (re-read when it changes): when given, webhook clients must present a
    /// certificate it signed (the API server's, set in its AdmissionConfiguration; see
    /// docs/install.md).
    #[arg(long, env = "PPS_CLIENT_CA")]
    pub client_ca: Option<PathBuf>,
    /// Plain HTTP address of /healthz, /readyz and /metrics (`[::]` as for `--listen`).
    #[arg(long, env = "PPS_PROBE_LISTEN", default_value = "[::]:8080")]
    pub probe_listen: SocketAddr,
    /// A custom StatefulSet-like workload kind, GROUP/KIND (repeatable; comma list in the env var).
    #[arg(long = "custom-workload", env = "PPS_CUSTOM_WORKLOADS", value_delimiter = ',', value_parser = parse_group_kind)]
    pub custom_workloads: Vec<GroupKind>,
    /// A file listing more custom kinds (`customWorkloads: [GROUP/KIND, ...]`), re-read when it changes.
    #[arg(long, env = "PPS_CUSTOM_WORKLOAD_CONFIG")]
    pub custom_workload_config: Option<PathBuf>,
    /// How long a node may be not ready (or tainted unreachable/not-ready) before a required
    /// pin to it is left out of re-created pods (e.g. `5m`, `90s`, `1h`).
    #[arg(long, env = "PPS_NODE_LOST_AFTER", default_value = "5m", value_parser = parse_duration)]
    pub node_lost_after: Duration,
    /// `active` injects; `observe` records and computes everything and injects nothing,
    /// reporting what it would have injected: a `WouldInject` Event per pod,
    /// `pps_observed_total`, `explain`. It still writes statuses and generated
    /// PersistentPodStates, and releases only pods it pinned itself (never a claim). One PersistentPodState can be observed on its own with
    /// the annotation `persistent-pod-state.io/mode: observe`.
    #[arg(long, env = "PPS_MODE", value_enum, default_value_t = Mode::Active)]
    pub mode: Mode,
    /// Waiting pods released per PersistentPodState per minute at most (a burst of that many,
    /// then one every 60/N s): a pod pinned by the webhook to values no usable node has any
    /// more is deleted so that its workload re-creates it. 0: none is released.
    #[arg(long, env = "PPS_MAX_RELEASES_PER_MINUTE", default_value_t = 10)]
    pub max_releases_per_minute: u32,
    /// Node labels, beside the built-in ones, whose value names one node in a node-local
    /// volume's affinity (another driver's node key): a claim on a volume pinned by one of them
    /// is released with its lost node; a volume pinned by any other label is kept.
    #[arg(long = "node-local-volume-key", env = "PPS_NODE_LOCAL_VOLUME_KEYS", value_delimiter = ',',
          value_parser = parse_label_key)]
    pub node_local_volume_keys: Vec<String>,
    /// Leader election.
    #[command(flatten)]
    pub lease: LeaseArgs,
    /// Seconds to keep serving after SIGTERM with readiness failing, before refusing connections.
    #[arg(long, env = "PPS_SHUTDOWN_DELAY_SECONDS", default_value_t = 3)]
    pub shutdown_delay_seconds: u64,
    /// Threads that serve the admission webhooks, apart from the controllers' (which never
    /// hold them up); each new connection goes to the one serving the fewest, which serves it
    /// to its end. One answers tens of thousands of reviews a second (BENCHMARKS.md); a second
    /// keeps answering while the kernel preempts the first or it decodes a review of megabytes.
    #[arg(long, env = "PPS_ADMISSION_THREADS", default_value_t = crate::serving::ADMISSION_THREADS,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub admission_threads: u16,
    /// The time slice, in microseconds, the admission threads ask the kernel for (EEVDF's
    /// custom slice of a normal thread: Linux 6.12 and later honour it, clamped to
    /// 100-100,000; older kernels ignore it). A short slice lets a review that arrives while
    /// another thread holds the core preempt it sooner. 0: the kernel's default.
    #[arg(long, env = "PPS_ADMISSION_SLICE_MICROS",
          default_value_t = crate::serving::ADMISSION_SLICE.as_micros() as u32,
          value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub admission_slice_micros: u32,
    /// Steps of `nice` below the process's own priority that everything but admission runs at
    /// (the controllers, the caches' watches, leader election, probes), so that a review waits
    /// less behind them when both want the CPU. 0: the same priority.
    #[arg(long, env = "PPS_BACKGROUND_NICE", default_value_t = crate::serving::BACKGROUND_NICE,
          value_parser = clap::value_parser!(u8).range(0..=19))]
    pub background_nice: u8,
    /// Seconds to let requests in flight finish once no longer accepting.
    #[arg(long, env = "PPS_DRAIN_SECONDS", default_value_t = 20)]
    pub drain_seconds: u64,
    /// Runs the code a review runs (linked first, `link/`) from one 2 MiB huge page, copied
    /// there at start (Linux on x86-64, where `link/` lays the code out; skipped, with a
    /// warning, where the kernel refuses a step; no effect on other architectures). `perf`
    /// does not name the functions of that page by itself: see `--hot-code-perf-map`.
    #[arg(long, env = "PPS_HOT_CODE_HUGE_PAGE", default_value_t = true,
          action = clap::ArgAction::Set)]
    pub hot_code_huge_page: bool,
    /// With the hot code on its huge page, writes `/tmp/perf-PID.map` at start, naming the
    /// functions there for `perf` and the profilers that read its maps (as a JIT names its
    /// code). The file stays after the process ends, for reports made later.
    #[arg(long, env = "PPS_HOT_CODE_PERF_MAP", default_value_t = false,
          action = clap::ArgAction::Set)]
    pub hot_code_perf_map: bool,
}

/// Leader election flags of `serve`.
#[derive(Debug, Args)]
pub struct LeaseArgs {
    /// Run the controllers only while holding the Lease (all replicas serve webhooks). Off: this
    /// process always runs them (a single replica).
    #[arg(long, env = "PPS_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the coordination.k8s.io Lease.
    #[arg(long, env = "PPS_LEASE_NAME", default_value = "persistent-pod-state")]
    pub lease_name: String,
    /// Namespace of the Lease (default: POD_NAMESPACE, else the service account's, else default).
    #[arg(long, env = "PPS_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Seconds a Lease record must stay unchanged before another replica may take it (a dead
    /// leader's successor waits this long).
    #[arg(long, env = "PPS_LEASE_DURATION_SECONDS", default_value_t = 15)]
    pub lease_duration_seconds: u64,
    /// Seconds within which the leader must renew, or step down (stops its controllers); less
    /// than the lease duration, so it stops before another replica may take over.
    #[arg(long, env = "PPS_LEASE_RENEW_DEADLINE_SECONDS", default_value_t = 10)]
    pub lease_renew_deadline_seconds: u64,
    /// Seconds between renewals (and between a candidate's looks).
    #[arg(long, env = "PPS_LEASE_RETRY_PERIOD_SECONDS", default_value_t = 2)]
    pub lease_retry_period_seconds: u64,
    /// This replica's identity in the Lease (default: pod or host name and process id).
    #[arg(long, env = "PPS_LEADER_IDENTITY")]
    pub leader_identity: Option<String>,
}

/// Flags of `crd`: where the API server reaches the `/convert` webhook.
#[derive(Debug, Args)]
pub struct CrdArgs {
    /// Conversion webhook URL (instead of a Service), e.g. `https://127.0.0.1:9443/convert`.
    #[arg(long, env = "PPS_CONVERSION_URL")]
    pub conversion_url: Option<String>,
    /// Namespace of the Service in front of the webhook.
    #[arg(
        long,
        env = "PPS_CONVERSION_SERVICE_NAMESPACE",
        default_value = "persistent-pod-state"
    )]
    pub conversion_service_namespace: String,
    /// Name of the Service in front of the webhook.
    #[arg(
        long,
        env = "PPS_CONVERSION_SERVICE_NAME",
        default_value = "persistent-pod-state"
    )]
    pub conversion_service_name: String,
    /// PEM CA bundle the API server trusts the webhook with (left out: injected by cert-manager).
    #[arg(long, env = "PPS_CA_BUNDLE_FILE")]
    pub ca_bundle_file: Option<PathBuf>,
    /// Leave out `selectableFields` (`spec.targetRef.name`), for Kubernetes before 1.31 (1.30
    /// without its CustomResourceFieldSelectors gate on), whose API servers do not serve it (strict
    /// clients refuse the CRD). Without it, validating a
    /// PersistentPodState CREATE reads its namespace's whole list.
    #[arg(long, env = "PPS_CRD_WITHOUT_SELECTABLE_FIELDS")]
    pub without_selectable_fields: bool,
}

/// Flags of `certs`.
#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory to write ca.crt, ca.key (the CA's private key), tls.crt and tls.key into.
    #[arg(long, env = "PPS_CERTS_OUT_DIR")]
    pub out_dir: PathBuf,
    /// DNS name or IP address the certificate is for (repeatable; comma list in the env var).
    #[arg(
        long = "host",
        env = "PPS_CERTS_HOSTS",
        value_delimiter = ',',
        required = true
    )]
    pub hosts: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn serve_defaults() {
        let cli = Cli::try_parse_from(["persistent-pod-state", "serve"]).expect("parses");
        let Command::Serve(args) = cli.command else {
            panic!("serve expected")
        };
        assert_eq!(args.listen.to_string(), "[::]:9443");
        assert_eq!(args.probe_listen.to_string(), "[::]:8080");
        assert_eq!(args.tls_cert, PathBuf::from("certs/tls.crt"));
        assert_eq!(args.tls_key, PathBuf::from("certs/tls.key"));
    }

    #[test]
    fn node_local_volume_keys_are_label_keys_repeated_or_listed() {
        let cli = Cli::try_parse_from([
            "persistent-pod-state",
            "serve",
            "--node-local-volume-key",
            "directpv.min.io/node,example.com/disk-node",
            "--node-local-volume-key=rack-node",
        ])
        .expect("parses");
        let Command::Serve(args) = cli.command else {
            panic!("serve expected")
        };
        assert_eq!(
            args.node_local_volume_keys,
            ["directpv.min.io/node", "example.com/disk-node", "rack-node"]
        );
        for bad in ["", "Example.com/node", "a/b/c", "-node"] {
            let parsed = Cli::try_parse_from([
                "persistent-pod-state",
                "release",
                "web-0",
                "--node-local-volume-key",
                bad,
            ]);
            assert!(parsed.is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn durations_parse_in_friendly_and_iso_forms() {
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("PT2M"), Ok(Duration::from_secs(120)));
        for bad in ["", "soon", "-5m", "5"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        let cli = Cli::try_parse_from(["persistent-pod-state", "serve"]).expect("parses");
        let Command::Serve(args) = cli.command else {
            panic!("serve expected")
        };
        assert_eq!(args.node_lost_after, Duration::from_secs(300));
    }

    #[test]
    fn custom_workloads_are_group_kinds() {
        let cli = Cli::try_parse_from([
            "persistent-pod-state",
            "serve",
            "--custom-workload",
            "example.com/Ring",
            "--custom-workload",
            "db.example.com/Cluster",
        ])
        .expect("parses");
        let Command::Serve(args) = cli.command else {
            panic!("serve expected")
        };
        assert_eq!(
            args.custom_workloads,
            [
                GroupKind::new("example.com", "Ring"),
                GroupKind::new("db.example.com", "Cluster")
            ]
        );
        assert!(
            Cli::try_parse_from(["persistent-pod-state", "serve", "--custom-workload", "Ring"])
                .is_err()
        );
    }

    #[test]
    fn certs_takes_repeated_hosts() {
        let cli = Cli::try_parse_from([
            "persistent-pod-state",
            "certs",
            "--out-dir",
            "x",
            "--host",
            "a.svc",
            "--host",
            "127.0.0.1",
        ])
        .expect("parses");
        let Command::Certs(args) = cli.command else {
            panic!("certs expected")
        };
        assert_eq!(args.hosts, ["a.svc", "127.0.0.1"]);
    }
}
