//! Which workload kinds are watched: the native StatefulSet always; Kruise's Advanced
//! StatefulSet and the configured custom kinds once their CustomResourceDefinition is
//! established, including CRDs that appear (or a configuration that changes) after start.
//! Also reads the custom-workload configuration file and re-reads it when it changes.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::ApiResource;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::files::FileStamp;
use crate::state::Caches;
use crate::state::index::{Indexer, Relisting};
use crate::workload::{CustomKinds, GroupKind};

/// CustomResourceDefinitions listed per page.
const CRD_PAGE: u32 = 25;

/// Parses `GROUP/KIND` (the group may contain dots and must not be empty).
pub fn parse_group_kind(s: &str) -> Result<GroupKind, String> {
    let (group, kind) = s
        .trim()
        .rsplit_once('/')
        .ok_or_else(|| format!("{s:?} is not GROUP/KIND"))?;
    if group.is_empty() || kind.is_empty() {
        return Err(format!("{s:?} is not GROUP/KIND"));
    }
    Ok(GroupKind::new(group, kind))
}

/// The custom-workload configuration file: `customWorkloads: [GROUP/KIND, ...]` (YAML or JSON).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    custom_workloads: Vec<String>,
}

/// Parses the configuration file's text.
pub fn parse_config(text: &str) -> Result<BTreeSet<GroupKind>, String> {
    if text.trim().is_empty() {
        return Ok(BTreeSet::new());
    }
    let file: ConfigFile = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    file.custom_workloads
        .iter()
        .map(|s| parse_group_kind(s))
        .collect()
}

/// The resource to watch for an established CRD of `kind`: its storage version if served,
/// else its first served version, under the names the API server accepted (`status.acceptedNames`:
/// a renamed CRD is served under its old names until the new ones are accepted).
pub fn crd_resource(crd: &CustomResourceDefinition) -> Option<ApiResource> {
    let established = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
    if !established {
        return None;
    }
    let spec = &crd.spec;
    let version = spec
        .versions
        .iter()
        .find(|v| v.storage && v.served)
        .or_else(|| spec.versions.iter().find(|v| v.served))?;
    let names = crd
        .status
        .as_ref()
        .and_then(|s| s.accepted_names.as_ref())
        .filter(|n| !n.kind.is_empty() && !n.plural.is_empty())
        .unwrap_or(&spec.names);
    Some(ApiResource {
        group: spec.group.clone(),
        version: version.name.clone(),
        api_version: format!("{}/{}", spec.group, version.name),
        kind: names.kind.clone(),
        plural: names.plural.clone(),
    })
}

/// The established CRDs and the resource to watch for each, by CRD name.
#[derive(Debug, Default)]
pub struct EstablishedCrds(HashMap<String, (GroupKind, ApiResource)>);

impl Indexer<CustomResourceDefinition> for EstablishedCrds {
    fn upsert(&mut self, crd: &CustomResourceDefinition) -> bool {
        match crd_resource(crd) {
            Some(ar) => {
                let entry = (GroupKind::new(&ar.group, &ar.kind), ar);
                self.0.insert(crd.name_any(), entry.clone()) != Some(entry)
            }
            None => self.0.remove(&crd.name_any()).is_some(),
        }
    }

    fn remove(&mut self, crd: &CustomResourceDefinition) -> bool {
        self.0.remove(&crd.name_any()).is_some()
    }
}

/// Keeps the watched workload kinds in line with the established CRDs and the handled kinds
/// (Kruise's StatefulSet and `custom`), until `shutdown`. `config_changed` fires when the
/// custom kinds change.
pub async fn run(
    client: Client,
    caches: Arc<Caches>,
    custom: Arc<CustomKinds>,
    mut config_changed: watch::Receiver<u64>,
    shutdown: CancellationToken,
) {
    let api: Api<CustomResourceDefinition> = Api::all(client);
    // Ended by the API server every minute, so that a silent connection is given up
    // (`state::watcher_config`). Listed 25 at a time: a CRD's schema can take a megabyte, and
    // each is dropped only once its page is read (clusters with hundreds of large CRDs).
    let config = crate::state::watcher_config().page_size(CRD_PAGE);
    let events = watcher(api, config).default_backoff().modify(trim);
    futures::pin_mut!(events);
    let mut crds = Relisting::<EstablishedCrds>::default();
    let mut config_open = true;
    // The PersistentPodState CRD's uid and generation, as last seen.
    let mut pps_crd = None;
    loop {
        tokio::select! {
            event = events.try_next() => match event {
                Ok(Some(event)) => {
                    pps_crd_seen(&caches, &event, &mut pps_crd);
                    crds.apply(&event);
                }
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(%error, "CustomResourceDefinition watch failed; retrying");
                    continue;
                }
            },
            // Without a configuration file nothing ever changes the kinds: stop listening.
            changed = config_changed.changed(), if config_open => config_open = changed.is_ok(),
            () = shutdown.cancelled() => return,
        }
        if !crds.is_relisting() {
            reconcile_kinds(&caches, &custom, crds.current());
        }
    }
}

