//! What a failed run prints: the seed, the faults, and the history of
//! the entities involved.

use super::*;

/// The seed, the faults, and every operation on the entities the failures name.
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
    eprintln!("---- history of the {} entities involved ----", involved.len());
    for op in shared.ops.lock().unwrap().iter().filter(|o| involved.contains(&o.id)) {
        eprintln!("  {:>7} ms client {} {}: {} -> {}", op.at_ms, op.client, op.id, op.what, op.outcome);
    }
    eprintln!("---- their events in topic order (version@partition:offset) ----");
    for id in &involved {
        eprintln!("  {id}: {}", model::topic_history(events, id).join(" "));
    }
}
