//! The configuration reference, `docs/configuration.md`, generated from the
//! settings' own sources so it cannot drift from them: every section struct
//! of `sections.rs` and `mysql.rs` in the order of [`Settings`]'s fields, every field with
//! its doc comment, its type as a configuration file spells it, its default
//! (from `Settings::default()`, serialized) and its environment variable;
//! then the keys earlier releases had (`REMOVED` in `mod.rs`), which are
//! refused at start.
//!
//! The parser reads this codebase's style, not Rust at large: a section is
//! a `pub struct` whose fields are one line each (`pub name: Type,`), with
//! `///` doc comments and one-line `#[…]` attributes above them. Anything it
//! cannot document is an error rather than a gap in the page: a field with
//! no doc comment, a type it does not know, a field the defaults have and
//! the parse missed.
//!
//! `config_reference_matches_docs_configuration_md` fails when the page is
//! out of date; `BAGSTORE_BLESS=1 cargo test -p schemas config_reference`
//! writes it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::Settings;

const MOD_RS: &str = include_str!("mod.rs");
/// The section structs: `sections.rs`, and `mysql.rs` (the `[mysql]`
/// section, in a file of its own for its length).
const SECTIONS_RS: &str = concat!(include_str!("sections.rs"), "\n", include_str!("mysql.rs"));
const DOC_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
const REGENERATE: &str = "BAGSTORE_BLESS=1 cargo test -p schemas config_reference";

/// One field of a struct, or one variant of an enum.
#[derive(Debug)]
struct Item {
    name: String,
    /// The Rust type (empty for an enum's variant).
    ty: String,
    docs: Vec<String>,
    attrs: Vec<String>,
}

#[derive(Debug, Default)]
struct Parsed {
    structs: BTreeMap<String, (Vec<String>, Vec<Item>)>,
    enums: BTreeMap<String, (Vec<String>, Vec<Item>)>,
    /// The file's own `//!` documentation.
    module_docs: Vec<String>,
}

/// Reads the `pub struct`s and `pub enum`s of one source file.
fn parse(source: &str) -> Result<Parsed, String> {
    let mut parsed = Parsed::default();
    let mut docs: Vec<String> = Vec::new();
    let mut attrs: Vec<String> = Vec::new();
    // (is an enum, name, its docs, its items) while inside a body.
    let mut open: Option<(bool, String, Vec<String>, Vec<Item>)> = None;
    // Braces still open inside a variant with fields (`Read { path: … }`).
    let mut nested = 0usize;
    for (n, line) in source.lines().enumerate() {
        let at = || format!("line {}: {line:?}", n + 1);
        let t = line.trim();
        if nested > 0 {
            nested = (nested + t.matches('{').count()).saturating_sub(t.matches('}').count());
            continue;
        }
        if let Some(doc) = t.strip_prefix("//!") {
            parsed.module_docs.push(doc.strip_prefix(' ').unwrap_or(doc).to_string());
            continue;
        }
        if let Some(doc) = t.strip_prefix("///") {
            docs.push(doc.strip_prefix(' ').unwrap_or(doc).trim_end().to_string());
            continue;
        }
        if t.starts_with("#[") {
            if !t.ends_with(']') {
                return Err(format!("{}: an attribute over several lines is not understood", at()));
            }
            attrs.push(t.to_string());
            continue;
        }
        if t.starts_with("//") {
            continue;
        }
        if let Some((is_enum, name, _, items)) = open.as_mut() {
            if line.starts_with('}') {
                let (is_enum, name, item_docs, items) = open.take().expect("open");
                let map = if is_enum { &mut parsed.enums } else { &mut parsed.structs };
                map.insert(name, (item_docs, items));
            } else if t.is_empty() {
                if !docs.is_empty() || !attrs.is_empty() {
                    return Err(format!("{}: a doc comment or attribute is not followed by its item", at()));
                }
            } else if *is_enum {
                let variant = t.trim_end_matches(',');
                let variant = variant.split(['(', ' ', '{']).next().unwrap_or_default();
                if variant.is_empty() || !variant.chars().all(|c| c.is_ascii_alphanumeric()) {
                    return Err(format!("{}: not a variant of enum {name}", at()));
                }
                items.push(Item {
                    name: variant.to_string(),
                    ty: String::new(),
                    docs: std::mem::take(&mut docs),
                    attrs: std::mem::take(&mut attrs),
                });
                nested = t.matches('{').count().saturating_sub(t.matches('}').count());
            } else {
                let field = t
                    .strip_prefix("pub ")
                    .and_then(|f| f.strip_suffix(','))
                    .and_then(|f| f.split_once(": "))
                    .ok_or_else(|| format!("{}: not a one-line `pub name: Type,` field of {name}", at()))?;
                items.push(Item {
                    name: field.0.to_string(),
                    ty: field.1.to_string(),
                    docs: std::mem::take(&mut docs),
                    attrs: std::mem::take(&mut attrs),
                });
            }
            continue;
        }
        let header = |kind: &str| {
            t.strip_prefix(kind)
                .and_then(|rest| rest.strip_suffix(" {"))
                .filter(|name| name.chars().all(|c| c.is_ascii_alphanumeric()))
                .map(str::to_string)
        };
        if let Some(name) = header("pub struct ") {
            open = Some((false, name, std::mem::take(&mut docs), Vec::new()));
        } else if let Some(name) = header("pub enum ") {
            open = Some((true, name, std::mem::take(&mut docs), Vec::new()));
        } else {
            // Docs of something else (a function, a constant): not ours.
            docs.clear();
        }
        attrs.clear();
    }
    if let Some((_, name, _, _)) = open {
        return Err(format!("the body of {name} never closes"));
    }
    Ok(parsed)
}