/// A CRD as it is read: without its managed fields, and without its schemas (which can be
/// large) but the PersistentPodState CRD's, whose status fields are read
/// ([`declares_extensions`]).
fn trim(crd: &mut CustomResourceDefinition) {
    crd.metadata.managed_fields = None;
    if crd.metadata.name.as_deref() != Some(pps_crd_name()) {
        for v in &mut crd.spec.versions {
            v.schema = None;
        }
    }
}

/// The name of the PersistentPodState CRD.
fn pps_crd_name() -> &'static str {
    use kube::CustomResourceExt as _;
    crate::api::PersistentPodState::crd_name()
}

/// Notes the PersistentPodState CRD seen in `event`: once it changes (another definition,
/// OpenKruise's replaced by this service's), statuses are written whole again
/// ([`Caches::pps_crd_changed`]).
fn pps_crd_seen(
    caches: &Caches,
    event: &watcher::Event<CustomResourceDefinition>,
    seen: &mut Option<(Option<String>, Option<i64>)>,
) {
    let (watcher::Event::Apply(crd) | watcher::Event::InitApply(crd)) = event else {
        return;
    };
    if crd.metadata.name.as_deref() != Some(pps_crd_name()) {
        return;
    }
    caches.pps_crd_declares_extensions(declares_extensions(crd));
    let now = (crd.metadata.uid.clone(), crd.metadata.generation);
    if seen.as_ref().is_some_and(|before| *before != now) && caches.pps_crd_changed() {
        tracing::info!(
            "the PersistentPodState CRD changed: statuses are written with this service's fields again"
        );
    }
    *seen = Some(now);
}

/// Whether every version `crd` serves declares this service's status fields (this service's
/// CRD does; OpenKruise's does not, and its API server prunes them), read by `recorded`.
fn declares_extensions(crd: &CustomResourceDefinition) -> bool {
    let mut served = crd.spec.versions.iter().filter(|v| v.served).peekable();
    served.peek().is_some()
        && served.all(|v| {
            v.schema
                .as_ref()
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .and_then(|s| s.properties.as_ref())
                .and_then(|p| p.get("status"))
                .and_then(|s| s.properties.as_ref())
                .is_some_and(|p| p.contains_key("recorded"))
        })
}

fn reconcile_kinds(caches: &Arc<Caches>, custom: &CustomKinds, known: &EstablishedCrds) {
    let wanted: HashMap<&GroupKind, &ApiResource> = known
        .0
        .values()
        .filter(|(kind, _)| custom.handles(kind))
        .map(|(kind, ar)| (kind, ar))
        .collect();
    for (kind, ar) in &wanted {
        if !kind.is_native_statefulset() {
            caches.add_workload_kind((*ar).clone());
        }
    }
    for (kind, _) in caches.workload_kinds() {
        if !kind.is_native_statefulset() && !wanted.contains_key(&kind) {
            caches.remove_workload_kind(&kind);
        }
    }
}

