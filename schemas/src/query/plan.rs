//! Choosing the index for a query and how to scan it, and the re-filter
//! that decides whether a fetched entity answers the query.

use crate::filter::{Condition, KeyRange};
use crate::index::{IndexKey, IndexProperty, IndexSpec, KeyValue, PropType};
use crate::settings::ReaderSettings;
use crate::value::Bag;

use super::{bad, Query, QueryError};

/// The index chosen for a query and how to scan it.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: IndexSpec,
    /// Leading properties fixed by equality or `in`.
    pub prefix_len: usize,
    /// Every combination of the prefix values, in scan order.
    pub prefixes: Vec<IndexKey>,
    /// Range on property `prefix_len`, if any.
    pub range: Option<KeyRange>,
    pub descending: bool,
    /// The prefix fixes `shard_on`: each prefix lives on one shard.
    pub shard_fixed: bool,
}

fn type_name(p: &IndexProperty) -> String {
    match p.ty {
        PropType::Uuid => "uuid (32 hex digits or a dashed UUID)".into(),
        PropType::String => format!("string of at most {} characters", p.string_len()),
        PropType::Int => "integer".into(),
        PropType::Float => "number".into(),
        PropType::Bool => "boolean".into(),
    }
}

/// How much of an index a query's conditions pin down: the equality prefix
/// length and whether a range follows it.
fn fit(q: &Query, spec: &IndexSpec) -> (usize, bool) {
    let prefix = spec
        .properties
        .iter()
        .take_while(|p| q.conditions.get(&p.name).is_some_and(Condition::is_equality))
        .count();
    let range = spec
        .properties
        .get(prefix)
        .is_some_and(|p| matches!(q.conditions.get(&p.name), Some(Condition::Range { .. })));
    (prefix, range)
}

/// Picks the index among `indexes` (in a stable order) and builds the scan.
pub fn plan(q: &Query, indexes: &[IndexSpec], settings: &ReaderSettings) -> Result<Plan, QueryError> {
    let spec = match &q.index {
        Some(name) => {
            indexes.iter().find(|s| &s.table == name).ok_or_else(|| QueryError::UnknownIndex(name.clone()))?
        }
        None => {
            // Most constrained leading properties first; ties: fewer shards.
            let score = |s: &IndexSpec| {
                let (prefix, range) = fit(q, s);
                let fixed = s.properties[..prefix].iter().any(|p| p.name == s.shard_on());
                (prefix + range as usize, fixed)
            };
            let best = indexes.iter().filter(|s| score(s).0 > 0).max_by(|a, b| {
                score(a).cmp(&score(b)).then_with(|| {
                    // Earlier in the list wins a full tie.
                    let pa = indexes.iter().position(|o| o == *a);
                    let pb = indexes.iter().position(|o| o == *b);
                    pb.cmp(&pa)
                })
            });
            best.ok_or_else(|| QueryError::NoUsableIndex {
                properties: q.conditions.keys().cloned().collect(),
            })?
        }
    };
    let (prefix_len, has_range) = fit(q, spec);
    let mut prefixes: Vec<IndexKey> = vec![Vec::new()];
    for p in &spec.properties[..prefix_len] {
        let mut typed = Vec::new();
        for v in q.conditions[&p.name].values() {
            let k = p.typed(v).ok_or_else(|| {
                bad(format!(
                    "{:?} is an index property of type {}; {} does not fit",
                    p.name,
                    type_name(p),
                    v.to_json()
                ))
            })?;
            if !typed.contains(&k) {
                typed.push(k);
            }
        }
        let mut next = Vec::new();
        for k in &prefixes {
            for t in &typed {
                let mut nk = k.clone();
                nk.push(t.clone());
                next.push(nk);
            }
        }
        if next.len() > settings.max_in {
            return Err(bad(format!(
                "the in lists expand to {} index keys, over the limit of {}",
                next.len(),
                settings.max_in
            )));
        }
        prefixes = next;
    }
    prefixes.sort_by(|a, b| cmp_keys(a, b));
    if q.descending {
        prefixes.reverse();
    }
    let range = if has_range {
        let p = &spec.properties[prefix_len];
        let r = q.conditions[&p.name].typed_range(p).ok_or_else(|| {
            bad(format!("the range on {:?} must use values of its index type, {}", p.name, type_name(p)))
        })?;
        Some(r)
    } else {
        None
    };
    let shard_fixed = spec.properties[..prefix_len].iter().any(|p| p.name == spec.shard_on());
    Ok(Plan { spec: spec.clone(), prefix_len, prefixes, range, descending: q.descending, shard_fixed })
}

