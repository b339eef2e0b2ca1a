//! Reading a command: one message's value → the change and precondition
//! it asks for (with its guard), or the problem that refuses it.

use rdkafka::message::OwnedMessage;
use schemas::{idempotency, patch, EntityId};
use serde_json::{Map, Value as JsonValue};
use service::http::Problem;

use crate::http::entity_body;
use crate::Outcome;
use crate::{Change, Guard, Precondition};

/// Longest accepted `correlation_id`.
pub const MAX_CORRELATION_ID_BYTES: usize = 255;

/// Every field a command may have.
const FIELDS: [&str; 8] =
    ["op", "id", "properties", "patch", "form", "upsert", "if_match", "idempotency_key"];

/// Where a message was read: the default guard of a command without an
/// `idempotency_key`, and the dead-letter record's `source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

impl Place {
    /// Where `msg` was read.
    pub fn of(msg: &OwnedMessage) -> Place {
        use rdkafka::Message;
        Place { topic: msg.topic().to_string(), partition: msg.partition(), offset: msg.offset() }
    }

    /// The `bagstore-ingest-source` header value naming this place.
    pub fn header(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }

    /// Reads a `bagstore-ingest-source` header value (topic names cannot
    /// hold `/`).
    pub fn from_header(value: &[u8]) -> Option<Place> {
        let text = std::str::from_utf8(value).ok()?;
        let mut parts = text.rsplitn(3, '/');
        let offset = parts.next()?.parse().ok()?;
        let partition = parts.next()?.parse().ok()?;
        let topic = parts.next().filter(|t| !t.is_empty())?.to_string();
        Some(Place { topic, partition, offset })
    }
}

/// A command as read from the topic: what to apply, or why not.
#[derive(Debug)]
pub struct Command {
    pub correlation_id: Option<String>,
    /// The entity, when the command names one that parses.
    pub id: Option<EntityId>,
    pub action: Result<(Change, Precondition), Problem>,
}

/// One message of a round and what became of it.
#[derive(Debug)]
pub(crate) struct Item {
    pub(crate) msg: OwnedMessage,
    pub(crate) command: Command,
    /// Its outcome once applied, or its problem (refused or malformed).
    pub(crate) result: Option<Result<Outcome, Problem>>,
}

fn malformed(detail: impl Into<String>) -> Problem {
    Problem::bad_request("bad-command", detail)
}

/// Reads one message's payload as a command. Never fails: a command that
/// cannot be applied carries its problem (what the dead-letter topic and
/// the reply say).
pub fn parse(payload: Option<&[u8]>, place: &Place, max_body_bytes: usize) -> Command {
    let doc: JsonValue = match payload.map(serde_json::from_slice) {
        None => return refused(None, malformed("the message has no value")),
        Some(Err(e)) => return refused(None, malformed(format!("the message is not JSON: {e}"))),
        Some(Ok(doc)) => doc,
    };
    let JsonValue::Object(mut map) = doc else {
        return refused(None, malformed("a command must be a JSON object"));
    };
    // Read first, so even a command refused for another reason is answered.
    let correlation_id = match map.remove("correlation_id") {
        None => None,
        Some(JsonValue::String(c)) if !c.is_empty() && c.len() <= MAX_CORRELATION_ID_BYTES => Some(c),
        Some(_) => {
            return refused(
                None,
                malformed(format!(
                    "\"correlation_id\" must be a string of 1 to {MAX_CORRELATION_ID_BYTES} bytes"
                )),
            )
        }
    };
    let id = match map.get("id") {
        Some(JsonValue::String(s)) => EntityId::parse(s).ok(),
        _ => None,
    };
    let action = action(&map, place, max_body_bytes);
    Command { correlation_id, id, action }
}

fn refused(correlation_id: Option<String>, p: Problem) -> Command {
    Command { correlation_id, id: None, action: Err(p) }
}

