//! Arbitrary bytes decoded as the API's request messages and run through the real gRPC
//! service implementations over an in-process ledger (host backend). After every call: no
//! panic, no INTERNAL/UNKNOWN status, and the ledger's figures add up; after the input, once
//! every Attach stream is dropped, the ledger is empty.
#![no_main]

use graphpool::ledger::{LedgerError, Peer};
use graphpool_fuzz::{Bytes, Daemon, own_cred, pick, request, runtime};
use graphpool_proto::v1 as pb;
use graphpool_proto::v1::admin_server::Admin;
use graphpool_proto::v1::graphpool_server::Graphpool;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tokio_stream::StreamExt;
use tonic::Code;

fn ok_code<T: std::fmt::Debug>(what: &str, r: &Result<T, tonic::Status>) {
    if let Err(s) = r {
        assert!(
            !matches!(s.code(), Code::Internal | Code::Unknown | Code::DataLoss | Code::Unimplemented),
            "{what}: {s:?}"
        );
        if matches!(s.code(), Code::InvalidArgument) {
            assert!(!s.message().is_empty(), "{what}: an INVALID_ARGUMENT must say what is wrong");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let d = Daemon::new();
    let cred = own_cred();
    let me = Peer { pid: cred.pid().unwrap() as u32, uid: cred.uid(), gid: cred.gid() };
    let stranger = Peer { pid: me.pid.wrapping_add(1), ..me };
    let mut input = Bytes(data);
    let mut streams = Vec::new();
    let mut sessions: Vec<u64> = Vec::new();
    let mut grants: Vec<u64> = Vec::new();
    let rt = runtime();
    let mut steps = 0;
    while let (Some(op), Some(body)) = (input.u8(), input.chunk()) {
        steps += 1;
        if steps > 64 {
            break;
        }
        match op % 12 {
            0 => {
                let Ok(mut r) = pb::AttachRequest::decode(body) else { continue };
                // Declarations that name live ids and the ids the ledger hands out next.
                let mut near = grants.clone();
                if let Some(last) = grants.iter().max() {
                    near.extend([last + 1, last + 2, last + 3]);
                }
                for h in &mut r.resume {
                    h.grant_id = pick(h.grant_id, &near);
                }
                let res = rt.block_on(d.graphpool.attach(request(r, Some(cred))));
                ok_code("Attach", &res);
                if let Ok(resp) = res {
                    let mut s = resp.into_inner();
                    let first = rt.block_on(s.next()).expect("a first event").expect("not an error");
                    let Some(pb::session_event::Event::Attached(a)) = first.event else {
                        panic!("{first:?}")
                    };
                    sessions.push(a.session_id);
                    grants.extend(a.adopted.iter().map(|g| g.grant_id));
                    streams.push(s);
                }
            }
            1 => {
                let Ok(mut r) = pb::AllocateSegmentRequest::decode(body) else { continue };
                r.session_id = pick(r.session_id, &sessions);
                let res = rt.block_on(d.graphpool.allocate_segment(request(r.clone(), Some(cred))));
                ok_code("AllocateSegment", &res);
                if let Ok(g) = res {
                    let g = g.into_inner();
                    assert!(g.size_bytes >= r.size_bytes && g.size_bytes % (2 << 20) == 0);
                    grants.push(g.grant_id);
                }
            }
            2 => {
                let Ok(mut r) = pb::ReleaseSegmentRequest::decode(body) else { continue };
                r.session_id = pick(r.session_id, &sessions);
                r.grant_id = pick(r.grant_id, &grants);
                ok_code("ReleaseSegment", &rt.block_on(d.graphpool.release_segment(request(r, Some(cred)))));
            }
            3 => {
                let Ok(mut r) = pb::DetachRequest::decode(body) else { continue };
                r.session_id = pick(r.session_id, &sessions);
                ok_code("Detach", &rt.block_on(d.graphpool.detach(request(r, Some(cred)))));
            }
            4 => {
                let Ok(mut r) = pb::ListGrantsRequest::decode(body) else { continue };
                r.session_id = pick(r.session_id, &sessions);
                let res = rt.block_on(d.graphpool.list_grants(request(r.clone(), Some(cred))));
                ok_code("ListGrants", &res);
                if let (Ok(l), true) = (res, r.session_id != 0) {
                    let job = (!r.job_id.is_empty()).then_some(r.job_id.as_str());
                    assert_eq!(l.into_inner().grants.len(), d.ledger.grants(Some(r.session_id), job).len());
                }
            }
            5 => {
                ok_code(
                    "GetUsage",
                    &rt.block_on(d.graphpool.get_usage(request(pb::GetUsageRequest {}, Some(cred)))),
                );
                ok_code(
                    "GetStatus",
                    &rt.block_on(d.graphpool.get_status(request(pb::GetStatusRequest {}, Some(cred)))),
                );
            }
            6 => {
                let Ok(mut r) = pb::PlanCaptureRequest::decode(body) else { continue };
                r.session_id = pick(r.session_id, &sessions);
                if let Some(i) = r.input.as_mut() {
                    i.time_budget_ms = i.time_budget_ms.clamp(1, 2);
                }
                ok_code("PlanCapture", &rt.block_on(d.graphpool.plan_capture(request(r, Some(cred)))));
            }
            7 => {
                let Ok(r) = pb::SetLimitsRequest::decode(body) else { continue };
                ok_code("SetLimits", &rt.block_on(d.admin.set_limits(request(r, Some(cred)))));
            }
            8 => {
                // The client goes away: its stream closes.
                if !streams.is_empty() {
                    let i = usize::from(body.first().copied().unwrap_or(0)) % streams.len();
                    drop(streams.swap_remove(i));
                }
            }
            9 => {
                // Another process holding the ids gets nothing.
                let (s, g) = (
                    pick(1 + u64::from(body.first().copied().unwrap_or(0) % 32), &sessions),
                    pick(1 + u64::from(body.get(1).copied().unwrap_or(0) % 32), &grants),
                );
                match d.ledger.segment_for(s, &stranger, g) {
                    Err(LedgerError::ForeignSession { .. } | LedgerError::UnknownSession(_)) => {}
                    other => panic!("a stranger asked for grant {g} of session {s}: {other:?}"),
                }
                match d.ledger.release(s, &stranger, g) {
                    Err(LedgerError::ForeignSession { .. } | LedgerError::UnknownSession(_)) => {}
                    other => panic!("a stranger released grant {g} of session {s}: {other:?}"),
                }
            }
            10 => {
                // A peer whose credentials are unknown is refused.
                let Ok(r) = pb::AllocateSegmentRequest::decode(body) else { continue };
                let e = rt.block_on(d.graphpool.allocate_segment(request(r, None))).unwrap_err();
                assert_eq!(e.code(), Code::PermissionDenied);
            }
            _ => {
                // The owner gets the fd of exactly the granted size.
                let (s, g) = (
                    pick(1 + u64::from(body.first().copied().unwrap_or(0) % 32), &sessions),
                    pick(1 + u64::from(body.get(1).copied().unwrap_or(0) % 32), &grants),
                );
                if let Ok(seg) = d.ledger.segment_for(s, &me, g) {
                    let view = d.ledger.grants(Some(s), None).into_iter().find(|x| x.id == g).expect("owned");
                    assert_eq!(seg.size_bytes(), view.size_bytes);
                }
            }
        }
        d.check();
    }
    drop(streams);
    d.check_drained();
});
