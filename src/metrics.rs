//! Prometheus metrics.
//!
//! Counters and histograms (requests, refusals, latencies, ended sessions) go through the
//! `metrics` facade into `metrics-exporter-prometheus`. Everything that describes the current
//! state (capacity, granted, free, holders, plans) is rendered from a ledger snapshot at
//! scrape time, so a series disappears the moment its job or rank does and a scrape never
//! shows stale holders. Labels `gpu`, `UUID` and `Hostname` join with dcgm-exporter.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::backend::DeviceInfo;
use crate::ledger::{EndReason, Ledger, LimitKind, Refusal};
use crate::service::segments::Transport;
use crate::shutdown::Shutdown;

/// Latency buckets of `graphpool_request_duration_seconds`, from 10 µs to 10 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 10.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The daemon's metrics: a recorder handle plus the ledger it renders gauges from.
#[derive(Debug)]
pub struct Metrics {
    handle: PrometheusHandle,
    hostname: String,
    backend: &'static str,
}

impl Metrics {
    /// Installs the process-wide recorder (once) and returns the metrics of this daemon.
    pub fn new(backend: &'static str) -> Arc<Metrics> {
        let handle = HANDLE
            .get_or_init(|| {
                let recorder = PrometheusBuilder::new()
                    .set_buckets_for_metric(
                        Matcher::Full("graphpool_request_duration_seconds".into()),
                        LATENCY_BUCKETS,
                    )
                    .expect("static buckets are valid")
                    .build_recorder();
                let handle = recorder.handle();
                // Fails only if another recorder is installed (tests): then metrics go there.
                let _ = metrics::set_global_recorder(recorder);
                handle
            })
            .clone();
        Arc::new(Metrics { handle, hostname: hostname(), backend })
    }

    /// Records one request: its method, the transport it came in on (`grpc`, `fd-socket`),
    /// its gRPC code name and the daemon's time handling it.
    pub fn request(
        &self,
        method: &'static str,
        transport: &'static str,
        code: &'static str,
        elapsed: Duration,
    ) {
        metrics::counter!("graphpool_requests_total", "method" => method, "transport" => transport, "code" => code)
            .increment(1);
        metrics::histogram!("graphpool_request_duration_seconds", "method" => method, "transport" => transport)
            .record(elapsed.as_secs_f64());
    }

    /// Records a refusal.
    pub fn refusal(&self, r: &Refusal) {
        self.refusals(r.limit, r.device, &r.device_uuid).increment(1);
    }

    fn refusals(&self, limit: LimitKind, device: u32, uuid: &str) -> metrics::Counter {
        metrics::counter!(
            "graphpool_refusals_total",
            "reason" => limit.as_str(),
            "gpu" => device.to_string(),
            "UUID" => uuid.to_string(),
            "Hostname" => self.hostname.clone()
        )
    }

    /// Records a connection closed at accept because its uid held as many as it may on that
    /// socket ([`crate::conn_limit`]); `transport` is `grpc` or `fd-socket`.
    pub fn connection_refused(&self, transport: &'static str) {
        metrics::counter!("graphpool_connections_refused_total", "transport" => transport).increment(1);
    }

    /// Records a connection closed at accept because its peer's uid and gid are not on the
    /// allow-list (`access.allowed_uids` / `access.allowed_gids`); `transport` is `grpc` or
    /// `fd-socket`.
    pub fn peer_refused(&self, transport: &'static str) {
        metrics::counter!("graphpool_peers_refused_total", "transport" => transport).increment(1);
    }

    /// Exports the refusal, session-end and connection-refusal counters at 0 for every reason,
    /// device and transport before anything happens: a counter that first appears at 1 hides
    /// that first event from `rate()` and `increase()`, so a single refusal would never reach
    /// the alerts.
    pub fn start_counters(&self, devices: &[DeviceInfo]) {
        for d in devices {
            for limit in LimitKind::ALL {
                self.refusals(limit, d.index, &d.uuid).increment(0);
            }
        }
        for reason in EndReason::ALL {
            metrics::counter!("graphpool_sessions_ended_total", "reason" => reason.as_str()).increment(0);
        }
        for transport in [Transport::Grpc, Transport::FdSocket] {
            metrics::counter!("graphpool_connections_refused_total", "transport" => transport.as_str())
                .increment(0);
            metrics::counter!("graphpool_peers_refused_total", "transport" => transport.as_str())
                .increment(0);
        }
    }

