//! How many `PlanCapture` calls plan at once. A plan is CPU work on every core of the node
//! for up to its time box (at most `planning::MAX_TIME_BUDGET`), so the daemon bounds it:
//! one plan in flight per session (a second is refused at once), and at most
//! [`plans_at_once`] on the node (more wait their turn in arrival order; a caller that gives
//! up stops waiting). A plan that started keeps its place until the planner stops, even when
//! its caller gives up: cancelling and asking again does not add planners.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

/// Plans that run at once on the node: one per two cores, at least two. Each uses the cores
/// it finds for its time box; the ranks of a node (eight on a node of eight GPUs and sixteen
/// cores or more) plan together at the start of a job without waiting on one another's whole
/// budget, while a flood of plans cannot take more than that from the node.
pub fn plans_at_once() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get() / 2).max(2)
}

/// The gate every `PlanCapture` passes (see the module documentation).
#[derive(Debug)]
pub struct PlanGate {
    running: Arc<Semaphore>,
    sessions: Arc<Mutex<HashSet<u64>>>,
}

impl Default for PlanGate {
    fn default() -> Self {
        PlanGate::new(plans_at_once())
    }
}

/// A plan's place through the gate: while it lives, its session has a plan in flight (waiting
/// for a place, then holding one of the node's). Owned, so the planner's thread can hold it
/// to its end.
#[derive(Debug)]
pub struct PlanTicket {
    sessions: Arc<Mutex<HashSet<u64>>>,
    session_id: u64,
    _running: Option<OwnedSemaphorePermit>,
}

impl Drop for PlanTicket {
    fn drop(&mut self) {
        self.sessions.lock().expect("plan gate lock").remove(&self.session_id);
    }
}

impl PlanGate {
    /// A gate letting `at_once` plans run together (at least one).
    pub fn new(at_once: usize) -> Self {
        PlanGate { running: Arc::new(Semaphore::new(at_once.max(1))), sessions: Arc::default() }
    }

    /// Waits for a place for a plan of `session_id`. Refused with RESOURCE_EXHAUSTED when that
    /// session already has a plan in flight.
    pub async fn enter(&self, session_id: u64) -> Result<PlanTicket, Status> {
        if !self.sessions.lock().expect("plan gate lock").insert(session_id) {
            return Err(Status::resource_exhausted(format!(
                "session {session_id} already has a PlanCapture in flight; wait for its answer \
                 before asking for another plan"
            )));
        }
        // Dropped while waiting (the caller gave up), the ticket clears the session's mark.
        let mut ticket = PlanTicket { sessions: self.sessions.clone(), session_id, _running: None };
        ticket._running = Some(self.running.clone().acquire_owned().await.map_err(|_| {
            Status::unavailable("graphpoold is shutting down; attach again after it restarts")
        })?);
        Ok(ticket)
    }

    /// Sessions with a plan in flight: running, or waiting for a place.
    pub fn in_flight(&self) -> usize {
        self.sessions.lock().expect("plan gate lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_plan_per_session_and_a_bounded_number_at_once() {
        let gate = PlanGate::new(1);
        let a = gate.enter(1).await.unwrap();
        // The same session again: refused at once, naming what to do.
        let e = gate.enter(1).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("session 1") && e.message().contains("wait"), "{}", e.message());
        // Another session waits for the one place.
        assert!(tokio::time::timeout(Duration::from_millis(50), gate.enter(2)).await.is_err());
        // A caller that gave up left no mark: session 2 may ask again, and gets in once a is done.
        drop(a);
        let b = tokio::time::timeout(Duration::from_secs(5), gate.enter(2)).await.unwrap().unwrap();
        assert_eq!(gate.in_flight(), 1);
        drop(b);
        assert_eq!(gate.in_flight(), 0);
        let _c = gate.enter(1).await.unwrap();
    }
}
