//! Running a plan: index scan → fetch → re-filter, until the limit is met
//! or the index range is exhausted, so stale rows never shorten a page.
//!
//! The scan of a shard's index table joins that shard's `entities` on the
//! clustered key (each index row says where its entity's row is, checked
//! against the id), so the entities stored next to their index rows come in
//! the same statement; only those on other shards are fetched, by the same
//! location. With two shards a "latest 20" query is two statements, not
//! three, and each entity costs one B-tree descent, not two. A row whose
//! location is unknown or wrong costs a fetch by id instead.
//!
//! Each equality prefix is scanned in index order on its one shard (when
//! the prefix fixes `shard_on`) or on every shard in parallel, merged k-way
//! by (remaining columns, entity id). A candidate row is kept only if the
//! entity, as stored now, matches every condition *and* this row's key is
//! the entity's first matching key in scan order: stale rows and the extra
//! rows of multi-valued properties are skipped, so an entity appears once
//! across all pages. The page token is the position of the last entity
//! returned.
//!
//! Every statement goes where the attempt's [`Route`] says (a shard's
//! primary or one of its replicas, see [`crate::routing`]); a statement a
//! replica cannot answer runs on the primary, and entities a write token
//! names are brought up to it (see [`crate::consistency`]).

use schemas::clock::now_micros;
use schemas::index::{IndexKey, KeyValue};
use schemas::query::{cmp_keys, PageToken, Plan, Query};
use schemas::{codec, expiry};
use schemas::{Bag, EntityId};
use std::collections::{HashMap, HashSet, VecDeque};
use storage::entities::{self, EntityRecord};
use storage::index_scan::{self, IndexScan, Local, ScannedRow};
use storage::shards::Routing;
use storage::{topology, StaleMapRetry};

use crate::consistency::Tokens;
use crate::routing::{check_epoch, Fallback, Route, Target};
use crate::{ReadError, Reader};

/// A live entity, decoded.
#[derive(Debug, Clone)]
pub struct Entity {
    pub id: EntityId,
    pub version: u64,
    pub updated_us: i64,
    pub properties: Bag,
}

/// What a query returned and what it cost.
#[derive(Debug, Default)]
pub struct Outcome {
    pub items: Vec<Entity>,
    pub next_page_token: Option<String>,
    pub shards_touched: usize,
    pub index_rows: u64,
    pub dropped: u64,
}

/// A live entity's record, decoded (`None` for a tombstone, and for an
/// entity expired by now under `expiry`, the `expiry.property` setting:
/// decoded after the read began, so a read that begins at or after the
/// expiry instant never returns it).
fn decode(shard: usize, s: EntityRecord, expiry: Option<&str>) -> Result<Option<Entity>, ReadError> {
    let Some(body) = s.body else { return Ok(None) };
    let properties =
        codec::decode_body(&body).map_err(|source| ReadError::Corrupt { id: s.id, shard, source })?;
    if expiry::bag_is_expired(&properties, expiry, now_micros()) {
        return Ok(None);
    }
    Ok(Some(Entity { id: s.id, version: s.version, updated_us: s.updated_us, properties }))
}

/// One attempt of a query: the map it routes with, the servers it reads,
/// what it has found.
struct Attempt<'a> {
    plan: &'a Plan,
    q: &'a Query,
    map: &'a Routing,
    route: &'a Route<'a>,
    tokens: &'a Tokens,
    out: Outcome,
    /// Entities already on the page (one appears once, at its first key).
    seen: HashSet<EntityId>,
    /// Physical shards read.
    touched: HashSet<usize>,
}

/// Two keys in the order the plan scans.
fn in_order(plan: &Plan, a: &IndexKey, b: &IndexKey) -> std::cmp::Ordering {
    let o = cmp_keys(a, b);
    if plan.descending {
        o.reverse()
    } else {
        o
    }
}

/// Up to `want` rows of the streams merged in scan order (each with the
/// shard whose index table it came from), while every stream that is not
/// done has a head (so order holds).
fn merge(plan: &Plan, streams: &mut [Stream], want: usize) -> Vec<(ScannedRow, usize)> {
    let mut candidates: Vec<(ScannedRow, usize)> = Vec::new();
    while candidates.len() < want && !streams.iter().any(|s| s.buf.is_empty() && !s.done) {
        let best = streams
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.buf.front().map(|h| (i, h)))
            .min_by(|(_, a), (_, b)| {
                in_order(plan, &a.key, &b.key).then_with(|| {
                    if plan.descending {
                        b.entity.cmp(&a.entity)
                    } else {
                        a.entity.cmp(&b.entity)
                    }
                })
            })
            .map(|(i, _)| i);
        match best {
            Some(i) => candidates.push((streams[i].buf.pop_front().expect("has a head"), streams[i].shard)),
            None => break,
        }
    }
    candidates
}

