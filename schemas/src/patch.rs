//! Partial updates (`PATCH /v1/entities/{id}`, and Kafka ingest's patch
//! commands): an RFC 7396 merge patch, or update operators in MongoDB's
//! shape (`$set`, `$unset`, `$inc`, `$push`, `$addToSet`, `$pull`). Pure:
//! parsed before any database work (a bad document is a 400), applied by
//! the writer to the row it has locked (a clash with what is stored is a
//! 422 naming the property). Which of the two a document is follows one
//! rule, [`parse`], wherever it comes from.
//!
//! **Paths.** An operator's keys are paths into the bag: `a.b.c` is
//! property `c` of the object in property `b` of the object in property
//! `a`. A name that contains a dot is written with the dot escaped,
//! `a\.b` (in JSON: `"a\\.b"`), and a backslash as `\\`. Paths reach into
//! objects only (no array indexes): `$set`, `$inc`, `$push` and
//! `$addToSet` create missing objects on the way; `$unset` and `$pull` of
//! a missing path do nothing. One document may not name a path twice, nor
//! a path and a path inside it (MongoDB's rule: the result would depend on
//! the order of application).

use crate::value::{Bag, Value, MAX_DEPTH};

/// Most segments in one path (the result must stay within [`MAX_DEPTH`]).
pub const MAX_PATH_SEGMENTS: usize = 32;
/// Longest name of one segment, bytes (the same limit as a property name).
pub const MAX_SEGMENT_BYTES: usize = 255;

/// A parsed partial update.
#[derive(Debug, Clone, PartialEq)]
pub enum Patch {
    /// RFC 7396: `null` removes, an object merges, anything else replaces.
    Merge(Bag),
    /// Operators, applied in the order given.
    Ops(Vec<Update>),
}

/// One operator applied to one path.
#[derive(Debug, Clone, PartialEq)]
pub struct Update {
    pub op: Operator,
    pub path: Vec<String>,
    /// The operand (`Null` for `$unset`); for `$push` and `$addToSet` with
    /// `$each`, every element to add.
    pub values: Vec<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operator {
    Set,
    Unset,
    Inc,
    Push,
    AddToSet,
    Pull,
}

impl Operator {
    fn parse(name: &str) -> Option<Operator> {
        Some(match name {
            "$set" => Operator::Set,
            "$unset" => Operator::Unset,
            "$inc" => Operator::Inc,
            "$push" => Operator::Push,
            "$addToSet" => Operator::AddToSet,
            "$pull" => Operator::Pull,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Operator::Set => "$set",
            Operator::Unset => "$unset",
            Operator::Inc => "$inc",
            Operator::Push => "$push",
            Operator::AddToSet => "$addToSet",
            Operator::Pull => "$pull",
        }
    }
}

/// Why a patch document is refused (before any database work).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BadPatch {
    pub message: String,
}

/// Why a patch cannot apply to the stored entity; `property` is the path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{property}: {reason}")]
pub struct PatchClash {
    pub property: String,
    pub reason: String,
}

fn bad(message: impl Into<String>) -> BadPatch {
    BadPatch { message: message.into() }
}

/// Which of the two forms a patch document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// An RFC 7396 merge patch.
    Merge,
    /// An update document of `$`-operators.
    Operators,
}

impl Form {
    /// A form by the name an ingest command declares it with (`"form"`).
    pub fn from_name(name: &str) -> Option<Form> {
        match name {
            "merge" => Some(Form::Merge),
            "operators" => Some(Form::Operators),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Form::Merge => "merge",
            Form::Operators => "operators",
        }
    }
}

/// How to declare a merge patch, wherever a patch comes from (the hint in
/// the errors below).
const DECLARE_MERGE: &str = "declare a merge patch (Content-Type: application/merge-patch+json over HTTP, \
     \"form\": \"merge\" in a Kafka ingest command)";

