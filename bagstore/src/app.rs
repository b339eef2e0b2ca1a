//! Assembling services in one process. `bagstore writer|indexer|reader|
//! cleaner` each start one role; `bagstore dev` starts them all behind one
//! listener.

use axum::Router;
use prometheus::Registry;
use schemas::{IndexSpec, Settings};
use service::health::{Health, Phase};
use service::http::{self, auth, request_id, HttpMetrics, Routes};
use service::serve::Pipeline;
use storage::Shards;

/// Which services this process runs.
#[derive(Debug, Clone, Default)]
pub struct Roles {
    pub writer: bool,
    pub reader: bool,
    /// One consumer group each.
    pub indexes: Vec<IndexSpec>,
    /// The continuous cleaner (drift repair, backfills, lag measurement).
    pub cleaner: bool,
}

impl Roles {
    /// The roles as a process reports them (`writer,reader,indexer,cleaner`).
    pub fn names(&self) -> String {
        let mut out = Vec::new();
        for (on, name) in [
            (self.writer, "writer"),
            (self.reader, "reader"),
            (!self.indexes.is_empty(), "indexer"),
            (self.cleaner, "cleaner"),
        ] {
            if on {
                out.push(name);
            }
        }
        out.join(",")
    }
}

/// Services started in this process.
#[derive(Debug)]
pub struct Running {
    pub router: Router,
    pub shards: Shards,
    /// Starting until the caller serves; see `service::health`.
    pub health: Health,
    /// Relays, index consumers and sweeps, and their stop signal.
    pub pipeline: Pipeline,
}

/// Every route this process serves, each with its role: the services'
/// for `roles`, and the ops routes every process has. The writer role also
/// starts the relays that publish what it commits, and the Kafka ingest.
pub fn routes(
    settings: &Settings,
    shards: &Shards,
    roles: &Roles,
    registry: &Registry,
    pipeline: &Pipeline,
    health: &Health,
) -> anyhow::Result<Routes> {
    let mut routes = http::ops::routes(registry.clone(), health.clone());
    if roles.writer {
        let w = writer::Writer::new(settings.clone(), shards.clone(), registry, health.clone())?;
        w.spawn_relays(&pipeline.tracker, pipeline.stop.clone())?;
        w.spawn_ingest(&pipeline.tracker, pipeline.stop.clone());
        w.spawn_ack_watch(&pipeline.tracker, pipeline.stop.clone());
        w.spawn_unique_watch(&pipeline.tracker, pipeline.stop.clone());
        routes = routes.merge(writer::http::routes(w));
    }
    if roles.reader {
        let r = reader::Reader::new(settings.clone(), shards.clone(), registry)?;
        r.spawn_replica_watch(&pipeline.tracker, pipeline.stop.clone());
        routes = routes.merge(reader::http::routes(r));
    }
    Ok(routes)
}

pub async fn start(settings: &Settings, roles: Roles) -> anyhow::Result<Running> {
    let shards = Shards::connect(&settings.mysql).await?;
    let registry = Registry::new();
    let pipeline = Pipeline::new();
    let http_metrics = HttpMetrics::register(&registry, "http")?;
    let uses_kafka = roles.writer || roles.cleaner || !roles.indexes.is_empty();
    let kafka_only = !roles.indexes.is_empty() && !roles.writer && !roles.reader && !roles.cleaner;
    let health = Health::new(shards.clone(), uses_kafka.then(|| settings.kafka.clone()), kafka_only);
    let routes = routes(settings, &shards, &roles, &registry, &pipeline, &health)?;
    let role_names = roles.names();
    if !roles.indexes.is_empty() {
        let metrics = indexer::Metrics::register(&registry)?;
        // A unique index's rows are written by the writers themselves.
        for spec in roles.indexes.into_iter().filter(|s| !s.unique) {
            let c = indexer::IndexConsumer::new(
                settings.clone(),
                spec,
                shards.clone(),
                metrics.clone(),
                health.clone(),
            );
            let stop = pipeline.stop.clone();
            pipeline.tracker.spawn(async move {
                if let Err(e) = c.run(stop).await {
                    tracing::error!(error = %e, "index consumer stopped with an error");
                }
            });
        }
    }
    let map_metrics = service::cluster::MapMetrics::register(&registry)?;
    let every = std::time::Duration::from_millis(settings.mysql.map_refresh_ms);
    pipeline.tracker.spawn(service::cluster::watch(
        shards.clone(),
        role_names,
        every,
        map_metrics,
        pipeline.stop.clone(),
    ));
    if roles.cleaner {
        let m =
            mover::Mover::new(settings.clone(), shards.clone(), mover::MoverMetrics::register(&registry)?);
        pipeline.tracker.spawn(m.serve(pipeline.stop.clone()));
        pipeline.tracker.spawn(failover::watch::watch(
            settings.clone(),
            shards.clone(),
            failover::FailoverMetrics::register(&registry)?,
            pipeline.stop.clone(),
        ));
        let c = cleaner::Cleaner::new(
            settings.clone(),
            shards.clone(),
            cleaner::CleanerMetrics::register(&registry)?,
            health.clone(),
        );
        let (backfills, stop) = (pipeline.tracker.clone(), pipeline.stop.clone());
        let (lag, lag_stop) = (c.clone(), stop.clone());
        let (purge, purge_stop) = (c.clone(), stop.clone());
        pipeline.tracker.spawn(async move { purge.purge_idempotency_keys(purge_stop).await });
        let (tombstones, tombstones_stop) = (c.clone(), stop.clone());
        pipeline.tracker.spawn(async move { tombstones.purge_tombstones(tombstones_stop).await });
        let (expire, expire_stop) = (c.clone(), stop.clone());
        pipeline.tracker.spawn(async move { expire.expire_entities(expire_stop).await });
        pipeline.tracker.spawn(async move { c.run(&backfills, stop).await });
        pipeline.tracker.spawn(async move { lag.report_lag(lag_stop).await });
    }
    let policy = auth::Policy::new(settings.auth.clone(), routes.roles());
    let (router, _) = routes.into_parts();
    let router = router
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        // Route layers see the matched route template; the request id
        // wraps everything, so even a refused request has one.
        .route_layer(axum::middleware::from_fn_with_state(policy, auth::authorize))
        .route_layer(axum::middleware::from_fn_with_state(http_metrics, http::metrics::track))
        .layer(axum::middleware::from_fn(request_id::request_id));
    Ok(Running { router, shards, health, pipeline })
}