    /// Records the end of a session.
    pub fn session_ended(&self, reason: EndReason) {
        metrics::counter!("graphpool_sessions_ended_total", "reason" => reason.as_str()).increment(1);
    }

    /// Folds recorded histogram samples into their buckets. Samples are buffered until this
    /// runs (or a scrape renders them), so it must run periodically even when nobody scrapes.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    /// The full exposition: counters and histograms, then state gauges from `ledger`.
    pub fn render(&self, ledger: &Ledger) -> String {
        let mut out = self.handle.render();
        self.render_state(ledger, &mut out);
        out
    }

    fn render_state(&self, ledger: &Ledger, out: &mut String) {
        let host = escape(&self.hostname);
        let mut gauge = |name: &str, help: &str, rows: Vec<(String, u64)>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (labels, v) in rows {
                let _ = writeln!(out, "{name}{{{labels}}} {v}");
            }
        };
        gauge(
            "graphpool_build_info",
            "Version and backend of the running daemon.",
            vec![(format!("version=\"{}\",backend=\"{}\"", env!("CARGO_PKG_VERSION"), self.backend), 1)],
        );
        let devices = ledger.devices();
        let dl = |d: &crate::ledger::DeviceView| {
            format!("gpu=\"{}\",UUID=\"{}\",Hostname=\"{host}\"", d.info.index, escape(&d.info.uuid))
        };
        let per_dev = |f: &dyn Fn(&crate::ledger::DeviceView) -> u64| -> Vec<(String, u64)> {
            devices.iter().map(|d| (dl(d), f(d))).collect()
        };
        gauge(
            "graphpool_device_capacity_bytes",
            "Device memory graphpool may manage.",
            per_dev(&|d| ledger.backend().capacity_bytes(d.info.index).unwrap_or(0)),
        );
        gauge(
            "graphpool_device_budget_bytes",
            "Graphpool's budget on the device.",
            per_dev(&|d| d.budget_bytes),
        );
        gauge("graphpool_device_granted_bytes", "Bytes granted to sessions.", per_dev(&|d| d.granted_bytes));
        gauge(
            "graphpool_device_free_bytes",
            "Bytes that can still be admitted.",
            per_dev(&|d| d.free_bytes()),
        );
        gauge(
            "graphpool_device_planned_bytes",
            "Bytes reserved by budgets and plans beyond what is granted.",
            per_dev(&|d| d.planned_bytes),
        );
        gauge("graphpool_grants", "Grants held.", per_dev(&|d| u64::from(d.grants)));
        gauge(
            "graphpool_device_warm_bytes",
            "Bytes created and exported ahead of requests (warm stock), within the budget's headroom.",
            per_dev(&|d| ledger.backend().idle_bytes(d.info.index)),
        );
        let driver: Vec<(String, u64)> = devices
            .iter()
            .filter_map(|d| ledger.backend().driver_memory(d.info.index).map(|m| (dl(d), m.used_bytes)))
            .collect();
        if !driver.is_empty() {
            gauge(
                "graphpool_device_driver_used_bytes",
                "Device memory in use, all processes (NVML).",
                driver,
            );
        }

