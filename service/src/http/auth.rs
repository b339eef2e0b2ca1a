//! Access control, default-deny: every route declares the role it needs
//! where it is defined ([`Routes::route`]), and a request to a route that
//! declared none is refused.
//!
//! Roles are checked by bearer token (`Authorization: Bearer <t>`, see
//! `AuthSettings`): a role with no tokens configured is open; admin tokens
//! are accepted everywhere. Missing or unknown token → 401; a valid token
//! of another role → 403. The check runs before the handler, so a refused
//! request writes nothing.

use axum::extract::{MatchedPath, Request, State};
use axum::handler::Handler;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::Router;
use schemas::settings::AuthSettings;
use std::collections::HashMap;
use std::sync::Arc;

use super::Problem;

/// Which token a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Anyone (`/health`, the OpenAPI document).
    Open,
    /// `/metrics`: open, or a read token with `auth.protect_metrics`.
    Metrics,
    Read,
    Write,
    Admin,
}

/// One route and the role it declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRole {
    pub method: Method,
    /// The route template, as axum matches it (`/v1/entities/{id}`).
    pub path: &'static str,
    pub role: Role,
}

/// An axum router whose routes can only be added with their role. The
/// roles travel with the router, so whoever serves it can enforce them.
#[derive(Debug)]
pub struct Routes<S = ()> {
    router: Router<S>,
    roles: Vec<RouteRole>,
}

impl<S: Clone + Send + Sync + 'static> Default for Routes<S> {
    fn default() -> Self {
        Routes { router: Router::new(), roles: Vec::new() }
    }
}

impl<S: Clone + Send + Sync + 'static> Routes<S> {
    pub fn new() -> Self {
        Self::default()
    }

    /// `method path` served by `handler`, open to `role`.
    pub fn route<H, T>(mut self, method: Method, path: &'static str, role: Role, handler: H) -> Self
    where
        H: Handler<T, S>,
        T: 'static,
    {
        let filter = MethodFilter::try_from(method.clone()).expect("a standard HTTP method");
        self.router = self.router.route(path, on(filter, handler));
        self.roles.push(RouteRole { method, path, role });
        self
    }

    /// The routes with their state: ready to merge with other services'.
    pub fn with_state<S2>(self, state: S) -> Routes<S2> {
        Routes { router: self.router.with_state(state), roles: self.roles }
    }

    pub fn merge(mut self, other: Routes<S>) -> Self {
        self.router = self.router.merge(other.router);
        self.roles.extend(other.roles);
        self
    }

    /// Every route and its role, in the order they were added.
    pub fn roles(&self) -> &[RouteRole] {
        &self.roles
    }

    pub fn into_parts(self) -> (Router<S>, Vec<RouteRole>) {
        (self.router, self.roles)
    }
}

/// What [`authorize`] enforces: the tokens, and the declared role of every
/// route by method and template.
#[derive(Debug)]
pub struct Policy {
    auth: AuthSettings,
    roles: HashMap<(Method, &'static str), Role>,
}

impl Policy {
    pub fn new(auth: AuthSettings, routes: &[RouteRole]) -> Arc<Policy> {
        let roles = routes.iter().map(|r| ((r.method.clone(), r.path), r.role)).collect();
        Arc::new(Policy { auth, roles })
    }

    /// The role `method route` declared; `None` for a route that declared
    /// none. HEAD is answered by GET routes, so it needs what GET needs.
    pub fn role_of(&self, method: &Method, route: &str) -> Option<Role> {
        let method = if method == Method::HEAD { &Method::GET } else { method };
        self.roles.iter().find(|((m, p), _)| m == method && *p == route).map(|(_, role)| *role)
    }
}

/// Middleware (a route layer, so it sees the matched template): refuses a
/// route without a declared role, then checks the bearer token.
pub async fn authorize(State(policy): State<Arc<Policy>>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_default();
    let Some(role) = policy.role_of(req.method(), &route) else {
        tracing::error!(method = %req.method(), route, "refused: the route declares no role");
        return Problem::new(
            StatusCode::FORBIDDEN,
            "route-without-role",
            "Forbidden",
            "this route declares no access role, so nobody may use it",
        )
        .into_response();
    };
    let auth = &policy.auth;
    let needed = match role {
        Role::Open => None,
        Role::Metrics if auth.protect_metrics => Some(&auth.read_tokens),
        Role::Metrics => None,
        Role::Read => Some(&auth.read_tokens),
        Role::Write => Some(&auth.write_tokens),
        Role::Admin => Some(&auth.admin_tokens),
    };
    let Some(needed) = needed.filter(|t| !t.is_empty()) else {
        return next.run(req).await;
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(token) = presented else {
        return unauthorized("this route needs a bearer token (Authorization: Bearer <token>)");
    };
    if needed.iter().chain(&auth.admin_tokens).any(|s| s.matches(token)) {
        return next.run(req).await;
    }
    let known = [&auth.read_tokens, &auth.write_tokens, &auth.admin_tokens]
        .iter()
        .any(|l| l.iter().any(|s| s.matches(token)));
    if known {
        Problem::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "Forbidden",
            "this token's role may not use this route",
        )
        .into_response()
    } else {
        unauthorized("the bearer token is not valid")
    }
}

fn unauthorized(detail: &str) -> Response {
    let mut resp =
        Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized", detail).into_response();
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt;

    /// A route added to a served router without going through [`Routes`]
    /// (so without a role) is refused, whatever the tokens.
    #[tokio::test]
    async fn a_route_without_a_declared_role_is_refused() {
        let declared = Routes::<()>::new().route(Method::GET, "/v1/known", Role::Open, || async { "ok" });
        let policy = Policy::new(AuthSettings::default(), declared.roles());
        let (router, _) = declared.into_parts();
        let app = router
            .route("/v1/sneaky", axum::routing::get(|| async { "should never answer" }))
            .route_layer(axum::middleware::from_fn_with_state(policy, authorize));
        let call = |path: &'static str| {
            let app = app.clone();
            async move { app.oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap().status() }
        };
        assert_eq!(call("/v1/known").await, StatusCode::OK);
        assert_eq!(call("/v1/sneaky").await, StatusCode::FORBIDDEN);
    }
}