/// The command's change and precondition (with its guard), from its
/// fields other than `correlation_id`.
fn action(
    map: &Map<String, JsonValue>,
    place: &Place,
    max_body_bytes: usize,
) -> Result<(Change, Precondition), Problem> {
    if let Some(unknown) = map.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(malformed(format!("unknown field {unknown:?} (a command has {})", FIELDS.join(", "))));
    }
    let op = match map.get("op") {
        Some(JsonValue::String(op)) => op.as_str(),
        _ => return Err(malformed("\"op\" must be \"put\", \"patch\" or \"delete\"")),
    };
    match map.get("id") {
        Some(JsonValue::String(s)) => {
            EntityId::parse(s).map_err(|e| Problem::bad_request("bad-id", format!("\"id\": {e}")))?;
        }
        _ => return Err(Problem::bad_request("bad-id", "\"id\" must be a string of 32 hex digits")),
    }
    let mut pre = Precondition::default();
    match map.get("if_match") {
        None | Some(JsonValue::Null) => {}
        Some(v) => {
            pre.if_version =
                Some(v.as_u64().ok_or_else(|| malformed("\"if_match\" must be a version number"))?)
        }
    }
    let change = change(map, op, max_body_bytes)?;
    pre.guard = Some(guard(map, place)?);
    Ok((change, pre))
}

/// What `op` changes, from the fields that op takes (and no other).
fn change(map: &Map<String, JsonValue>, op: &str, max_body_bytes: usize) -> Result<Change, Problem> {
    let only = |allowed: &[&str]| -> Result<(), Problem> {
        for field in ["properties", "patch", "form", "upsert"] {
            if map.contains_key(field) && !allowed.contains(&field) {
                return Err(malformed(format!("a {op} command has no {field:?}")));
            }
        }
        Ok(())
    };
    match op {
        "put" => {
            only(&["properties"])?;
            let props =
                map.get("properties").cloned().ok_or_else(|| malformed("a put needs \"properties\""))?;
            if props.as_object().is_some_and(|o| o.contains_key("id")) {
                return Err(malformed(
                    "\"properties\" may not hold \"id\" (the command's \"id\" names the entity)",
                ));
            }
            let (_, bag) = entity_body(props, Some(max_body_bytes))?;
            Ok(Change::Put(bag))
        }
        "patch" => {
            only(&["patch", "form", "upsert"])?;
            patch_change(map)
        }
        "delete" => {
            only(&[])?;
            Ok(Change::Delete)
        }
        other => Err(malformed(format!("unknown op {other:?}: \"put\", \"patch\" or \"delete\""))),
    }
}

/// A patch command's change: its `patch` read by the rule every patch
/// follows (`schemas::patch::parse`), the form declared by `form` if the
/// command has one.
fn patch_change(map: &Map<String, JsonValue>) -> Result<Change, Problem> {
    let doc = map.get("patch").ok_or_else(|| malformed("a patch needs \"patch\""))?;
    let upsert = match map.get("upsert") {
        None => false,
        Some(JsonValue::Bool(b)) => *b,
        Some(_) => return Err(malformed("\"upsert\" must be true or false")),
    };
    let declared = match map.get("form") {
        None | Some(JsonValue::Null) => None,
        Some(JsonValue::String(f)) if patch::Form::from_name(f).is_some() => patch::Form::from_name(f),
        Some(_) => return Err(malformed("\"form\" must be \"merge\" or \"operators\"")),
    };
    let (_, parsed) =
        patch::parse(doc, declared).map_err(|e| Problem::bad_request("bad-patch", e.to_string()))?;
    Ok(Change::Patch { patch: std::sync::Arc::new(parsed), upsert })
}

