//! Waiting for the source: nothing is programmed from a half-filled cache.
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::error;

use crate::sources::{Source, SourceError};

use super::AgentError;

/// When the agent starts saying why its source is not ready, and how often.
pub(super) const NOT_READY_HINT_AFTER: Duration = Duration::from_secs(5);
pub(super) const NOT_READY_HINT_EVERY: Duration = Duration::from_secs(15);

/// Waits until `source` has a complete view, saying why within seconds
/// while it has not (an unreachable API server names its address and the
/// setting that fixes it).
pub(super) async fn wait_until_ready(
    source: &dyn Source,
    changes: &mut mpsc::UnboundedReceiver<()>,
) -> Result<(), AgentError> {
    let waiting = Instant::now();
    let mut hint = tokio::time::interval_at(
        (waiting + NOT_READY_HINT_AFTER).into(),
        NOT_READY_HINT_EVERY,
    );
    while !source.ready() {
        tokio::select! {
            c = changes.recv() => if c.is_none() {
                return Err(SourceError::Other("the source stopped before it was ready".into()).into());
            },
            _ = hint.tick() => {
                if let Some(h) = source.not_ready_hint(waiting.elapsed()) {
                    error!("{h}");
                }
            }
        }
    }
    Ok(())
}