/// One shard's stream of rows for one prefix.
#[derive(Debug)]
struct Stream {
    shard: usize,
    buf: VecDeque<ScannedRow>,
    after: Option<(Vec<KeyValue>, EntityId)>,
    done: bool,
}

impl Reader {
    /// `expiry.property`: entities expired under it are not returned.
    fn expiry(&self) -> Option<&str> {
        self.settings().expiry.property.as_deref()
    }

    /// The live entity `id`, never older than `tokens` say.
    pub async fn get(&self, id: &EntityId, tokens: &Tokens) -> Result<Option<Entity>, ReadError> {
        self.fresh(|| async {
            let (map, route) = (self.shards().routing(), self.route());
            Ok(self.fetch_on(&route, &map, map.of_id(id), &[(*id, None)], tokens).await?.pop())
        })
        .await
    }

    /// Runs a read again after it found its map stale (a shard's epoch moved:
    /// a move's cutover completed since the map was loaded), with the map
    /// reloaded, for as long as a query may take.
    pub(crate) async fn fresh<T, F, Fut>(&self, read: F) -> Result<T, ReadError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, ReadError>>,
    {
        let budget = std::time::Duration::from_millis(self.settings().reader.query_timeout_ms);
        let mut stale = StaleMapRetry::new(budget);
        loop {
            match read().await {
                Err(ReadError::Store(e)) if e.is_stale_map() && stale.again(self.shards()).await => {
                    self.inner.metrics.stale_map_retries.inc();
                }
                other => return other,
            }
        }
    }

    /// Live entities among `ids`, in the order asked, absent ones and
    /// repeats left out. Shards in parallel, each id fetched once.
    /// Never older than `tokens` say.
    pub async fn get_many(&self, ids: &[EntityId], tokens: &Tokens) -> Result<Vec<Entity>, ReadError> {
        let found = self
            .fresh(|| async {
                let (map, route) = (self.shards().routing(), self.route());
                self.fetch_located(&map, &route, ids.iter().map(|id| (*id, None)), tokens).await
            })
            .await?;
        let mut found: HashMap<EntityId, Entity> = found.into_iter().map(|e| (e.id, e)).collect();
        Ok(ids.iter().filter_map(|id| found.remove(id)).collect())
    }

    /// Live entities among `ids` (each with where its row is, if known), in
    /// no particular order; shards in parallel, each id fetched once.
    async fn fetch_located(
        &self,
        map: &Routing,
        route: &Route<'_>,
        ids: impl Iterator<Item = (EntityId, Option<u64>)>,
        tokens: &Tokens,
    ) -> Result<Vec<Entity>, ReadError> {
        let mut per_shard: Vec<Vec<(EntityId, Option<u64>)>> = vec![Vec::new(); map.slots_len()];
        let mut asked = HashSet::new();
        for (id, at) in ids.filter(|(id, _)| asked.insert(*id)) {
            per_shard[map.of_id(&id)].push((id, at));
        }
        let mut out = Vec::new();
        let per_shard = &per_shard;
        for (_, found) in self
            .shards()
            .each_with(per_shard, |shard, _, ids| self.fetch_on(route, map, shard, ids, tokens))
            .await
        {
            out.extend(found?);
        }
        Ok(out)
    }

