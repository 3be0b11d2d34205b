//! `kubectl pps`: the binary installed as `kubectl-pps` (kubectl runs any `kubectl-NAME` on its
//! PATH as `kubectl NAME`) answers `status`, `explain POD` and `release POD` with kubectl's usual
//! flags (`-n`, `-A`, `-o json|yaml|wide`, `--context`, `--kubeconfig`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::Event;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use serde::Serialize;

use crate::api::PersistentPodState;
use crate::cli::{Mode, parse_duration, parse_label_key};
use crate::placement::{self, Health, PodDemands};
use crate::state::Caches;
use crate::{explain, release};

/// The name the binary answers to as a kubectl plugin.
pub const PLUGIN_NAME: &str = "kubectl-pps";

/// `kubectl pps`: PersistentPodStates at a glance, what a re-created pod would get, and the
/// release of a pod waiting for a node that is gone.
#[derive(Debug, Parser)]
#[command(name = "kubectl pps", version)]
pub struct PluginCli {
    /// The namespace (default: the context's, else `default`).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// Every namespace (`status`).
    #[arg(short = 'A', long, global = true)]
    pub all_namespaces: bool,
    /// Output format (default: a table or text).
    #[arg(short = 'o', long, global = true, value_enum)]
    pub output: Option<PluginOutput>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// The kubeconfig file (default: $KUBECONFIG, else ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// The user to impersonate (as kubectl's `--as`).
    #[arg(long = "as", global = true)]
    pub as_user: Option<String>,
    /// A group to impersonate, repeatable (as kubectl's `--as-group`).
    #[arg(long = "as-group", global = true)]
    pub as_groups: Vec<String>,
    /// As `serve --node-lost-after` (what the webhook is run with).
    #[arg(long, global = true, env = "PPS_NODE_LOST_AFTER", default_value = "5m", value_parser = parse_duration)]
    pub node_lost_after: Duration,
    /// As `serve --node-local-volume-key` (what the controller is run with).
    #[arg(long = "node-local-volume-key", global = true, env = "PPS_NODE_LOCAL_VOLUME_KEYS",
          value_delimiter = ',', value_parser = parse_label_key)]
    pub node_local_volume_keys: Vec<String>,
    /// As `serve --mode` (what the replicas are run with).
    #[arg(long, global = true, env = "PPS_MODE", value_enum, default_value_t = Mode::Active)]
    pub mode: Mode,
    /// As `serve --max-releases-per-minute` (0: the replicas release nothing).
    #[arg(
        long,
        global = true,
        env = "PPS_MAX_RELEASES_PER_MINUTE",
        default_value_t = 10
    )]
    pub max_releases_per_minute: u32,
    /// What to do.
    #[command(subcommand)]
    pub command: PluginCommand,
}

/// `-o` of `kubectl pps`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PluginOutput {
    /// One JSON document.
    Json,
    /// One YAML document.
    Yaml,
    /// The table with more columns (`status`); text otherwise.
    Wide,
}

/// The commands of `kubectl pps`.
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Per PersistentPodState: its workload, how many pods are recorded, restored to their node,
    /// unplaceable now (node or zone gone or lost), and released (from their Events of the
    /// last hour, the API server's Event lifetime by default).
    Status,
    /// What a re-created pod would get now, and every part left out and why.
    Explain {
        /// The pod (it may be gone, if a PersistentPodState records it).
        pod: String,
    },
    /// Release a pod that waits unscheduled for a node that is gone (its own claims on that
    /// node's local volumes, then the pod), on an operator's word.
    Release {
        /// The waiting pod.
        pod: String,
        /// Delete nothing; print what would be deleted.
        #[arg(long)]
        dry_run: bool,
    },
}

/// One PersistentPodState in `kubectl pps status`.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusRow {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its workload, `Kind/name`.
    pub target: String,
    /// Pods recorded.
    pub recorded: usize,
    /// Re-created pods back on their recorded node, of those judged (`restored/judged`).
    pub restored: Option<String>,
    /// Recorded pods whose required values cannot all be injected now (`None`: not judged, the
    /// nodes could not be listed).
    pub unplaceable: Option<Vec<String>>,
    /// Pods released (`PodReleased` Events still kept by the API server; `None`: the Events
    /// could not be listed).
    pub released: Option<Vec<String>>,
}

/// `kubectl pps status`: its rows, and what could not be read (a user who may not list nodes
/// or Events still gets the rest).
#[derive(Debug)]
pub struct Status {
    /// One per PersistentPodState.
    pub rows: Vec<StatusRow>,
    /// What could not be read, and which columns it leaves unjudged (`?`).
    pub unread: Vec<String>,
}