/// Parses a patch document by the one rule the HTTP route and Kafka
/// ingest share, and says which form it was read in:
///
/// - a declared form wins: over HTTP, `Content-Type:
///   application/merge-patch+json` declares a merge patch (any other type
///   declares nothing); a Kafka ingest command declares either with
///   `"form": "merge"` or `"form": "operators"`;
/// - undeclared, the keys decide: every key starts with `$`, operators;
///   none does, a merge patch (`{}` too: it changes nothing but the
///   version); a mix is refused, since it is most likely a mistake either
///   way.
///
/// So a property whose name starts with `$` is written by declaring the
/// merge form (or by a PUT of the whole entity, or with `$set`): without a
/// declaration `{"$x": 1}` reads as an operator, and `$x` is none.
pub fn parse(doc: &serde_json::Value, declared: Option<Form>) -> Result<(Form, Patch), BadPatch> {
    let form = match declared {
        Some(form) => form,
        None => {
            let serde_json::Value::Object(map) = doc else {
                return Err(bad("a patch must be a JSON object: a merge patch, or $-operators"));
            };
            match map.keys().filter(|k| k.starts_with('$')).count() {
                0 => Form::Merge,
                n if n == map.len() => Form::Operators,
                _ => {
                    return Err(bad(format!(
                        "the patch mixes $-operators with property names: send one form, a merge patch or \
                         operators; to write a property whose name starts with $, {DECLARE_MERGE}"
                    )))
                }
            }
        }
    };
    let patch = match form {
        Form::Merge => parse_merge(doc)?,
        Form::Operators => parse_operators(doc)?,
    };
    Ok((form, patch))
}

/// Parses an RFC 7396 merge patch; it must be an object (a patch that is
/// not one would replace the whole entity with something that is not a bag).
pub fn parse_merge(doc: &serde_json::Value) -> Result<Patch, BadPatch> {
    let serde_json::Value::Object(map) = doc else {
        return Err(bad("a merge patch of an entity must be a JSON object"));
    };
    let bag = crate::value::bag_from_json_map(map).map_err(|e| bad(e.to_string()))?;
    Ok(Patch::Merge(bag))
}

/// Parses an update document: `{"$set": {"a.b": 1}, "$inc": {"n": 2}, …}`.
pub fn parse_operators(doc: &serde_json::Value) -> Result<Patch, BadPatch> {
    let serde_json::Value::Object(ops) = doc else {
        return Err(bad("an update document must be a JSON object of $-operators"));
    };
    if ops.is_empty() {
        return Err(bad("the update document names no operator"));
    }
    let mut updates = Vec::new();
    let mut paths: Vec<Vec<String>> = Vec::new();
    for (name, fields) in ops {
        let op = Operator::parse(name).ok_or_else(|| {
            bad(format!(
                "unknown operator {name:?}: use $set, $unset, $inc, $push, $addToSet or $pull \
                 (to write a property of that name, {DECLARE_MERGE})"
            ))
        })?;
        let serde_json::Value::Object(fields) = fields else {
            return Err(bad(format!("{name} takes an object of paths")));
        };
        for (key, operand) in fields {
            let path = parse_path(key)?;
            if let Some(other) = paths.iter().find(|p| p.starts_with(&path) || path.starts_with(p)) {
                return Err(bad(format!(
                    "{} and {} overlap: a document may change a path only once",
                    show_path(&path),
                    show_path(other)
                )));
            }
            let value = Value::from_json(operand).map_err(|e| bad(format!("{key}: {e}")))?;
            let values = match op {
                Operator::Unset => vec![Value::Null],
                Operator::Inc if value.as_f64().is_none() => {
                    return Err(bad(format!("{name} of {key} needs a number, not {}", kind(&value))));
                }
                Operator::Push | Operator::AddToSet => each(value, key)?,
                _ => vec![value],
            };
            paths.push(path.clone());
            updates.push(Update { op, path, values });
        }
    }
    Ok(Patch::Ops(updates))
}

/// `{"$each": [..]}` adds every element; any other operand adds itself.
fn each(value: Value, key: &str) -> Result<Vec<Value>, BadPatch> {
    match value {
        Value::Object(o) if o.contains_key("$each") => {
            if o.len() != 1 {
                return Err(bad(format!("{key}: $each takes no other modifier here")));
            }
            match o.into_iter().next().map(|(_, v)| v) {
                Some(Value::Array(items)) => Ok(items),
                _ => Err(bad(format!("{key}: $each takes an array"))),
            }
        }
        other => Ok(vec![other]),
    }
}

/// Splits a path on unescaped dots (`\.` is a dot in a name, `\\` a
/// backslash).
pub fn parse_path(text: &str) -> Result<Vec<String>, BadPatch> {
    let mut segments = vec![String::new()];
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '.' => segments.push(String::new()),
            '\\' => match chars.next() {
                Some(e @ ('.' | '\\')) => segments.last_mut().expect("one at least").push(e),
                _ => return Err(bad(format!("path {text:?}: a backslash escapes only '.' or '\\'"))),
            },
            c => segments.last_mut().expect("one at least").push(c),
        }
    }
    if segments.len() > MAX_PATH_SEGMENTS {
        return Err(bad(format!("path {text:?} has more than {MAX_PATH_SEGMENTS} segments")));
    }
    for s in &segments {
        if s.is_empty() || s.len() > MAX_SEGMENT_BYTES || s.chars().any(char::is_control) {
            return Err(bad(format!(
                "path {text:?}: each name must be 1 to {MAX_SEGMENT_BYTES} bytes without control characters"
            )));
        }
    }
    Ok(segments)
}

