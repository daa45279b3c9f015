//! The `graphpool` command-line tool: status, grants, limits, health and plan.

pub mod plan;
mod table;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use graphpool_proto::v1 as pb;
use serde_json::json;

use crate::client::{ClientError, connect, default_socket};
use crate::units::{SizeDisplay, parse_size};
use table::Table;

/// `graphpool`: inspect and steer graphpoold.
#[derive(Debug, Parser)]
#[command(name = "graphpool", version, about = "Inspect and steer graphpoold, and plan graph memory")]
pub struct Cli {
    /// The daemon's socket (default: $GRAPHPOOL_SOCKET, /run/graphpool/graphpool.sock, or
    /// $XDG_RUNTIME_DIR/graphpool/graphpool.sock).
    #[arg(long, global = true, env = "GRAPHPOOL_SOCKET")]
    pub socket: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Devices, capacity, granted, free and sessions.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Every grant on the node (yours only unless you are an admin).
    Grants {
        /// Only grants of this job.
        #[arg(long)]
        job: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show limits, or change them (admins).
    Limits {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Change limits.
        #[command(subcommand)]
        action: Option<LimitsAction>,
    },
    /// Exit 0 when the daemon answers, 1 otherwise (for probes).
    Health {
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 3.0)]
        timeout: f64,
    },
    /// Predict graph memory offline (no daemon): a plan for a schedule or a buffer list.
    Plan(plan::PlanArgs),
}

/// `graphpool limits set`.
#[derive(Debug, Subcommand)]
pub enum LimitsAction {
    /// Set quotas and budgets until the daemon restarts (its config file's `[limits]` keep them
    /// across restarts); sizes like 8GiB; 0 removes a job or rank quota.
    Set {
        /// Quota of every rank without its own.
        #[arg(long, value_parser = parse_size)]
        default_rank_quota: Option<u64>,
        /// Quota of every job without its own.
        #[arg(long, value_parser = parse_size)]
        default_job_quota: Option<u64>,
        /// JOB=SIZE (repeatable).
        #[arg(long = "job", value_parser = parse_kv)]
        jobs: Vec<(String, u64)>,
        /// JOB:RANK=SIZE (repeatable).
        #[arg(long = "rank", value_parser = parse_kv)]
        ranks: Vec<(String, u64)>,
        /// DEVICE=SIZE, device by index or UUID (repeatable).
        #[arg(long = "device", value_parser = parse_kv)]
        devices: Vec<(String, u64)>,
    },
}

fn parse_kv(s: &str) -> Result<(String, u64), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected KEY=SIZE"))?;
    Ok((k.to_string(), parse_size(v).map_err(|e| e.to_string())?))
}

/// Errors of the CLI.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The daemon could not be reached.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The daemon answered with an error.
    #[error("{}", describe_status(.0))]
    Rpc(#[from] tonic::Status),
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
}

/// A daemon error as a person should read it, with the structured details when present.
pub fn describe_status(s: &tonic::Status) -> String {
    let mut out = format!("{:?}: {}", s.code(), s.message());
    if let Some(pb::ErrorDetail { detail: Some(pb::error_detail::Detail::Capacity(c)) }) =
        crate::client::error_detail(s)
    {
        if c.limit == crate::ledger::LimitKind::SessionGrants.as_str() {
            // This limit counts grants, not bytes.
            out.push_str(&format!(
                "\n  a session on {} may hold at most {} grants (session-grants)",
                c.device_uuid, c.limit_bytes
            ));
        } else {
            out.push_str(&format!(
                "\n  requested {} on {}, {} still allowed by {} (limit {})",
                SizeDisplay(c.requested_bytes),
                c.device_uuid,
                SizeDisplay(c.free_bytes),
                c.limit,
                SizeDisplay(c.limit_bytes)
            ));
        }
        for h in &c.top_holders {
            out.push_str(&format!(
                "\n  held by job {} rank {} (pid {}): {}",
                h.job_id,
                h.rank,
                h.pid,
                SizeDisplay(h.granted_bytes)
            ));
        }
    }
    out
}

