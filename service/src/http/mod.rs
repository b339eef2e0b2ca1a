//! HTTP plumbing every service shares.
//!
//! - [`problem`]: problem documents, the one shape of an error answer.
//! - [`body`]: bounded JSON bodies and path ids.
//! - [`auth`]: routes that declare their role, and the default-deny check.
//! - [`request_id`]: an id per request, in a header and in the logs.
//! - [`metrics`]: request counts and latency per route and status.
//! - [`ops`]: `/metrics`, `/health`, `/v1/openapi.json`.

pub mod auth;
pub mod body;
pub mod metrics;
pub mod ops;
pub mod problem;
pub mod request_id;

pub use auth::{Role, RouteRole, Routes};
pub use body::{parse_id, read_json};
pub use metrics::HttpMetrics;
pub use problem::{method_not_allowed, not_found, Problem};
