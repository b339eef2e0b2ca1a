//! Every repository path the documentation names exists. `README.md`,
//! `BENCHMARKS.md` and `docs/**/*.md` are scanned for paths in inline code
//! (`` `storage/src/outbox.rs` ``) and in Markdown links
//! (`[runbooks](deploy/runbooks.md)`); a path is a word that starts with a
//! top-level directory of the repository (`writer/`, `deploy/…`, `.ci/…`)
//! or names a top-level file (`Cargo.toml`, `docker-compose.yml`).
//! Inline-code paths are relative to the repository root, link targets to
//! the page that holds them. Paths on the user's machine (`/tmp/…`,
//! `~/.cargo/…`), build output (`target/…`, anything `.gitignore` keeps out
//! at the top) and fenced code blocks (shell sessions, program output) are
//! not checked. Needs no database or broker.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The repository: the parent of the tests crate.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// The top-level names a documented path may start with: the repository's
/// own entries, less `.git` and what `.gitignore` ignores at the top (build
/// output, `bagstore dev`'s data directory).
fn top_level_names(root: &Path) -> BTreeSet<String> {
    let ignored: BTreeSet<String> = std::fs::read_to_string(root.join(".gitignore"))
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_start_matches('/').trim_end_matches('/').to_string())
        .filter(|l| !l.contains('/'))
        .collect();
    std::fs::read_dir(root)
        .expect("read the repository root")
        .map(|e| e.expect("a directory entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name != ".git" && !ignored.contains(name))
        .collect()
}

/// A path a doc names, and where.
#[derive(Debug, PartialEq, Eq)]
struct Named {
    line: usize,
    /// As written, for the report.
    text: String,
    /// Relative to the repository root.
    path: PathBuf,
}

/// The repository paths `markdown` (the page `page`, relative to the
/// root) names. `top` is [`top_level_names`].
fn named_paths(page: &Path, markdown: &str, top: &BTreeSet<String>) -> Vec<Named> {
    let dir = page.parent().unwrap_or(Path::new(""));
    let mut found = Vec::new();
    // Fenced blocks blanked, lines kept, so line numbers stay right.
    let mut fenced = false;
    let prose: Vec<&str> = markdown
        .lines()
        .map(|line| {
            let fence = line.trim_start().starts_with("```");
            fenced ^= fence;
            if fence || fenced {
                ""
            } else {
                line
            }
        })
        .collect();
    let prose = prose.join("\n");
    // Inline code: the odd pieces between backticks (a span may wrap onto
    // the next line); each word of one, as a command names its script
    // first (`scripts/fuzz [TARGET]`).
    let mut line = 1;
    for (i, piece) in prose.split('`').enumerate() {
        if i % 2 == 1 {
            for word in piece.split_whitespace() {
                let word = word.trim_start_matches("./").trim_end_matches([',', ';', ':', '.', ')']);
                let first = word.split('/').next().unwrap_or_default();
                let top_dir = word.contains('/') && top.contains(first);
                if top_dir || looks_like_a_top_level_file(word) {
                    found.push(Named { line, text: word.to_string(), path: PathBuf::from(word) });
                }
            }
        }
        line += piece.matches('\n').count();
    }
    // Links: `](target)`, relative to the page, anchors dropped.
    for (n, text) in prose.lines().enumerate() {
        let mut rest = text;
        while let Some(at) = rest.find("](") {
            let tail = &rest[at + 2..];
            let Some(end) = tail.find(')') else { break };
            let target = tail[..end].trim();
            rest = &tail[end..];
            let file = target.split('#').next().unwrap_or_default();
            if file.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            found.push(Named { line: n + 1, text: target.to_string(), path: normalize(&dir.join(file)) });
        }
    }
    found.sort_by_key(|named| named.line);
    found
}

/// `Cargo.toml`, `README.md`, `LICENSE`, `docker-compose.yml`: a file at the
/// top of a repository by its name alone (`bagstore.toml` is not: it is
/// said of files in `deploy/` too).
fn looks_like_a_top_level_file(word: &str) -> bool {
    let capital = word.chars().next().is_some_and(|c| c.is_ascii_uppercase());
    let named = word.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    named
        && (word == "LICENSE"
            || word == "docker-compose.yml"
            || (capital && [".md", ".toml", ".lock", ".yml", ".yaml"].iter().any(|ext| word.ends_with(ext))))
}

/// `docs/../BENCHMARKS.md` → `BENCHMARKS.md`.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Whether `path` exists under `root`. A component with a placeholder
/// (`<table>`, `…`) or `**` ends the check at its parent; one with `*`
/// matches any entry with the same prefix and suffix.
fn exists(root: &Path, path: &Path) -> bool {
    let mut here = vec![root.to_path_buf()];
    for part in path.components() {
        let part = part.as_os_str().to_string_lossy();
        if part.contains(['<', '…', '{']) || part == "**" {
            break;
        }
        here = here
            .into_iter()
            .flat_map(|dir| match part.split_once('*') {
                None => vec![dir.join(&*part)],
                Some((prefix, suffix)) => std::fs::read_dir(&dir)
                    .map(|entries| {
                        entries
                            .filter_map(Result::ok)
                            .map(|e| e.path())
                            .filter(|p| {
                                let name = p.file_name().unwrap_or_default().to_string_lossy();
                                name.starts_with(prefix) && name.ends_with(suffix)
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            })
            .filter(|p| p.exists())
            .collect();
    }
    !here.is_empty()
}

/// The pages checked: `README.md`, `BENCHMARKS.md` and `docs/**/*.md`.
fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![PathBuf::from("README.md"), PathBuf::from("BENCHMARKS.md")];
    let mut dirs = vec![PathBuf::from("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(root.join(&dir)).expect("read docs/") {
            let name = dir.join(entry.expect("a directory entry").file_name());
            if root.join(&name).is_dir() {
                dirs.push(name);
            } else if name.extension().is_some_and(|e| e == "md") {
                pages.push(name);
            }
        }
    }
    pages.sort();
    pages
}

/// Each named path that does not exist, as `page:line: text`.
fn dangling(root: &Path, top: &BTreeSet<String>, page: &Path, markdown: &str) -> Vec<String> {
    named_paths(page, markdown, top)
        .into_iter()
        .filter(|named| !exists(root, &named.path))
        .map(|named| format!("{}:{}: {}", page.display(), named.line, named.text))
        .collect()
}

#[test]
fn every_repository_path_the_docs_name_exists() {
    let root = repo_root();
    let pages = pages(&root);
    assert!(pages.len() > 4, "expected README.md, BENCHMARKS.md and the docs/ pages, found {pages:?}");
    let top = top_level_names(&root);
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text =
            std::fs::read_to_string(root.join(page)).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
        checked += named_paths(page, &text, &top).len();
        missing.extend(dangling(&root, &top, page, &text));
    }
    assert!(checked > 100, "only {checked} paths found in the docs: is the extractor broken?");
    assert!(
        missing.is_empty(),
        "paths named in the docs that do not exist in the repository (fix the doc, or the path):\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn docs_paths_a_dangling_path_is_reported_and_others_are_not() {
    let root = repo_root();
    let sample = "\
The relay is in `storage/src/outbox.rs`, not `storage/src/relay_gone.rs`; see
[the runbooks](../deploy/runbooks.md), [a missing page](nowhere.md#top),
[the web](https://example.invalid/x) and [a section](#here). Run
`scripts/fuzz [TARGET|all]`, `./scripts/test`; `Cargo.toml` and `CHANGES.md`;
`deploy/k8s/indexer-*.yaml` and `deploy/k8s/nothing-*.yaml`; `docs/**/*.md`;
`<table>__bulk`, `storage::outbox`, `/tmp/x`, `~/.cargo/bin`, `target/console.png`.
```sh
cat tests/src/chaos.rs   # fenced: not checked
```
";
    let found = dangling(&root, &top_level_names(&root), Path::new("docs/sample.md"), sample);
    assert_eq!(
        found,
        [
            "docs/sample.md:1: storage/src/relay_gone.rs",
            "docs/sample.md:2: nowhere.md#top",
            "docs/sample.md:4: CHANGES.md",
            "docs/sample.md:5: deploy/k8s/nothing-*.yaml",
        ],
        "the extractor must report exactly the dangling paths"
    );
}