/// A path as written (dots and backslashes in names escaped again).
pub fn show_path(path: &[String]) -> String {
    path.iter().map(|s| s.replace('\\', "\\\\").replace('.', "\\.")).collect::<Vec<_>>().join(".")
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Int(_) => "an integer",
        Value::Float(_) => "a float",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Levels of arrays and objects in `v` (a scalar is 0).
fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Equality as MongoDB's `$addToSet` and `$pull` see it: numbers by value
/// (`1` equals `1.0`), containers element by element.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|((k1, v1), (k2, v2))| k1 == k2 && same(v1, v2))
        }
        _ => match (a.as_f64(), b.as_f64()) {
            (Some(x), Some(y)) => x == y,
            _ => a == b,
        },
    }
}

impl Patch {
    /// The bag after the patch; `current` is the live entity (`None` when
    /// absent: an upsert starts from an empty bag).
    pub fn apply(&self, current: Option<&Bag>) -> Result<Bag, PatchClash> {
        let mut bag = current.cloned().unwrap_or_default();
        match self {
            Patch::Merge(patch) => merge_into(&mut bag, patch),
            Patch::Ops(updates) => {
                for u in updates {
                    apply_one(&mut bag, u)?;
                }
            }
        }
        for (name, v) in &bag {
            // A property value sits inside the bag: MAX_DEPTH levels below it.
            if depth(v) > MAX_DEPTH {
                return Err(PatchClash {
                    property: show_path(std::slice::from_ref(name)),
                    reason: format!("arrays and objects would nest deeper than {MAX_DEPTH} levels"),
                });
            }
        }
        Ok(bag)
    }
}

/// RFC 7396 on an object: `null` removes a member, an object merges into
/// the member (replacing a member that is not an object), anything else
/// replaces it.
fn merge_into(target: &mut Bag, patch: &Bag) {
    for (name, p) in patch {
        match p {
            Value::Null => {
                target.remove(name);
            }
            Value::Object(inner) => {
                let slot = target.entry(name.clone()).or_insert_with(|| Value::Object(Bag::new()));
                if !matches!(slot, Value::Object(_)) {
                    *slot = Value::Object(Bag::new());
                }
                if let Value::Object(t) = slot {
                    merge_into(t, inner);
                }
            }
            other => {
                target.insert(name.clone(), other.clone());
            }
        }
    }
}

