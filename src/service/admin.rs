//! `graphpool.v1.Admin`: limits, readable by every allowed peer, changeable by admins.

use std::time::Instant;

use graphpool_proto::v1 as pb;
use graphpool_proto::v1::admin_server::Admin;
use tonic::{Request, Response, Status};

use super::status::invalid;
use super::{Shared, validate};
use crate::ledger::{Limits, LimitsUpdate};

/// The Admin service.
#[derive(Debug, Clone)]
pub struct AdminService {
    shared: Shared,
}

impl AdminService {
    /// An admin service over `shared`.
    pub fn new(shared: Shared) -> Self {
        AdminService { shared }
    }

    fn limits_proto(&self, l: &Limits) -> pb::Limits {
        let ledger = &self.shared.ledger;
        pb::Limits {
            devices: ledger
                .devices()
                .iter()
                .map(|d| pb::DeviceLimit {
                    device_uuid: d.info.uuid.clone(),
                    device_index: d.info.index,
                    budget_bytes: d.budget_bytes,
                })
                .collect(),
            jobs: l.jobs.iter().map(|(j, q)| pb::JobLimit { job_id: j.clone(), quota_bytes: *q }).collect(),
            default_rank_quota_bytes: l.default_rank_quota_bytes,
            default_job_quota_bytes: l.default_job_quota_bytes,
            ranks: l
                .ranks
                .iter()
                .map(|((j, r), q)| pb::RankLimit { job_id: j.clone(), rank: *r, quota_bytes: *q })
                .collect(),
        }
    }

    fn set_inner(&self, req: Request<pb::SetLimitsRequest>) -> Result<Response<pb::Limits>, Status> {
        let peer = self.shared.peer(&req)?;
        if !self.shared.access.is_admin(peer.uid) {
            tracing::warn!(uid = peer.uid, pid = peer.pid, "SetLimits refused: not an admin");
            return Err(Status::permission_denied(format!(
                "uid {} may not change limits; admins are root, the daemon's uid and access.admin_uids",
                peer.uid
            )));
        }
        let r = req.into_inner();
        let mut update = LimitsUpdate {
            default_rank_quota_bytes: r.default_rank_quota_bytes,
            default_job_quota_bytes: r.default_job_quota_bytes,
            ..Default::default()
        };
        for (i, j) in r.jobs.iter().enumerate() {
            validate::job_id(&j.job_id).map_err(|e| invalid(&format!("jobs[{i}].job_id"), e.message()))?;
            update.jobs.push((j.job_id.clone(), j.quota_bytes));
        }
        for (i, rk) in r.ranks.iter().enumerate() {
            validate::job_id(&rk.job_id).map_err(|e| invalid(&format!("ranks[{i}].job_id"), e.message()))?;
            update.ranks.push((rk.job_id.clone(), rk.rank, rk.quota_bytes));
        }
        let ledger = &self.shared.ledger;
        for (i, d) in r.devices.iter().enumerate() {
            validate::device(&format!("devices[{i}].device_uuid"), &d.device_uuid)?;
            let idx = if d.device_uuid.is_empty() {
                d.device_index
            } else {
                ledger
                    .resolve_device(&d.device_uuid)
                    .map_err(|e| invalid(&format!("devices[{i}].device_uuid"), e.to_string()))?
            };
            let cap = ledger
                .backend()
                .capacity_bytes(idx)
                .ok_or_else(|| invalid(&format!("devices[{i}].device_index"), format!("no device {idx}")))?;
            if d.budget_bytes > cap {
                return Err(invalid(
                    &format!("devices[{i}].budget_bytes"),
                    format!("exceeds the device's capacity of {}", crate::units::SizeDisplay(cap)),
                ));
            }
            update.devices.push((idx, d.budget_bytes));
        }
        let limits = ledger.set_limits(update)?;
        tracing::info!(uid = peer.uid, pid = peer.pid, ?limits, "limits changed");
        let proto = self.limits_proto(&limits);
        self.shared.sessions.broadcast(pb::SessionEvent {
            event: Some(pb::session_event::Event::LimitsChanged(proto.clone())),
        });
        Ok(Response::new(proto))
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn get_limits(&self, req: Request<pb::GetLimitsRequest>) -> Result<Response<pb::Limits>, Status> {
        let t = Instant::now();
        let r =
            self.shared.peer(&req).map(|_| Response::new(self.limits_proto(&self.shared.ledger.limits())));
        self.shared.observe("GetLimits", t, &r);
        r
    }

    async fn set_limits(&self, req: Request<pb::SetLimitsRequest>) -> Result<Response<pb::Limits>, Status> {
        let t = Instant::now();
        let r = self.set_inner(req);
        self.shared.observe("SetLimits", t, &r);
        r
    }
}
