//! `apps.kruise.io/v1beta1` PersistentPodState (the storage version, and the one this process
//! works with): topology terms list `keys`.

super::versioned::versioned_types!("v1beta1", keys);
