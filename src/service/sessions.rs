//! Live sessions: each one's event stream and the watcher that ends it.
//!
//! A session ends on the first of: its Attach stream closing (client gone or cancelled), its
//! process exiting (pidfd), an explicit Detach, or daemon shutdown. Whichever comes first
//! releases every grant in the ledger; the others find nothing left to do.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use graphpool_proto::v1::SessionEvent;
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::ledger::{EndReason, Ledger, SessionView};
use crate::metrics::Metrics;

/// Stream of events of one session, as returned by Attach.
pub type EventStream = ReceiverStream<Result<SessionEvent, Status>>;

#[derive(Debug)]
struct Live {
    tx: mpsc::Sender<Result<SessionEvent, Status>>,
    ended: Arc<Notify>,
}

/// The live sessions' streams.
#[derive(Debug, Default)]
pub struct SessionRegistry {
    live: Mutex<HashMap<u64, Live>>,
}

impl SessionRegistry {
    /// Starts the event stream and the watcher of a session the ledger has just opened.
    pub fn start(
        self: &Arc<Self>,
        session: &SessionView,
        first: SessionEvent,
        ledger: Arc<Ledger>,
        metrics: Arc<Metrics>,
    ) -> EventStream {
        let (tx, rx) = mpsc::channel(16);
        // Cannot fail: the channel is new and has room.
        let _ = tx.try_send(Ok(first));
        let ended = Arc::new(Notify::new());
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(session.id, Live { tx: tx.clone(), ended: ended.clone() });
        let (id, pid) = (session.id, session.peer.pid);
        let registry = self.clone();
        tokio::spawn(async move {
            let reason = tokio::select! {
                _ = crate::peer::process_exit(pid) => Some(EndReason::ProcessExit),
                _ = tx.closed() => Some(EndReason::StreamClosed),
                _ = ended.notified() => None,
            };
            if let Some(reason) = reason
                && ledger.end_session(id, reason).is_some()
            {
                metrics.session_ended(reason);
            }
            registry.live.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            // Dropping the last sender ends the client's stream.
        });
        ReceiverStream::new(rx)
    }

    /// Ends a session's stream (after Detach or at shutdown).
    pub fn close(&self, id: u64) {
        if let Some(live) = self.live.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
            live.ended.notify_one();
        }
    }

    /// Sends an event to every live session (best effort: a full stream misses it).
    pub fn broadcast(&self, event: SessionEvent) {
        for live in self.live.lock().unwrap_or_else(|p| p.into_inner()).values() {
            let _ = live.tx.try_send(Ok(event.clone()));
        }
    }

    /// Number of live session streams.
    pub fn len(&self) -> usize {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no session is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every stream.
    pub fn close_all(&self) {
        for live in self.live.lock().unwrap_or_else(|p| p.into_inner()).values() {
            live.ended.notify_one();
        }
    }
}
