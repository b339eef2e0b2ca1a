//! Kafka ingest: producers write JSON commands to `ingest.topic`; every
//! writer process is a member of one consumer group (`bagstore-ingest`)
//! and applies each command through the same write path as HTTP. Who
//! holds which partition is the writers' member leases on the metadata
//! shard, through the fenced consumer the index consumers use too
//! (`service::consumer`).
//!
//! A command (docs/api.md, "Kafka ingest (for producers)"):
//! `{"op": "put" | "patch" | "delete", "id": "<32 hex>", "properties": {…}
//! (put), "patch": {…} (patch: a merge patch, or `$`-operators, by the rule
//! of `schemas::patch::parse`), "form": "merge" | "operators" (patch,
//! declares the form), "upsert": bool (patch), "if_match": N,
//! "idempotency_key": "…", "correlation_id": "…"}`.
//!
//! Exactly once in effect: every command is a guarded write (see
//! `storage::idempotency`), its record committed in the transaction of the
//! write. The guard's key is the command's `idempotency_key` when it has
//! one (a producer's resend of a command is then applied once), else the
//! message's place (topic, partition, offset: a redelivery after a crash or
//! a partition's move is applied once). A replay answers what the first apply did.
//!
//! A round: take up to `ingest.batch` messages, apply them (one entity's
//! commands in their order, different entities at once), send each refused
//! or malformed command to `<topic>.dlq` with its reason and each outcome
//! to the reply topic (keyed by `correlation_id`, when the command has
//! one), await those acknowledgements, and only then store the offsets
//! (librdkafka's auto-commit commits what was stored). A crash anywhere
//! replays at most the round in hand, and the replay writes nothing new.
//!
//! Answered once: a replayed round must not answer again what its first
//! try already put on the reply or dead-letter topic. Kafka's own answer,
//! a transaction over the answers and the offsets, needs a broker that
//! hides aborted messages from `read_committed` readers, and neither
//! broker bagstore is tested on does (tansu 0.6 and librdkafka's mock
//! cluster answer every fetch with an empty aborted-transactions list). So
//! each answer goes to the partition of its command's partition (modulo
//! the answer topic's partitions) with a header naming its command
//! ([`SOURCE_HEADER`]), and a member that is given a partition first reads
//! that answer partition back from its end, down to an answer for an
//! offset before where it resumes: everything after that is the answers a
//! predecessor sent but never committed, and they are not sent again.
//! Answers for offsets before a committed offset all precede answers for
//! offsets after it (a round's answers are acknowledged before its offsets
//! are committed), so the read stops at the first older answer it meets.
//! The same read, after a round's sends failed, finds which of them landed.
//!
//! A member whose lease's share moved while it was in a round (or whose
//! lease ran out unseen, the metadata shard out of reach) would go on
//! applying and answering
//! beside its successor. Its applies are harmless (each command's guard:
//! the second try finds the first's record), its answers are not. So each
//! member records a claim on every partition it is given before it applies
//! anything of it (`storage::fences`, the indexers' claims), and compares
//! the claims right before each send of answers (not at all while they
//! cannot be compared): a member that finds a newer claim answers nothing
//! more and is replaced by a new consumer. A member lease gives a
//! partition at once, with no revocation to wait for, so a member given
//! one by its lease waits out the previous holder's sends (the producer's
//! message timeout) before it reads back: what passed a comparison before
//! the claim has landed by then (measured: without the wait, a writer whose
//! share moved mid-round answered some 500 commands twice on tansu). The
//! first claim ever on a partition has no previous holder and waits for
//! nothing.
//!
//! Layout:
//! - [`command`]: a message → the change, precondition and guard it asks
//!   for, or its problem.
//! - [`consumer`]: the loop: rounds applied, answered, committed.
//! - [`answers`]: replies, dead letters, and the read-back.
//!
//! The modules depend one way: `consumer` → `answers` → `command`.

mod answers;
mod command;
mod consumer;

pub use answers::{dead_letter, reply, SOURCE_HEADER};
pub use command::{parse, Command, Place, MAX_CORRELATION_ID_BYTES};
