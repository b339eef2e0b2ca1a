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

use schemas::clock::now_micros;
use schemas::index::{IndexKey, KeyValue};
use schemas::query::{cmp_keys, PageToken, Plan, Query};
use schemas::{codec, expiry};
use schemas::{Bag, EntityId};
use std::collections::{HashMap, HashSet, VecDeque};
use storage::entities::{self, EntityRecord};
use storage::index_scan::{self, IndexScan, Local, ScannedRow};
use storage::shards::Routing;
use storage::{topology, StaleMapRetry, StoreError};

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

/// Runs one read (`$conn` names the connection inside `$read`) on one of
/// `$conns`' ping-free connections; once more, on a new connection, if the
/// reused one turned out dead (see `storage::conns`). A macro rather than a
/// function taking an async closure: such closures, borrowing as these do,
/// cost the HTTP handlers' futures their `Send`.
macro_rules! read_on {
    ($conns:expr, $conn:ident => $read:expr) => {{
        let conns = $conns;
        let mut taken = conns.take().await?;
        loop {
            let $conn = &mut taken.conn;
            let r = $read.await;
            match conns.settle(taken, &r).await? {
                Some(again) => taken = again,
                None => break r?,
            }
        }
    }};
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

/// One attempt of a query: the map it routes with, what it has found.
struct Attempt<'a> {
    plan: &'a Plan,
    q: &'a Query,
    map: &'a Routing,
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

    pub async fn get(&self, id: &EntityId) -> Result<Option<Entity>, ReadError> {
        self.fresh(|| async {
            let map = self.shards().routing();
            Ok(self.fetch_on(&map, map.of_id(id), &[(*id, None)]).await?.pop())
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

    /// Whether `shard`'s epoch, as a read saw it, is the one `map` (the
    /// map the read was routed with) gives it; a mismatch is
    /// [`StoreError::StaleMap`]. Never the current map: one reloaded since
    /// the read was routed would vouch for a shard the read should not
    /// have asked (a moved-away copy, or nothing once it was removed).
    fn check_epoch(map: &Routing, shard: usize, seen: Option<u64>) -> Result<(), ReadError> {
        match seen {
            Some(e) if e != map.epoch_of(shard) => Err(StoreError::StaleMap { shard }.into()),
            _ => Ok(()),
        }
    }

    /// Live entities among `ids`, in the order asked, absent ones and
    /// repeats left out. Shards in parallel, each id fetched once.
    pub async fn get_many(&self, ids: &[EntityId]) -> Result<Vec<Entity>, ReadError> {
        let found = self
            .fresh(|| async {
                let map = self.shards().routing();
                self.fetch_located(&map, ids.iter().map(|id| (*id, None))).await
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
        ids: impl Iterator<Item = (EntityId, Option<u64>)>,
    ) -> Result<Vec<Entity>, ReadError> {
        let mut per_shard: Vec<Vec<(EntityId, Option<u64>)>> = vec![Vec::new(); map.slots_len()];
        let mut asked = HashSet::new();
        for (id, at) in ids.filter(|(id, _)| asked.insert(*id)) {
            per_shard[map.of_id(&id)].push((id, at));
        }
        let mut out = Vec::new();
        let per_shard = &per_shard;
        for (_, found) in
            self.shards().each_with(per_shard, |shard, _, ids| self.fetch_on(map, shard, ids)).await
        {
            out.extend(found?);
        }
        Ok(out)
    }

    /// Live entities among `ids` (all on `shard`, no repeats), in no
    /// particular order: one statement for those whose location is given
    /// or remembered, one by id for the others and for any whose location
    /// turned out not to hold them (see [`crate::locations`]).
    async fn fetch_on(
        &self,
        map: &Routing,
        shard: usize,
        ids: &[(EntityId, Option<u64>)],
    ) -> Result<Vec<Entity>, ReadError> {
        let locations = &self.inner.locations;
        let fetches = &self.inner.metrics.fetches;
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
            let fetched =
                read_on!(self.shards().conns(shard), c => entities::get_entities_at(shard, c, &added));
            Self::check_epoch(map, shard, fetched.shard_epoch)?;
            vouched |= fetched.shard_epoch.is_some();
            let rows = fetched.records;
            // Keyed by the id each row really holds: a row that is not the
            // asked id's leaves that id unresolved.
            let mut got: HashMap<EntityId, EntityRecord> = rows.into_iter().map(|r| (r.id, r)).collect();
            let mut stale = 0;
            for (id, _) in &at {
                match got.remove(id) {
                    // A tombstone decodes to nothing: deleted.
                    Some(record) => out.extend(decode(shard, record, self.expiry())?),
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
            let fetched = read_on!(self.shards().conns(shard), c => entities::get_entities(shard, c, &by_id));
            Self::check_epoch(map, shard, fetched.shard_epoch)?;
            vouched |= fetched.shard_epoch.is_some();
            locations.learn(fetched.records.iter().map(|s| (s.id, s.added_id)));
            for s in fetched.records {
                out.extend(decode(shard, s, self.expiry())?);
            }
        }
        if !vouched && !ids.is_empty() {
            let epoch = read_on!(self.shards().conns(shard), c => topology::shard_epoch(shard, c));
            Self::check_epoch(map, shard, Some(epoch))?;
        }
        Ok(out)
    }

    /// Runs `plan` for `q`: from its page token, if any, to a full page or
    /// the end of the index range.
    pub async fn run(&self, plan: &Plan, q: &Query) -> Result<Outcome, ReadError> {
        let start = match &q.page_token {
            Some(text) => {
                let t = PageToken::decode(text, plan, q).map_err(schemas::query::QueryError::from)?;
                Some((t.key, t.id))
            }
            None => None,
        };
        self.fresh(|| self.scan(plan, q, start.clone())).await
    }

    async fn scan(
        &self,
        plan: &Plan,
        q: &Query,
        start: Option<(IndexKey, EntityId)>,
    ) -> Result<Outcome, ReadError> {
        let table = plan.spec.table.as_str();
        // One map for the whole attempt: where to read, which rows each
        // shard answers for and the epochs that vouch for it must agree.
        let map = self.shards().routing();
        let mut a = Attempt {
            plan,
            q,
            map: &map,
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
                .map(|s| self.refill(plan, map, prefix, s, want));
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
    /// ran dry.
    async fn refill(
        &self,
        plan: &Plan,
        map: &Routing,
        prefix: &IndexKey,
        s: &mut Stream,
        want: usize,
    ) -> Result<(), StoreError> {
        let scan = IndexScan {
            prefix,
            range: plan.range.as_ref(),
            after: s.after.as_ref().map(|(rest, id)| (&rest[..], *id)),
            descending: plan.descending,
            limit: want,
            with_entities: true,
        };
        let rows = read_on!(
            self.shards().conns(s.shard),
            c => index_scan::scan_index(s.shard, c, &plan.spec, &scan)
        );
        // The shard's epoch came with the rows; with no row,
        // one more statement asks (a stale map must not
        // read as "nothing here").
        let epoch = match rows.first() {
            Some(r) => r.shard_epoch,
            None => {
                read_on!(self.shards().conns(s.shard), c => topology::shard_epoch(s.shard, c))
            }
        };
        if epoch != map.epoch_of(s.shard) {
            return Err(StoreError::StaleMap { shard: s.shard });
        }
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
            let (rows, mut found) = self.entities_of(a.map, chunk).await?;
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
        map: &Routing,
        chunk: Vec<(ScannedRow, usize)>,
    ) -> Result<(Vec<(IndexKey, EntityId)>, HashMap<EntityId, Entity>), ReadError> {
        let mut found = HashMap::new();
        let mut fetch = Vec::new();
        let mut rows = Vec::with_capacity(chunk.len());
        for (row, from) in chunk {
            let here = map.of_id(&row.entity) == from;
            match row.local {
                Local::Live(stored) if here => {
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
        found.extend(self.fetch_located(map, fetch.into_iter()).await?.into_iter().map(|e| (e.id, e)));
        Ok((rows, found))
    }

    fn count(&self, table: &str, out: &Outcome) {
        self.inner.metrics.index_rows.with_label_values(&[table]).inc_by(out.index_rows);
        self.inner.metrics.dropped.with_label_values(&[table]).inc_by(out.dropped);
    }
}
