"""A producer of bagstore Kafka ingest commands, written with PyPI
kafka-python (a Kafka client that shares no code with librdkafka), and the
reader of what came back.

    ingest_producer.py produce BOOTSTRAP TOPIC COUNT ENTITIES SEED OUT [API_VERSION]
    ingest_producer.py collect BOOTSTRAP REPLY_TOPIC DLQ_TOPIC PLAN OUT [API_VERSION]

produce sends COUNT commands (keyed by entity id, so one entity's commands
keep their order) over ENTITIES entities, in bursts, and writes the plan to
OUT: every message sent, what it is ("valid", "duplicate": a valid keyed
command sent again under the same idempotency_key with a new
correlation_id, "refused": a put whose if_match cannot hold, "malformed"),
the answer each one expects, and each entity's expected final version and
properties, computed by applying the valid commands in order (a
duplicate, a refused or a malformed one changes nothing).

collect reads the reply and dead-letter topics from the beginning until
every expected correlation id is answered and every refused or malformed
command is dead-lettered (or 120 s pass), and writes to OUT the answers per
correlation id and the dead-letter records.

API_VERSION (for example 1.0.0) pins the protocol version: librdkafka's
mock cluster answers kafka-python's version probe in a way it cannot use.
Run by tests/tests/chaos_tansu.rs."""

import json
import random
import sys
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition


def options(argv, at):
    if len(argv) > at:
        return {"api_version": tuple(int(x) for x in argv[at].split("."))}
    return {}


def plan_commands(count, entities, seed):
    """The commands to send, and the state they should leave."""
    rng = random.Random(seed)
    ids = [f"{0xABC0000 + i:032x}" for i in range(entities)]
    state = {i: (0, None) for i in ids}  # id -> (version, properties or None)
    sent = []
    keyed = []  # valid commands with an idempotency key, for duplicates
    for n in range(count):
        cid = f"c{n}"
        roll = rng.random()
        if roll < 0.05 and keyed:
            first = rng.choice(keyed)
            command = dict(first["command"], correlation_id=cid)
            sent.append({"kind": "duplicate", "key": first["key"], "payload": json.dumps(command),
                         "cid": cid, "expect": first["expect"]})
            continue
        entity = rng.choice(ids)
        if roll < 0.10:
            shape = rng.randrange(6)
            if shape == 0:
                payload, cid = '{"op": "put", "id": ', None  # not JSON
            elif shape == 1:
                payload = json.dumps({"op": "put", "id": "not-an-id", "properties": {}, "correlation_id": cid})
            elif shape == 2:
                payload = json.dumps({"op": "replace", "id": entity, "correlation_id": cid})
            elif shape == 3:
                payload = json.dumps({"op": "put", "id": entity, "correlation_id": cid})
            elif shape == 4:
                payload = json.dumps({"op": "patch", "id": entity, "patch": {"$inc": {"n": 1}, "x": 1},
                                      "correlation_id": cid})
            else:
                payload, cid = json.dumps(["a", "list"]), None
            sent.append({"kind": "malformed", "key": entity, "payload": payload, "cid": cid,
                         "expect": {"ok": False}})
            continue
        if roll < 0.15:
            command = {"op": "put", "id": entity, "properties": {"never": True}, "if_match": 999999,
                       "correlation_id": cid}
            sent.append({"kind": "refused", "key": entity, "payload": json.dumps(command), "cid": cid,
                         "expect": {"ok": False}})
            continue
        version, props = state[entity]
        if rng.random() < 0.5:
            command = {"op": "put", "id": entity, "properties": {"n": n, "who": "kafka-python"}}
            props = {"n": n, "who": "kafka-python"}
        else:
            command = {"op": "patch", "id": entity, "patch": {"$inc": {"count": 1}}, "upsert": True}
            props = dict(props or {})
            props["count"] = props.get("count", 0) + 1
        if rng.random() < 0.5:
            command["idempotency_key"] = f"k{n}"
        version += 1
        state[entity] = (version, props)
        expect = {"ok": True, "id": entity, "version": version}
        entry = {"kind": "valid", "key": entity, "command": command, "cid": cid, "expect": expect,
                 "payload": json.dumps(dict(command, correlation_id=cid))}
        sent.append(entry)
        if "idempotency_key" in command:
            keyed.append(entry)
    final = {i: {"version": v, "properties": p} for i, (v, p) in state.items()}
    return sent, final


def produce(argv):
    bootstrap, topic, count, entities, seed, out_path = argv[2:8]
    sent, final = plan_commands(int(count), int(entities), int(seed))
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=False,
        retries=5,
        # One request in flight: a retried batch cannot overtake the next.
        max_in_flight_requests_per_connection=1,
        **options(argv, 8),
    )
    started = time.monotonic()
    for n, m in enumerate(sent):
        producer.send(topic, key=m["key"].encode(), value=m["payload"].encode())
        if n % 500 == 499:
            producer.flush()
            # Bursts, so the run spans the writer's kill and restart.
            time.sleep(0.4)
    producer.flush()
    producer.close()
    kinds = {}
    for m in sent:
        kinds[m["kind"]] = kinds.get(m["kind"], 0) + 1
    json.dump({"sent": sent, "final": final}, open(out_path, "w"))
    print(f"ingest producer: {len(sent)} commands {kinds} in {time.monotonic() - started:.1f} s")


def read_all(consumer, topic):
    partitions = sorted(consumer.partitions_for_topic(topic) or [])
    return [TopicPartition(topic, p) for p in partitions]


def collect(argv):
    bootstrap, reply_topic, dlq_topic, plan_path, out_path = argv[2:7]
    plan = json.load(open(plan_path))
    want_replies = {m["cid"] for m in plan["sent"] if m["cid"] is not None}
    want_dead = sum(1 for m in plan["sent"] if m["kind"] in ("malformed", "refused"))
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, **options(argv, 7))
    deadline = time.monotonic() + 120
    tps = []
    while not tps:
        tps = read_all(consumer, reply_topic) + read_all(consumer, dlq_topic)
        if time.monotonic() > deadline:
            print("ingest collector: the reply and dead-letter topics have no partitions", file=sys.stderr)
            sys.exit(1)
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    replies, dead = {}, []
    while time.monotonic() < deadline:
        for tp, batch in consumer.poll(timeout_ms=500).items():
            for m in batch:
                value = json.loads(m.value)
                if tp.topic == reply_topic:
                    if m.key.decode() != value["correlation_id"]:
                        print(f"ingest collector: reply keyed {m.key!r} for {value['correlation_id']}", file=sys.stderr)
                        sys.exit(1)
                    replies.setdefault(value["correlation_id"], []).append(value)
                else:
                    dead.append(value)
        if want_replies <= replies.keys() and len(dead) >= want_dead:
            break
    json.dump({"replies": replies, "dead": dead}, open(out_path, "w"))
    print(f"ingest collector: {len(replies)} of {len(want_replies)} correlation ids answered "
          f"({sum(len(v) for v in replies.values())} replies), {len(dead)} dead letters of {want_dead}")


if __name__ == "__main__":
    {"produce": produce, "collect": collect}[sys.argv[1]](sys.argv)
