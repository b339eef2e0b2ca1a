"""The seed's scenario through a client generated from bagstore's OpenAPI
document by openapi-python-client: put the FriendFeed entity, get it, query
it by user_id. tests/tests/e2e/clients.rs generates the client, starts
bagstore and runs this with the client on PYTHONPATH and the server's URL
in BAGSTORE_URL. Exits non-zero, saying why, on any difference."""

import os
import sys
import time

from bagstore_client import Client
from bagstore_client.api.default import get_entity, put_entity, query
from bagstore_client.models import Entity, Problem, Properties, Query, QueryResponse200, QueryWhere, WriteResult

SEED_ID = "71f0c4d2291844cca2df6f486e96e37c"
SEED_USER = "f48b0440ca0c4f66991c4d5f6a078eaf"
SEED = {
    "user_id": SEED_USER,
    "feed_id": SEED_USER,
    "title": "We just launched a new backend system for FriendFeed!",
    "link": "http://friendfeed.com/e/71f0c4d2-2918-44cc-a2df-6f486e96e37c",
    "published": 1235697046,
    "updated": 1235697046,
}


def fail(why):
    print(f"generated client scenario: {why}", file=sys.stderr)
    sys.exit(1)


def main():
    client = Client(base_url=os.environ["BAGSTORE_URL"], raise_on_unexpected_status=True)

    written = put_entity.sync(SEED_ID, client=client, body=Properties.from_dict(SEED))
    if not isinstance(written, WriteResult) or written.version != 1 or written.id != SEED_ID:
        fail(f"put answered {written!r}")

    got = get_entity.sync(SEED_ID, client=client)
    if not isinstance(got, Entity):
        fail(f"get answered {got!r}")
    if got.version != 1 or got.properties.to_dict() != SEED:
        fail(f"get answered version {got.version}, properties {got.properties.to_dict()}")

    # The index follows asynchronously: ask until it has the entity.
    ask = Query(index="index_user_id", where=QueryWhere.from_dict({"user_id": SEED_USER}))
    deadline = time.monotonic() + 30
    while True:
        page = query.sync(client=client, body=ask)
        if isinstance(page, Problem):
            fail(f"query answered {page.status} {page.type_}: {page.detail}")
        if not isinstance(page, QueryResponse200):
            fail(f"query answered {page!r}")
        ids = [e.id for e in page.items]
        if ids == [SEED_ID]:
            if page.items[0].properties.to_dict() != SEED:
                fail(f"the query's item differs: {page.items[0].properties.to_dict()}")
            break
        if ids or time.monotonic() > deadline:
            fail(f"query by user_id found {ids}, not [{SEED_ID}]")
        time.sleep(0.1)

    # A problem comes back typed too.
    missing = get_entity.sync("00000000000000000000000000000001", client=client)
    if not isinstance(missing, Problem) or missing.status != 404:
        fail(f"a missing entity answered {missing!r}")
    print("generated client scenario: put, get, query and a 404 as documented")


if __name__ == "__main__":
    main()