    /// Live entities among `ids` (all on `shard`, no repeats), in no
    /// particular order, read where `route` says (a replica that cannot
    /// answer, or answers behind the map, gives way to the primary), none
    /// older than `tokens` say.
    async fn fetch_on(
        &self,
        route: &Route<'_>,
        map: &Routing,
        shard: usize,
        ids: &[(EntityId, Option<u64>)],
        tokens: &Tokens,
    ) -> Result<Vec<Entity>, ReadError> {
        let (target, mut records) = loop {
            let target = route.target(shard);
            match self.records_on(&target, map, shard, ids, tokens).await {
                Err(e) if target.is_replica() && Fallback::after(&e).is_some() => {
                    route.demote(shard, Fallback::after(&e).expect("checked"));
                }
                r => break (target, r?),
            }
        };
        if target.is_replica() && !tokens.is_empty() {
            let asked: Vec<EntityId> = ids.iter().map(|(id, _)| *id).collect();
            self.catch_up(route, &target, map, (shard, &asked), &mut records, tokens).await?;
        }
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            out.extend(decode(shard, r, self.expiry())?);
        }
        Ok(out)
    }

    /// The rows of `ids` on `target` of `shard` (tombstones among them,
    /// when a token names an id): one statement for those whose location
    /// is given or remembered, one by id for the others and for any whose
    /// location turned out not to hold them (see [`crate::locations`]).
    async fn records_on(
        &self,
        target: &Target,
        map: &Routing,
        shard: usize,
        ids: &[(EntityId, Option<u64>)],
        tokens: &Tokens,
    ) -> Result<Vec<EntityRecord>, ReadError> {
        let locations = &self.inner.locations;
        let fetches = &self.inner.metrics.fetches;
        let conns = target.conns(self, shard);
        let mut out = Vec::with_capacity(ids.len());
        let (mut by_id, mut at) = (Vec::new(), Vec::new());
        for (id, given) in ids {
            match given.or_else(|| locations.get(id)) {
                Some(added_id) => at.push((*id, added_id)),
                None => by_id.push(*id),
            }
        }
        fetches.with_label_values(&["id"]).inc_by(by_id.len() as u64);
        // Whether some statement brought the shard's epoch along (it comes
        // with any row); if none did, one more statement asks.
        let mut vouched = false;
        if !at.is_empty() {
            let added: Vec<u64> = at.iter().map(|(_, a)| *a).collect();
            let fetched = read_on!(conns, c => entities::get_entities_at(shard, c, &added));
            check_epoch(map, shard, fetched.shard_epoch, target)?;
            vouched |= fetched.shard_epoch.is_some();
            // Keyed by the id each row really holds: a row that is not the
            // asked id's leaves that id unresolved.
            let mut got: HashMap<EntityId, EntityRecord> =
                fetched.records.into_iter().map(|r| (r.id, r)).collect();
            let mut stale = 0;
            for (id, _) in &at {
                match got.remove(id) {
                    Some(record) => out.push(record),
                    None => {
                        locations.forget(id);
                        by_id.push(*id);
                        stale += 1;
                    }
                }
            }
            fetches.with_label_values(&["location"]).inc_by((at.len() - stale) as u64);
            fetches.with_label_values(&["stale"]).inc_by(stale as u64);
        }
        if !by_id.is_empty() {
            // Tombstones only matter to a token: a deleted entity at its
            // version is an answer, not a lag.
            let fetched = if tokens.is_empty() {
                read_on!(conns, c => entities::get_entities(shard, c, &by_id))
            } else {
                read_on!(conns, c => entities::read_entities_any(shard, c, &by_id))
            };
            check_epoch(map, shard, fetched.shard_epoch, target)?;
            vouched |= fetched.shard_epoch.is_some();
            locations.learn(fetched.records.iter().map(|s| (s.id, s.added_id)));
            out.extend(fetched.records);
        }
        if !vouched && !ids.is_empty() {
            let epoch = read_on!(conns, c => topology::shard_epoch(shard, c));
            check_epoch(map, shard, Some(epoch), target)?;
        }
        Ok(out)
    }

    /// Runs `plan` for `q`: from its page token, if any, to a full page or
    /// the end of the index range; once the index reflects the query's
    /// write tokens (`consistent_with`), waiting for that until `deadline`
    /// (then [`ReadError::IndexBehind`]), and scanning until it too (then
    /// [`ReadError::Timeout`]).
    pub async fn run(
        &self,
        plan: &Plan,
        q: &Query,
        deadline: tokio::time::Instant,
    ) -> Result<Outcome, ReadError> {
        let start = match &q.page_token {
            Some(text) => {
                let t = PageToken::decode(text, plan, q).map_err(schemas::query::QueryError::from)?;
                Some((t.key, t.id))
            }
            None => None,
        };
        let tokens = Tokens::new(&q.consistent_with);
        let ms = u128::from(self.settings().reader.query_timeout_ms);
        self.fresh(|| async {
            // One map for the whole attempt: where to read, which rows each
            // shard answers for and the epochs that vouch for it must
            // agree; and one route, so the servers a token was checked on
            // are the ones read.
            // A unique index's rows are written before its writes are
            // acknowledged, on the primaries: read there, it reflects
            // every acknowledged write without waiting for a token.
            let map = self.shards().routing();
            let route = if plan.spec.unique { Route::primaries(self) } else { self.route() };
            if !tokens.is_empty() && !plan.spec.unique {
                self.wait_applied(&route, &map, &plan.spec, &q.consistent_with, deadline).await?;
            }
            let scan = self.scan(&map, &route, &tokens, (plan, q), start.clone());
            tokio::time::timeout_at(deadline, scan).await.map_err(|_| ReadError::Timeout { ms })?
        })
        .await
    }

    async fn scan(
        &self,
        map: &Routing,
        route: &Route<'_>,
        tokens: &Tokens,
        (plan, q): (&Plan, &Query),
        start: Option<(IndexKey, EntityId)>,
    ) -> Result<Outcome, ReadError> {
        let table = plan.spec.table.as_str();
        let mut a = Attempt {
            plan,
            q,
            map,
            route,
            tokens,
            out: Outcome::default(),
            seen: HashSet::new(),
            touched: HashSet::new(),
        };
        let k = plan.prefix_len;
        for prefix in &plan.prefixes {
            // Where the previous page stopped decides where this prefix starts.
            let after = match &start {
                Some((key, id)) => match in_order(plan, prefix, &key[..k].to_vec()) {
                    std::cmp::Ordering::Less => continue,
                    std::cmp::Ordering::Equal => Some((key[k..].to_vec(), *id)),
                    std::cmp::Ordering::Greater => None,
                },
                None => None,
            };
            if self.scan_prefix(&mut a, prefix, after).await? {
                break;
            }
        }
        a.out.shards_touched = a.touched.len();
        self.count(table, &a.out);
        Ok(a.out)
    }

    /// Scans one equality prefix from `after` until the page is full (then
    /// `true`, with its page token) or the prefix's rows end.
    async fn scan_prefix(
        &self,
        a: &mut Attempt<'_>,
        prefix: &IndexKey,
        after: Option<(Vec<KeyValue>, EntityId)>,
    ) -> Result<bool, ReadError> {
        let (plan, map) = (a.plan, a.map);
        let shards: Vec<usize> = if plan.shard_fixed {
            let pos = plan.spec.shard_on_position();
            vec![map.of_logical(schemas::logical_of(&prefix[pos].canonical_bytes(), map.logical_shards()))]
        } else {
            map.live.clone()
        };
        a.touched.extend(shards.iter().copied());
        let mut streams: Vec<Stream> = shards
            .iter()
            .map(|&shard| Stream { shard, buf: VecDeque::new(), after: after.clone(), done: false })
            .collect();
        loop {
            // A little more than the page still needs, for rows the
            // re-filter drops; each local row brings its entity along.
            let need = a.q.limit - a.out.items.len();
            let want = (need + need / 8 + 2).min(1000);
            let refills = streams
                .iter_mut()
                .filter(|s| s.buf.is_empty() && !s.done)
                .map(|s| self.refill(plan, (map, a.route), prefix, s, want));
            for r in futures::future::join_all(refills).await {
                r?;
            }
            for s in &streams {
                let table = plan.spec.table.as_str();
                self.inner.metrics.shard_reads.with_label_values(&[table, &s.shard.to_string()]).inc();
            }
            let candidates = merge(plan, &mut streams, want);
            if candidates.is_empty() && streams.iter().all(|s| s.done && s.buf.is_empty()) {
                return Ok(false);
            }
            a.out.index_rows += candidates.len() as u64;
            if self.keep_matching(a, candidates).await? {
                return Ok(true);
            }
        }
    }

    /// Reads up to `want` more rows of `prefix` into a stream whose buffer
    /// ran dry, where the route says (the primary, if a replica cannot).
    async fn refill(
        &self,
        plan: &Plan,
        (map, route): (&Routing, &Route<'_>),
        prefix: &IndexKey,
        s: &mut Stream,
        want: usize,
    ) -> Result<(), ReadError> {
        let scan = IndexScan {
            prefix,
            range: plan.range.as_ref(),
            after: s.after.as_ref().map(|(rest, id)| (&rest[..], *id)),
            descending: plan.descending,
            limit: want,
            with_entities: true,
        };
        let rows = loop {
            let target = route.target(s.shard);
            match self.scan_on(&target, map, plan, s.shard, &scan).await {
                Err(e) if target.is_replica() && Fallback::after(&e).is_some() => {
                    route.demote(s.shard, Fallback::after(&e).expect("checked"));
                }
                r => break r?,
            }
        };
        s.done = rows.len() < want;
        if let Some(last) = rows.last() {
            s.after = Some((last.key[plan.prefix_len..].to_vec(), last.entity));
        }
        // Rows of logical shards this shard does not own are
        // a moved-away copy not yet removed: never answers.
        let shard = s.shard;
        s.buf.extend(rows.into_iter().filter(|r| map.of_logical(r.logical) == shard));
        Ok(())
    }

    /// One page of `scan` on `target` of `shard`, its epoch checked.
    async fn scan_on(
        &self,
        target: &Target,
        map: &Routing,
        plan: &Plan,
        shard: usize,
        scan: &IndexScan<'_>,
    ) -> Result<Vec<ScannedRow>, ReadError> {
        let conns = target.conns(self, shard);
        let rows = read_on!(conns, c => index_scan::scan_index(shard, c, &plan.spec, scan));
        // The shard's epoch came with the rows; with no row, one more
        // statement asks (a stale map must not read as "nothing here").
        let epoch = match rows.first() {
            Some(r) => r.shard_epoch,
            None => read_on!(conns, c => topology::shard_epoch(shard, c)),
        };
        check_epoch(map, shard, Some(epoch), target)?;
        Ok(rows)
    }

    /// Keeps the candidates whose entities, as stored now, match and are
    /// not yet on the page, in order, until the page is full (then `true`,
    /// with its page token).
    async fn keep_matching(
        &self,
        a: &mut Attempt<'_>,
        candidates: Vec<(ScannedRow, usize)>,
    ) -> Result<bool, ReadError> {
        let (plan, q) = (a.plan, a.q);
        // Entities on the index row's own shard came with the scan;
        // the others (and any the join missed) are fetched, one
        // statement per shard, only as many at a time as the page
        // still needs: fetching and decoding is what costs.
        let mut candidates = candidates.into_iter().peekable();
        while candidates.peek().is_some() {
            let need = q.limit - a.out.items.len();
            let chunk: Vec<(ScannedRow, usize)> = candidates.by_ref().take(need).collect();
            let (rows, mut found) = self.entities_of(a, chunk).await?;
            for (key, id) in rows {
                let keep = found.get(&id).is_some_and(|e| {
                    !a.seen.contains(&id)
                        && plan.admits(q, &e.properties)
                        && plan.canonical_key(&e.properties).is_some_and(|c| c == key)
                });
                if !keep {
                    a.out.dropped += 1;
                    continue;
                }
                a.seen.insert(id);
                a.out.items.push(found.remove(&id).expect("kept entities were found"));
                if a.out.items.len() == q.limit {
                    a.out.next_page_token = Some(PageToken { key, id }.encode(plan, q));
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// The candidates' `(key, entity id)`s in order, and their live
    /// entities: those that came with the scan from their own shard, and
    /// the others fetched.
    async fn entities_of(
        &self,
        a: &Attempt<'_>,
        chunk: Vec<(ScannedRow, usize)>,
    ) -> Result<(Vec<(IndexKey, EntityId)>, HashMap<EntityId, Entity>), ReadError> {
        let map = a.map;
        let mut found = HashMap::new();
        let mut fetch = Vec::new();
        let mut rows = Vec::with_capacity(chunk.len());
        for (row, from) in chunk {
            let here = map.of_id(&row.entity) == from;
            // An entity a token names came from the server the token was
            // checked on, so it is at least that version; one that is not
            // (which would be a bug) is fetched, and brought up to it.
            let behind = |v: u64| a.tokens.floor(&row.entity).is_some_and(|floor| v < floor);
            match row.local {
                Local::Live(stored) if here && !behind(stored.version) => {
                    self.inner.locations.learn([(row.entity, stored.added_id)]);
                    if let Some(entity) = decode(from, stored, self.expiry())? {
                        found.insert(row.entity, entity);
                    }
                }
                Local::Deleted if here => {}
                _ => fetch.push((row.entity, row.entity_added_id)),
            }
            rows.push((row.key, row.entity));
        }
        let fetched = self.fetch_located(map, a.route, fetch.into_iter(), a.tokens).await?;
        found.extend(fetched.into_iter().map(|e| (e.id, e)));
        Ok((rows, found))
    }

    fn count(&self, table: &str, out: &Outcome) {
        self.inner.metrics.index_rows.with_label_values(&[table]).inc_by(out.index_rows);
        self.inner.metrics.dropped.with_label_values(&[table]).inc_by(out.dropped);
    }
}
