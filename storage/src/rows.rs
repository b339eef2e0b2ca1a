//! Statements over many rows: the one home of `VALUES (?, ?), (?, ?), …`
//! and `IN (?, ?, …)`.
//!
//! A [`Rows`] is a statement's text around a list: its head, one template
//! per row (joined by `, `), its tail. [`Rows::statements`] cuts the rows
//! into statements of at most [`Rows::capacity`] rows each, in order, and
//! the caller runs each in turn, so what runs, in which order and in which
//! transaction stays the caller's to say; [`Statement::bind`] binds a
//! statement's rows, each through the caller's closure.
//!
//! A statement's rows are bounded twice: by the size the caller picks (how
//! much one statement may carry or lock) and by MariaDB's limit of 65,535
//! placeholders a statement. Placeholders are counted in the text: the
//! head, template and tail hold no `?` but the placeholders (every value is
//! bound, none is written into SQL text).

/// Rows per statement unless said otherwise: rows written (entities,
/// index rows, events, idempotency records) and the lists of ids or keys
/// that go with them.
pub(crate) const PER_STATEMENT: usize = 500;

/// Rows per statement of narrow rows: lists of keys (logical shards,
/// sequence numbers, the ids a write locks) and rows of one or two
/// numbers.
pub(crate) const KEYS_PER_STATEMENT: usize = 1000;

/// The most placeholders one MariaDB (or MySQL) statement may hold.
pub(crate) const MAX_PLACEHOLDERS: usize = 65_535;

/// `?, ?, …` for `n` parameters: an `IN` list of a statement that is not
/// cut (its rows must meet in one statement: a count, an order, a limit).
pub(crate) fn marks(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// A statement over many rows: `head`, the row template once per row
/// (joined by `, `), then `tail`.
#[derive(Debug, Clone)]
pub(crate) struct Rows {
    head: String,
    row: String,
    tail: String,
    at_most: usize,
}

impl Rows {
    /// At most [`PER_STATEMENT`] rows a statement; `row` holds at least one
    /// placeholder.
    pub(crate) fn new(head: impl Into<String>, row: impl Into<String>, tail: impl Into<String>) -> Rows {
        let rows = Rows { head: head.into(), row: row.into(), tail: tail.into(), at_most: PER_STATEMENT };
        assert!(rows.row.contains('?'), "a row template binds something: {:?}", rows.row);
        rows
    }

    /// At most `n` rows a statement (the placeholder limit still holds).
    pub(crate) fn at_most(self, n: usize) -> Rows {
        Rows { at_most: n.max(1), ..self }
    }

    /// How many rows one statement carries at most: the size asked for,
    /// or fewer when the placeholders would pass MariaDB's limit.
    pub(crate) fn capacity(&self) -> usize {
        let fixed = placeholders(&self.head) + placeholders(&self.tail);
        let room = MAX_PLACEHOLDERS.checked_sub(fixed).expect("head and tail within the placeholder limit");
        self.at_most.min(room / placeholders(&self.row)).max(1)
    }

    /// The statement's text for `n` rows.
    pub(crate) fn sql(&self, n: usize) -> String {
        let mut sql = String::with_capacity(self.head.len() + n * (self.row.len() + 2) + self.tail.len());
        sql.push_str(&self.head);
        for i in 0..n {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str(&self.row);
        }
        sql.push_str(&self.tail);
        sql
    }

    /// The statements that carry `rows`, in order, each with at most
    /// [`Rows::capacity`] of them; none for no rows.
    pub(crate) fn statements<'r, T>(&'r self, rows: &'r [T]) -> impl Iterator<Item = Statement<'r, T>> + 'r {
        rows.chunks(self.capacity()).map(|chunk| self.statement(chunk))
    }

    /// One statement for `rows`, which the caller already cut to fit (the
    /// rows of another [`Rows`]'s statement, run beside it). Panics if they
    /// do not fit or there are none: a bug of the caller.
    pub(crate) fn statement<'r, T>(&self, rows: &'r [T]) -> Statement<'r, T> {
        assert!(
            !rows.is_empty() && rows.len() <= self.capacity(),
            "{} rows for a statement of at most {}",
            rows.len(),
            self.capacity()
        );
        Statement { sql: self.sql(rows.len()), rows }
    }
}

/// One statement of a [`Rows`]: its text and the rows it carries.
#[derive(Debug)]
pub(crate) struct Statement<'r, T> {
    pub(crate) sql: String,
    pub(crate) rows: &'r [T],
}

