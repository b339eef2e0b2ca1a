//! What a failed run prints: the seed, the faults, and the history of
//! the entities involved (also written to `chaos-failures.txt` in the
//! run's kept directory: a CI log may keep only its last lines).

use super::*;

/// Operations printed per entity involved (its latest).
const HISTORY_OPS: usize = 16;

/// The seed, the faults, the entities' events on the topic, and the latest
/// operations on the entities the failures name.
pub(super) fn history(
    shared: &Shared,
    timeline: &[FaultRecord],
    failures: &[String],
    keys: usize,
    events: &[model::TopicEvent],
) -> String {
    let mut out = String::new();
    let mut ours: BTreeSet<String> = (0..keys).map(entity_id).collect();
    ours.extend(shared.created.lock().unwrap().iter().cloned());
    ours.extend((0..EXP_KEYS).map(exp_id));
    writeln!(out, "---- {} failed checks ----", failures.len()).ok();
    for f in failures.iter().take(50) {
        writeln!(out, "  {f}").ok();
    }
    writeln!(out, "---- fault timeline ----").ok();
    for f in timeline {
        writeln!(out, "  {:>7} ms {:?}: {}", f.at_ms, f.fault, f.detail).ok();
    }
    let involved: BTreeSet<String> = failures
        .iter()
        .flat_map(|f| {
            f.split(|c: char| !c.is_ascii_hexdigit())
                .filter(|w| ours.contains(*w))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    // The events first: a log cut short keeps them.
    writeln!(out, "---- their events in topic order (version, d for a delete, @partition:offset) ----").ok();
    for id in &involved {
        writeln!(out, "  {id}: {}", model::topic_history(events, id).join(" ")).ok();
    }
    writeln!(
        out,
        "---- the last {HISTORY_OPS} operations on each of the {} entities involved ----",
        involved.len()
    )
    .ok();
    let ops = shared.ops.lock().unwrap();
    for id in &involved {
        let of_id: Vec<_> = ops.iter().filter(|o| &o.id == id).collect();
        for op in &of_id[of_id.len().saturating_sub(HISTORY_OPS)..] {
            writeln!(
                out,
                "  {:>7} ms client {} {}: {} -> {}",
                op.at_ms, op.client, op.id, op.what, op.outcome
            )
            .ok();
        }
    }
    out
}