/// Returns once every index consumer of the process holds its partitions
/// (see `service::consumer`), saying every few seconds what it waits for.
pub async fn until_consumers_hold(health: &Health) {
    let started = std::time::Instant::now();
    loop {
        tokio::select! {
            _ = health.until_started() => break,
            _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {
                tracing::info!(waiting_for = ?health.waiting_for(),
                    "waiting for the index consumers to hold their partitions before saying ready");
            }
        }
    }
    tracing::info!(
        took_ms = started.elapsed().as_millis() as u64,
        "every index consumer holds its partitions"
    );
}

/// Runs one role set as a standalone service: serve until a signal, then
/// stop HTTP (bounded), then the pipeline. The ready line comes once HTTP
/// serves; `/health/ready` answers 503 `starting` until the index
/// consumers hold their partitions.
pub async fn serve(settings: Settings, roles: Roles, name: &str, http: Option<String>) -> anyhow::Result<()> {
    settings.require_external()?;
    let running = start(&settings, roles).await?;
    let addr = http.unwrap_or_else(|| settings.http.addr.clone());
    let (listener, url) = service::serve::bind(&addr).await?;
    running.health.set_phase(Phase::Serving);
    println!("bagstore {name} ready: http={url}");
    service::serve::until_signal(
        &settings,
        listener,
        running.router.clone(),
        &running.pipeline,
        &running.health,
        async {},
    )
    .await;
    running.shards.close().await;
    tracing::info!("{name} stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Method;
    use service::http::Role;

    /// Every route of every service, with the role it must declare. A route
    /// added to any router is either listed here (a deliberate decision on
    /// who may call it) or fails this test; one that skips `Routes`
    /// altogether has no role and is refused at run time (see
    /// `service::http::auth`).
    const EXPECTED: &[(&str, &str, Role)] = &[
        ("GET", "/", Role::Open),
        ("GET", "/health", Role::Open),
        ("GET", "/health/live", Role::Open),
        ("GET", "/health/ready", Role::Open),
        ("GET", "/v1/openapi.json", Role::Open),
        ("GET", "/metrics", Role::Metrics),
        ("POST", "/v1/entities", Role::Write),
        ("POST", "/v1/entities/batch", Role::Write),
        ("PUT", "/v1/entities/{id}", Role::Write),
        ("PATCH", "/v1/entities/{id}", Role::Write),
        ("DELETE", "/v1/entities/{id}", Role::Write),
        ("GET", "/v1/entities/{id}", Role::Read),
        ("POST", "/v1/entities/get", Role::Read),
        ("POST", "/v1/query", Role::Read),
        ("GET", "/v1/indexes", Role::Read),
        ("DELETE", "/v1/indexes/{table}", Role::Admin),
        ("GET", "/v1/lag", Role::Read),
        ("GET", "/v1/shards", Role::Read),
    ];

    #[tokio::test]
    async fn every_route_of_every_router_declares_the_expected_role() {
        let mut settings = Settings::default();
        settings.mysql.shards = vec![schemas::settings::Dsn("mysql://root@127.0.0.1:1/never".into())];
        settings.kafka.brokers = "127.0.0.1:1".into();
        let shards = Shards::configured(&settings.mysql).unwrap();
        let roles = Roles { writer: true, reader: true, ..Default::default() };
        let pipeline = Pipeline::new();
        let health = Health::new(shards.clone(), None, false);
        let routes = routes(&settings, &shards, &roles, &Registry::new(), &pipeline, &health).unwrap();
        pipeline.stop.cancel();
        let mut declared: Vec<(String, &str, Role)> =
            routes.roles().iter().map(|r| (r.method.to_string(), r.path, r.role)).collect();
        let mut want: Vec<(String, &str, Role)> =
            EXPECTED.iter().map(|(m, p, r)| (m.to_string(), *p, *r)).collect();
        declared.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        want.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        assert_eq!(declared, want);
        // The API's own description lists no route without a role.
        let doc: serde_json::Value = serde_json::from_str(http::ops::OPENAPI).unwrap();
        for (path, ops) in doc["paths"].as_object().unwrap() {
            let methods = ["get", "put", "post", "delete", "patch", "head", "options"];
            for method in ops.as_object().unwrap().keys().filter(|k| methods.contains(&k.as_str())) {
                let m = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
                assert!(
                    routes.roles().iter().any(|r| r.method == m && r.path == path),
                    "{method} {path} is documented but has no declared role"
                );
            }
        }
    }
}
