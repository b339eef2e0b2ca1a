//! A typed client of bagstore's HTTP API (v1), shared by the `bagstore`
//! command (`put`, `get`, `query`, …) and the end-to-end tests.
//!
//! Every call returns the server's [`Answer`] whatever its status, so a
//! caller sees problem documents as they are; [`Answer::into_ok`] turns a
//! non-2xx answer into an [`ApiError`] carrying the problem's title and
//! detail. Only a transport failure (no answer at all) is an `Err` of the
//! call itself.

use reqwest::Method;
use serde_json::{json, Value};

/// A client of one bagstore HTTP listener.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

/// One answer: status, content type and body (JSON, or `Null` when the body
/// is not JSON; the text is kept).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: Value,
    pub text: String,
}

/// A non-2xx answer, as a problem document describes it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status} {title}: {detail}")]
pub struct ApiError {
    pub status: u16,
    pub title: String,
    pub detail: String,
    /// The whole problem document.
    pub problem: Value,
}

/// The request could not be sent or no answer came back.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach {url}")]
pub struct TransportError {
    pub url: String,
    #[source]
    pub source: reqwest::Error,
}

/// Conditions on the current version of an entity (`If-Match`,
/// `If-None-Match: *`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Precondition {
    pub if_version: Option<u64>,
    pub if_absent: bool,
}

impl Answer {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The body of a 2xx answer, or the problem as an [`ApiError`].
    pub fn into_ok(self) -> Result<Value, ApiError> {
        if self.is_success() {
            return Ok(self.body);
        }
        Err(ApiError {
            status: self.status,
            title: self.body["title"].as_str().unwrap_or("error").to_string(),
            detail: self.body["detail"].as_str().map_or_else(|| self.text.clone(), str::to_string),
            problem: self.body,
        })
    }
}

impl Client {
    /// A client of `base` (`http://host:port`), without a token.
    pub fn new(base: &str) -> Client {
        Client { base: base.trim_end_matches('/').to_string(), token: None, http: reqwest::Client::new() }
    }

    /// Sends `Authorization: Bearer <token>` with every request.
    pub fn with_token(mut self, token: Option<String>) -> Client {
        self.token = token;
        self
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// Any request: `method` on `path` (starting with `/`), with an optional
    /// JSON body and extra headers.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, String)],
    ) -> Result<Answer, TransportError> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(b);
        }
        self.send(req, headers).await
    }

    /// A request with a body of raw bytes (for malformed-input tests).
    pub async fn raw(&self, method: Method, path: &str, body: Vec<u8>) -> Result<Answer, TransportError> {
        self.send(self.http.request(method, format!("{}{path}", self.base)).body(body), &[]).await
    }

    async fn send(
        &self,
        mut req: reqwest::RequestBuilder,
        headers: &[(&str, String)],
    ) -> Result<Answer, TransportError> {
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let url = self.base.clone();
        let resp = req.send().await.map_err(|source| TransportError { url: url.clone(), source })?;
        let status = resp.status().as_u16();
        let content_type =
            resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let text = resp.text().await.map_err(|source| TransportError { url, source })?;
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Ok(Answer { status, content_type, body, text })
    }

    /// `POST /v1/entities`: creates (or replaces, with an `"id"` in the body).
    pub async fn create(&self, body: &Value, pre: Precondition) -> Result<Answer, TransportError> {
        self.request(Method::POST, "/v1/entities", Some(body), &pre.headers()).await
    }

    /// `PUT /v1/entities/{id}`.
    pub async fn put(&self, id: &str, body: &Value, pre: Precondition) -> Result<Answer, TransportError> {
        self.request(Method::PUT, &format!("/v1/entities/{id}"), Some(body), &pre.headers()).await
    }

    /// `PATCH /v1/entities/{id}`: `$`-operators, or a merge patch when
    /// `merge` (sent as `application/merge-patch+json`); `upsert` creates a
    /// missing entity.
    pub async fn patch(
        &self,
        id: &str,
        doc: &Value,
        merge: bool,
        upsert: bool,
        pre: Precondition,
    ) -> Result<Answer, TransportError> {
        let path = format!("/v1/entities/{id}{}", if upsert { "?upsert=true" } else { "" });
        let content_type = if merge { "application/merge-patch+json" } else { "application/json" };
        let req = self
            .http
            .request(Method::PATCH, format!("{}{path}", self.base))
            .header("Content-Type", content_type)
            .body(doc.to_string());
        self.send(req, &pre.headers()).await
    }

    /// `DELETE /v1/entities/{id}`.
    pub async fn delete(&self, id: &str, pre: Precondition) -> Result<Answer, TransportError> {
        self.request(Method::DELETE, &format!("/v1/entities/{id}"), None, &pre.headers()).await
    }

    /// `GET /v1/entities/{id}`.
    pub async fn get(&self, id: &str) -> Result<Answer, TransportError> {
        self.request(Method::GET, &format!("/v1/entities/{id}"), None, &[]).await
    }

    /// `POST /v1/entities/get`.
    pub async fn get_many(&self, ids: &[&str]) -> Result<Answer, TransportError> {
        self.request(Method::POST, "/v1/entities/get", Some(&json!({ "ids": ids })), &[]).await
    }

    /// `POST /v1/entities/batch`.
    pub async fn batch(&self, entities: &[Value]) -> Result<Answer, TransportError> {
        self.request(Method::POST, "/v1/entities/batch", Some(&json!({ "entities": entities })), &[]).await
    }

    /// `POST /v1/query`.
    pub async fn query(&self, q: &Value) -> Result<Answer, TransportError> {
        self.request(Method::POST, "/v1/query", Some(q), &[]).await
    }

    /// `GET /v1/indexes`.
    pub async fn indexes(&self) -> Result<Answer, TransportError> {
        self.request(Method::GET, "/v1/indexes", None, &[]).await
    }

    /// `DELETE /v1/indexes/{table}`.
    pub async fn drop_index(&self, table: &str) -> Result<Answer, TransportError> {
        self.request(Method::DELETE, &format!("/v1/indexes/{table}"), None, &[]).await
    }

    /// `GET /v1/lag`.
    pub async fn lag(&self) -> Result<Answer, TransportError> {
        self.request(Method::GET, "/v1/lag", None, &[]).await
    }

    /// `GET /v1/shards`.
    pub async fn shards(&self) -> Result<Answer, TransportError> {
        self.request(Method::GET, "/v1/shards", None, &[]).await
    }

    /// `GET /metrics`: the Prometheus text.
    pub async fn metrics(&self) -> Result<String, TransportError> {
        Ok(self.request(Method::GET, "/metrics", None, &[]).await?.text)
    }
}

impl Precondition {
    fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(v) = self.if_version {
            h.push(("If-Match", format!("\"{v}\"")));
        }
        if self.if_absent {
            h.push(("If-None-Match", "*".to_string()));
        }
        h
    }
}
