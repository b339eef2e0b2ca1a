//! The workspace's layout rules, checked (STYLE.md, Layout): no two
//! top-level modules of one crate refer to each other; each service crate
//! builds on `schemas`, `storage` and `service` alone; no library file over
//! 600 lines and no function over 100, unless it is a flat table.
//!
//! It reads source files only: no server, no build. The scan is textual and
//! relies on rustfmt'ed code (the workspace's `cargo fmt --check` keeps it
//! so): an item's closing brace sits alone at the item's own indentation.
//! Test code does not count: an item under `#[cfg(test)]` is skipped to its
//! closing brace, and the `tests` and `bench` crates are not scanned (nor
//! `fuzz`, which is outside the workspace).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines a library file may have, its test module aside.
const FILE_LINES: usize = 600;

/// The most lines a function may have, from its `fn` line to its closing
/// brace.
const FN_LINES: usize = 100;

/// Functions allowed over [`FN_LINES`] because they are flat tables (one
/// entry a line, no steps to name): `(file, fn, why)`. An entry that no
/// longer matches an over-long function fails the check too, so the list
/// stays as short as it can be.
const FLAT_TABLES: &[(&str, &str, &str)] = &[(
    "cleaner/src/metrics.rs",
    "register",
    "one definition per series, then one registration per series: the shape of every crate's metrics \
     module, twenty series long",
)];

/// The service crates, and the only workspace crates they may build on:
/// services meet through the database and Kafka, never through each
/// other's code.
const SERVICES: &[&str] = &["writer", "indexer", "cleaner", "reader", "mover", "failover"];
const SERVICE_BASE: &[&str] = &["schemas", "storage", "service"];

/// Workspace members not scanned: test and benchmark code.
const NOT_SCANNED: &[&str] = &["tests", "bench"];

#[test]
fn no_two_top_level_modules_of_a_crate_refer_to_each_other() {
    let mut found = Vec::new();
    for krate in scanned_crates() {
        found.extend(mutual_references(&krate, &sources(&krate)));
    }
    assert!(found.is_empty(), "modules that refer to each other:\n{}", found.join("\n"));
}

