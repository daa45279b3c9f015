//! Shared harness of the graphpool fuzz targets: an in-process daemon (ledger over the host
//! backend, the real gRPC service implementations, the real fd broker) driven without a
//! network, and the invariants every target checks after each step.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use graphpool::backend::host::HostBackend;
use graphpool::config::{AccessConfig, GuardsConfig, HostConfig, LimitsConfig};
use graphpool::ledger::Ledger;
use graphpool::metrics::Metrics;
use graphpool::service::Shared;
use graphpool::service::admin::AdminService;
use graphpool::service::graphpool::{GraphpoolService, PlanLimits};
use graphpool::service::sessions::SessionRegistry;
use tonic::transport::server::UdsConnectInfo;

const MIB: u64 = 1 << 20;

/// One current-thread runtime for the whole fuzz process.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime"))
}

/// This process's own credentials as the daemon sees them on a Unix socket.
pub fn own_cred() -> tokio::net::unix::UCred {
    static CRED: OnceLock<tokio::net::unix::UCred> = OnceLock::new();
    *CRED.get_or_init(|| {
        runtime().block_on(async {
            let (a, _b) = tokio::net::UnixStream::pair().expect("socketpair");
            a.peer_cred().expect("SO_PEERCRED")
        })
    })
}

/// A `tonic::Request` as the server would hand it to the service: with the peer's
/// credentials (`None`: a peer whose pid is not visible).
pub fn request<T>(msg: T, cred: Option<tokio::net::unix::UCred>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.extensions_mut().insert(UdsConnectInfo { peer_addr: None, peer_cred: cred });
    r
}

/// An in-process daemon: the ledger, and the two gRPC services over it.
pub struct Daemon {
    pub ledger: Arc<Ledger>,
    pub sessions: Arc<SessionRegistry>,
    pub graphpool: GraphpoolService,
    pub admin: AdminService,
    pub metrics: Arc<Metrics>,
}

/// Small guards so that inputs reach the limits.
pub fn guards() -> GuardsConfig {
    GuardsConfig {
        max_sessions_per_uid: 8,
        max_grants_per_session: 16,
        max_plan_buffers: 64,
        ..Default::default()
    }
}

impl Daemon {
    /// Two host devices of 64 MiB (2 MiB granularity), a rank quota of 48 MiB.
    pub fn new() -> Daemon {
        let backend = HostBackend::new(&HostConfig {
            devices: 2,
            capacity_bytes: 64 * MIB,
            granularity_bytes: 2 * MIB,
        })
        .expect("host backend");
        let limits = LimitsConfig { default_rank_quota_bytes: 48 * MIB, ..Default::default() };
        let ledger = Arc::new(Ledger::new(Arc::new(backend), &limits, guards()).expect("ledger"));
        let metrics = Metrics::new("host");
        let sessions = Arc::new(SessionRegistry::default());
        let shared = Shared {
            ledger: ledger.clone(),
            metrics: metrics.clone(),
            access: AccessConfig::default(),
            sessions: sessions.clone(),
        };
        let plans = PlanLimits {
            time_budget: Duration::from_millis(1),
            max_buffers: guards().max_plan_buffers,
            max_response_bytes: guards().max_message_bytes,
            // Plans of a millisecond on one thread: no thread spawned per plan and input.
            cores: 1,
        };
        let graphpool =
            GraphpoolService::new(shared.clone(), "/nonexistent/graphpool-fd.sock".into(), "fuzz".into(), plans);
        Daemon { ledger, sessions, graphpool, admin: AdminService::new(shared), metrics }
    }

    /// The ledger's invariants: device figures equal the sum of the grants; the grants of
    /// each session add up to what the session is charged for.
    pub fn check(&self) {
        let grants = self.ledger.grants(None, None);
        for d in self.ledger.devices() {
            let on: Vec<_> = grants.iter().filter(|g| g.device == d.info.index).collect();
            let sum: u64 = on.iter().map(|g| g.size_bytes).sum();
            assert_eq!(sum, d.granted_bytes, "device {} granted bytes != sum of its grants", d.info.index);
            assert_eq!(on.len() as u32, d.grants, "device {} grant count", d.info.index);
            assert!(d.charged_bytes >= d.granted_bytes);
        }
        let sessions = self.ledger.sessions();
        for s in &sessions {
            let mine: Vec<_> = grants.iter().filter(|g| g.session == s.id).collect();
            assert_eq!(mine.iter().map(|g| g.size_bytes).sum::<u64>(), s.granted_bytes, "session {}", s.id);
            assert_eq!(mine.len() as u32, s.grants);
            assert!(mine.len() <= guards().max_grants_per_session as usize);
        }
        for g in &grants {
            assert!(sessions.iter().any(|s| s.id == g.session), "grant {} of no session", g.id);
            assert!(g.adopted || g.size_bytes % (2 * MIB) == 0, "grant {} not rounded", g.id);
        }
    }

    /// Waits (bounded) until every session whose stream was dropped has ended, then checks
    /// that nothing is left.
    pub fn check_drained(&self) {
        runtime().block_on(async {
            for _ in 0..1000 {
                if self.ledger.sessions().is_empty() && self.sessions.is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_micros(50)).await;
            }
        });
        assert!(self.ledger.sessions().is_empty(), "sessions outlive their streams");
        assert!(self.ledger.grants(None, None).is_empty(), "grants outlive their sessions");
        assert!(self.ledger.devices().iter().all(|d| d.granted_bytes == 0 && d.charged_bytes == 0));
    }
}

impl Default for Daemon {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads bytes off the front of a fuzz input.
#[derive(Debug)]
pub struct Bytes<'a>(pub &'a [u8]);

impl<'a> Bytes<'a> {
    pub fn u8(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }

    /// A length-prefixed (one byte) chunk.
    pub fn chunk(&mut self) -> Option<&'a [u8]> {
        let n = usize::from(self.u8()?).min(self.0.len());
        let (c, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(c)
    }
}

/// Maps small ids in a decoded request onto ids that exist, so that inputs reach live
/// sessions and grants; large ids are kept (unknown ids are part of the input space too).
pub fn pick(id: u64, known: &[u64]) -> u64 {
    if id > 0 && id <= 32 && !known.is_empty() { known[(id as usize - 1) % known.len()] } else { id }
}
