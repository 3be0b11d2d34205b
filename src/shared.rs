//! Strings many cached objects repeat (namespaces, node names, owners, topology keys and
//! values), held once: [`intern`] gives the shared copy, and [`Shared`] is a string field
//! that is read through it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The table of shared strings.
static INTERNED: Mutex<Interner> = Mutex::new(Interner {
    strings: None,
    pruned_at: 0,
});

struct Interner {
    strings: Option<HashSet<Arc<str>>>,
    /// How many strings there were after the last pruning.
    pruned_at: usize,
}

/// The shared copy of `s`. Strings nothing holds any more are dropped whenever the table has
/// doubled since it was last pruned, so it stays within about twice what is in use.
pub fn intern(s: &str) -> Shared {
    Shared(crate::sync::lock(&INTERNED).get(s))
}

impl Interner {
    fn get(&mut self, s: &str) -> Arc<str> {
        let strings = self.strings.get_or_insert_with(HashSet::new);
        if let Some(shared) = strings.get(s) {
            return shared.clone();
        }
        if strings.len() >= (self.pruned_at * 2).max(1024) {
            strings.retain(|s| Arc::strong_count(s) > 1);
            self.pruned_at = strings.len();
        }
        let shared: Arc<str> = Arc::from(s);
        strings.insert(shared.clone());
        shared
    }
}

/// A string read once and held through [`intern`]: a field repeated across many cached objects
/// (a recorded state's node and its topology keys and values) costs a pointer each, not a copy.
/// Serialized, compared, ordered and hashed as the plain string.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Shared(Arc<str>);

impl Shared {
    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Shared {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for Shared {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Shared {
    fn from(s: &str) -> Self {
        intern(s)
    }
}

impl From<String> for Shared {
    fn from(s: String) -> Self {
        intern(&s)
    }
}

impl From<&String> for Shared {
    fn from(s: &String) -> Self {
        intern(s)
    }
}

impl PartialEq<str> for Shared {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Shared {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialEq<String> for Shared {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<Shared> for String {
    fn eq(&self, other: &Shared) -> bool {
        **self == *other.0
    }
}

impl Serialize for Shared {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Shared {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Shared;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Shared, E> {
                Ok(Shared::from(s))
            }
        }
        // Read from the input in place where it can be, then shared: never a second copy.
        deserializer.deserialize_str(Visitor)
    }
}

impl schemars::JsonSchema for Shared {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        String::schema_name()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        String::json_schema(generator)
    }

    fn inline_schema() -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_string_read_twice_is_held_once_and_reads_as_the_string() {
        let a: Shared = serde_json::from_str(r#""topology.kubernetes.io/zone""#).expect("string");
        let b: Shared = serde_json::from_str(r#""topology.kubernetes.io/zone""#).expect("string");
        assert!(Arc::ptr_eq(&a.0, &b.0), "the second read shares the first");
        assert_eq!(a, "topology.kubernetes.io/zone");
        assert_eq!(
            serde_json::to_string(&a).expect("written"),
            r#""topology.kubernetes.io/zone""#
        );
        // Escaped input is unescaped before it is shared.
        let c: Shared = serde_json::from_str(r#""a\"b""#).expect("string");
        assert_eq!(c, "a\"b");
        assert!(serde_json::from_str::<Shared>("7").is_err(), "not a string");
    }

    #[test]
    fn strings_nothing_holds_are_dropped_when_the_table_has_doubled() {
        let mut table = Interner {
            strings: None,
            pruned_at: 0,
        };
        let kept = table.get("kept");
        for i in 0..5000 {
            drop(table.get(&format!("dropped-{i}")));
        }
        let strings = table.strings.as_ref().expect("table");
        assert!(
            strings.len() <= 1024,
            "pruned as it grows: {} strings",
            strings.len()
        );
        assert!(strings.contains("kept"), "{kept} is held");
        assert!(Arc::ptr_eq(&kept, &table.get("kept")), "and still shared");
    }
}