#[test]
fn service_crates_build_on_schemas_storage_and_service_only() {
    let members = members();
    let mut found = Vec::new();
    for service in SERVICES {
        let toml = manifest(&workspace_root().join(service));
        for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
            let Some(deps) = toml.get(section).and_then(toml::Value::as_table) else { continue };
            for dep in deps.keys() {
                if members.contains(dep) && !SERVICE_BASE.contains(&dep.as_str()) {
                    found.push(format!("{service}/Cargo.toml [{section}]: {dep}"));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "service crates build on {SERVICE_BASE:?} only, never on each other or the binaries:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_library_file_or_function_outgrows_the_size_rule() {
    let mut found = Vec::new();
    let mut allowed_seen = BTreeSet::new();
    for krate in scanned_crates() {
        for src in sources(&krate) {
            if src.counted > FILE_LINES {
                found.push(format!("{}: {} lines (at most {FILE_LINES})", src.path, src.counted));
            }
            for f in functions(&src.lines) {
                if f.lines <= FN_LINES {
                    continue;
                }
                match FLAT_TABLES.iter().position(|(p, n, _)| *p == src.path && *n == f.name) {
                    Some(at) => {
                        allowed_seen.insert(at);
                    }
                    None => found.push(format!(
                        "{}:{}: fn {} has {} lines (at most {FN_LINES})",
                        src.path, f.line, f.name, f.lines
                    )),
                }
            }
        }
    }
    for (at, (path, name, _)) in FLAT_TABLES.iter().enumerate() {
        if !allowed_seen.contains(&at) {
            found.push(format!(
                "{path}: fn {name} is on the flat-table list but is no longer over {FN_LINES} lines"
            ));
        }
    }
    assert!(found.is_empty(), "over the size rule:\n{}", found.join("\n"));
}

#[test]
fn the_scan_sees_groups_re_exports_and_climbing_supers_and_skips_test_code() {
    let lib = Source::new(
        "x/src/lib.rs",
        Path::new("lib.rs"),
        "pub mod a;\npub use b::{Thing, other::Alias as Nick};\n",
    );
    let a = Source::new(
        "x/src/a.rs",
        Path::new("a.rs"),
        "use crate::{\n    c::One,\n    d::{Two, Three},\n};\n\
         /// See [`crate::Nick`].\n\
         fn f() -> u8 {\n    super::e::g()\n}\n\
         #[cfg(test)]\nmod tests {\n    use crate::h::H;\n    fn long() {\n    }\n}\n",
    );
    let b = Source::new("x/src/b/mod.rs", Path::new("b/mod.rs"), "use crate::a::f;\n");
    let inner = Source::new(
        "x/src/b/inner.rs",
        Path::new("b/inner.rs"),
        "fn x() -> u8 { super::super::c::y() + super::z() + $crate::q() + my_crate::r() }\n",
    );
    let [c, d, e, h] = ["c", "d", "e", "h"].map(|m| {
        let rel = format!("{m}.rs");
        Source::new(&format!("x/src/{rel}"), Path::new(&rel), "use crate::a::f;\n")
    });
    assert_eq!(a.counted, 8, "the test module does not count");
    let refs: Vec<&str> = a.refs.keys().map(String::as_str).collect();
    assert_eq!(refs, ["Nick", "c", "d", "e"], "a group, a doc link, a climbing super; not test code");
    let refs: Vec<&str> = inner.refs.keys().map(String::as_str).collect();
    assert_eq!(refs, ["c"], "only a super chain that reaches the crate root");
    let found = mutual_references("x", &[lib, a, b, inner, c, d, e, h]);
    assert_eq!(
        found,
        [
            "x: a ↔ b (x/src/a.rs:5 → b; x/src/b/mod.rs:1 → a)",
            "x: a ↔ c (x/src/a.rs:1 → c; x/src/c.rs:1 → a)",
            "x: a ↔ d (x/src/a.rs:1 → d; x/src/d.rs:1 → a)",
            "x: a ↔ e (x/src/a.rs:7 → e; x/src/e.rs:1 → a)",
        ],
        "the re-exported Nick is b's; h is referred to from test code only"
    );

    let lines: Vec<String> = "impl X {\n    pub(crate) async fn one(&self) -> u8 { 1 }\n\n    fn sig(\n        a: u8,\n    ) -> u8\n    where\n        u8: Copy,\n    {\n        a\n    }\n    fn decl(&self);\n}\n"
        .lines()
        .map(str::to_string)
        .collect();
    let got: Vec<(String, usize, usize)> =
        functions(&lines).into_iter().map(|f| (f.name, f.line, f.lines)).collect();
    assert_eq!(got, [("one".to_string(), 2, 1), ("sig".to_string(), 4, 8)]);
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

fn manifest(dir: &Path) -> toml::Table {
    let path = dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse().unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The workspace's members, by directory (each directory is its package's
/// name, but for the tests crate, which is not scanned).
fn members() -> Vec<String> {
    let root = manifest(&workspace_root());
    root["workspace"]["members"]
        .as_array()
        .expect("workspace.members")
        .iter()
        .map(|m| m.as_str().expect("a member path").to_string())
        .collect()
}

fn scanned_crates() -> Vec<String> {
    members().into_iter().filter(|m| !NOT_SCANNED.contains(&m.as_str())).collect()
}

/// One source file, its test items blanked (line numbers kept).
#[derive(Debug)]
struct Source {
    /// Relative to the workspace root, for messages.
    path: String,
    /// The top-level module the file belongs to; `None` for a crate root
    /// (`lib.rs`, `main.rs`).
    module: Option<String>,
    lines: Vec<String>,
    /// Lines outside test items.
    counted: usize,
    /// Crate-level names the file refers to, each with the line of its
    /// first reference.
    refs: BTreeMap<String, usize>,
}

impl Source {
    /// `rel` is the file's path under `src/`.
    fn new(path: &str, rel: &Path, text: &str) -> Source {
        let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        let (module, depth) = match parts.as_slice() {
            [only] if only == "lib.rs" || only == "main.rs" => (None, 0),
            [first, ..] => {
                // `a/mod.rs` is module `a` itself; `a/b.rs` is one deeper.
                let depth =
                    if parts.last().is_some_and(|l| l == "mod.rs") { parts.len() - 1 } else { parts.len() };
                (Some(first.trim_end_matches(".rs").to_string()), depth)
            }
            [] => unreachable!("a file has a name"),
        };
        let (lines, blanked) = without_tests(text);
        let counted = lines.len() - blanked;
        let refs = crate_refs(&lines.join("\n"), depth);
        Source { path: path.to_string(), module, lines, counted, refs }
    }
}

/// Every `.rs` file under a crate's `src/`, in path order.
fn sources(krate: &str) -> Vec<Source> {
    let src = workspace_root().join(krate).join("src");
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            let rel = f.strip_prefix(&src).expect("under src");
            Source::new(&format!("{krate}/src/{}", rel.display()), rel, &text)
        })
        .collect()
}

/// `text`'s lines with every `#[cfg(test)]` item blanked, from the
/// attribute to the item's `;` line or to its closing brace at the
/// attribute's indentation; and how many lines were blanked.
fn without_tests(text: &str) -> (Vec<String>, usize) {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let mut blanked = 0;
    let mut i = 0;
    while i < lines.len() {
        if !lines[i].trim_start().starts_with("#[cfg(test)]") {
            i += 1;
            continue;
        }
        let close = format!("{}}}", " ".repeat(indent_of(&lines[i])));
        let mut end = i + 1;
        while end < lines.len() && lines[end].trim_start().starts_with("#[") {
            end += 1;
        }
        if end < lines.len() && !lines[end].trim_end().ends_with(';') {
            end = (end + 1..lines.len()).find(|&j| lines[j].starts_with(&close)).unwrap_or(lines.len());
        }
        let end = end.min(lines.len() - 1);
        for line in &mut lines[i..=end] {
            line.clear();
        }
        blanked += end + 1 - i;
        i = end + 1;
    }
    (lines, blanked)
}

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The crate-level names `text` refers to, each with the line of its first
/// reference: the name after each `crate::`, or each name of a
/// `crate::{…}` group, and the same after a `super::` chain that climbs
/// from a module `depth` deep to the crate root. Doc links count: a module
/// whose docs send the reader up to its caller depends on it too.
fn crate_refs(text: &str, depth: usize) -> BTreeMap<String, usize> {
    let bytes = text.as_bytes();
    let mut out = BTreeMap::new();
    let mut at = 0;
    while at < text.len() {
        let rest = &text[at..];
        let starts_path =
            at == 0 || !(is_ident(bytes[at - 1]) || bytes[at - 1] == b'$' || bytes[at - 1] == b':');
        let mut climbed = 0;
        let mut after = rest;
        while let Some(a) = after.strip_prefix("super::") {
            after = a;
            climbed += 1;
        }
        let to_root = match after.strip_prefix("crate::") {
            Some(a) if climbed == 0 => Some(a),
            _ if climbed > 0 && climbed == depth => Some(after),
            _ => None,
        };
        if let (true, Some(path)) = (starts_path, to_root) {
            let line = text[..at].matches('\n').count() + 1;
            for name in first_names(path) {
                out.entry(name).or_insert(line);
            }
            at = text.len() - path.len();
            continue;
        }
        at += rest.chars().next().map_or(1, char::len_utf8);
    }
    out
}

/// The first name of a path's rest (`a` of `a::b`), or of each element of
/// a group (`{a::b, c}`).
fn first_names(path: &str) -> Vec<String> {
    let ident =
        |s: &str| s.trim_start().bytes().take_while(|b| is_ident(*b)).map(char::from).collect::<String>();
    let names = match path.strip_prefix('{') {
        Some(group) => split_group(group).into_iter().map(ident).collect(),
        None => vec![ident(path)],
    };
    names.into_iter().filter(|n| !n.is_empty() && n != "self").collect()
}

/// The top-level elements of a `{…}` group whose opening brace is already
/// consumed.
fn split_group(group: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                out.push(&group[start..i]);
                return out;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&group[start..]);
    out
}

/// What a crate root re-exports from its own modules: name → module.
fn re_exports(root: &Source, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let text = root.lines.join("\n");
    let mut out = BTreeMap::new();
    for stmt in text.split(';') {
        let stmt = stmt.trim();
        let Some(tree) = ["pub use ", "pub(crate) use "].iter().find_map(|p| stmt.strip_prefix(p)) else {
            continue;
        };
        let tree = tree.strip_prefix("self::").unwrap_or(tree);
        let module: String = tree.bytes().take_while(|b| is_ident(*b)).map(char::from).collect();
        if !modules.contains(&module) {
            continue;
        }
        let mut leaves = Vec::new();
        use_leaves(tree, &mut leaves);
        out.extend(leaves.into_iter().map(|leaf| (leaf, module.clone())));
    }
    out
}

/// The names a `use` tree brings in (`a::{b, c::d as e}` → `b`, `e`).
fn use_leaves(tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        for element in split_group(&tree[open + 1..]) {
            use_leaves(element, out);
        }
    } else if let Some((_, alias)) = tree.split_once(" as ") {
        out.push(alias.trim().to_string());
    } else if let Some(last) = tree.rsplit("::").next().filter(|l| !l.is_empty() && *l != "self" && *l != "*")
    {
        out.push(last.to_string());
    }
}

/// The pairs of a crate's top-level modules that refer to each other, each
/// with where each side first does (a name the crate root re-exports counts
/// as its module's).
fn mutual_references(krate: &str, sources: &[Source]) -> Vec<String> {
    let modules: BTreeSet<String> = sources.iter().filter_map(|s| s.module.clone()).collect();
    let exported = sources
        .iter()
        .filter(|s| s.module.is_none() && s.path.ends_with("lib.rs"))
        .map(|root| re_exports(root, &modules))
        .next()
        .unwrap_or_default();
    // (from, to) → where first.
    let mut edges: BTreeMap<(String, String), String> = BTreeMap::new();
    for src in sources {
        let Some(from) = &src.module else { continue };
        for (name, line) in &src.refs {
            let to = if modules.contains(name) { Some(name) } else { exported.get(name) };
            if let Some(to) = to.filter(|to| *to != from) {
                edges.entry((from.clone(), to.clone())).or_insert_with(|| format!("{}:{line}", src.path));
            }
        }
    }
    let mut out = Vec::new();
    for ((a, b), there) in &edges {
        if a < b {
            if let Some(back) = edges.get(&(b.clone(), a.clone())) {
                out.push(format!("{krate}: {a} ↔ {b} ({there} → {b}; {back} → {a})"));
            }
        }
    }
    out
}

/// A function with a body, as [`functions`] finds it.
#[derive(Debug)]
struct Function {
    name: String,
    /// 1-based line of its `fn`.
    line: usize,
    /// From its `fn` line to its closing brace, both included.
    lines: usize,
}

/// Every function with a body in rustfmt'ed `lines`: from its `fn` line to
/// the first line that is only a closing brace at the `fn` line's
/// indentation (or the `fn` line alone for a one-line function).
fn functions(lines: &[String]) -> Vec<Function> {
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else { continue };
        let close = format!("{}}}", " ".repeat(indent_of(line)));
        // The body opens where the signature ends with `{`; a signature
        // that ends with `;` has none.
        let mut open = None;
        for (j, l) in lines.iter().enumerate().skip(i) {
            let l = l.trim_end();
            if l.ends_with('{') {
                open = Some(j);
                break;
            }
            if l.ends_with(';') || (j == i && l.contains('{') && l.ends_with('}')) {
                break;
            }
        }
        let lines_of = match open {
            None if line.trim_end().ends_with('}') => 1,
            None => continue,
            Some(open) => match (open + 1..lines.len()).find(|&k| lines[k].trim_end() == close) {
                Some(end) => end + 1 - i,
                None => continue,
            },
        };
        out.push(Function { name, line: i + 1, lines: lines_of });
    }
    out
}

/// The name of the function a line declares, if it does.
fn fn_name(line: &str) -> Option<String> {
    let mut t = line.trim_start();
    loop {
        let before = t;
        for q in ["pub ", "const ", "async ", "unsafe ", "default ", "extern \"C\" "] {
            t = t.strip_prefix(q).unwrap_or(t);
        }
        if let Some(r) = t.strip_prefix("pub(") {
            t = r.split_once(") ")?.1;
        }
        if t == before {
            break;
        }
    }
    let name: String = t.strip_prefix("fn ")?.bytes().take_while(|b| is_ident(*b)).map(char::from).collect();
    (!name.is_empty()).then_some(name)
}