/// The rows of `status` as a table; `wide` names the unplaceable and released pods.
pub fn table(rows: &[StatusRow], wide: bool) -> String {
    let mut lines = vec![{
        let mut h = vec![
            "NAMESPACE",
            "NAME",
            "TARGET",
            "RECORDED",
            "RESTORED",
            "UNPLACEABLE",
            "RELEASED",
        ];
        if wide {
            h.extend(["UNPLACEABLE-PODS", "RELEASED-PODS"]);
        }
        h.into_iter().map(str::to_owned).collect::<Vec<_>>()
    }];
    for r in rows {
        let mut cells = vec![
            r.namespace.clone(),
            r.name.clone(),
            r.target.clone(),
            r.recorded.to_string(),
            r.restored.clone().unwrap_or_else(|| "-".into()),
            count(r.unplaceable.as_deref()),
            count(r.released.as_deref()),
        ];
        if wide {
            let list = |v: Option<&[String]>| match v {
                None => "?".into(),
                Some([]) => "-".into(),
                Some(v) => v.join(","),
            };
            cells.extend([list(r.unplaceable.as_deref()), list(r.released.as_deref())]);
        }
        lines.push(cells);
    }
    let columns = lines.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for l in &lines {
        let cells: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// A column's count, `?` when it could not be judged.
fn count(v: Option<&[String]>) -> String {
    v.map_or_else(|| "?".into(), |v| v.len().to_string())
}

/// The client of `--kubeconfig`/`--context`/`--as`, and the namespace to use.
async fn client(cli: &PluginCli) -> anyhow::Result<(Client, String)> {
    let options = KubeConfigOptions {
        context: cli.context.clone(),
        ..KubeConfigOptions::default()
    };
    let mut config = match &cli.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &options).await
        }
        None => kube::Config::from_kubeconfig(&options).await,
    }
    .context("no usable kubeconfig (KUBECONFIG, --kubeconfig, --context)")?;
    if let Some(user) = &cli.as_user {
        config.auth_info.impersonate = Some(user.clone());
    }
    if !cli.as_groups.is_empty() {
        // The API server refuses groups without a user, with a less telling error.
        anyhow::ensure!(
            config.auth_info.impersonate.is_some(),
            "--as-group needs --as (or `as` in the kubeconfig's user)"
        );
        config.auth_info.impersonate_groups = Some(cli.as_groups.clone());
    }
    let namespace = cli
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    Ok((Client::try_from(config)?, namespace))
}

