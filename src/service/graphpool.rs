//! `graphpool.v1.Graphpool`: what training ranks call.

use std::time::Instant;

use graphpool_proto::v1 as pb;
use graphpool_proto::v1::graphpool_server::Graphpool;
use tonic::{Request, Response, Status};

use super::sessions::EventStream;
use super::status::{bounded, invalid};
use super::{Shared, segments, validate};
use crate::ledger::{AttachSpec, Declared, EndReason, GrantView, LedgerError, SessionView};

/// The Graphpool service.
#[derive(Debug, Clone)]
pub struct GraphpoolService {
    shared: Shared,
    fd_socket: String,
    instance: String,
    plans: PlanLimits,
    plan_gate: std::sync::Arc<super::plan_gate::PlanGate>,
}

/// What `PlanCapture` may spend and send.
#[derive(Debug, Clone, Copy)]
pub struct PlanLimits {
    /// Planning time when the input asks for none.
    pub time_budget: std::time::Duration,
    /// Buffers a plan may have (`[guards] max_plan_buffers`).
    pub max_buffers: usize,
    /// Largest response the server sends (`[guards] max_message_bytes`).
    pub max_response_bytes: usize,
    /// Cores the plans use between them (`plan_cores`).
    pub cores: usize,
}

impl GraphpoolService {
    /// A service over `shared`, announcing `fd_socket` to clients.
    pub fn new(shared: Shared, fd_socket: String, instance: String, plans: PlanLimits) -> Self {
        let plan_gate = std::sync::Arc::new(super::plan_gate::PlanGate::for_cores(plans.cores));
        GraphpoolService { shared, fd_socket, instance, plans, plan_gate }
    }

    fn device_proto(&self, index: u32) -> pb::Device {
        let ledger = &self.shared.ledger;
        let d = ledger.devices().into_iter().find(|d| d.info.index == index).expect("valid index");
        let drv = ledger.backend().driver_memory(index);
        pb::Device {
            index,
            uuid: d.info.uuid.clone(),
            name: d.info.name.clone(),
            total_bytes: d.info.total_bytes,
            capacity_bytes: d.budget_bytes,
            granted_bytes: d.granted_bytes,
            free_bytes: d.free_bytes(),
            granularity_bytes: d.info.granularity_bytes,
            driver_used_bytes: drv.map(|m| m.used_bytes).unwrap_or(0),
            driver_free_bytes: drv.map(|m| m.free_bytes).unwrap_or(0),
        }
    }

    fn ledger_error(&self, e: LedgerError, who: &str) -> Status {
        self.shared.ledger_error(e, who)
    }

