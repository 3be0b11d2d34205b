//! persistent-pod-state: keeps a StatefulSet pod's node, zone and IP across re-creation.
//!
//! A drop-in replacement for OpenKruise's PersistentPodState: the controller records where each
//! Ready pod of a target workload runs, and the mutating webhook steers a re-created pod back.
//!
//! Layout: [`api`] (types), [`workload`] (what a StatefulSet-like workload is), [`state`]
//! (shared stores, indexes, triggers), [`controller`] (status recording and PPS generation),
//! [`webhook`] (HTTPS server and admission handlers), [`placement`] (usable nodes, what a pod
//! demands, which required values to inject), [`ip_request`] (asking the CNI for recorded IPs),
//! [`explain`] (what a re-created pod would get), [`discovery`] (which workload kinds are
//! watched), [`leader`], [`events`], [`probes`], [`metrics`], [`certs`], [`files`], [`cli`],
//! [`serve`].

#![warn(missing_docs)]

pub mod alloc;
pub mod api;
#[cfg(feature = "bench")]
pub mod benchkit;
pub mod certs;
pub mod cli;
pub mod client;
pub mod controller;
pub mod discovery;
pub mod events;
pub mod explain;
pub mod files;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub mod hot_code;
pub mod ip_request;
pub mod leader;
pub mod metrics;
pub mod placement;
pub mod plugin;
pub mod probes;
pub mod release;
pub mod serve;
pub mod serving;
pub mod shared;
pub mod state;
pub mod supervise;
pub mod sync;
#[cfg(feature = "bench")]
pub mod synthetic;
#[cfg(test)]
mod test_api;
pub mod unregister;
pub mod webhook;
pub mod workload;

#[cfg(test)]
mod layout_tests {
    use std::path::{Path, PathBuf};

    /// Paths named in the first column of README's layout table.
    fn documented() -> Vec<String> {
        let readme = include_str!("../README.md");
        let table = readme
            .split("## Layout")
            .nth(1)
            .expect("README has a Layout section");
        table
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|row| row.split('|').nth(1))
            .flat_map(|cell| cell.split('`').skip(1).step_by(2).map(str::to_owned))
            .collect()
    }

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("readable").flatten() {
            let path = entry.path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn readme_layout_matches_the_tree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let documented = documented();
        // Names given inside a row's description (e.g. `mod.rs`) are relative to the row.
        let paths: Vec<&String> = documented.iter().filter(|p| p.contains('/')).collect();
        for path in &paths {
            assert!(
                root.join(path).exists(),
                "README names {path}, which does not exist"
            );
        }
        let mut files = Vec::new();
        rust_files(&root.join("src"), &mut files);
        for file in files {
            let rel = file
                .strip_prefix(root)
                .expect("under the root")
                .to_string_lossy()
                .into_owned();
            let covered = paths
                .iter()
                .any(|p| rel == **p || (p.ends_with('/') && rel.starts_with(p.as_str())));
            assert!(covered, "{rel} is in no row of README's layout table");
        }
    }
}