/// Doc comment lines as one Markdown line for a table cell: paragraphs
/// joined, intra-doc links as plain code, `|` escaped.
fn cell(docs: &[String]) -> String {
    let text = docs.iter().map(|l| l.trim()).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ");
    plain_links(&text).replace('|', "\\|")
}

/// `[`X`]` (a rustdoc link) becomes `` `X` ``; `crate::` reads `schemas::`.
fn plain_links(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("[`") {
        let Some(len) = rest[start + 2..].find("`]") else { break };
        let end = start + 2 + len + 2;
        if rest[end..].starts_with('(') {
            out.push_str(&rest[..end]);
        } else {
            out.push_str(&rest[..start]);
            out.push('`');
            out.push_str(&rest[start + 2..start + 2 + len].replace("crate::", "schemas::"));
            out.push('`');
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// The type as a configuration file spells it, and whether it holds secrets.
fn config_type(
    item: &Item,
    enums: &BTreeMap<String, (Vec<String>, Vec<Item>)>,
) -> Result<(String, bool), String> {
    let ty = item.ty.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')).unwrap_or(&item.ty);
    let csv = item.attrs.iter().any(|a| a.contains("list_or_csv"));
    Ok(match ty {
        "u16" | "u32" | "u64" | "usize" | "i32" | "i64" => ("integer".into(), false),
        "f64" => ("float".into(), false),
        "bool" => ("boolean".into(), false),
        "String" => ("string".into(), false),
        "Vec<Dsn>" if csv => ("list of DSNs, or one comma-separated string; passwords redacted".into(), true),
        "Vec<Secret>" if csv => ("list of strings, or one comma-separated string; secret".into(), true),
        "Secret" => ("string; secret".into(), true),
        "std::collections::BTreeMap<String, String>" | "BTreeMap<String, String>" => {
            ("table of strings; secret ones redacted".into(), true)
        }
        _ => match enums.get(ty) {
            Some((_, variants)) if !variants.is_empty() => {
                let names: Vec<String> =
                    variants.iter().map(|v| format!("`\"{}\"`", v.name.to_lowercase())).collect();
                (names.join(" or "), false)
            }
            _ => return Err(format!("{}: type `{}` has no configuration spelling here", item.name, item.ty)),
        },
    })
}

/// A default as TOML spells it; a secret that is set never shows.
fn default_text(value: Option<&toml::Value>, secret: bool) -> String {
    match value {
        None => "unset".into(),
        Some(toml::Value::Array(a)) if a.is_empty() => "`[]`".into(),
        Some(toml::Value::Table(t)) if t.is_empty() => "`{}`".into(),
        Some(toml::Value::String(s)) if s.is_empty() => "`\"\"`".into(),
        Some(_) if secret => "(redacted)".into(),
        Some(v) => format!("`{v}`"),
    }
}

/// `docs/configuration.md`, from the settings' sources and defaults.
fn render() -> Result<String, String> {
    render_from(MOD_RS, SECTIONS_RS, &defaults_of(&Settings::default())?)
}

/// Settings as TOML, where the defaults are read.
fn defaults_of(settings: &Settings) -> Result<toml::Value, String> {
    toml::Value::try_from(settings).map_err(|e| format!("the defaults do not serialize: {e}"))
}

fn render_from(mod_rs: &str, sections_rs: &str, defaults: &toml::Value) -> Result<String, String> {
    let top = parse(mod_rs)?;
    let sections = parse(sections_rs)?;
    let (_, top_fields) = top.structs.get("Settings").ok_or("mod.rs: no `pub struct Settings`")?;

    let mut out = String::new();
    out.push_str("# Configuration reference\n\n");
    let _ = writeln!(
        out,
        "<!-- Generated by schemas/src/settings/reference.rs from the doc comments in schemas/src/settings/; \
         do not edit by hand. After changing a setting or its doc comment: {REGENERATE} -->\n"
    );
    out.push_str(&top.module_docs.join("\n"));
    out.push_str(
        "\n\nEach table lists a section's keys: the type the file spells, the default (unset: the \
         meaning says what applies), the environment variable that overrides it, and what it does. \
         Unknown keys are errors, in the file and in the environment. Secrets (DSN passwords, \
         bearer tokens, secret librdkafka options) never appear in logs, errors or Debug output. \
         Complete files: `deploy/bagstore.toml` (production) and `deploy/bagstore.dev.toml` \
         (`bagstore dev`).\n",
    );
    let mut errors = Vec::new();
    for section in top_fields {
        let key = &section.name;
        if section.ty.starts_with("Vec<") {
            // An array of tables, such as `[[indexes]]`: the file only.
            if section.docs.is_empty() {
                errors.push(format!("Settings.{key}: no doc comment"));
                continue;
            }
            let _ = write!(out, "\n## `[[{key}]]`\n\n{}\n", plain_links(&section.docs.join("\n")));
            continue;
        }
        let Some((docs, fields)) = sections.structs.get(&section.ty) else {
            errors.push(format!("Settings.{key}: its type {} is not a struct of sections.rs", section.ty));
            continue;
        };
        if docs.is_empty() {
            errors.push(format!("{} (the [{key}] section): no doc comment", section.ty));
        }
        let table = defaults.get(key).and_then(toml::Value::as_table);
        let _ = write!(out, "\n## `[{key}]`\n\n{}\n\n", plain_links(&docs.join("\n")));
        section_table(&mut out, key, fields, table, &sections.enums, &mut errors);
    }
    out.push_str(
        "\n## Removed keys\n\nKeys of earlier releases. Setting one, in the file or the environment, \
         fails at start with an error naming it: it asked for a behaviour this release does not have.\n\n\
         | Key | Environment variable | Why it went |\n|---|---|---|\n",
    );
    for (section, key, why) in super::REMOVED {
        let env = format!("BAGSTORE_{}__{}", section.to_uppercase(), key.to_uppercase());
        let _ = writeln!(out, "| `{section}.{key}` | `{env}` | {} |", why.replace('|', "\\|"));
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(format!("cannot document every setting:\n  {}", errors.join("\n  ")))
    }
}

/// One section's table: a row per key (type, default, environment
/// variable, meaning), and an error for whatever cannot be documented.
fn section_table(
    out: &mut String,
    key: &str,
    fields: &[Item],
    table: Option<&toml::map::Map<String, toml::Value>>,
    enums: &BTreeMap<String, (Vec<String>, Vec<Item>)>,
    errors: &mut Vec<String>,
) {
    out.push_str("| Key | Type | Default | Environment variable | Meaning |\n|---|---|---|---|---|\n");
    for field in fields {
        let name = &field.name;
        if field.docs.is_empty() {
            errors.push(format!("{key}.{name}: no doc comment (every setting is documented)"));
        }
        let (ty, secret) = match config_type(field, enums) {
            Ok(t) => t,
            Err(e) => {
                errors.push(format!("{key}.{e}"));
                continue;
            }
        };
        let value = table.and_then(|t| t.get(name));
        if value.is_none() && !field.ty.starts_with("Option<") {
            errors.push(format!("{key}.{name}: not in the serialized defaults (renamed or skipped?)"));
        }
        let mut meaning = cell(&field.docs);
        let bare = field.ty.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')).unwrap_or(&field.ty);
        if let Some((_, variants)) = enums.get(bare) {
            for v in variants {
                if v.docs.is_empty() {
                    errors.push(format!("{bare}::{}: no doc comment", v.name));
                }
                let _ = write!(meaning, "<br>`\"{}\"`: {}", v.name.to_lowercase(), cell(&v.docs));
            }
        }
        let env = if ty.starts_with("table") {
            format!("`BAGSTORE_{}__{}__<NAME>`", key.to_uppercase(), name.to_uppercase())
        } else {
            format!("`BAGSTORE_{}__{}`", key.to_uppercase(), name.to_uppercase())
        };
        let _ = writeln!(
            out,
            "| `{key}.{name}` | {} | {} | {env} | {meaning} |",
            ty.replace('|', "\\|"),
            default_text(value, secret)
        );
    }
    // A key the defaults have and the parse did not find: a field the
    // parser misread would otherwise vanish from the page unnoticed.
    for name in table.map(|t| t.keys().cloned().collect::<Vec<_>>()).unwrap_or_default() {
        if !fields.iter().any(|f| f.name == name) {
            errors.push(format!("{key}.{name}: in the defaults but not found in sections.rs"));
        }
    }
}

#[test]
fn config_reference_matches_docs_configuration_md() {
    let rendered = render().unwrap_or_else(|e| panic!("{e}"));
    if std::env::var_os("BAGSTORE_BLESS").is_some() {
        std::fs::write(DOC_PATH, &rendered).unwrap_or_else(|e| panic!("writing {DOC_PATH}: {e}"));
        return;
    }
    let Ok(committed) = std::fs::read_to_string(DOC_PATH) else {
        panic!("docs/configuration.md is missing. Generate it with\n    {REGENERATE}\nand commit it.");
    };
    if committed != rendered {
        let line = committed.lines().zip(rendered.lines()).position(|(a, b)| a != b);
        let line = line.unwrap_or_else(|| committed.lines().count().min(rendered.lines().count()));
        panic!(
            "docs/configuration.md is out of date with the settings in schemas/src/settings \
             (first difference at line {}: {:?} should read {:?}). Regenerate it with\n    {REGENERATE}\n\
             and commit the result.",
            line + 1,
            committed.lines().nth(line).unwrap_or("<end of file>"),
            rendered.lines().nth(line).unwrap_or("<end of file>"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOD: &str =
        "//! Settings.\npub struct Settings {\n    #[serde(default)]\n    pub http: HttpSettings,\n}\n";

    fn sections(fields: &str) -> String {
        format!("/// The listener.\n#[derive(Debug)]\npub struct HttpSettings {{\n{fields}}}\n")
    }

    /// The defaults the samples' `[http]` section has.
    fn defaults() -> toml::Value {
        toml::Value::Table(toml::toml! {
            [http]
            addr = "127.0.0.1:8080"
            shutdown_grace_ms = 10000
            request_timeout_ms = 30000
        })
    }

    #[test]
    fn config_reference_documents_a_field_with_its_type_default_and_variable() {
        let src = sections(
            "    /// Where it listens.\n    pub addr: String,\n    /// How long it waits.\n    pub shutdown_grace_ms: u64,\n    /// Body time limit, see [`HttpSettings`].\n    pub request_timeout_ms: u64,\n",
        );
        let page = render_from(MOD, &src, &defaults()).unwrap();
        assert!(page.contains("## `[http]`\n\nThe listener."), "{page}");
        assert!(
            page.contains(
                "| `http.addr` | string | `\"127.0.0.1:8080\"` | `BAGSTORE_HTTP__ADDR` | Where it listens. |"
            ),
            "{page}"
        );
        assert!(page.contains("| `http.request_timeout_ms` | integer | `30000` |"), "{page}");
        assert!(page.contains("Body time limit, see `HttpSettings`."), "{page}");
    }

    #[test]
    fn config_reference_refuses_a_field_without_a_doc_comment() {
        let src = sections(
            "    pub addr: String,\n    /// How long it waits.\n    pub shutdown_grace_ms: u64,\n    /// Body.\n    pub request_timeout_ms: u64,\n",
        );
        let err = render_from(MOD, &src, &defaults()).unwrap_err();
        assert!(err.contains("http.addr: no doc comment"), "{err}");
    }

    #[test]
    fn config_reference_refuses_a_type_or_a_field_it_cannot_read() {
        let src = sections("    /// A.\n    pub addr: std::net::SocketAddr,\n    /// B.\n    pub shutdown_grace_ms: u64,\n    /// C.\n    pub request_timeout_ms: u64,\n");
        let err = render_from(MOD, &src, &defaults()).unwrap_err();
        assert!(err.contains("addr: type `std::net::SocketAddr`"), "{err}");
        // A field the parse missed (here: left out) but the defaults hold.
        let src = sections(
            "    /// B.\n    pub shutdown_grace_ms: u64,\n    /// C.\n    pub request_timeout_ms: u64,\n",
        );
        let err = render_from(MOD, &src, &defaults()).unwrap_err();
        assert!(err.contains("http.addr: in the defaults but not found"), "{err}");
        let src = sections("    /// A.\n    pub addr:\n        String,\n");
        assert!(render_from(MOD, &src, &defaults()).unwrap_err().contains("not a one-line"));
    }

    #[test]
    fn config_reference_never_shows_a_secret() {
        let mut defaults = Settings::default();
        defaults.kafka.options.insert("sasl.password".into(), "hunter2".into());
        defaults.auth.read_tokens.push(super::super::Secret("hunter2".into()));
        defaults.mysql.shards.push(super::super::Dsn("mysql://u:hunter2@db/x".into()));
        let page = render_from(MOD_RS, SECTIONS_RS, &defaults_of(&defaults).unwrap()).unwrap();
        assert!(!page.contains("hunter2"));
        assert!(
            page.contains("| `kafka.options` | table of strings; secret ones redacted | (redacted) |"),
            "{page}"
        );
    }
}
