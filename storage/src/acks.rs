//! Which shards refuse new writes because no replica would acknowledge
//! them.
//!
//! A shard with replicas acknowledges a write only once a replica holds it
//! (semi-sync at `AFTER_SYNC` with a timeout that never passes): with no
//! acknowledging replica connected, a
//! commit waits until one connects, and must never be killed meanwhile
//! (killed, it would commit on the primary alone). So while a shard's
//! primary counts no acknowledging replica, new writes to it are refused
//! before they begin ([`StoreError::NoAcknowledgingReplica`]: nothing was
//! written, try again shortly). The writer's watch sets the gate from each
//! primary's count.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Result, StoreError};
use crate::shards::MAX_PHYSICAL;

/// One flag per physical shard: refusing writes or not.
#[derive(Debug)]
pub struct AckGate {
    refusing: Vec<AtomicBool>,
}

impl Default for AckGate {
    fn default() -> Self {
        AckGate { refusing: (0..MAX_PHYSICAL).map(|_| AtomicBool::new(false)).collect() }
    }
}

impl AckGate {
    /// Whether new writes to `shard` are refused from now on.
    pub fn set(&self, shard: usize, refusing: bool) {
        if let Some(flag) = self.refusing.get(shard) {
            flag.store(refusing, Ordering::Relaxed);
        }
    }

    /// Ok unless writes to `shard` are refused.
    pub fn check(&self, shard: usize) -> Result<()> {
        match self.refusing.get(shard) {
            Some(flag) if flag.load(Ordering::Relaxed) => Err(StoreError::NoAcknowledgingReplica { shard }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusing_shard_refuses_and_the_others_do_not() {
        let gate = AckGate::default();
        assert!(gate.check(1).is_ok());
        gate.set(1, true);
        let e = gate.check(1).unwrap_err();
        assert!(e.is_transient() && e.to_string().contains("none acknowledges"), "{e}");
        assert!(gate.check(0).is_ok());
        gate.set(1, false);
        assert!(gate.check(1).is_ok());
        gate.set(MAX_PHYSICAL, true);
        assert!(gate.check(MAX_PHYSICAL).is_ok());
    }
}
