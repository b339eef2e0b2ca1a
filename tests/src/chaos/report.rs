//! What a failed run prints: the seed, the faults, and the history of
//! the entities involved.

use super::*;

/// Operations printed per entity involved (its latest).
const HISTORY_OPS: usize = 16;

/// The seed, the faults, the entities' events on the topic, and the latest
/// operations on the entities the failures name.
pub(super) fn print_history(
    shared: &Shared,
    timeline: &[FaultRecord],
    failures: &[String],
    keys: usize,
    events: &[model::TopicEvent],
) {
    let mut ours: BTreeSet<String> = (0..keys).map(entity_id).collect();
    ours.extend(shared.created.lock().unwrap().iter().cloned());
    ours.extend((0..EXP_KEYS).map(exp_id));
    eprintln!("---- {} failed checks ----", failures.len());
    for f in failures.iter().take(50) {
        eprintln!("  {f}");
    }
    eprintln!("---- fault timeline ----");
    for f in timeline {
        eprintln!("  {:>7} ms {:?}: {}", f.at_ms, f.fault, f.detail);
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
    eprintln!("---- their events in topic order (version, d for a delete, @partition:offset) ----");
    for id in &involved {
        eprintln!("  {id}: {}", model::topic_history(events, id).join(" "));
    }
    eprintln!(
        "---- the last {HISTORY_OPS} operations on each of the {} entities involved ----",
        involved.len()
    );
    let ops = shared.ops.lock().unwrap();
    for id in &involved {
        let of_id: Vec<_> = ops.iter().filter(|o| &o.id == id).collect();
        for op in &of_id[of_id.len().saturating_sub(HISTORY_OPS)..] {
            eprintln!("  {:>7} ms client {} {}: {} -> {}", op.at_ms, op.client, op.id, op.what, op.outcome);
        }
    }
}