/// Index order of two keys (all columns of one index have one type each).
pub fn cmp_keys(a: &[KeyValue], b: &[KeyValue]) -> std::cmp::Ordering {
    a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal)
}

impl Plan {
    /// The re-filter of Invariant R: whether an entity, as stored, really
    /// answers the query. Every condition holds (typed like the index for
    /// the index's own properties, so a row is accepted exactly when the
    /// entity produces that key) and so does the index's `match_on`.
    pub fn admits(&self, q: &Query, bag: &Bag) -> bool {
        self.spec.matches_partial(bag)
            && q.conditions.iter().all(|(name, c): (&String, &Condition)| match self.spec.property(name) {
                Some(prop) => c.matches_typed(prop, bag.get(name)),
                None => c.matches(bag.get(name)),
            })
    }

    /// The entity's first key in scan order among those the scan covers:
    /// the one row of it a page may count (an entity appears once).
    pub fn canonical_key(&self, bag: &Bag) -> Option<IndexKey> {
        let covered = self.spec.keys(bag).into_iter().filter(|k| {
            self.prefixes.iter().any(|p| k[..self.prefix_len] == p[..])
                && self.range.as_ref().is_none_or(|r| r.contains(&k[self.prefix_len]))
        });
        if self.descending {
            covered.max_by(|a, b| cmp_keys(a, b))
        } else {
            covered.min_by(|a, b| cmp_keys(a, b))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn settings() -> crate::Settings {
        crate::Settings::from_toml_and_env(
            r#"
            [[indexes]]
            table = "index_user_id"
            properties = [{ name = "user_id", type = "uuid" }]
            [[indexes]]
            table = "index_user_published"
            properties = [{ name = "user_id", type = "uuid" }, { name = "published", type = "int" }]
            shard_on = "user_id"
            [[indexes]]
            table = "index_user_name"
            properties = [{ name = "first_name", type = "string" }, { name = "last_name", type = "string" }]
            [[indexes]]
            table = "index_first"
            properties = [{ name = "first_name", type = "string" }]
            "#,
            Vec::new(),
        )
        .unwrap()
    }

    fn plan_of(q: serde_json::Value) -> Result<Plan, QueryError> {
        let s = settings();
        plan(&crate::query::parse(q, &s.reader)?, &s.indexes, &s.reader)
    }

    #[test]
    fn the_index_constraining_the_most_leading_properties_wins() {
        let p = plan_of(json!({"where": {"first_name": "a", "last_name": {"in": ["b", "c"]}}})).unwrap();
        assert_eq!((p.spec.table.as_str(), p.prefixes.len()), ("index_user_name", 2));
        let p = plan_of(json!({"where": {"first_name": "a", "title": "x"}})).unwrap();
        assert_eq!(p.spec.table, "index_user_name", "ties go to the earlier index");
        let u = "f48b0440ca0c4f66991c4d5f6a078eaf";
        let p = plan_of(json!({"where": {"user_id": u, "published": {"gte": 5}}})).unwrap();
        assert_eq!(
            (p.spec.table.as_str(), p.prefix_len, p.range.is_some()),
            ("index_user_published", 1, true)
        );
        assert!(p.shard_fixed);
        let p = plan_of(json!({"where": {"user_id": u}, "order": "desc"})).unwrap();
        assert_eq!(p.spec.table, "index_user_id", "a full tie goes to the earlier index");
        let p = plan_of(json!({"index": "index_user_published", "where": {"published": {"lt": 9}}})).unwrap();
        assert_eq!((p.prefix_len, p.range.is_none(), p.shard_fixed), (0, true, false));
    }

    #[test]
    fn in_lists_expand_in_scan_order() {
        let p = plan_of(json!({"where": {"first_name": {"in": ["b", "a", "c"]}}, "order": "desc"})).unwrap();
        let firsts: Vec<&KeyValue> = p.prefixes.iter().map(|k| &k[0]).collect();
        assert_eq!(
            firsts,
            vec![&KeyValue::Str("c".into()), &KeyValue::Str("b".into()), &KeyValue::Str("a".into())]
        );
    }
}