/// The command's guard: its `idempotency_key` when it has one (a
/// producer's resend is then applied once), else its place (a redelivery
/// is applied once).
fn guard(map: &Map<String, JsonValue>, place: &Place) -> Result<Guard, Problem> {
    let key = match map.get("idempotency_key") {
        None | Some(JsonValue::Null) => format!("@{}/{}/{}", place.topic, place.partition, place.offset),
        Some(JsonValue::String(k)) => {
            idempotency::check_key(k).map_err(|e| Problem::bad_request("bad-idempotency-key", e))?;
            format!("key:{k}")
        }
        Some(_) => {
            return Err(Problem::bad_request("bad-idempotency-key", "\"idempotency_key\" must be a string"))
        }
    };
    // The request under the key: the command without its correlation id
    // (a producer's resend may carry a new one), in canonical JSON.
    let body = serde_json::to_vec(map).unwrap_or_default();
    Ok(Guard {
        key: idempotency::key_hash(&format!("kafka ingest {key}")),
        request: idempotency::request_hash("INGEST", &body),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn place(offset: i64) -> Place {
        Place { topic: "bagstore.ingest.v1".into(), partition: 2, offset }
    }

    fn command(doc: JsonValue, offset: i64) -> Command {
        parse(Some(doc.to_string().as_bytes()), &place(offset), 1 << 20)
    }

    const ID: &str = "000102030405060708090a0b0c0d0e0f";

    #[test]
    fn each_op_parses_with_its_fields_and_the_correlation_id_is_kept() {
        let c = command(json!({"op": "put", "id": ID, "properties": {"a": 1}, "correlation_id": "c1"}), 7);
        assert_eq!(c.correlation_id.as_deref(), Some("c1"));
        assert_eq!(c.id.map(|i| i.to_hex()).as_deref(), Some(ID));
        assert!(matches!(c.action, Ok((Change::Put(_), _))));
        let c = command(json!({"op": "patch", "id": ID, "patch": {"$inc": {"n": 1}}, "if_match": 3}), 8);
        let Ok((Change::Patch { upsert: false, .. }, pre)) = c.action else { panic!("{:?}", c.action) };
        assert_eq!(pre.if_version, Some(3));
        let c = command(json!({"op": "patch", "id": ID, "patch": {"a": null}, "upsert": true}), 9);
        assert!(matches!(c.action, Ok((Change::Patch { upsert: true, .. }, _))));
        let c = command(json!({"op": "delete", "id": ID}), 10);
        assert!(matches!(c.action, Ok((Change::Delete, _))));
    }

    /// The patch of a command, as applied to `current`.
    fn patched(doc: JsonValue, current: JsonValue) -> Result<JsonValue, String> {
        match command(doc, 1).action {
            Ok((Change::Patch { patch, .. }, _)) => {
                let bag = schemas::value::bag_from_json(&current).unwrap();
                let after = patch.apply(Some(&bag)).map_err(|e| e.to_string())?;
                Ok(JsonValue::Object(schemas::value::bag_to_json_map(&after)))
            }
            Ok(other) => panic!("not a patch: {other:?}"),
            Err(p) => Err(p.detail),
        }
    }

    #[test]
    fn a_declared_form_wins_and_undeclared_the_keys_decide() {
        let now = json!({"n": 1, "$price": 2});
        // Undeclared: the keys decide.
        assert_eq!(
            patched(json!({"op": "patch", "id": ID, "patch": {"$inc": {"n": 1}}}), now.clone()),
            Ok(json!({"n": 2, "$price": 2}))
        );
        assert_eq!(
            patched(json!({"op": "patch", "id": ID, "patch": {"n": null}}), now.clone()),
            Ok(json!({"$price": 2}))
        );
        // A $-named property is written by declaring the merge form.
        let doc = json!({"op": "patch", "id": ID, "patch": {"$price": 3, "n": 5}, "form": "merge"});
        assert_eq!(patched(doc, now.clone()), Ok(json!({"n": 5, "$price": 3})));
        let doc = json!({"op": "patch", "id": ID, "patch": {"$set": {"n": 7}}, "form": "operators"});
        assert_eq!(patched(doc, now.clone()), Ok(json!({"n": 7, "$price": 2})));
        // Undeclared, a mix is refused and says how to declare.
        let e = patched(json!({"op": "patch", "id": ID, "patch": {"$price": 3, "n": 5}}), now.clone());
        assert!(e.as_ref().is_err_and(|d| d.contains("mixes") && d.contains("\"form\": \"merge\"")), "{e:?}");
        for bad in [json!("merges"), json!(true), json!({"merge": 1})] {
            let e = patched(json!({"op": "patch", "id": ID, "patch": {"n": 1}, "form": bad}), now.clone());
            assert!(e.as_ref().is_err_and(|d| d.contains("\"form\" must be")), "{e:?}");
        }
        let c = command(json!({"op": "put", "id": ID, "properties": {}, "form": "merge"}), 2);
        assert!(c.action.unwrap_err().detail.contains("a put command has no \"form\""));
    }

    #[test]
    fn the_guard_is_the_key_when_given_else_the_place() {
        let guard = |doc: JsonValue, offset| command(doc, offset).action.unwrap().1.guard.unwrap();
        let keyed = json!({"op": "delete", "id": ID, "idempotency_key": "k1"});
        // Same key, resent elsewhere with another correlation id: one guard.
        let mut resent = keyed.clone();
        resent["correlation_id"] = json!("again");
        assert_eq!(guard(keyed.clone(), 1), guard(resent, 99));
        // No key: the place is the key, so a redelivery shares it.
        let plain = json!({"op": "delete", "id": ID});
        assert_eq!(guard(plain.clone(), 5), guard(plain.clone(), 5));
        assert_ne!(guard(plain.clone(), 5).key, guard(plain, 6).key);
        // Same key, another command: same key, another request (a 422).
        let other = json!({"op": "put", "id": ID, "properties": {}, "idempotency_key": "k1"});
        let (a, b) = (guard(keyed, 1), guard(other, 2));
        assert_eq!(a.key, b.key);
        assert_ne!(a.request, b.request);
    }

    #[test]
    fn malformed_commands_say_why_and_keep_what_can_be_answered() {
        let cases: Vec<(Option<&[u8]>, &str)> = vec![
            (None, "no value"),
            (Some(b"{not json"), "not JSON"),
            (Some(b"[1]"), "JSON object"),
            (Some(br#"{"op": "put", "id": "xyz", "properties": {}, "correlation_id": "c"}"#), "\"id\""),
            (Some(br#"{"op": "upsert", "id": "000102030405060708090a0b0c0d0e0f"}"#), "unknown op"),
            (Some(br#"{"op": "put", "id": "000102030405060708090a0b0c0d0e0f"}"#), "needs \"properties\""),
            (Some(br#"{"op": "delete", "id": "000102030405060708090a0b0c0d0e0f", "properties": {}}"#), "no \"properties\""),
            (Some(br#"{"op": "put", "id": "000102030405060708090a0b0c0d0e0f", "properties": {}, "extra": 1}"#), "unknown field"),
            (Some(br#"{"op": "patch", "id": "000102030405060708090a0b0c0d0e0f", "patch": {"$inc": {"n": 1}, "a": 2}}"#), "mixes"),
            (Some(br#"{"op": "patch", "id": "000102030405060708090a0b0c0d0e0f", "patch": {"$frob": {}}}"#), "$frob"),
            (Some(br#"{"op": "patch", "id": "000102030405060708090a0b0c0d0e0f", "patch": [1]}"#), "JSON object"),
            (Some(br#"{"op": "delete", "id": "000102030405060708090a0b0c0d0e0f", "if_match": -1}"#), "if_match"),
            (Some(br#"{"op": "delete", "id": "000102030405060708090a0b0c0d0e0f", "idempotency_key": ""}"#), "Idempotency-Key"),
        ];
        for (payload, why) in cases {
            let c = parse(payload, &place(1), 1 << 20);
            let Err(p) = &c.action else { panic!("{payload:?} was accepted") };
            assert!(p.detail.contains(why), "{payload:?}: {:?} does not say {why:?}", p.detail);
            assert_eq!(p.status.as_u16(), 400);
        }
        let c = parse(Some(br#"{"op": "nope", "id": "x", "correlation_id": "c9"}"#), &place(1), 1 << 20);
        assert_eq!(c.correlation_id.as_deref(), Some("c9"), "a refused command is still answered");
    }

    #[test]
    fn a_source_header_names_its_place_and_bad_ones_name_none() {
        let p = place(41);
        assert_eq!(p.header(), "bagstore.ingest.v1/2/41");
        assert_eq!(Place::from_header(p.header().as_bytes()), Some(p));
        for bad in ["", "x/1", "/1/2", "t/x/2", "t/1/y", "t/1/2/3x"] {
            assert_eq!(Place::from_header(bad.as_bytes()), None, "{bad:?}");
        }
    }

    #[test]
    fn a_put_over_the_size_limit_is_refused() {
        let c = parse(
            Some(json!({"op": "put", "id": ID, "properties": {"s": "x".repeat(200)}}).to_string().as_bytes()),
            &place(1),
            100,
        );
        assert_eq!(c.action.unwrap_err().status.as_u16(), 413);
    }
}