        let sessions = ledger.sessions();
        gauge(
            "graphpool_sessions",
            "Sessions attached.",
            vec![(format!("Hostname=\"{host}\""), sessions.len() as u64)],
        );
        let mut jobs: std::collections::BTreeMap<&str, u64> = Default::default();
        let mut ranks: std::collections::BTreeMap<(&str, u32, u32), u64> = Default::default();
        for s in &sessions {
            *jobs.entry(&s.job_id).or_default() += s.granted_bytes;
            *ranks.entry((&s.job_id, s.rank, s.device)).or_default() += s.granted_bytes;
        }
        let uuid = |d: u32| devices.get(d as usize).map(|d| escape(&d.info.uuid)).unwrap_or_default();
        gauge(
            "graphpool_job_granted_bytes",
            "Bytes granted per job.",
            jobs.iter().map(|(j, v)| (format!("job_id=\"{}\",Hostname=\"{host}\"", escape(j)), *v)).collect(),
        );
        gauge(
            "graphpool_rank_granted_bytes",
            "Bytes granted per job, rank and device.",
            ranks
                .iter()
                .map(|((j, r, d), v)| {
                    (
                        format!(
                            "job_id=\"{}\",rank=\"{r}\",gpu=\"{d}\",UUID=\"{}\",Hostname=\"{host}\"",
                            escape(j),
                            uuid(*d)
                        ),
                        *v,
                    )
                })
                .collect(),
        );
        let plan_rows = |pick: fn((u64, u64)) -> u64| -> Vec<(String, u64)> {
            let mut m: std::collections::BTreeMap<(&str, u32, u32), u64> = Default::default();
            for s in &sessions {
                if let Some(p) = s.plan {
                    *m.entry((&s.job_id, s.rank, s.device)).or_default() += pick(p);
                }
            }
            m.iter()
                .map(|((j, r, d), v)| {
                    (
                        format!(
                            "job_id=\"{}\",rank=\"{r}\",gpu=\"{d}\",UUID=\"{}\",Hostname=\"{host}\"",
                            escape(j),
                            uuid(*d)
                        ),
                        *v,
                    )
                })
                .collect()
        };
        gauge("graphpool_plan_bytes", "Footprint of the latest plan per live session.", plan_rows(|p| p.0));
        gauge(
            "graphpool_plan_saved_bytes",
            "Bytes saved by aliasing in the latest plan.",
            plan_rows(|p| p.1),
        );
        let orphaned = sessions
            .iter()
            .filter(|s| !std::path::Path::new(&format!("/proc/{}", s.peer.pid)).exists())
            .map(|s| u64::from(s.grants))
            .sum();
        gauge(
            "graphpool_orphaned_grants",
            "Grants held by sessions whose process is gone (should be 0).",
            vec![(format!("Hostname=\"{host}\""), orphaned)],
        );
        let (rss, fds) = process_figures();
        gauge(
            "graphpool_process_resident_memory_bytes",
            "Resident memory of the daemon.",
            vec![(String::new(), rss)],
        );
        gauge(
            "graphpool_process_open_fds",
            "Open file descriptors of the daemon.",
            vec![(String::new(), fds)],
        );
        if let Ok((soft, _)) = crate::fd_limit::open_file_limit() {
            gauge(
                "graphpool_process_max_fds",
                "The daemon's open-file limit (soft RLIMIT_NOFILE).",
                vec![(String::new(), soft)],
            );
        }
    }
}

