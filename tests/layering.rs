//! Data flows one way between the files of `src/`: no file names (through `crate::` or
//! `super::` paths, in code or in a doc comment's link) a file that names it back, directly or
//! around a circle. A mod.rs and its own direct children, and the crate root, are left out
//! (Rust's usual parent/child traffic); test code (`*tests.rs` files and `#[cfg(test)]` items),
//! plain comments and string literals are left out too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A module path, e.g. `["webhook", "admit"]` (empty: the crate root).
type ModPath = Vec<String>;

/// The module path of a file under `src/` (`webhook/mod.rs` -> `webhook`).
fn module_of(relative: &str) -> ModPath {
    let stem = relative.trim_end_matches(".rs");
    let mut parts: ModPath = stem.split('/').map(str::to_owned).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] || parts == ["main"] {
        parts.clear();
    }
    parts
}

/// `text` without plain comments, string literals and `#[cfg(test)]` items (doc comments stay:
/// their links name items as code does).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            // Skip the item: up to its `;` or the end of its braces.
            let (mut depth, mut opened) = (0i32, false);
            for item in lines.by_ref() {
                depth += item.matches('{').count() as i32 - item.matches('}').count() as i32;
                opened |= item.contains('{');
                if (opened && depth <= 0) || (!opened && item.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        let mut in_string = false;
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '"' => in_string = !in_string,
                '\\' if in_string => {
                    chars.next();
                }
                '/' if !in_string && chars.peek() == Some(&'/') => {
                    chars.next();
                    if !matches!(chars.peek(), Some('/' | '!')) {
                        break;
                    }
                }
                _ if in_string => {}
                _ => out.push(c),
            }
        }
        out.push('\n');
    }
    out
}

/// Every `crate::...` and `super::...` path in `code`, brace groups expanded, as
/// (`crate` or `super` count, segments).
fn paths_in(code: &str) -> Vec<(usize, Vec<String>)> {
    fn ident(s: &str) -> (&str, &str) {
        let end = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        (&s[..end], &s[end..])
    }
    /// The paths of a `use` tree starting at `s` (after a `::`), prefixed by `base`.
    fn tree(s: &str, base: &[String], out: &mut Vec<Vec<String>>) {
        let s = s.trim_start();
        if let Some(rest) = s.strip_prefix('{') {
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in rest.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        tree(&rest[start..i], base, out);
                        return;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        tree(&rest[start..i], base, out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            return;
        }
        let (name, rest) = ident(s);
        if name.is_empty() {
            if !base.is_empty() {
                out.push(base.to_vec());
            }
            return;
        }
        let mut path = base.to_vec();
        path.push(name.to_owned());
        match rest.trim_start().strip_prefix("::") {
            Some(more) => tree(more, &path, out),
            None => out.push(path),
        }
    }
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let start = ["crate::", "super::"]
            .iter()
            .find(|p| rest.starts_with(**p));
        match (boundary, start) {
            (true, Some(prefix)) => {
                let mut supers = 0;
                let mut after = rest;
                let crate_root = prefix.starts_with("crate");
                if crate_root {
                    after = &after["crate::".len()..];
                } else {
                    while let Some(more) = after.strip_prefix("super::") {
                        supers += 1;
                        after = more;
                    }
                }
                let mut paths = Vec::new();
                tree(after, &[], &mut paths);
                for p in paths {
                    found.push((if crate_root { usize::MAX } else { supers }, p));
                }
                i += rest.len() - after.len();
            }
            _ => i += rest.chars().next().map_or(1, char::len_utf8),
        }
    }
    found
}

/// The import graph of `files` (module path -> code), module to module.
fn graph(files: &BTreeMap<ModPath, String>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let resolve = |path: &[String]| -> Option<ModPath> {
        (1..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|p| files.contains_key(p))
    };
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (module, code) in files {
        edges.entry(module.clone()).or_default();
        for (supers, segments) in paths_in(code) {
            let absolute = if supers == usize::MAX {
                segments
            } else {
                // `super` is the parent module, whatever file the module is written in.
                let up = module.len().saturating_sub(supers);
                module[..up].iter().cloned().chain(segments).collect()
            };
            let Some(target) = resolve(&absolute) else {
                continue;
            };
            let parent_child =
                |a: &ModPath, b: &ModPath| a.len() == b.len() + 1 && a[..b.len()] == b[..];
            if target == *module
                || target.is_empty()
                || module.is_empty()
                || parent_child(module, &target)
                || parent_child(&target, module)
            {
                continue;
            }
            edges.entry(module.clone()).or_default().insert(target);
        }
    }
    edges
}

