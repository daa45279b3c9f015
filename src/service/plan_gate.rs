//! How many `PlanCapture` calls plan at once. A plan is CPU work on every core of the node
//! for up to its time box (at most `planning::MAX_TIME_BUDGET`), so the daemon bounds it:
//! one plan in flight per session (a second is refused at once), and at most
//! [`plans_at_once`] on the node (more wait their turn in arrival order; a caller that gives
//! up stops waiting). A plan that started keeps its place until the planner stops, even when
//! its caller gives up: cancelling and asking again does not add planners. Each plan runs on
//! its share of the cores ([`PlanTicket::threads`]), so that plans started together do not
//! each spawn a thread per core.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

/// Plans that run at once on `cores` cores (`plan_cores`: by default every core of the node):
/// one per two cores, at least two. Each runs on its share of the cores
/// ([`PlanTicket::threads`]) for its time box; the ranks of a node (eight on a node of eight
/// GPUs and sixteen cores or more) plan together at the start of a job without waiting on one
/// another's whole budget, while a flood of plans cannot take more than that from the node.
pub fn plans_at_once(cores: usize) -> usize {
    (cores / 2).max(2)
}

/// The gate every `PlanCapture` passes (see the module documentation).
#[derive(Debug)]
pub struct PlanGate {
    running: Arc<Semaphore>,
    at_once: usize,
    cores: usize,
    sessions: Arc<Mutex<HashSet<u64>>>,
}

/// A plan's place through the gate: while it lives, its session has a plan in flight (waiting
/// for a place, then holding one of the node's). Owned, so the planner's thread can hold it
/// to its end.
#[derive(Debug)]
pub struct PlanTicket {
    sessions: Arc<Mutex<HashSet<u64>>>,
    session_id: u64,
    _running: Option<OwnedSemaphorePermit>,
    threads: usize,
}

impl PlanTicket {
    /// The planner threads this plan may use: the node's cores over the plans running when
    /// it got its place, itself included (at least one), fixed for the plan's life: as eight
    /// ranks start on 16 cores, 16, 8, 5, 4, 3, 2, 2, 2; once eight run, two each instead of
    /// sixteen. On two cores, a schedule sweep planned with 16 threads (as each of eight such
    /// plans would be) left 13 of 3000 above 1.001 × the bound, the worst at 1.0105, and plans
    /// took up to 299 ms of a 200 ms budget; with 2 threads, 10, 1.0049 and 198 ms
    /// (docs/planner.md, "Plans that run together").
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Drop for PlanTicket {
    fn drop(&mut self) {
        self.sessions.lock().expect("plan gate lock").remove(&self.session_id);
    }
}

impl PlanGate {
    /// The gate of plans sharing `cores` cores: [`plans_at_once`] of them run together.
    pub fn for_cores(cores: usize) -> Self {
        PlanGate::new(plans_at_once(cores), cores)
    }

    /// A gate letting `at_once` plans run together (at least one), sharing `cores` cores.
    pub fn new(at_once: usize, cores: usize) -> Self {
        let at_once = at_once.max(1);
        PlanGate { running: Arc::new(Semaphore::new(at_once)), at_once, cores, sessions: Arc::default() }
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
        let mut ticket =
            PlanTicket { sessions: self.sessions.clone(), session_id, _running: None, threads: 1 };
        ticket._running = Some(self.running.clone().acquire_owned().await.map_err(|_| {
            Status::unavailable("graphpoold is shutting down; attach again after it restarts")
        })?);
        let running = self.at_once.saturating_sub(self.running.available_permits()).max(1);
        ticket.threads = (self.cores / running).max(1);
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
        let gate = PlanGate::new(1, 2);
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

    #[tokio::test]
    async fn each_plan_gets_its_share_of_the_cores() {
        let gate = PlanGate::for_cores(16);
        // Alone, a plan has every core; each plan that starts beside others, its share.
        let a = gate.enter(1).await.unwrap();
        assert_eq!(a.threads(), 16);
        let b = gate.enter(2).await.unwrap();
        assert_eq!(b.threads(), 8);
        let mut held = Vec::new();
        for s in 3..=8 {
            held.push(gate.enter(s).await.unwrap());
        }
        assert_eq!(held.last().unwrap().threads(), 2);
        // Places freed give the next plan more.
        drop(held);
        drop(b);
        assert_eq!(gate.enter(9).await.unwrap().threads(), 8);
        // Never less than one thread, on a node with fewer cores than plans.
        let small = PlanGate::new(4, 2);
        let _x = small.enter(1).await.unwrap();
        let _y = small.enter(2).await.unwrap();
        assert_eq!(small.enter(3).await.unwrap().threads(), 1);
    }
}