/// Resident bytes and open fds of this process, from /proc/self.
pub fn process_figures() -> (u64, u64) {
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        // SAFETY: sysconf has no preconditions.
        .map(|pages| pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64)
        .unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0);
    (rss, fds)
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn hostname() -> String {
    if let Ok(h) = std::env::var("GRAPHPOOL_HOSTNAME") {
        return h;
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default()
}

/// Serves `GET /metrics` (and `GET /healthz`) on `addr` until `shutdown` fires.
///
/// An accept that fails (the daemon is out of fds, say) is logged, at most once every
/// [`crate::conn_limit::WARNING_INTERVAL`], and the next one waits
/// [`crate::server::ACCEPT_ERROR_PAUSE`]: the connection that could not be taken stays
/// queued, so accepting again at once would fail again at once.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, ledger: Arc<Ledger>, shutdown: Shutdown) {
    let mut accept_failures = crate::conn_limit::Warnings::default();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait() => return,
        };
        let mut conn = match accepted {
            Ok((conn, _)) => conn,
            Err(e) => {
                if let Some(unlogged) = accept_failures.due(std::time::Instant::now()) {
                    tracing::warn!(error = %e, unlogged, "metrics listener accept failed");
                }
                tokio::select! {
                    _ = tokio::time::sleep(crate::server::ACCEPT_ERROR_PAUSE) => continue,
                    _ = shutdown.wait() => return,
                }
            }
        };
        let (metrics, ledger) = (metrics.clone(), ledger.clone());
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
                    let n = conn.read(&mut chunk).await?;
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                Ok::<_, std::io::Error>(())
            })
            .await;
            if !matches!(read, Ok(Ok(()))) {
                return;
            }
            let line = buf.split(|b| *b == b'\n').next().unwrap_or_default();
            let line = String::from_utf8_lossy(line);
            let mut parts = line.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let path = path.split('?').next().unwrap_or("");
            let (status, ctype, body) = match (method, path) {
                ("GET", "/metrics") => {
                    ("200 OK", "text/plain; version=0.0.4; charset=utf-8", metrics.render(&ledger))
                }
                ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".to_string()),
                ("GET", _) => ("404 Not Found", "text/plain", "try /metrics\n".to_string()),
                _ => ("405 Method Not Allowed", "text/plain", "GET only\n".to_string()),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(body.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

/// Binds the metrics listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;
    use crate::backend::{BackendError, BackendKind, DeviceBackend, DeviceInfo, DriverMemory, Segment};
    use crate::config::{GuardsConfig, HostConfig, LimitsConfig};

    const GIB: u64 = 1 << 30;

    /// Devices of 8 GiB of which 2 GiB are reserved, as the cuda backend's `reserve` does.
    #[derive(Debug)]
    struct Reserving(HostBackend);

    impl DeviceBackend for Reserving {
        fn kind(&self) -> BackendKind {
            self.0.kind()
        }
        fn devices(&self) -> &[DeviceInfo] {
            self.0.devices()
        }
        fn allocate(&self, device: u32, size: u64, headroom: u64) -> Result<Box<dyn Segment>, BackendError> {
            self.0.allocate(device, size, headroom)
        }
        fn driver_memory(&self, _device: u32) -> Option<DriverMemory> {
            None
        }
        fn capacity_bytes(&self, device: u32) -> Option<u64> {
            self.0.capacity_bytes(device).map(|c| c - 2 * GIB)
        }
    }

    fn gauge(text: &str, name: &str) -> Vec<u64> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect()
    }

    #[test]
    fn refusal_session_end_and_connection_counters_start_at_zero() {
        let host =
            HostBackend::new(&HostConfig { devices: 2, capacity_bytes: 8 * GIB, granularity_bytes: 2 << 20 })
                .unwrap();
        let metrics = Metrics::new("host");
        metrics.start_counters(host.devices());
        let text = metrics.handle.render();
        for limit in LimitKind::ALL {
            for gpu in ["0", "1"] {
                let series = format!("reason=\"{}\"", limit.as_str());
                assert!(
                    text.lines().any(|l| l.starts_with("graphpool_refusals_total{")
                        && l.contains(&series)
                        && l.contains(&format!("gpu=\"{gpu}\""))),
                    "{series} gpu {gpu}: {text}"
                );
            }
        }
        for reason in EndReason::ALL {
            let series = format!("graphpool_sessions_ended_total{{reason=\"{}\"}}", reason.as_str());
            assert!(text.lines().any(|l| l.starts_with(&series)), "{series}: {text}");
        }
        for transport in ["grpc", "fd-socket"] {
            for counter in ["graphpool_connections_refused_total", "graphpool_peers_refused_total"] {
                let series = format!("{counter}{{transport=\"{transport}\"}}");
                assert!(text.lines().any(|l| l.starts_with(&series)), "{series}: {text}");
            }
        }
    }

    #[test]
    fn device_capacity_is_what_graphpool_may_manage_not_the_total() {
        let host =
            HostBackend::new(&HostConfig { devices: 1, capacity_bytes: 8 * GIB, granularity_bytes: 2 << 20 })
                .unwrap();
        let ledger =
            Ledger::new(Arc::new(Reserving(host)), &LimitsConfig::default(), GuardsConfig::default())
                .unwrap();
        let text = Metrics::new("host").render(&ledger);
        assert_eq!(gauge(&text, "graphpool_device_capacity_bytes"), [6 * GIB]);
        assert_eq!(gauge(&text, "graphpool_device_budget_bytes"), [6 * GIB]);
        assert_eq!(gauge(&text, "graphpool_device_free_bytes"), [6 * GIB]);
    }
}