impl<'r, T> Statement<'r, T> {
    /// Binds the rows to `q` (a query on [`Statement::sql`], with the
    /// head's values already bound), each through `bind`, in order; the
    /// tail's values are the caller's to bind after.
    pub(crate) fn bind<Q>(&self, q: Q, bind: impl FnMut(Q, &'r T) -> Q) -> Q {
        self.rows.iter().fold(q, bind)
    }
}

fn placeholders(sql: &str) -> usize {
    sql.bytes().filter(|b| *b == b'?').count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqls<T>(rows: &Rows, of: &[T]) -> Vec<(String, usize)> {
        rows.statements(of).map(|s| (s.sql, s.rows.len())).collect()
    }

    #[test]
    fn a_statement_is_its_head_one_template_a_row_and_its_tail() {
        let values =
            Rows::new("INSERT INTO t (a, b) VALUES ", "(?, ?)", " ON DUPLICATE KEY UPDATE b = VALUES(b)");
        assert_eq!(
            sqls(&values, &[1, 2, 3]),
            [(
                "INSERT INTO t (a, b) VALUES (?, ?), (?, ?), (?, ?) ON DUPLICATE KEY UPDATE b = VALUES(b)"
                    .to_string(),
                3
            )]
        );
        let within = Rows::new("DELETE FROM t WHERE seq IN (", "?", ")");
        assert_eq!(sqls(&within, &[7]), [("DELETE FROM t WHERE seq IN (?)".to_string(), 1)]);
        assert_eq!(marks(3), "?, ?, ?");
        assert_eq!(marks(0), "");
    }

    #[test]
    fn rows_are_cut_at_the_size_asked_for_in_order() {
        let rows: Vec<u32> = (0..1001).collect();
        let within = Rows::new("SELECT x FROM t WHERE x IN (", "?", ")");
        let cut: Vec<Vec<u32>> = within.statements(&rows).map(|s| s.rows.to_vec()).collect();
        assert_eq!(cut.iter().map(Vec::len).collect::<Vec<_>>(), [500, 500, 1]);
        assert_eq!(cut.concat(), rows, "every row once, in order");
        let at_most = within.clone().at_most(1000);
        assert_eq!(at_most.statements(&rows).map(|s| s.rows.len()).collect::<Vec<_>>(), [1000, 1]);
        assert_eq!(
            at_most.statements(&rows[..1000]).count(),
            1,
            "a full statement and no empty one after it"
        );
    }

    #[test]
    fn no_rows_make_no_statement() {
        let values = Rows::new("INSERT INTO t (a) VALUES ", "(?)", "");
        assert_eq!(values.statements::<u8>(&[]).count(), 0);
    }

    #[test]
    fn a_statement_stays_within_the_placeholder_limit() {
        // 200 columns a row: 327 rows hold 65,400 placeholders, 328 would
        // pass 65,535.
        let wide = Rows::new("INSERT INTO t VALUES ", format!("({})", marks(200)), "");
        assert_eq!(wide.capacity(), 327);
        // The head's and the tail's placeholders count too.
        let tail = format!(" AND logical IN ({})", marks(535));
        let ids = Rows::new("DELETE FROM t WHERE entity_id IN (", "?", tail).at_most(100_000);
        assert_eq!(ids.capacity(), 65_000);
        let rows = vec![0u8; 65_001];
        assert_eq!(ids.statements(&rows).map(|s| s.rows.len()).collect::<Vec<_>>(), [65_000, 1]);
        for s in ids.statements(&rows) {
            assert!(placeholders(&s.sql) <= MAX_PLACEHOLDERS);
        }
    }

    #[test]
    fn each_row_is_bound_through_the_closure_in_order() {
        let rows = [(1, 'a'), (2, 'b'), (3, 'c')];
        let values = Rows::new("INSERT INTO t (n, c) VALUES ", "(?, ?)", "").at_most(2);
        let bound: Vec<Vec<String>> = values
            .statements(&rows)
            .map(|s| {
                s.bind(vec!["head".to_string()], |mut q, (n, c)| {
                    q.extend([n.to_string(), c.to_string()]);
                    q
                })
            })
            .collect();
        assert_eq!(bound, [vec!["head", "1", "a", "2", "b"], vec!["head", "3", "c"]]);
    }

    #[test]
    fn a_statement_for_rows_cut_elsewhere_must_fit() {
        let within = Rows::new("DELETE FROM t WHERE x IN (", "?", ")").at_most(2);
        assert_eq!(within.statement(&[1, 2]).sql, "DELETE FROM t WHERE x IN (?, ?)");
        assert!(std::panic::catch_unwind(|| within.statement(&[1, 2, 3]).sql).is_err());
        assert!(std::panic::catch_unwind(|| within.statement::<u8>(&[]).sql).is_err());
    }
}