    async fn attach_inner(&self, req: Request<pb::AttachRequest>) -> Result<Response<EventStream>, Status> {
        let peer = self.shared.peer(&req)?;
        let r = req.into_inner();
        validate::job_id(&r.job_id)?;
        validate::client(&r.client)?;
        validate::device("device", &r.device)?;
        if r.resume.len() > validate::MAX_RESUME {
            return Err(invalid("resume", format!("at most {} grants", validate::MAX_RESUME)));
        }
        let ledger = &self.shared.ledger;
        let device = ledger.resolve_device(&r.device).map_err(|e| self.ledger_error(e, &r.job_id))?;
        let info = ledger.backend().devices()[device as usize].clone();
        if r.reserve_budget && r.budget_bytes == 0 {
            return Err(invalid("budget_bytes", "must be set when reserve_budget is true"));
        }
        let mut declared = Vec::with_capacity(r.resume.len());
        for (i, h) in r.resume.iter().enumerate() {
            // Id 0 is "not set" everywhere else: a grant adopted under it could never be
            // released (ReleaseSegment refuses grant_id 0).
            validate::id(&format!("resume[{i}].grant_id"), h.grant_id)?;
            validate::device(&format!("resume[{i}].device_uuid"), &h.device_uuid)?;
            if !h.device_uuid.is_empty() && !h.device_uuid.eq_ignore_ascii_case(&info.uuid) {
                return Err(invalid(
                    &format!("resume[{i}].device_uuid"),
                    format!("{} is not the session's device {}", h.device_uuid, info.uuid),
                ));
            }
            validate::size(&format!("resume[{i}].size_bytes"), h.size_bytes, info.total_bytes)?;
            validate::label(&format!("resume[{i}].label"), &h.label)?;
            declared.push(Declared {
                grant_id: h.grant_id,
                size_bytes: h.size_bytes,
                label: h.label.clone(),
            });
        }
        let spec = AttachSpec {
            job_id: r.job_id.clone(),
            rank: r.rank,
            local_rank: r.local_rank,
            device,
            client: r.client.clone(),
            budget_bytes: r.budget_bytes,
            reserve_budget: r.reserve_budget,
        };
        let (session, adopted) =
            ledger.attach(peer, spec, &declared).map_err(|e| self.ledger_error(e, &r.job_id))?;
        tracing::info!(
            session = session.id, job = %session.job_id, rank = session.rank, local_rank = session.local_rank,
            device, pid = peer.pid, uid = peer.uid, client = %session.client, adopted = adopted.len(),
            reserved = session.reserved_bytes, "session attached"
        );
        let first = pb::SessionEvent {
            event: Some(pb::session_event::Event::Attached(pb::Attached {
                session_id: session.id,
                device: Some(self.device_proto(device)),
                daemon_instance: self.instance.clone(),
                adopted: adopted.iter().map(grant_proto).collect(),
                fd_socket: self.fd_socket.clone(),
                reserved_bytes: session.reserved_bytes,
            })),
        };
        let stream = self.shared.sessions.start(&session, first, ledger.clone(), self.shared.metrics.clone());
        Ok(Response::new(stream))
    }

    fn allocate_inner(
        &self,
        req: Request<pb::AllocateSegmentRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        let peer = self.shared.peer(&req)?;
        let g = segments::allocate(&self.shared, &peer, req.get_ref())?;
        Ok(Response::new(grant_proto(&g)))
    }

    fn release_inner(
        &self,
        req: Request<pb::ReleaseSegmentRequest>,
    ) -> Result<Response<pb::ReleaseSegmentResponse>, Status> {
        let peer = self.shared.peer(&req)?;
        segments::release(&self.shared, &peer, req.get_ref()).map(Response::new)
    }

    fn session_proto(s: &SessionView) -> pb::SessionInfo {
        pb::SessionInfo {
            session_id: s.id,
            job_id: s.job_id.clone(),
            rank: s.rank,
            local_rank: s.local_rank,
            device_index: s.device,
            pid: s.peer.pid,
            uid: s.peer.uid,
            granted_bytes: s.granted_bytes,
            grants: s.grants,
            client: s.client.clone(),
            attached_unix_seconds: s.attached_unix,
        }
    }
}

/// The API form of a grant.
pub fn grant_proto(g: &GrantView) -> pb::Grant {
    pb::Grant {
        grant_id: g.id,
        session_id: g.session,
        size_bytes: g.size_bytes,
        requested_bytes: g.requested_bytes,
        device_uuid: g.device_uuid.clone(),
        device_index: g.device,
        label: g.label.clone(),
        job_id: g.job_id.clone(),
        rank: g.rank,
        pid: g.pid,
        created_unix_seconds: g.created_unix,
        adopted: g.adopted,
        handle_kind: g.handle_kind.to_string(),
    }
}

#[tonic::async_trait]
impl Graphpool for GraphpoolService {
    type AttachStream = EventStream;

    async fn attach(&self, req: Request<pb::AttachRequest>) -> Result<Response<EventStream>, Status> {
        let t = Instant::now();
        let r = self.attach_inner(req).await;
        self.shared.observe("Attach", t, &r);
        r
    }

    async fn detach(&self, req: Request<pb::DetachRequest>) -> Result<Response<pb::DetachResponse>, Status> {
        let t = Instant::now();
        let r = (|| {
            let peer = self.shared.peer(&req)?;
            let id = req.get_ref().session_id;
            validate::id("session_id", id)?;
            self.shared.ledger.session(id, &peer)?;
            let (_, released) = self
                .shared
                .ledger
                .end_session(id, EndReason::Detach)
                .ok_or(LedgerError::UnknownSession(id))?;
            self.shared.metrics.session_ended(EndReason::Detach);
            self.shared.sessions.close(id);
            Ok(Response::new(pb::DetachResponse {
                grants_released: released.grants,
                bytes_released: released.bytes,
            }))
        })();
        self.shared.observe("Detach", t, &r);
        r
    }

