//! The end-to-end suites, one module each, in one test binary: one build
//! and link instead of fifteen, and one pair of private MariaDB servers for
//! all of them (every test still gets its own databases, topics and Kafka,
//! so they run in parallel). The chaos matrix, the tests against the
//! standalone broker and the membership tests (one indexer per partition
//! after a broker outage) are binaries of their own (`tests/tests/`): long,
//! or sensitive to the load of the others. What each suite proves: `docs/testing.md`.
//!
//! - `pipeline`: the seed entity's lifecycle through every index kind.
//! - `queries`: ordered pages, ranges, merges across shards, the planner.
//! - `edges`: bad input, repeatable migrations, request ids.
//! - `limits`: size limits and slow clients.
//! - `delivery`: Invariant W across broker outages and writer kills.
//! - `group_commit`: concurrent writes sharing transactions; locations.
//! - `convergence`: a seeded random history; indexes end exact.
//! - `cleaner`: drift repair, online backfill, index drop.
//! - `drift`: what the cleaner counts as drift, and what as lag.
//! - `shards`: logical shards: the topology guard, online moves, a frozen
//!   writer across a cutover, resume and rollback.
//! - `idempotency`: keyed retries (single and batch) after a crash between
//!   commit and answer.
//! - `ingest`: Kafka ingest answers each command once, also when its
//!   commands are delivered again after a crash.
//! - `expiry`: expired entities hidden, then deleted; tombstone purge and
//!   the version floor.
//! - `health`: readiness with a frozen or stopped shard, or no broker.
//! - `patch`: partial updates, counters, HTTP conditionals.
//! - `shutdown`: graceful stops under load.
//! - `observability`: metrics, dashboard and alert rules, lag.
//! - `auth`, `tls`: bearer tokens; TLS to MariaDB and Kafka.
//! - `backpressure`: a flood of writes against a bounded writer.
//! - `cli`, `config`: the `bagstore` command; configuration and compose.
//! - `changes`: the public change stream: envelopes, schema, order.
//! - `clients`: the OpenAPI document validated, and a client generated
//!   from it running the seed's scenario.
//! - `console`: the operator console in headless chromium.
//! - `bench_quick`: the benchmark's smoke run.
//! - `replication`: MariaDB replication as bagstore runs it: the checks,
//!   the unacknowledged commit a failover must lose, a primary rejoining.
//! - `read_routing`: reads on replicas within a lag bound; write tokens
//!   never answered older, on a replica whose SQL thread is stopped; a
//!   cutover a replica lacks is lag; replicas leaving routing.
//! - `failover`: the coordinator's automatic failover after a `kill -9`
//!   (a data shard's primary and the metadata shard's), the dead server
//!   restarted and taken back as a replica, every acknowledged write kept.
//! - `upgrade`: what removed features left, dropped by `migrate` once it
//!   loses nothing; removed settings refused.
//! - `unique`: unique indexes: every write route refuses a taken key,
//!   freed by update, delete and expiry; racing writers; a writer killed
//!   between reserving and committing.
//! - `docs`: every repository path the docs name exists (no servers).
//! - `layout`: the workspace's layout rules (no two modules of a crate
//!   referring to each other, service crates on schemas, storage and
//!   service only, file and function sizes); reads sources, no server.

mod auth;
mod backpressure;
mod bench_quick;
mod changes;
mod cleaner;
mod cli;
mod clients;
mod config;
mod console;
mod convergence;
mod delivery;
mod docs;
mod drift;
mod edges;
mod expiry;
mod failover;
mod group_commit;
mod health;
mod idempotency;
mod ingest;
mod layout;
mod limits;
mod observability;
mod patch;
mod pipeline;
mod queries;
mod read_routing;
mod replication;
mod shards;
mod shutdown;
mod tls;
mod unique;
mod upgrade;