/// The rows of `status` for `namespace` (every namespace when `None`). Nodes or Events the
/// caller may not list leave their columns unjudged, and say so in [`Status::unread`].
pub async fn status(
    client: &Client,
    namespace: Option<&str>,
    lost_after: Duration,
) -> anyhow::Result<Status> {
    let (pps_api, events): (Api<PersistentPodState>, Api<Event>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let mut list = Vec::new();
    crate::state::list_each(&pps_api, &ListParams::default(), |p| list.push(p))
        .await
        .context("listing PersistentPodStates")?;
    let mut unread = Vec::new();
    let caches = match Caches::with_nodes(client).await {
        Ok(caches) => Some(caches),
        Err(kube::Error::Api(e)) if e.code == 403 => {
            unread.push(format!("nodes ({}): UNPLACEABLE not judged", e.message));
            None
        }
        Err(e) => return Err(e).context("listing nodes"),
    };
    let mut released = Vec::new();
    let params = ListParams::default().fields("reason=PodReleased");
    let events_read = match crate::state::list_each(&events, &params, |e| released.push(e)).await {
        Ok(()) => true,
        Err(kube::Error::Api(e)) if e.code == 403 => {
            unread.push(format!("Events ({}): RELEASED not counted", e.message));
            false
        }
        Err(e) => return Err(e).context("listing Events"),
    };
    let mut released_by: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for e in released {
        let about = &e.involved_object;
        if about.kind.as_deref() != Some("PersistentPodState") {
            continue;
        }
        let pod = e
            .related
            .as_ref()
            .and_then(|r| r.name.clone())
            .unwrap_or_default();
        let key = (
            about.namespace.clone().unwrap_or_default(),
            about.name.clone().unwrap_or_default(),
        );
        let pods = released_by.entry(key).or_default();
        if !pods.contains(&pod) {
            pods.push(pod);
        }
    }
    let health = Health::now(lost_after);
    let demands = PodDemands::none();
    let rows = list
        .into_iter()
        .map(|p| {
            let ns = p.namespace().unwrap_or_default();
            let name = p.name_any();
            let status = p.status.clone().unwrap_or_default();
            let unplaceable = caches.as_ref().map(|caches| {
                let place = |recorded: &BTreeMap<String, String>| {
                    placement::required_owned(recorded, &demands, caches.as_ref(), &health)
                };
                crate::controller::record::unplaceable_states(&p.spec, &status, &place)
                    .into_keys()
                    .collect()
            });
            let released = released_by.remove(&(ns.clone(), name.clone()));
            let t = &p.spec.target_ref;
            StatusRow {
                released: events_read.then(|| released.unwrap_or_default()),
                target: format!("{}/{}", t.kind, t.name),
                recorded: status.pod_states.len(),
                restored: status.restored.clone(),
                unplaceable,
                namespace: ns,
                name,
            }
        })
        .collect();
    Ok(Status { rows, unread })
}

fn print<T: Serialize>(
    value: &T,
    output: Option<PluginOutput>,
    text: String,
) -> anyhow::Result<()> {
    match output {
        Some(PluginOutput::Json) => println!("{}", serde_json::to_string_pretty(value)?),
        Some(PluginOutput::Yaml) => print!("{}", serde_yaml_ng::to_string(value)?),
        Some(PluginOutput::Wide) | None => print!("{text}"),
    }
    Ok(())
}

/// Runs `kubectl pps` with its parsed command line.
pub async fn run(cli: PluginCli) -> anyhow::Result<()> {
    let (client, namespace) = client(&cli).await?;
    match &cli.command {
        PluginCommand::Status => {
            let scope = (!cli.all_namespaces).then_some(namespace.as_str());
            let status = status(&client, scope, cli.node_lost_after).await?;
            for what in &status.unread {
                eprintln!("warning: could not list {what}");
            }
            let text = table(&status.rows, cli.output == Some(PluginOutput::Wide));
            print(&status.rows, cli.output, text)
        }
        PluginCommand::Explain { pod } => {
            let served = explain::AsServed {
                node_lost_after: cli.node_lost_after,
                node_keys: release::NodeKeys::with(&cli.node_local_volume_keys),
                observe_all: cli.mode == Mode::Observe,
                max_releases_per_minute: cli.max_releases_per_minute,
            };
            let e = explain::explain(&client, &namespace, pod, &served).await?;
            print(&e, cli.output, e.text())
        }
        PluginCommand::Release { pod, dry_run } => {
            let keys = release::NodeKeys::with(&cli.node_local_volume_keys);
            let r = release::release_pod(&client, &namespace, pod, *dry_run, &keys).await?;
            print(&r, cli.output, r.text())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubectl_flags_parse_before_and_after_the_command() {
        let cli = PluginCli::try_parse_from([
            "kubectl-pps",
            "-n",
            "db",
            "explain",
            "web-0",
            "-o",
            "yaml",
            "--context",
            "prod",
        ])
        .expect("parses");
        assert_eq!(cli.namespace.as_deref(), Some("db"));
        assert_eq!(cli.output, Some(PluginOutput::Yaml));
        assert_eq!(cli.context.as_deref(), Some("prod"));
        assert!(matches!(cli.command, PluginCommand::Explain { ref pod } if pod == "web-0"));
        let all = PluginCli::try_parse_from(["kubectl-pps", "status", "-A", "-o", "wide"])
            .expect("parses");
        assert!(all.all_namespaces);
        assert!(PluginCli::try_parse_from(["kubectl-pps", "status", "-o", "xml"]).is_err());
    }

    #[test]
    fn the_table_aligns_and_wide_names_the_pods() {
        let rows = vec![StatusRow {
            namespace: "db".into(),
            name: "web".into(),
            target: "StatefulSet/web".into(),
            recorded: 3,
            restored: Some("2/2".into()),
            unplaceable: Some(vec!["web-2".into()]),
            released: Some(vec![]),
        }];
        let narrow = table(&rows, false);
        let lines: Vec<&str> = narrow.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("NAMESPACE   NAME"), "{narrow}");
        assert!(
            lines[1].contains("StatefulSet/web") && lines[1].ends_with('0'),
            "{narrow}"
        );
        let unjudged = StatusRow {
            unplaceable: None,
            released: None,
            ..rows[0].clone()
        };
        let line = table(&[unjudged], true);
        let cells: Vec<&str> = line
            .lines()
            .nth(1)
            .map(|l| l.split_whitespace().skip(5).collect())
            .unwrap_or_default();
        assert_eq!(cells, ["?"; 4], "{line}");
        let wide = table(&rows, true);
        assert!(
            wide.lines()
                .nth(1)
                .is_some_and(|l| l.contains("web-2") && l.ends_with('-')),
            "{wide}"
        );
    }
}
