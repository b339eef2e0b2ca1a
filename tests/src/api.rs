//! [`Api`]: the tests' view of the HTTP API, on the `client` crate (the
//! same client the `bagstore` command uses): every answer as `(status,
//! body)`, and an error answer that is not a problem document fails the
//! test. Plus reading metrics and waiting for query results.

use reqwest::Method;
use serde_json::Value;
use std::time::Duration;

use crate::eventually;

/// A status code and a JSON body (or `null`).
pub type Reply = (u16, Value);

/// Typed helpers over the v1 HTTP API.
#[derive(Debug, Clone)]
pub struct Api {
    client: client::Client,
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api { client: client::Client::new(base) }
    }

    /// The answer as `(status, body)`; an error answer must be a problem
    /// document.
    fn reply(answer: Result<client::Answer, client::TransportError>) -> Reply {
        let a = answer.expect("HTTP request");
        if a.status >= 400 {
            assert_eq!(
                a.content_type, "application/problem+json",
                "error without a problem document: {} {}",
                a.status, a.text
            );
        }
        (a.status, a.body)
    }

    pub async fn post_entity(&self, body: &Value) -> Reply {
        Self::reply(self.client.create(body, Default::default()).await)
    }

    pub async fn put(&self, id: &str, body: &Value) -> Reply {
        Self::reply(self.client.put(id, body, Default::default()).await)
    }

    pub async fn put_with(&self, id: &str, body: &Value, header: (&str, &str)) -> Reply {
        let path = format!("/v1/entities/{id}");
        Self::reply(
            self.client.request(Method::PUT, &path, Some(body), &[(header.0, header.1.to_string())]).await,
        )
    }

    /// `PATCH` with `$`-operators.
    pub async fn patch(&self, id: &str, doc: &Value) -> Reply {
        Self::reply(self.client.patch(id, doc, false, false, Default::default()).await)
    }

    pub async fn raw(&self, method: Method, path: &str, body: Vec<u8>) -> Reply {
        Self::reply(self.client.raw(method, path, body).await)
    }

    /// `GET /v1/shards`.
    pub async fn shards(&self) -> Reply {
        Self::reply(self.client.shards().await)
    }

    pub async fn delete(&self, id: &str) -> Reply {
        Self::reply(self.client.delete(id, Default::default()).await)
    }

    pub async fn get(&self, id: &str) -> Reply {
        Self::reply(self.client.get(id).await)
    }

    pub async fn get_many(&self, ids: &[&str]) -> Reply {
        Self::reply(self.client.get_many(ids).await)
    }

    pub async fn batch(&self, entities: &[Value]) -> Reply {
        Self::reply(self.client.batch(entities).await)
    }

    pub async fn query(&self, q: &Value) -> Reply {
        Self::reply(self.client.query(q).await)
    }

    pub async fn indexes(&self) -> Reply {
        Self::reply(self.client.indexes().await)
    }

    pub async fn metrics(&self) -> String {
        self.client.metrics().await.unwrap_or_default()
    }

    /// Ids returned by a query that must succeed.
    pub async fn query_ids(&self, q: &Value) -> Vec<String> {
        let (status, body) = self.query(q).await;
        assert_eq!(status, 200, "query {q} failed: {body}");
        let mut ids: Vec<String> = body["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|e| e["id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    }
}

/// Sum of a metric's samples whose label set contains every `labels` pair.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, r)) => (n, r),
                None => (series, ""),
            };
            if n != name || !labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))) {
                return None;
            }
            value.parse::<f64>().ok()
        })
        .sum()
}

/// Waits until a query returns exactly `want` (sorted ids).
pub async fn until_query_is(api: &Api, q: &Value, want: &[&str]) {
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    want.sort();
    let what = format!("query {q} to return {want:?}");
    eventually(&what, Duration::from_secs(20), || {
        let api = api.clone();
        let want = want.clone();
        async move { (api.query_ids(q).await == want).then_some(()) }
    })
    .await
}
