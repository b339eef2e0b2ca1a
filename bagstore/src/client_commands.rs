//! `bagstore put|get|delete|query|index list|index drop|lag`: commands of
//! the HTTP API through the `client` crate. Human-readable tables by
//! default, the server's JSON with `--json`. Errors print the problem's
//! detail; `main` picks the exit code from the status (docs/operations.md,
//! "Commands": "Exit codes, errors and output").

use anyhow::Context;
use client::{Answer, Client, Precondition, TransportError};
use serde_json::Value;
use std::io::Read;

use crate::table::{cut, table};

#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// Base URL of a bagstore HTTP listener.
    #[arg(long, env = "BAGSTORE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Print the server's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Bearer token, when the server requires one.
    #[arg(long, env = "BAGSTORE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// A JSON argument: inline text, `@file`, or `-` for standard input.
pub fn json_arg(arg: &str) -> anyhow::Result<Value> {
    let text = if arg == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading standard input")?;
        s
    } else if let Some(path) = arg.strip_prefix('@') {
        std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?
    } else {
        arg.to_string()
    };
    serde_json::from_str(&text).context("the argument is not valid JSON")
}

impl ClientArgs {
    fn client(&self) -> Client {
        Client::new(&self.url).with_token(self.token.clone())
    }
}

/// The body of a successful answer; a problem (or no answer) is an error
/// naming the status, the title and the detail.
fn ok(answer: Result<Answer, TransportError>) -> anyhow::Result<Value> {
    Ok(answer?.into_ok()?)
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A JSON value's text, cut to `max` characters.
fn short(v: &Value, max: usize) -> String {
    cut(&v.to_string(), max)
}

pub async fn put(c: &ClientArgs, id: Option<&str>, body: Value, if_match: Option<u64>) -> anyhow::Result<()> {
    let pre = Precondition { if_version: if_match, if_absent: false };
    let doc = match id {
        Some(id) => ok(c.client().put(id, &body, pre).await)?,
        None => ok(c.client().create(&body, pre).await)?,
    };
    print_written(c, &doc);
    Ok(())
}

/// A write's answer: the JSON with --json, else one line.
fn print_written(c: &ClientArgs, doc: &Value) {
    if c.json {
        println!("{doc}");
    } else {
        println!(
            "{} version {} (write_token {})",
            text(&doc["id"]),
            doc["version"],
            text(&doc["write_token"])
        );
    }
}

pub async fn patch(
    c: &ClientArgs,
    id: &str,
    body: Value,
    merge: bool,
    upsert: bool,
    if_match: Option<u64>,
) -> anyhow::Result<()> {
    let pre = Precondition { if_version: if_match, if_absent: false };
    let doc = ok(c.client().patch(id, &body, merge, upsert, pre).await)?;
    print_written(c, &doc);
    Ok(())
}

pub async fn get(c: &ClientArgs, id: &str) -> anyhow::Result<()> {
    let doc = ok(c.client().get(id).await)?;
    if c.json {
        println!("{doc}");
    } else {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}

pub async fn delete(c: &ClientArgs, id: &str) -> anyhow::Result<()> {
    let doc = ok(c.client().delete(id, Precondition::default()).await)?;
    if c.json {
        println!("{doc}");
    } else {
        println!("{} deleted at version {}", text(&doc["id"]), doc["version"]);
    }
    Ok(())
}

pub async fn query(c: &ClientArgs, q: Value) -> anyhow::Result<()> {
    let doc = ok(c.client().query(&q).await)?;
    if c.json {
        println!("{doc}");
        return Ok(());
    }
    let rows = doc["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|e| vec![text(&e["id"]), text(&e["version"]), short(&e["properties"], 80)])
                .collect()
        })
        .unwrap_or_default();
    println!("{}", table(&["ID", "VERSION", "PROPERTIES"], rows));
    println!(
        "index {} · lag {} ms · next_page_token {}",
        text(&doc["index"]),
        text(&doc["index_lag_ms"]),
        text(&doc["next_page_token"])
    );
    Ok(())
}

/// `bagstore shards list` through the HTTP API.
pub async fn shards_list(c: &ClientArgs) -> anyhow::Result<()> {
    let doc = ok(c.client().shards().await)?;
    println!("{}", if c.json { doc.to_string() } else { crate::shards::render(&doc) });
    Ok(())
}

pub async fn index_list(c: &ClientArgs) -> anyhow::Result<()> {
    let doc = ok(c.client().indexes().await)?;
    if c.json {
        println!("{doc}");
        return Ok(());
    }
    let rows = doc["indexes"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|i| {
                    let props: Vec<String> = i["properties"]
                        .as_array()
                        .map(|ps| {
                            ps.iter().map(|p| format!("{}:{}", text(&p["name"]), text(&p["type"]))).collect()
                        })
                        .unwrap_or_default();
                    let progress = i["backfill"]["fraction"].as_f64().unwrap_or(0.0) * 100.0;
                    vec![
                        text(&i["table"]),
                        text(&i["state"]),
                        props.join(","),
                        text(&i["shard_on"]),
                        if i["match_on"].as_object().is_some_and(|m| !m.is_empty()) {
                            short(&i["match_on"], 40)
                        } else {
                            "-".into()
                        },
                        format!("{progress:.1}%"),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    println!("{}", table(&["TABLE", "STATE", "PROPERTIES", "SHARD_ON", "MATCH_ON", "BACKFILL"], rows));
    Ok(())
}

pub async fn index_drop(c: &ClientArgs, table_name: &str) -> anyhow::Result<()> {
    let doc = ok(c.client().drop_index(table_name).await)?;
    if c.json {
        println!("{doc}");
    } else {
        println!("index {table_name} dropped on {} shards; remove it from the config", doc["shards"]);
    }
    Ok(())
}

pub async fn lag(c: &ClientArgs) -> anyhow::Result<()> {
    let doc = ok(c.client().lag().await)?;
    if c.json {
        println!("{doc}");
        return Ok(());
    }
    let rows = doc["indexes"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|i| {
                    vec![text(&i["index"]), text(&i["state"]), text(&i["lag_events"]), text(&i["lag_ms"])]
                })
                .collect()
        })
        .unwrap_or_default();
    println!("{}", table(&["INDEX", "STATE", "LAG_EVENTS", "LAG_MS"], rows));
    Ok(())
}