fn apply_one(bag: &mut Bag, u: &Update) -> Result<(), PatchClash> {
    let clash = |at: &[String], reason: String| PatchClash { property: show_path(at), reason };
    let (last, parents) = u.path.split_last().expect("a path has a segment");
    let creates = !matches!(u.op, Operator::Unset | Operator::Pull);
    // Walk to the object that holds the last segment.
    let mut obj = bag;
    for (i, seg) in parents.iter().enumerate() {
        if !obj.contains_key(seg) {
            if !creates {
                return Ok(());
            }
            obj.insert(seg.clone(), Value::Object(Bag::new()));
        }
        match obj.get_mut(seg).expect("present") {
            Value::Object(inner) => obj = inner,
            other => {
                let what = kind(other);
                return Err(clash(
                    &u.path[..=i],
                    format!("is {what}, so {} cannot reach inside it", u.op.name()),
                ));
            }
        }
    }
    let operand = &u.values;
    match u.op {
        Operator::Set => {
            obj.insert(last.clone(), operand[0].clone());
        }
        Operator::Unset => {
            obj.remove(last);
        }
        Operator::Inc => {
            let sum = match (obj.get(last), &operand[0]) {
                (None, by) => by.clone(),
                (Some(Value::Int(a)), Value::Int(b)) => Value::Int(
                    a.checked_add(*b)
                        .ok_or_else(|| clash(&u.path, "$inc overflows a 64-bit integer".into()))?,
                ),
                (Some(a @ (Value::Int(_) | Value::Float(_))), b) => {
                    let f = a.as_f64().expect("a number") + b.as_f64().expect("a number");
                    if !f.is_finite() {
                        return Err(clash(&u.path, "$inc gives a number that is not finite".into()));
                    }
                    Value::Float(f)
                }
                (Some(other), _) => {
                    return Err(clash(&u.path, format!("is {}, and $inc needs a number", kind(other))));
                }
            };
            obj.insert(last.clone(), sum);
        }
        Operator::Push | Operator::AddToSet => {
            let slot = obj.entry(last.clone()).or_insert_with(|| Value::Array(Vec::new()));
            let Value::Array(items) = slot else {
                let what = kind(slot);
                return Err(clash(&u.path, format!("is {what}, and {} needs an array", u.op.name())));
            };
            for v in operand {
                if u.op == Operator::Push || !items.iter().any(|x| same(x, v)) {
                    items.push(v.clone());
                }
            }
        }
        Operator::Pull => match obj.get_mut(last) {
            None => {}
            Some(Value::Array(items)) => items.retain(|x| !same(x, &operand[0])),
            Some(other) => {
                let what = kind(other);
                return Err(clash(&u.path, format!("is {what}, and $pull needs an array")));
            }
        },
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bag(v: serde_json::Value) -> Bag {
        crate::value::bag_from_json(&v).unwrap()
    }

    fn ops(v: serde_json::Value) -> Patch {
        parse_operators(&v).unwrap()
    }

    #[test]
    fn a_declared_form_wins_and_undeclared_the_keys_decide() {
        let merge = |v: serde_json::Value| Patch::Merge(bag(v));
        // Undeclared: all $ is operators, none is a merge patch.
        let (form, p) = parse(&json!({"$inc": {"n": 1}, "$set": {"a": 2}}), None).unwrap();
        assert_eq!((form, p), (Form::Operators, ops(json!({"$inc": {"n": 1}, "$set": {"a": 2}}))));
        let (form, p) = parse(&json!({"a": null, "b": {"c": 1}}), None).unwrap();
        assert_eq!((form, p), (Form::Merge, merge(json!({"a": null, "b": {"c": 1}}))));
        assert_eq!(parse(&json!({}), None).unwrap(), (Form::Merge, merge(json!({}))));
        // A mix is refused, and says how to write a $-named property.
        let e = parse(&json!({"$inc": {"n": 1}, "a": 2}), None).unwrap_err();
        assert!(e.message.contains("mixes") && e.message.contains("declare a merge patch"), "{e}");
        // Declared merge: a $-named property is a property.
        let (form, p) = parse(&json!({"$price": 3, "a": 1}), Some(Form::Merge)).unwrap();
        assert_eq!((form, p), (Form::Merge, merge(json!({"$price": 3, "a": 1}))));
        let (_, p) = parse(&json!({"$inc": {"n": 1}}), Some(Form::Merge)).unwrap();
        let got = p.apply(Some(&bag(json!({"n": 5})))).unwrap();
        assert_eq!(got, bag(json!({"n": 5, "$inc": {"n": 1}})), "declared merge: $inc is a property");
        // Undeclared, that same document is an operator.
        let (_, p) = parse(&json!({"$inc": {"n": 1}}), None).unwrap();
        assert_eq!(p.apply(Some(&bag(json!({"n": 5})))).unwrap(), bag(json!({"n": 6})));
        // Declared operators: a plain name is an unknown operator.
        let e = parse(&json!({"a": 1}), Some(Form::Operators)).unwrap_err();
        assert!(e.message.contains("unknown operator \"a\""), "{e}");
        let e = parse(&json!({"$price": 3}), None).unwrap_err();
        assert!(e.message.contains("$price") && e.message.contains("\"form\": \"merge\""), "{e}");
        // Not an object: refused whichever the form.
        for declared in [None, Some(Form::Merge), Some(Form::Operators)] {
            assert!(parse(&json!([1]), declared).is_err(), "{declared:?}");
        }
        assert_eq!(Form::from_name("merge"), Some(Form::Merge));
        assert_eq!(Form::from_name(Form::Operators.name()), Some(Form::Operators));
        assert_eq!(Form::from_name("Merge"), None);
    }

    /// RFC 7396, appendix A, every example whose target and result are
    /// objects (a bag is an object; the examples that patch a non-object
    /// into place are the top-level cases the API refuses).
    #[test]
    fn merge_patch_follows_rfc_7396_appendix_a() {
        let cases = [
            (json!({"a":"b"}), json!({"a":"c"}), json!({"a":"c"})),
            (json!({"a":"b"}), json!({"b":"c"}), json!({"a":"b","b":"c"})),
            (json!({"a":"b"}), json!({"a":null}), json!({})),
            (json!({"a":"b","b":"c"}), json!({"a":null}), json!({"b":"c"})),
            (json!({"a":["b"]}), json!({"a":"c"}), json!({"a":"c"})),
            (json!({"a":"c"}), json!({"a":["b"]}), json!({"a":["b"]})),
            (json!({"a":{"b":"c"}}), json!({"a":{"b":"d","c":null}}), json!({"a":{"b":"d"}})),
            (json!({"a":[{"b":"c"}]}), json!({"a":[1]}), json!({"a":[1]})),
            (json!({"e":null}), json!({"a":1}), json!({"e":null,"a":1})),
            (json!({}), json!({"a":{"bb":{"ccc":null}}}), json!({"a":{"bb":{}}})),
        ];
        for (target, patch, want) in cases {
            let got = parse_merge(&patch).unwrap().apply(Some(&bag(target.clone()))).unwrap();
            assert_eq!(got, bag(want.clone()), "{target} + {patch}");
        }
        assert!(parse_merge(&json!(["a", "b"])).is_err(), "a non-object merge patch of a bag");
    }

    #[test]
    fn operators_set_unset_inc_push_add_to_set_pull() {
        let start = bag(json!({"n": 1, "f": 1.5, "tags": ["a"], "o": {"x": 1}, "gone": true}));
        let p = ops(json!({
            "$set": {"o.y": "new", "deep.er": 2},
            "$unset": {"gone": "", "nothing.here": ""},
            "$inc": {"n": 2, "f": 1, "fresh": 5},
            "$push": {"tags": {"$each": ["a", "b"]}},
            "$addToSet": {"set": 1},
            "$pull": {"missing": 1}
        }));
        let got = p.apply(Some(&start)).unwrap();
        assert_eq!(
            got,
            bag(json!({"n": 3, "f": 2.5, "fresh": 5, "tags": ["a", "a", "b"], "set": [1],
                       "o": {"x": 1, "y": "new"}, "deep": {"er": 2}}))
        );
        let again = ops(json!({"$addToSet": {"tags": {"$each": ["b", "c"]}}, "$pull": {"set": 1.0}}));
        let got = again.apply(Some(&got)).unwrap();
        assert_eq!(got["tags"], Value::from_json(&json!(["a", "a", "b", "c"])).unwrap());
        assert_eq!(got["set"], Value::Array(vec![]), "1.0 pulls 1");
    }

    #[test]
    fn clashes_name_the_property() {
        let start = bag(json!({"s": "text", "n": i64::MAX, "o": {"a": 1}}));
        let cases = [
            (json!({"$inc": {"s": 1}}), "s"),
            (json!({"$inc": {"n": 1}}), "n"),
            (json!({"$push": {"o": 1}}), "o"),
            (json!({"$set": {"s.x": 1}}), "s"),
            (json!({"$pull": {"o.a": 1}}), "o.a"),
        ];
        for (doc, property) in cases {
            let e = ops(doc.clone()).apply(Some(&start)).unwrap_err();
            assert_eq!(e.property, property, "{doc}: {e}");
        }
    }

    #[test]
    fn bad_documents_are_refused_before_anything_is_applied() {
        for doc in [
            json!({"$rename": {"a": "b"}}),
            json!({"a": 1}),
            json!({}),
            json!({"$set": 1}),
            json!({"$inc": {"a": "one"}}),
            json!({"$set": {"a": 1}, "$inc": {"a": 1}}),
            json!({"$set": {"a": 1, "a.b": 2}}),
            json!({"$set": {"a..b": 1}}),
            json!({"$set": {"a\\x": 1}}),
            json!({"$push": {"a": {"$each": 1}}}),
        ] {
            assert!(parse_operators(&doc).is_err(), "{doc}");
        }
    }

    #[test]
    fn escaped_dots_address_names_with_dots() {
        assert_eq!(parse_path("a\\.b.c").unwrap(), vec!["a.b", "c"]);
        assert_eq!(parse_path("x\\\\y").unwrap(), vec!["x\\y"]);
        assert_eq!(show_path(&["a.b".into(), "c".into()]), "a\\.b.c");
        let got = ops(json!({"$set": {"version\\.2": true}})).apply(None).unwrap();
        assert_eq!(got, bag(json!({"version.2": true})));
    }

    #[test]
    fn too_deep_a_result_is_a_clash() {
        let mut deep = json!(1);
        for _ in 0..(MAX_DEPTH - 20) {
            deep = json!([deep]);
        }
        let path: Vec<String> = (0..MAX_PATH_SEGMENTS).map(|i| format!("p{i}")).collect();
        let doc = json!({"$set": {path.join("."): deep}});
        let e = ops(doc).apply(None).unwrap_err();
        assert_eq!(e.property, "p0");
    }
}
