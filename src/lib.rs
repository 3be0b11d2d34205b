//! persistent-pod-state: keeps a StatefulSet pod's node, zone and IP across re-creation.
//!
//! A drop-in replacement for OpenKruise's PersistentPodState: the controller records where each
//! Ready pod of a target workload runs, and the mutating webhook steers a re-created pod back.
//!
//! Layout: [`api`] (types), [`workload`] (what a StatefulSet-like workload is), [`state`]
//! (shared stores, indexes, triggers), [`controller`] (status recording and PPS generation),
//! [`webhook`] (HTTPS server and admission handlers), [`discovery`] (which workload kinds are
//! watched), [`leader`], [`events`], [`probes`], [`metrics`], [`certs`], [`files`], [`cli`],
//! [`serve`].

#![warn(missing_docs)]

pub mod api;
pub mod certs;
pub mod cli;
pub mod controller;
pub mod discovery;
pub mod events;
pub mod files;
pub mod leader;
pub mod metrics;
pub mod probes;
pub mod serve;
pub mod state;
pub mod webhook;
pub mod workload;
