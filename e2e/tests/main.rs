//! End-to-end suite, against the local control plane started by e2e/run.sh: a real
//! kube-apiserver, kube-controller-manager (every controller a cluster runs but CSR signing and
//! node IPAM: StatefulSet, garbage collector, node lifecycle, taint eviction, pod GC ...) and
//! kube-scheduler of the current version (e2e/build-control-plane.sh), the fake kubelet's 4
//! nodes in 2 zones (and 3 Calico-like nodes, tainted, for the IP tests; a test stops a node's
//! kubelet as a kubelet dies, and the node lifecycle controller reacts), and
//! `persistent-pod-state serve` registered as the pod mutating webhook. `make e2e-v1.20` runs a
//! smoke subset on the oldest supported version.
//!
//! Tests run one at a time (`--test-threads 1` is not needed for correctness of most, but the
//! cordon test changes what the scheduler may pick): each uses its own namespace.

mod api;
mod chart;
mod docs;
mod faults;
mod fencing;
mod ha;
mod hang;
mod ip;
mod lifecycle;
mod local_volumes;
mod manifests;
mod migration;
mod node_loss;
mod observe;
mod passthrough;
mod placement;
mod plugin;
mod recent;
mod rotation;
mod safety;
mod server;
mod soak;
mod support;
mod workloads;