/// Keeps `custom` equal to `flags` plus the kinds listed in `file`, re-reading the file when its
/// [`FileStamp`] changes (checked every 2 seconds). A file that does not parse keeps the
/// previous kinds. Each change bumps `changed`.
pub async fn watch_config(
    file: Option<PathBuf>,
    flags: BTreeSet<GroupKind>,
    custom: Arc<CustomKinds>,
    changed: Arc<watch::Sender<u64>>,
    shutdown: CancellationToken,
) {
    let Some(path) = file else {
        return;
    };
    // The stamp of the version last read; `None` before the first read.
    let mut last: Option<Option<FileStamp>> = None;
    loop {
        let stamp = FileStamp::of(&path).ok();
        if last != Some(stamp) {
            last = Some(stamp);
            let kinds = std::fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|text| parse_config(&text));
            match kinds {
                Ok(kinds) => {
                    let all: BTreeSet<GroupKind> = flags.iter().cloned().chain(kinds).collect();
                    let added = custom.replace(all.clone());
                    tracing::info!(file = %path.display(), kinds = ?all, added = ?added, "custom workload kinds loaded");
                    changed.send_modify(|n| *n += 1);
                }
                Err(error) => {
                    tracing::warn!(file = %path.display(), %error, "custom workload configuration not usable; keeping the previous kinds")
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn group_kinds_parse() {
        assert_eq!(
            parse_group_kind("apps.kruise.io/StatefulSet"),
            Ok(GroupKind::new("apps.kruise.io", "StatefulSet"))
        );
        assert_eq!(
            parse_group_kind(" example.com/Ring "),
            Ok(GroupKind::new("example.com", "Ring"))
        );
        for bad in ["", "Ring", "/Ring", "example.com/", "a/b/"] {
            assert!(parse_group_kind(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_config_file_lists_kinds_and_bad_files_are_errors() {
        let kinds =
            parse_config("customWorkloads:\n- example.com/Ring\n- db.example.com/Cluster\n")
                .expect("parses");
        assert_eq!(kinds.len(), 2);
        assert!(kinds.contains(&GroupKind::new("example.com", "Ring")));
        assert_eq!(parse_config("").map(|k| k.len()), Ok(0));
        assert!(parse_config("customWorkloads: [Ring]").is_err());
        assert!(parse_config("somethingElse: []").is_err());
        assert!(parse_config("{{{").is_err());
    }

    #[tokio::test]
    async fn upstream_bug_9_custom_kinds_are_reloaded_without_restart() {
        let path = std::env::temp_dir().join(format!("pps-custom-{}.yaml", std::process::id()));
        std::fs::write(&path, "customWorkloads: [example.com/Ring]\n").expect("write");
        let flag = GroupKind::new("flag.example.com", "Set");
        let custom = Arc::new(CustomKinds::new([flag.clone()]));
        let (tx, mut rx) = watch::channel(0);
        let shutdown = CancellationToken::new();
        tokio::spawn(watch_config(
            Some(path.clone()),
            [flag.clone()].into(),
            custom.clone(),
            Arc::new(tx),
            shutdown.clone(),
        ));
        let deadline = Duration::from_secs(10);
        tokio::time::timeout(deadline, rx.changed())
            .await
            .expect("loaded")
            .expect("sender alive");
        assert!(custom.contains(&GroupKind::new("example.com", "Ring")) && custom.contains(&flag));

        std::fs::write(
            &path,
            "customWorkloads: [example.com/Other, example.com/More]\n",
        )
        .expect("rewrite");
        tokio::time::timeout(deadline, rx.changed())
            .await
            .expect("reloaded")
            .expect("sender alive");
        assert!(custom.contains(&GroupKind::new("example.com", "Other")));
        assert!(!custom.contains(&GroupKind::new("example.com", "Ring")));
        assert!(custom.contains(&flag), "flags stay");
        shutdown.cancel();
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn a_bare_answer_under_a_crd_that_declares_the_fields_leaves_them_in() {
        let caches = Caches::new();
        let mut seen = None;
        // This service's CRD: an answer without the fields came from an API server that had
        // not loaded it yet; the next write carries them again.
        let mut ours = crate::api::crd(&crate::api::ConversionEndpoint::default(), None, true);
        // As the watch reads it.
        super::trim(&mut ours);
        assert!(super::declares_extensions(&ours));
        super::pps_crd_seen(&caches, &watcher::Event::Apply(ours), &mut seen);
        assert!(!caches.status_came_back_bare());
        assert!(!caches.bare_status());
        // A CRD that does not declare them (OpenKruise's): left out from then on.
        let mut theirs = crd(
            true,
            json!([{"name": "v1alpha1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {"status": {
                    "type": "object", "properties": {"podStates": {"type": "object"}}}}}}}]),
        );
        theirs.metadata.name = Some(super::pps_crd_name().into());
        super::trim(&mut theirs);
        assert!(!super::declares_extensions(&theirs));
        super::pps_crd_seen(&caches, &watcher::Event::Apply(theirs), &mut seen);
        assert!(caches.status_came_back_bare());
        assert!(caches.bare_status());
    }

    #[test]
    fn statuses_are_written_whole_again_once_the_pps_crd_changes() {
        let caches = Caches::new();
        caches.apply_pps(watcher::Event::Apply(
            serde_json::from_value(json!({
                "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
                "metadata": {"name": "web", "namespace": "ns"},
                "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}
            }))
            .expect("pps"),
        ));
        let mut looks = caches.triggers.subscribe_pps();
        let pps_crd = |uid: &str, generation: i64| {
            let mut crd = crd(
                true,
                json!([{"name": "v1beta1", "served": true, "storage": true}]),
            );
            crd.metadata.name = Some(super::pps_crd_name().into());
            crd.metadata.uid = Some(uid.into());
            crd.metadata.generation = Some(generation);
            crd
        };
        let mut seen = None;
        super::pps_crd_seen(
            &caches,
            &watcher::Event::InitApply(pps_crd("a", 1)),
            &mut seen,
        );
        assert!(caches.status_came_back_bare(), "a write found it bare");
        // Seen again unchanged (a relist, a status update): still bare.
        super::pps_crd_seen(&caches, &watcher::Event::Apply(pps_crd("a", 1)), &mut seen);
        assert!(caches.bare_status());
        // Another CRD's change: still bare.
        let mut other = pps_crd("b", 2);
        other.metadata.name = Some("others.example.com".into());
        super::pps_crd_seen(&caches, &watcher::Event::Apply(other), &mut seen);
        assert!(caches.bare_status());
        assert!(looks.try_recv().is_err(), "nothing looked at meanwhile");
        // Its definition changed (this service's replacing OpenKruise's): whole again, and
        // every PersistentPodState looked at now (not at its next resync).
        super::pps_crd_seen(&caches, &watcher::Event::Apply(pps_crd("a", 2)), &mut seen);
        assert!(!caches.bare_status());
        assert_eq!(
            looks.try_recv().ok(),
            Some(kube::runtime::reflector::ObjectRef::new("web").within("ns"))
        );
        // Deleted and created again (another uid): whole again too.
        assert!(caches.status_came_back_bare());
        super::pps_crd_seen(&caches, &watcher::Event::Apply(pps_crd("c", 1)), &mut seen);
        assert!(!caches.bare_status());
    }

    fn crd(established: bool, versions: serde_json::Value) -> CustomResourceDefinition {
        serde_json::from_value(json!({
            "metadata": {"name": "statefulsets.apps.kruise.io"},
            "spec": {"group": "apps.kruise.io", "scope": "Namespaced",
                     "names": {"kind": "StatefulSet", "plural": "statefulsets"},
                     "versions": versions},
            "status": {"conditions": [{"type": "Established", "status": if established {"True"} else {"False"}}],
                       "acceptedNames": {"kind": "StatefulSet", "plural": "statefulsets"}, "storedVersions": []}
        }))
        .expect("crd")
    }

    #[test]
    fn watches_the_served_storage_version_of_established_crds() {
        let versions = json!([
            {"name": "v1alpha1", "served": true, "storage": false},
            {"name": "v1beta1", "served": true, "storage": true}
        ]);
        let ar = crd_resource(&crd(true, versions.clone())).expect("established");
        assert_eq!(
            (ar.api_version.as_str(), ar.plural.as_str()),
            ("apps.kruise.io/v1beta1", "statefulsets")
        );
        assert!(crd_resource(&crd(false, versions)).is_none());
        let unserved_storage = json!([
            {"name": "v1alpha1", "served": true, "storage": false},
            {"name": "v1beta1", "served": false, "storage": true}
        ]);
        assert_eq!(
            crd_resource(&crd(true, unserved_storage)).map(|a| a.version),
            Some("v1alpha1".into())
        );
    }

    #[test]
    fn watches_under_the_names_the_api_server_accepted() {
        let versions = json!([{"name": "v1", "served": true, "storage": true}]);
        // Renamed in its spec, the new plural not accepted yet (it conflicts): still served
        // under the old one.
        let mut renamed = crd(true, versions.clone());
        renamed.spec.names.plural = "sets".into();
        let ar = crd_resource(&renamed).expect("established");
        assert_eq!(
            (ar.kind.as_str(), ar.plural.as_str()),
            ("StatefulSet", "statefulsets")
        );
        // A status without accepted names (none written yet): the spec's.
        let mut bare = crd(true, versions);
        if let Some(status) = bare.status.as_mut() {
            status.accepted_names = None;
        }
        bare.spec.names.plural = "sets".into();
        assert_eq!(crd_resource(&bare).map(|a| a.plural), Some("sets".into()));
    }
}