    async fn allocate_segment(
        &self,
        req: Request<pb::AllocateSegmentRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        let t = Instant::now();
        let r = self.allocate_inner(req);
        self.shared.observe("AllocateSegment", t, &r);
        r
    }

    async fn release_segment(
        &self,
        req: Request<pb::ReleaseSegmentRequest>,
    ) -> Result<Response<pb::ReleaseSegmentResponse>, Status> {
        let t = Instant::now();
        let r = self.release_inner(req);
        self.shared.observe("ReleaseSegment", t, &r);
        r
    }

    async fn list_grants(
        &self,
        req: Request<pb::ListGrantsRequest>,
    ) -> Result<Response<pb::ListGrantsResponse>, Status> {
        let t = Instant::now();
        let r = (|| {
            let peer = self.shared.peer(&req)?;
            let r = req.get_ref();
            let job = (!r.job_id.is_empty()).then_some(r.job_id.as_str());
            let grants = if r.session_id != 0 {
                self.shared.ledger.session(r.session_id, &peer)?;
                self.shared.ledger.grants(Some(r.session_id), job)
            } else {
                let admin = self.shared.access.is_admin(peer.uid);
                let uids: std::collections::HashMap<u64, u32> =
                    self.shared.ledger.sessions().iter().map(|s| (s.id, s.peer.uid)).collect();
                let mut g = self.shared.ledger.grants(None, job);
                // Non-admins see the grants of their own uid only.
                g.retain(|g| admin || uids.get(&g.session) == Some(&peer.uid));
                g
            };
            Ok(Response::new(pb::ListGrantsResponse { grants: grants.iter().map(grant_proto).collect() }))
        })();
        self.shared.observe("ListGrants", t, &r);
        r
    }

    async fn get_usage(&self, req: Request<pb::GetUsageRequest>) -> Result<Response<pb::Usage>, Status> {
        let t = Instant::now();
        let r = (|| {
            self.shared.peer(&req)?;
            let ledger = &self.shared.ledger;
            let devices = ledger
                .devices()
                .iter()
                .map(|d| pb::DeviceUsage {
                    device_index: d.info.index,
                    device_uuid: d.info.uuid.clone(),
                    capacity_bytes: d.budget_bytes,
                    granted_bytes: d.granted_bytes,
                    free_bytes: d.free_bytes(),
                    grants: d.grants,
                    planned_bytes: d.planned_bytes,
                })
                .collect();
            let sessions = ledger.sessions();
            let mut jobs: std::collections::BTreeMap<&str, pb::JobUsage> = Default::default();
            let mut ranks: std::collections::BTreeMap<(&str, u32, u32), pb::RankUsage> = Default::default();
            for s in &sessions {
                let j = jobs
                    .entry(&s.job_id)
                    .or_insert_with(|| pb::JobUsage { job_id: s.job_id.clone(), ..Default::default() });
                j.granted_bytes += s.granted_bytes;
                j.grants += s.grants;
                j.sessions += 1;
                let r = ranks.entry((&s.job_id, s.rank, s.device)).or_insert_with(|| pb::RankUsage {
                    job_id: s.job_id.clone(),
                    rank: s.rank,
                    device_index: s.device,
                    ..Default::default()
                });
                r.granted_bytes += s.granted_bytes;
                r.grants += s.grants;
            }
            Ok(Response::new(pb::Usage {
                devices,
                jobs: jobs.into_values().collect(),
                ranks: ranks.into_values().collect(),
            }))
        })();
        self.shared.observe("GetUsage", t, &r);
        r
    }

