//! Property tests: the filter evaluator and the index value order.
//!
//! The reader merges shards in Rust using `KeyValue` order, and re-filters
//! with `Condition`; both must agree with the plain value semantics for
//! every input, including negative numbers and unicode strings.

use proptest::prelude::*;
use schemas::filter::Condition;
use schemas::index::{IndexProperty, KeyValue, PropType};
use schemas::value::generic_cmp;
use schemas::Value;

fn prop(ty: PropType) -> IndexProperty {
    IndexProperty { name: "p".into(), ty, max_len: Some(64) }
}

fn short_string() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![Just('a'), Just('Z'), Just('é'), Just('日'), Just('🎉'), Just(' '), any::<char>()],
        0..8,
    )
    .prop_map(|cs| cs.into_iter().collect())
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::Int),
        (-1e12f64..1e12).prop_map(Value::Float),
        short_string().prop_map(Value::String),
        any::<bool>().prop_map(Value::Bool),
    ]
}

proptest! {
    #[test]
    fn typed_order_equals_value_order_for_ints(a in any::<i64>(), b in any::<i64>()) {
        let p = prop(PropType::Int);
        let (ka, kb) = (p.typed(&Value::Int(a)).unwrap(), p.typed(&Value::Int(b)).unwrap());
        prop_assert_eq!(ka.partial_cmp(&kb), Some(a.cmp(&b)));
        prop_assert_eq!(generic_cmp(&Value::Int(a), &Value::Int(b)), Some(a.cmp(&b)));
    }

    #[test]
    fn typed_order_equals_value_order_for_floats(a in -1e300f64..1e300, b in -1e300f64..1e300) {
        let p = prop(PropType::Float);
        let (ka, kb) = (p.typed(&Value::Float(a)).unwrap(), p.typed(&Value::Float(b)).unwrap());
        prop_assert_eq!(ka.partial_cmp(&kb), a.partial_cmp(&b));
    }

    #[test]
    fn typed_order_equals_byte_order_for_strings(a in short_string(), b in short_string()) {
        let p = prop(PropType::String);
        let (ka, kb) = (p.typed(&Value::String(a.clone())).unwrap(), p.typed(&Value::String(b.clone())).unwrap());
        prop_assert_eq!(ka.partial_cmp(&kb), Some(a.as_bytes().cmp(b.as_bytes())));
        prop_assert_eq!(generic_cmp(&Value::String(a.clone()), &Value::String(b.clone())), Some(a.as_bytes().cmp(b.as_bytes())));
    }

    #[test]
    fn uuid_order_equals_the_order_of_their_hex_spelling(a in any::<[u8; 16]>(), b in any::<[u8; 16]>()) {
        let p = prop(PropType::Uuid);
        let hex = |x: &[u8; 16]| schemas::id::hex(x);
        let (ka, kb) = (p.typed(&Value::String(hex(&a))).unwrap(), p.typed(&Value::String(hex(&b))).unwrap());
        prop_assert_eq!(ka.partial_cmp(&kb), Some(hex(&a).cmp(&hex(&b))));
        prop_assert_eq!(ka, KeyValue::Uuid(a));
    }

    #[test]
    fn ranges_match_exactly_the_values_within(lo in any::<i64>(), hi in any::<i64>(), v in any::<i64>(),
                                               lo_inc in any::<bool>(), hi_inc in any::<bool>()) {
        let c = Condition::Range { lower: Some((Value::Int(lo), lo_inc)), upper: Some((Value::Int(hi), hi_inc)) };
        let within = (if lo_inc { v >= lo } else { v > lo }) && (if hi_inc { v <= hi } else { v < hi });
        prop_assert_eq!(c.matches(Some(&Value::Int(v))), within);
        prop_assert_eq!(c.matches_typed(&prop(PropType::Int), Some(&Value::Int(v))), within);
        // An array matches when one element is within.
        let arr = Value::Array(vec![Value::Int(lo.wrapping_sub(1)), Value::Int(v)]);
        prop_assert!(!within || c.matches(Some(&arr)));
    }

    #[test]
    fn string_ranges_agree_typed_and_untyped(lo in short_string(), v in short_string()) {
        let c = Condition::Range { lower: Some((Value::String(lo.clone()), false)), upper: None };
        let want = v.as_bytes() > lo.as_bytes();
        prop_assert_eq!(c.matches(Some(&Value::String(v.clone()))), want);
        prop_assert_eq!(c.matches_typed(&prop(PropType::String), Some(&Value::String(v))), want);
    }

    #[test]
    fn equality_is_reflexive_and_reaches_into_arrays(v in scalar(), other in scalar()) {
        let c = Condition::Eq(v.clone());
        prop_assert!(c.matches(Some(&v)));
        prop_assert!(c.matches(Some(&Value::Array(vec![other.clone(), v.clone()]))));
        prop_assert!(Condition::In(vec![other.clone(), v.clone()]).matches(Some(&v)));
        prop_assert!(!c.matches(None));
        // Mixed kinds never compare, so they never match a range.
        if generic_cmp(&v, &other).is_none() {
            let r = Condition::Range { lower: Some((other.clone(), true)), upper: None };
            prop_assert!(!r.matches(Some(&v)));
        }
    }

    #[test]
    fn numbers_compare_across_int_and_float(i in -1_000_000i64..1_000_000, f in -1e6f64..1e6) {
        let c = Condition::Range { lower: Some((Value::Float(f), true)), upper: None };
        prop_assert_eq!(c.matches(Some(&Value::Int(i))), i as f64 >= f);
        prop_assert_eq!(Condition::Eq(Value::Float(i as f64)).matches(Some(&Value::Int(i))), true);
    }
}
