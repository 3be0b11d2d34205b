//! Label and annotation keys: what Kubernetes accepts as one.

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
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
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
    }
}
