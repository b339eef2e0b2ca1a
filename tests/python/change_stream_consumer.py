"""A downstream consumer of bagstore's public change stream, written with
PyPI kafka-python (a Kafka client that shares no code with librdkafka).

Reads group GROUP's view of TOPIC: from the group's committed offsets to
the end of every partition, checking each message against the JSON Schema
(PyPI jsonschema), its key and headers against its value, and keeps a
message only when its version is above the last one kept for its id (the
dedupe rule of docs/api.md, "Change stream (for downstream consumers)").
Writes to OUT, as JSON, the live entities it ends with ("live": {id:
{"version", "properties"}}), the offsets it started from ("from":
{partition: offset}) and the messages per op ("ops").

    change_stream_consumer.py BOOTSTRAP TOPIC GROUP SCHEMA OUT [API_VERSION]

API_VERSION (for example 1.0.0) pins the protocol version: librdkafka's
mock cluster answers kafka-python's version probe in a way it cannot use.
Run by tests/tests/e2e/changes.rs and tests/tests/chaos_tansu.rs."""

import json
import sys
import time

import jsonschema
from kafka import KafkaConsumer, TopicPartition


def fail(why):
    print(f"change stream consumer: {why}", file=sys.stderr)
    sys.exit(1)


def main():
    bootstrap, topic, group, schema_path, out_path = sys.argv[1:6]
    options = {}
    if len(sys.argv) > 6:
        options["api_version"] = tuple(int(x) for x in sys.argv[6].split("."))
    validator = jsonschema.Draft202012Validator(json.load(open(schema_path)))
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False, **options
    )
    partitions = sorted(consumer.partitions_for_topic(topic) or [])
    if not partitions:
        fail(f"topic {topic} has no partitions")
    tps = [TopicPartition(topic, p) for p in partitions]
    consumer.assign(tps)
    start = {}
    for tp in tps:
        committed = consumer.committed(tp)
        if committed is None:
            fail(f"group {group} has no committed offset on {tp}")
        consumer.seek(tp, committed)
        start[tp.partition] = committed
    end = consumer.end_offsets(tps)
    print(f"change stream consumer: group {group} from offsets {start} to {({tp.partition: o for tp, o in end.items()})}")

    state = {}
    messages = 0
    ops = {}
    deadline = time.monotonic() + 120
    while any(consumer.position(tp) < end[tp] for tp in tps):
        if time.monotonic() > deadline:
            fail("the stream did not reach its end offsets in 120 s")
        for tp, batch in consumer.poll(timeout_ms=1000).items():
            for m in batch:
                if m.offset >= end[tp]:
                    continue
                messages += 1
                value = json.loads(m.value)
                errors = sorted(validator.iter_errors(value), key=str)
                if errors:
                    fail(f"{tp} offset {m.offset} does not match the schema: {errors[0].message}")
                source = value["source"]
                if m.key.decode() != source["id"]:
                    fail(f"{tp} offset {m.offset}: key {m.key!r} but source.id {source['id']}")
                headers = {k: v.decode() for k, v in (m.headers or [])}
                if headers.get("bagstore-version") != str(source["version"]) or headers.get("bagstore-op") != value["op"]:
                    fail(f"{tp} offset {m.offset}: headers {headers} disagree with the value")
                ops[value["op"]] = ops.get(value["op"], 0) + 1
                last = state.get(source["id"])
                if last is not None and last[0] >= source["version"]:
                    continue
                state[source["id"]] = (source["version"], value["after"])
    live = {i: {"version": v, "properties": after} for i, (v, after) in state.items() if after is not None}
    json.dump({"live": live, "from": start, "ops": ops}, open(out_path, "w"))
    print(f"change stream consumer: {messages} messages {ops}, {len(live)} live entities")


if __name__ == "__main__":
    main()