/// Entry point of the `graphpool` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Plan(args) = &cli.command {
        return match plan::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("graphpool plan: {e}");
                ExitCode::from(2)
            }
        };
    }
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("graphpool: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let socket = cli.socket.clone().unwrap_or_else(default_socket);
    match runtime.block_on(run(&socket, cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("graphpool: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(socket: &std::path::Path, command: Command) -> Result<ExitCode, CliError> {
    match command {
        Command::Health { timeout } => {
            let t = Duration::from_secs_f64(timeout.clamp(0.01, 3600.0));
            let ok = tokio::time::timeout(t, async {
                let mut c = connect(socket).await?;
                c.graphpool.get_status(pb::GetStatusRequest {}).await?;
                Ok::<_, CliError>(())
            })
            .await;
            match ok {
                Ok(Ok(())) => {
                    println!("ok");
                    Ok(ExitCode::SUCCESS)
                }
                Ok(Err(e)) => {
                    eprintln!("unhealthy: {e}");
                    Ok(ExitCode::FAILURE)
                }
                Err(_) => {
                    eprintln!("unhealthy: no answer from {} within {timeout} s", socket.display());
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Status { json } => {
            let mut c = connect(socket).await?;
            let st = c.graphpool.get_status(pb::GetStatusRequest {}).await?.into_inner();
            if json {
                println!("{}", serde_json::to_string_pretty(&status_json(&st)).expect("json"));
            } else {
                print_status(&st);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Grants { job, json } => {
            let mut c = connect(socket).await?;
            let req = pb::ListGrantsRequest { session_id: 0, job_id: job.unwrap_or_default() };
            let grants = c.graphpool.list_grants(req).await?.into_inner().grants;
            if json {
                let v: Vec<_> = grants.iter().map(grant_json).collect();
                println!("{}", serde_json::to_string_pretty(&v).expect("json"));
            } else {
                let mut t = Table::new(&["GRANT", "JOB", "RANK", "PID", "GPU", "SIZE", "LABEL", "KIND"]);
                for g in &grants {
                    t.row(vec![
                        g.grant_id.to_string(),
                        g.job_id.clone(),
                        g.rank.to_string(),
                        g.pid.to_string(),
                        g.device_index.to_string(),
                        SizeDisplay(g.size_bytes).to_string(),
                        g.label.clone(),
                        g.handle_kind.clone(),
                    ]);
                }
                print!("{t}");
                println!(
                    "{} grants, {}",
                    grants.len(),
                    SizeDisplay(grants.iter().map(|g| g.size_bytes).sum())
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Limits { json, action } => {
            let mut c = connect(socket).await?;
            let set = action.is_some();
            let limits = match action {
                None => c.admin.get_limits(pb::GetLimitsRequest {}).await?.into_inner(),
                Some(LimitsAction::Set { default_rank_quota, default_job_quota, jobs, ranks, devices }) => {
                    let mut req = pb::SetLimitsRequest {
                        default_rank_quota_bytes: default_rank_quota,
                        default_job_quota_bytes: default_job_quota,
                        jobs: jobs
                            .into_iter()
                            .map(|(job_id, quota_bytes)| pb::JobLimit { job_id, quota_bytes })
                            .collect(),
                        ..Default::default()
                    };
                    for (k, q) in ranks {
                        let (job, rank) = crate::config::parse_job_rank(&k).ok_or_else(|| {
                            CliError::Usage(format!("--rank {k:?}: expected JOB:RANK=SIZE"))
                        })?;
                        req.ranks.push(pb::RankLimit { job_id: job.to_string(), rank, quota_bytes: q });
                    }
                    for (k, b) in devices {
                        let mut d = pb::DeviceLimit { budget_bytes: b, ..Default::default() };
                        match k.parse::<u32>() {
                            Ok(i) => d.device_index = i,
                            Err(_) => d.device_uuid = k,
                        }
                        req.devices.push(d);
                    }
                    c.admin.set_limits(req).await?.into_inner()
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&limits_json(&limits)).expect("json"));
            } else {
                print_limits(&limits);
                if set {
                    eprintln!(
                        "in effect until graphpoold restarts; its config file's [limits] keep limits across restarts"
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan(_) => unreachable!("`plan` runs offline, before the runtime starts"),
    }
}

fn quota(b: u64) -> String {
    if b == 0 { "unlimited".into() } else { SizeDisplay(b).to_string() }
}

fn print_status(st: &pb::Status) {
    println!(
        "graphpoold {} · backend {} · instance {} · up {:.0} s",
        st.version, st.backend, st.daemon_instance, st.uptime_seconds
    );
    let mut t = Table::new(&["GPU", "UUID", "NAME", "TOTAL", "BUDGET", "GRANTED", "FREE", "DRIVER USED"]);
    for d in &st.devices {
        t.row(vec![
            d.index.to_string(),
            d.uuid.clone(),
            d.name.clone(),
            SizeDisplay(d.total_bytes).to_string(),
            SizeDisplay(d.capacity_bytes).to_string(),
            SizeDisplay(d.granted_bytes).to_string(),
            SizeDisplay(d.free_bytes).to_string(),
            if d.driver_used_bytes > 0 { SizeDisplay(d.driver_used_bytes).to_string() } else { "-".into() },
        ]);
    }
    print!("{t}");
    println!("\n{} sessions", st.sessions.len());
    if !st.sessions.is_empty() {
        let mut t = Table::new(&[
            "SESSION", "JOB", "RANK", "LOCAL", "GPU", "PID", "UID", "GRANTED", "GRANTS", "CLIENT",
        ]);
        for s in &st.sessions {
            t.row(vec![
                s.session_id.to_string(),
                s.job_id.clone(),
                s.rank.to_string(),
                s.local_rank.to_string(),
                s.device_index.to_string(),
                s.pid.to_string(),
                s.uid.to_string(),
                SizeDisplay(s.granted_bytes).to_string(),
                s.grants.to_string(),
                s.client.clone(),
            ]);
        }
        print!("{t}");
    }
}

fn print_limits(l: &pb::Limits) {
    println!("default rank quota: {}", quota(l.default_rank_quota_bytes));
    println!("default job quota:  {}", quota(l.default_job_quota_bytes));
    let mut t = Table::new(&["GPU", "UUID", "BUDGET"]);
    for d in &l.devices {
        t.row(vec![
            d.device_index.to_string(),
            d.device_uuid.clone(),
            SizeDisplay(d.budget_bytes).to_string(),
        ]);
    }
    print!("{t}");
    if !l.jobs.is_empty() || !l.ranks.is_empty() {
        let mut t = Table::new(&["JOB", "RANK", "QUOTA"]);
        for j in &l.jobs {
            t.row(vec![j.job_id.clone(), "*".into(), quota(j.quota_bytes)]);
        }
        for r in &l.ranks {
            t.row(vec![r.job_id.clone(), r.rank.to_string(), quota(r.quota_bytes)]);
        }
        print!("{t}");
    }
}

fn status_json(st: &pb::Status) -> serde_json::Value {
    json!({
        "version": st.version, "daemon_instance": st.daemon_instance, "backend": st.backend,
        "uptime_seconds": st.uptime_seconds, "fd_socket": st.fd_socket,
        "devices": st.devices.iter().map(|d| json!({
            "index": d.index, "uuid": d.uuid, "name": d.name, "total_bytes": d.total_bytes,
            "capacity_bytes": d.capacity_bytes, "granted_bytes": d.granted_bytes, "free_bytes": d.free_bytes,
            "granularity_bytes": d.granularity_bytes, "driver_used_bytes": d.driver_used_bytes,
            "driver_free_bytes": d.driver_free_bytes,
        })).collect::<Vec<_>>(),
        "sessions": st.sessions.iter().map(|s| json!({
            "session_id": s.session_id, "job_id": s.job_id, "rank": s.rank, "local_rank": s.local_rank,
            "device_index": s.device_index, "pid": s.pid, "uid": s.uid, "granted_bytes": s.granted_bytes,
            "grants": s.grants, "client": s.client, "attached_unix_seconds": s.attached_unix_seconds,
        })).collect::<Vec<_>>(),
    })
}

fn grant_json(g: &pb::Grant) -> serde_json::Value {
    json!({
        "grant_id": g.grant_id, "session_id": g.session_id, "size_bytes": g.size_bytes,
        "requested_bytes": g.requested_bytes, "device_uuid": g.device_uuid, "device_index": g.device_index,
        "label": g.label, "job_id": g.job_id, "rank": g.rank, "pid": g.pid,
        "created_unix_seconds": g.created_unix_seconds, "adopted": g.adopted, "handle_kind": g.handle_kind,
    })
}

fn limits_json(l: &pb::Limits) -> serde_json::Value {
    json!({
        "default_rank_quota_bytes": l.default_rank_quota_bytes,
        "default_job_quota_bytes": l.default_job_quota_bytes,
        "devices": l.devices.iter().map(|d| json!({"device_index": d.device_index, "device_uuid": d.device_uuid, "budget_bytes": d.budget_bytes})).collect::<Vec<_>>(),
        "jobs": l.jobs.iter().map(|j| json!({"job_id": j.job_id, "quota_bytes": j.quota_bytes})).collect::<Vec<_>>(),
        "ranks": l.ranks.iter().map(|r| json!({"job_id": r.job_id, "rank": r.rank, "quota_bytes": r.quota_bytes})).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{LimitKind, Refusal};

    fn refusal(limit: LimitKind, limit_bytes: u64) -> tonic::Status {
        let r = Refusal {
            requested_bytes: 2 << 20,
            free_bytes: 0,
            limit,
            limit_bytes,
            device: 0,
            device_uuid: "GPU-0".into(),
            top_holders: Vec::new(),
        };
        crate::service::status::refusal_status(&r, "refused".into())
    }

    #[test]
    fn refusals_are_described_in_their_units() {
        let bytes = describe_status(&refusal(LimitKind::RankQuota, 8 << 30));
        assert!(bytes.contains("still allowed by rank-quota (limit 8 GiB)"), "{bytes}");
        let grants = describe_status(&refusal(LimitKind::SessionGrants, 64));
        assert!(grants.contains("at most 64 grants"), "{grants}");
        assert!(!grants.contains(" B"), "a grant count is not a size: {grants}");
    }
}
