//! Prometheus histograms read from a `/metrics` scrape: quantiles and the
//! highest bucket of what was observed between two scrapes (shared by the
//! `bench` binaries).

/// (upper bound, cumulative count) of `name`'s buckets for `index`.
pub fn buckets(text: &str, name: &str, index: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut out: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with(&prefix) && l.contains(&format!("index=\"{index}\"")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// Quantile of the observations between two scrapes, interpolated inside
/// the bucket like Prometheus' histogram_quantile (ms).
pub fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let diff: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| (*le, c - before.iter().find(|(l, _)| l == le).map_or(0.0, |x| x.1)))
        .collect();
    let total = diff.last().map_or(0.0, |x| x.1);
    if total == 0.0 {
        return 0.0;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for (le, c) in &diff {
        if *c >= rank {
            if le.is_infinite() {
                return prev.0 * 1e3;
            }
            let within = if c - prev.1 > 0.0 { (rank - prev.1) / (c - prev.1) } else { 1.0 };
            return (prev.0 + (le - prev.0) * within) * 1e3;
        }
        prev = (*le, *c);
    }
    prev.0 * 1e3
}

/// The upper bound of the highest non-empty bucket between two scrapes (ms).
pub fn max_bucket(before: &[(f64, f64)], after: &[(f64, f64)]) -> f64 {
    let mut last = 0.0;
    let mut prev_count = 0.0;
    for (le, c) in after {
        let b = before.iter().find(|(l, _)| l == le).map_or(0.0, |x| x.1);
        if c - b > prev_count {
            last = *le;
        }
        prev_count = c - b;
    }
    last * 1e3
}
