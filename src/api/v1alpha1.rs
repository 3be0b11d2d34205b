//! `apps.kruise.io/v1alpha1` PersistentPodState (served; converted to and from v1beta1 by the
//! `/convert` webhook): topology terms list `nodeTopologyKeys`.

super::versioned::versioned_types!("v1alpha1", node_topology_keys);
