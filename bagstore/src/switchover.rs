//! `bagstore shards switchover SHARD [--to ADDRESS]` and `bagstore shards
//! failover SHARD [--to ADDRESS] [--accept-async]`: the operator's hand on
//! a replicated shard's primary. The protocols are the failover crate's
//! (the coordinator runs the same failover on its own, see
//! `mysql.failover`).

use failover::servers::shard_named;
use schemas::Settings;
use storage::Shards;

pub async fn switchover(settings: Settings, shard: &str, to: Option<&str>) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let result = match shard_named(&shards, shard) {
        Ok(p) => failover::switchover::switch_over(&shards, &settings, &p, to).await,
        Err(e) => Err(e),
    };
    shards.close().await;
    let s = result?;
    println!(
        "shard {shard}: {} is the primary now ({} replicates from it); writes waited {} ms",
        s.new,
        s.old,
        s.writes_waited.as_millis()
    );
    Ok(())
}

pub async fn failover(
    settings: Settings,
    shard: &str,
    to: Option<&str>,
    accept_async: bool,
) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let result = match shard_named(&shards, shard) {
        Ok(p) => failover::promote::fail_over(&shards, &settings, &p, to, accept_async).await,
        Err(e) => Err(e),
    };
    shards.close().await;
    let p = result?;
    let note = if p.asynchronous {
        "; it replicates asynchronously (accepted)"
    } else if p.alone {
        "; it has no replica left, so it stays read-only (writes are refused) until one joins (the \
         coordinator rejoins the old primary once it answers again, or `shards replicas add`)"
    } else {
        ""
    };
    println!("shard {shard}: {} is the primary now, in place of {}{note}", p.new, p.old);
    Ok(())
}