    async fn get_status(&self, req: Request<pb::GetStatusRequest>) -> Result<Response<pb::Status>, Status> {
        let t = Instant::now();
        let r = (|| {
            self.shared.peer(&req)?;
            let ledger = &self.shared.ledger;
            Ok(Response::new(pb::Status {
                version: env!("CARGO_PKG_VERSION").to_string(),
                daemon_instance: self.instance.clone(),
                backend: ledger.backend().kind().to_string(),
                devices: ledger.backend().devices().iter().map(|d| self.device_proto(d.index)).collect(),
                sessions: ledger.sessions().iter().map(Self::session_proto).collect(),
                fd_socket: self.fd_socket.clone(),
                uptime_seconds: ledger.uptime_seconds(),
            }))
        })();
        self.shared.observe("GetStatus", t, &r);
        r
    }

    async fn plan_capture(
        &self,
        req: Request<pb::PlanCaptureRequest>,
    ) -> Result<Response<pb::PlanCaptureResponse>, Status> {
        let t = Instant::now();
        let r = self.plan_inner(req).await;
        self.shared.observe("PlanCapture", t, &r);
        r
    }
}

impl GraphpoolService {
    async fn plan_inner(
        &self,
        req: Request<pb::PlanCaptureRequest>,
    ) -> Result<Response<pb::PlanCaptureResponse>, Status> {
        let peer = self.shared.peer(&req)?;
        let r = req.into_inner();
        validate::id("session_id", r.session_id)?;
        let session = self.shared.ledger.session(r.session_id, &peer)?;
        let input = r.input.ok_or_else(|| invalid("input", "must be set"))?;
        // One plan per session at a time, and a bounded number on the node: the planner's
        // thread holds the ticket to its end, so a caller that gives up frees the place only
        // when the planner stops.
        let ticket = self.plan_gate.enter(r.session_id).await?;
        let (budget, max, threads) = (self.plans.time_budget, self.plans.max_buffers, ticket.threads());
        // Planning is CPU work bounded by its time box: keep it off the async workers.
        let mut plan = tokio::task::spawn_blocking(move || {
            let _ticket = ticket;
            crate::planning::plan(&input, budget, max, threads)
        })
        .await
        .map_err(|e| Status::internal(format!("planner failed: {e}")))?
        .map_err(|e| match e.field() {
            Some(f) => invalid(&format!("input.{f}"), e.to_string()),
            None => Status::invalid_argument(bounded(e.to_string())),
        })?;
        if r.summary_only {
            plan.buffers = Vec::new();
        }
        // A response the transport would refuse to send fails here, before any reservation:
        // the plan as field 1 (tag, length, message) and `reserved_bytes` (tag, ≤ 10 bytes).
        let plan_bytes = prost::Message::encoded_len(&plan);
        let response_bytes = 1 + prost::length_delimiter_len(plan_bytes) + plan_bytes + 1 + 10;
        if response_bytes > self.plans.max_response_bytes {
            return Err(Status::resource_exhausted(format!(
                "the plan of {} buffers is {response_bytes} bytes encoded, more than the daemon's \
                 max_message_bytes ({}); set summary_only to leave the buffers out, or raise \
                 [guards] max_message_bytes",
                plan.buffers.len(),
                self.plans.max_response_bytes
            )));
        }
        let need = plan.predicted_capture_bytes.max(plan.footprint_bytes);
        let who = format!("{}/{}", session.job_id, session.rank);
        let reserved = if r.reserve {
            self.shared.ledger.reserve(r.session_id, &peer, need).map_err(|e| self.ledger_error(e, &who))?
        } else {
            self.shared
                .ledger
                .check_fits(r.session_id, &peer, need)
                .map_err(|e| self.ledger_error(e, &who))?;
            0
        };
        self.shared.ledger.record_plan(r.session_id, plan.footprint_bytes, plan.saved_by_aliasing_bytes);
        tracing::info!(
            session = r.session_id, job = %session.job_id, rank = session.rank, footprint = plan.footprint_bytes,
            lower_bound = plan.lower_bound_bytes, live_bound = plan.live_bound_bytes,
            predicted = plan.predicted_capture_bytes, reserved,
            strategy = %plan.strategy, seconds = plan.planning_seconds, threads, "planned"
        );
        Ok(Response::new(pb::PlanCaptureResponse { plan: Some(plan), reserved_bytes: reserved }))
    }
}