/// The circles of `edges`: strongly connected components of more than one module.
fn circles(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    // Kosaraju: finish order on the graph, then components on the reversed graph.
    fn visit(
        v: &ModPath,
        edges: &BTreeMap<ModPath, BTreeSet<ModPath>>,
        seen: &mut BTreeSet<ModPath>,
        out: &mut Vec<ModPath>,
    ) {
        if !seen.insert(v.clone()) {
            return;
        }
        for w in edges.get(v).into_iter().flatten() {
            visit(w, edges, seen, out);
        }
        out.push(v.clone());
    }
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for v in edges.keys() {
        visit(v, edges, &mut seen, &mut order);
    }
    let mut reversed: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (v, ws) in edges {
        for w in ws {
            reversed.entry(w.clone()).or_default().insert(v.clone());
        }
    }
    let mut assigned = BTreeSet::new();
    let mut found = Vec::new();
    for v in order.iter().rev() {
        let mut component = Vec::new();
        visit(v, &reversed, &mut assigned, &mut component);
        if component.len() > 1 {
            component.sort();
            found.push(component);
        }
    }
    found
}

fn show(module: &ModPath) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.join("::")
    }
}

fn load(dir: &Path, root: &Path, files: &mut BTreeMap<ModPath, String>) {
    for entry in std::fs::read_dir(dir).expect("src/ readable") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            load(&path, root, files);
            continue;
        }
        let relative = path
            .strip_prefix(root)
            .expect("under src/")
            .to_string_lossy()
            .replace('\\', "/");
        if !relative.ends_with(".rs") || relative.ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("source readable");
        files.insert(module_of(&relative), code_of(&text));
    }
}

#[test]
fn src_has_no_import_circles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    load(&root, &root, &mut files);
    assert!(files.len() > 20, "read the modules of src/");
    let found = circles(&graph(&files));
    let described: Vec<String> = found
        .iter()
        .map(|c| c.iter().map(show).collect::<Vec<_>>().join(" <-> "))
        .collect();
    assert!(
        described.is_empty(),
        "import circles between src/ modules (move the shared name down to the lowest floor that needs it):\n{}",
        described.join("\n")
    );
}

/// The check finds what it is for, and leaves parent/child traffic and test code alone.
#[test]
fn the_check_finds_circles_through_every_path_form() {
    let file = |path: &str, text: &str| (module_of(path), code_of(text));
    let files: BTreeMap<ModPath, String> = [
        file("lib.rs", "pub mod a; pub mod b; pub mod c; pub mod d;"),
        file("a/mod.rs", "use crate::b::{self, x::{Y, Z}};\npub mod inner;"),
        file("a/inner.rs", "use super::Thing; // parent: left out\nfn f() { super::super::c::g(); }"),
        file("b.rs", "fn f() { crate::a::inner::h(); }"),
        file("c.rs", "use crate::b::f;\n// crate::a is only named in a comment\nconst S: &str = \"crate::a\";\n#[cfg(test)]\nmod tests {\n    use crate::a;\n}"),
        file("d.rs", "//! Decided in [`crate::c`].\n/// See [`super::b::f`]."),
    ]
    .into_iter()
    .collect();
    let edges = graph(&files);
    let m = |s: &str| s.split("::").map(str::to_owned).collect::<ModPath>();
    assert_eq!(edges[&m("a")], BTreeSet::from([m("b")]));
    assert_eq!(edges[&m("a::inner")], BTreeSet::from([m("c")]));
    assert_eq!(
        edges[&m("c")],
        BTreeSet::from([m("b")]),
        "comments, strings and tests do not count"
    );
    assert_eq!(
        edges[&m("d")],
        BTreeSet::from([m("b"), m("c")]),
        "doc links count"
    );
    assert_eq!(circles(&edges), vec![vec![m("a::inner"), m("b"), m("c")]]);
}
