//! Label and annotation keys: what Kubernetes accepts as one.

/// Whether `key` is a valid annotation key, as Kubernetes checks one: [`qualified_name_error`]
/// of its lower-case form (`Example.com/ip` is a valid annotation key, not a valid label key).
pub fn annotation_key_error(key: &str) -> Option<String> {
    qualified_name_error(&key.to_lowercase())
}

/// Whether `key` is a valid label (or annotation) key: an optional DNS subdomain prefix and
/// `/`, then a name of at most 63 characters of `[A-Za-z0-9._-]`, alphanumeric at both ends.
pub fn qualified_name_error(key: &str) -> Option<String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Some("prefix part must not be empty".into());
        }
        if prefix.len() > 253 {
            return Some("prefix part must be no more than 253 characters".into());
        }
        // Kubernetes checks the prefix as a whole (IsDNS1123Subdomain: 253 characters, the
        // pattern), not the length of each of its labels.
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if !prefix.split('.').all(label_ok) {
            return Some(
                "prefix part must be a lowercase RFC 1123 subdomain (e.g. 'example.com')".into(),
            );
        }
    }
    if name.is_empty() {
        return Some("name part must not be empty".into());
    }
    if name.len() > 63 {
        return Some("name part must be no more than 63 characters".into());
    }
    let inner_ok = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    let ends_ok = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !inner_ok || !ends_ok {
        return Some(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into(),
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_keys_follow_kubernetes_rules() {
        for ok in [
            "a",
            "kubernetes.io/hostname",
            "topology.kubernetes.io/zone",
            "A_b.c-9",
            "x.y/Z",
        ] {
            assert_eq!(qualified_name_error(ok), None, "{ok}");
        }
        let long = "a".repeat(64);
        for bad in [
            "",
            "/a",
            "a/",
            "-a",
            "a-",
            "a b",
            "Example.com/a",
            "a//b",
            long.as_str(),
            "a/b/c",
        ] {
            assert!(qualified_name_error(bad).is_some(), "{bad}");
        }
        // The prefix is one DNS subdomain: a label of it may be longer than 63 characters.
        let long_label = format!("{}.example.com/a", "b".repeat(70));
        assert_eq!(qualified_name_error(&long_label), None);
        assert!(qualified_name_error(&format!("{}/a", "b".repeat(254))).is_some());
        // Annotation keys are checked lower-cased, as the API server does.
        assert_eq!(annotation_key_error("Example.com/ip"), None);
        assert!(qualified_name_error("Example.com/ip").is_some());
        assert!(annotation_key_error("a b").is_some());
    }
}
