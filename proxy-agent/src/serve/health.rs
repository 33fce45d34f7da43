//! The proxy's health, with kube-proxy's rule (`pkg/proxy/healthcheck`): the
//! proxy is healthy while nothing is queued, or while the oldest change queued
//! since the last completed sync is younger than the health timeout (kube-proxy
//! uses twice the sync period). `/healthz` also requires the node to be
//! eligible (not being deleted, not tainted `ToBeDeletedByClusterAutoscaler`);
//! `/livez` does not.
use std::{
    sync::Mutex,
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::api::core::v1::Node;

/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

#[derive(Debug)]
struct Inner {
    last_updated: Option<SystemTime>,
    oldest_pending_queued: Option<Instant>,
    node_eligible: bool,
    ready: bool,
}

/// Shared between the sync loop (writer) and the health server (reader).
#[derive(Debug)]
pub struct Health {
    timeout: Duration,
    inner: Mutex<Inner>,
}

/// What `/healthz` and `/livez` report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthStatus {
    /// The sync loop keeps up (kube-proxy's `isHealthy`).
    pub healthy: bool,
    /// Last completed sync; when healthy, the current time (kube-proxy
    /// reports it so for compatibility with older releases).
    pub last_updated: Option<SystemTime>,
    pub current_time: SystemTime,
    pub node_eligible: bool,
}

impl Health {
    /// `timeout`: how long a queued change may wait for a sync.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            inner: Mutex::new(Inner {
                last_updated: None,
                oldest_pending_queued: None,
                // Eligible until the Node object says otherwise.
                node_eligible: true,
                ready: false,
            }),
        }
    }

    /// kube-proxy's health timeout for a sync period.
    pub fn timeout_for(sync_period: Duration) -> Duration {
        2 * sync_period
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A change arrived that a sync must apply.
    pub fn queued_update(&self) {
        let mut i = self.lock();
        i.oldest_pending_queued.get_or_insert_with(Instant::now);
    }

    /// The first complete sync is done: maps programmed from a complete view
    /// of the source, programs attached. `/readyz` answers 200 from then on.
    pub fn set_ready(&self) {
        self.lock().ready = true;
    }

    /// Whether the first complete sync is done (the pod's readiness).
    pub fn is_ready(&self) -> bool {
        self.lock().ready
    }

    /// A sync completed.
    pub fn updated(&self) {
        let mut i = self.lock();
        i.oldest_pending_queued = None;
        i.last_updated = Some(SystemTime::now());
    }

    /// Updates node eligibility from this node's Node object (none: eligible,
    /// as kube-proxy is while starting up).
    pub fn sync_node(&self, node: Option<&Node>) {
        let eligible = node.is_none_or(|n| {
            n.metadata.deletion_timestamp.is_none()
                && !n
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT))
        });
        self.lock().node_eligible = eligible;
    }

    pub fn status(&self) -> HealthStatus {
        let i = self.lock();
        let healthy = i
            .oldest_pending_queued
            .is_none_or(|t| t.elapsed() < self.timeout);
        let current_time = SystemTime::now();
        HealthStatus {
            healthy,
            last_updated: if healthy {
                Some(current_time)
            } else {
                i.last_updated
            },
            current_time,
            node_eligible: i.node_eligible,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSpec, Taint};

    #[test]
    fn not_ready_until_the_first_complete_sync() {
        let h = Health::new(Duration::from_secs(3600));
        assert!(!h.is_ready());
        h.updated();
        assert!(!h.is_ready(), "a sync is not the first complete one");
        h.set_ready();
        assert!(h.is_ready());
    }

    #[test]
    fn healthy_at_start_and_while_a_change_is_young() {
        let h = Health::new(Duration::from_secs(3600));
        assert!(h.status().healthy);
        h.queued_update();
        assert!(h.status().healthy);
    }

    #[test]
    fn a_change_not_synced_within_the_timeout_is_unhealthy_until_a_sync() {
        let h = Health::new(Duration::from_millis(20));
        h.queued_update();
        std::thread::sleep(Duration::from_millis(60));
        let s = h.status();
        assert!(!s.healthy);
        assert_eq!(s.last_updated, None, "never synced");
        h.updated();
        assert!(h.status().healthy);
    }

    #[test]
    fn node_being_deleted_or_tainted_is_not_eligible() {
        let h = Health::new(Duration::from_secs(1));
        let mut node = Node {
            spec: Some(NodeSpec {
                taints: Some(vec![Taint {
                    key: TO_BE_DELETED_TAINT.into(),
                    effect: "NoSchedule".into(),
                    ..Taint::default()
                }]),
                ..NodeSpec::default()
            }),
            ..Node::default()
        };
        h.sync_node(Some(&node));
        assert!(!h.status().node_eligible);
        node.spec = None;
        h.sync_node(Some(&node));
        assert!(h.status().node_eligible);
        h.sync_node(None);
        assert!(h.status().node_eligible);
    }
}
