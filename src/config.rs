//! Daemon configuration, parsed in one place.
//!
//! Precedence, lowest to highest: embedded defaults, the TOML file (`--config` or
//! `GRAPHPOOL_CONFIG`), environment variables, command-line flags. [`Config::load`] is the
//! only place that reads any of them; the rest of the daemon takes a [`Config`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::units::parse_size;

/// Default path of the daemon's gRPC socket when `/run/graphpool` can be used.
pub const SYSTEM_SOCKET: &str = "/run/graphpool/graphpool.sock";
/// File name of the fd socket, next to the gRPC socket unless configured.
pub const FD_SOCKET_NAME: &str = "graphpool-fd.sock";
/// Default metrics listen address.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9478";

/// Which device backend to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA when a driver and a GPU are present, otherwise host.
    Auto,
    /// CUDA VMM; fails to start without a GPU.
    Cuda,
    /// memfd-backed simulated devices.
    Host,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Command-line flags of `graphpoold`. Every flag can also be set in the environment.
#[derive(Debug, Clone, Default, clap::Parser)]
#[command(
    name = "graphpoold",
    version,
    about = "graphpoold: owns, bounds and exports the GPU memory of CUDA graph capture"
)]
pub struct DaemonArgs {
    /// TOML configuration file.
    #[arg(long, env = "GRAPHPOOL_CONFIG")]
    pub config: Option<PathBuf>,
    /// Path of the gRPC Unix socket.
    #[arg(long, env = "GRAPHPOOL_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Path of the fd-passing Unix socket (default: next to --socket).
    #[arg(long, env = "GRAPHPOOL_FD_SOCKET")]
    pub fd_socket: Option<PathBuf>,
    /// Device backend.
    #[arg(long, env = "GRAPHPOOL_BACKEND", value_enum)]
    pub backend: Option<BackendChoice>,
    /// Address for the Prometheus metrics endpoint (`off` disables it).
    #[arg(long, env = "GRAPHPOOL_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Log format.
    #[arg(long, env = "GRAPHPOOL_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Host backend: number of simulated devices.
    #[arg(long, env = "GRAPHPOOL_HOST_DEVICES")]
    pub host_devices: Option<u32>,
    /// Host backend: capacity of each simulated device (e.g. 16GiB).
    #[arg(long, env = "GRAPHPOOL_HOST_CAPACITY")]
    pub host_capacity: Option<String>,
    /// Group that owns the sockets (mode 0660).
    #[arg(long, env = "GRAPHPOOL_SOCKET_GROUP")]
    pub socket_group: Option<String>,
}

/// Errors reading the configuration. Each names the key or flag at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid TOML or has unknown keys.
    #[error("config file {path} is invalid: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A value is out of range or malformed.
    #[error("invalid value for {key}: {message}")]
    Invalid {
        /// The key, as written in the file or as the flag.
        key: String,
        /// What is wrong and what is expected.
        message: String,
    },
    /// No socket location could be found.
    #[error(
        "no socket path: /run/graphpool is not writable and XDG_RUNTIME_DIR is not set; pass --socket PATH"
    )]
    NoSocketPath,
}

/// The daemon's whole configuration, after defaults, file, environment and flags.
#[derive(Debug, Clone)]
pub struct Config {
    /// gRPC socket path.
    pub socket: PathBuf,
    /// fd-passing socket path.
    pub fd_socket: PathBuf,
    /// Mode of both sockets.
    pub socket_mode: u32,
    /// Group of both sockets (name or numeric gid); None keeps the daemon's group.
    pub socket_group: Option<String>,
    /// Device backend.
    pub backend: BackendChoice,
    /// Metrics endpoint; None disables it.
    pub metrics_listen: Option<SocketAddr>,
    /// Log format.
    pub log_format: LogFormat,
    /// Peers allowed to connect.
    pub access: AccessConfig,
    /// Quotas and budgets.
    pub limits: LimitsConfig,
    /// Protection against clients that would exhaust the daemon.
    pub guards: GuardsConfig,
    /// Host backend settings.
    pub host: HostConfig,
    /// CUDA backend settings.
    pub cuda: CudaConfig,
    /// How long shutdown waits for sessions to detach.
    pub drain_timeout: Duration,
    /// Default time box of the planner's improvement stage.
    pub plan_time_budget: Duration,
    /// Cores the daemon's plans use between them (`plan_cores`; default every core of the
    /// node): they plan one per two of them at once, each on its share.
    pub plan_cores: usize,
}

/// Who may talk to the daemon.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessConfig {
    /// uids allowed to attach. Empty together with `allowed_gids` = anyone who can open the
    /// socket (its mode and group are then the only gate).
    pub allowed_uids: Vec<u32>,
    /// gids allowed to attach (the peer's primary gid).
    pub allowed_gids: Vec<u32>,
    /// uids allowed to change limits and list every grant. The daemon's own uid and root
    /// are always admins.
    pub admin_uids: Vec<u32>,
}

impl AccessConfig {
    /// Whether a peer with this uid/gid may use the daemon.
    pub fn allows(&self, uid: u32, gid: u32) -> bool {
        if self.allowed_uids.is_empty() && self.allowed_gids.is_empty() {
            return true;
        }
        uid == 0 || self.allowed_uids.contains(&uid) || self.allowed_gids.contains(&gid)
    }

    /// Whether a peer with this uid may use admin calls.
    pub fn is_admin(&self, uid: u32) -> bool {
        uid == 0 || uid == current_uid() || self.admin_uids.contains(&uid)
    }
}

/// Quotas and budgets at start-up; the Admin service can change them at run time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitsConfig {
    /// Quota of every rank without its own, bytes; 0 = unlimited.
    pub default_rank_quota_bytes: u64,
    /// Quota of every job without its own, bytes; 0 = unlimited.
    pub default_job_quota_bytes: u64,
    /// Per-job quotas.
    pub jobs: BTreeMap<String, u64>,
    /// Per-rank quotas, by job and rank.
    pub ranks: BTreeMap<(String, u32), u64>,
    /// Device budgets by index or UUID ("0", "GPU-..."); default is the device's capacity.
    pub devices: BTreeMap<String, u64>,
}

/// Limits on what one client can take from the daemon itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardsConfig {
    /// Sessions one uid may hold at once.
    pub max_sessions_per_uid: u32,
    /// Grants one session may hold at once.
    pub max_grants_per_session: u32,
    /// Largest gRPC message accepted or sent, bytes (a plan larger than this is refused before
    /// it is reserved; `PlanCaptureRequest.summary_only` leaves its buffers out).
    pub max_message_bytes: usize,
    /// Largest plan input accepted (buffers or layers × microbatches).
    pub max_plan_buffers: usize,
}

impl Default for GuardsConfig {
    fn default() -> Self {
        GuardsConfig {
            max_sessions_per_uid: 512,
            max_grants_per_session: 16_384,
            max_message_bytes: 16 << 20,
            max_plan_buffers: 1_000_000,
        }
    }
}

/// Host backend settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostConfig {
    /// Number of simulated devices.
    pub devices: u32,
    /// Capacity of each, bytes. memfd pages are only committed when written, so this may
    /// exceed the machine's RAM.
    pub capacity_bytes: u64,
    /// Allocation granularity, bytes.
    pub granularity_bytes: u64,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig { devices: 2, capacity_bytes: 64 << 30, granularity_bytes: 2 << 20 }
    }
}

/// CUDA backend settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaConfig {
    /// Bytes of each device that graphpool never grants (left to the training processes'
    /// own contexts and allocators).
    pub reserve_bytes: u64,
    /// Only these devices (indices or UUIDs); empty = all.
    pub devices: Vec<String>,
    /// Most bytes per device kept created and exported ahead of requests; always within the
    /// device budget's headroom. 0 (the default) disables the warm stock: its idle segments
    /// are device memory no rank asked for.
    pub warm_stock_bytes: u64,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig { reserve_bytes: 4 << 30, devices: Vec::new(), warm_stock_bytes: 0 }
    }
}

/// Largest capacity of a host-backend device (1024 TiB).
pub const MAX_HOST_CAPACITY: u64 = 1 << 50;

// ---- the TOML file -------------------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    socket: Option<PathBuf>,
    fd_socket: Option<PathBuf>,
    socket_mode: Option<String>,
    socket_group: Option<String>,
    backend: Option<BackendChoice>,
    metrics_listen: Option<String>,
    log_format: Option<LogFormat>,
    drain_timeout_seconds: Option<f64>,
    plan_time_budget_ms: Option<u64>,
    plan_cores: Option<usize>,
    #[serde(default)]
    access: FileAccess,
    #[serde(default)]
    limits: FileLimits,
    #[serde(default)]
    guards: FileGuards,
    #[serde(default)]
    host: FileHost,
    #[serde(default)]
    cuda: FileCuda,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileAccess {
    allowed_uids: Option<Vec<u32>>,
    allowed_gids: Option<Vec<u32>>,
    admin_uids: Option<Vec<u32>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLimits {
    default_rank_quota: Option<SizeValue>,
    default_job_quota: Option<SizeValue>,
    #[serde(default)]
    jobs: BTreeMap<String, SizeValue>,
    #[serde(default)]
    ranks: BTreeMap<String, SizeValue>,
    #[serde(default)]
    devices: BTreeMap<String, SizeValue>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileGuards {
    max_sessions_per_uid: Option<u32>,
    max_grants_per_session: Option<u32>,
    max_message_bytes: Option<SizeValue>,
    max_plan_buffers: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileHost {
    devices: Option<u32>,
    capacity: Option<SizeValue>,
    granularity: Option<SizeValue>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileCuda {
    reserve: Option<SizeValue>,
    devices: Option<Vec<String>>,
    warm_stock: Option<SizeValue>,
}

/// The bytes of a job's or rank's own quota at `key`: more than 0, since 0 means "no quota
/// of its own" to SetLimits, and written in the file it would lift the default quota off
/// `what` (`default` names the key of that default, `limits.default_{default}_quota`).
fn own_quota(key: &str, v: &SizeValue, what: &str, default: &str) -> Result<u64, ConfigError> {
    match v.bytes(key)? {
        0 => {
            Err(invalid(key, format!("more than 0; leave {what} out to use limits.default_{default}_quota")))
        }
        bytes => Ok(bytes),
    }
}

/// A rank named `JOB:RANK`, as rank quotas are written in the file and on the command line:
/// the rank follows the last ':' (job ids may hold one). `None` unless RANK is a number.
pub fn parse_job_rank(key: &str) -> Option<(&str, u32)> {
    let (job, rank) = key.rsplit_once(':')?;
    Some((job, rank.parse().ok()?))
}

/// A size in the file: a byte count or a string with a unit.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn bytes(&self, key: &str) -> Result<u64, ConfigError> {
        match self {
            SizeValue::Bytes(b) => Ok(*b),
            SizeValue::Text(t) => parse_size(t).map_err(|e| invalid(key, e.to_string())),
        }
    }
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_string(), message: message.into() }
}

impl Config {
    /// Reads the configuration: defaults, then the file named by `--config`/`GRAPHPOOL_CONFIG`
    /// (if any), then flags and environment (clap has already merged those two).
    pub fn load(args: &DaemonArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| ConfigError::Read { path: path.clone(), source })?;
                Self::parse_file(path, &text)?
            }
            None => FileConfig::default(),
        };
        Self::build(file, args)
    }

    /// Parses a configuration from TOML text with no flags (for tests).
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let file = Self::parse_file(Path::new("<inline>"), text)?;
        Self::build(file, &DaemonArgs::default())
    }

    fn parse_file(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
        toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })
    }

    fn build(file: FileConfig, args: &DaemonArgs) -> Result<Config, ConfigError> {
        let socket = match args.socket.clone().or(file.socket) {
            Some(p) => p,
            None => default_socket_path()?,
        };
        if socket.as_os_str().len() > 107 {
            return Err(invalid("socket", "a Unix socket path must be at most 107 bytes"));
        }
        let fd_socket = args
            .fd_socket
            .clone()
            .or(file.fd_socket)
            .unwrap_or_else(|| socket.with_file_name(FD_SOCKET_NAME));
        if fd_socket == socket {
            return Err(invalid("fd_socket", "must differ from socket"));
        }
        if fd_socket.as_os_str().len() > 107 {
            return Err(invalid(
                "fd_socket",
                format!(
                    "{} is longer than the 107 bytes a Unix socket path may have (by default it is \
                     {FD_SOCKET_NAME} next to socket); set a shorter fd_socket or socket",
                    fd_socket.display()
                ),
            ));
        }
        let socket_mode = match file.socket_mode {
            Some(m) => u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .ok()
                .filter(|m| *m <= 0o777)
                .ok_or_else(|| invalid("socket_mode", "an octal mode such as \"0660\""))?,
            None => 0o660,
        };
        let metrics_listen = match args.metrics_listen.clone().or(file.metrics_listen) {
            Some(s) if s == "off" || s.is_empty() => None,
            Some(s) => Some(s.parse::<SocketAddr>().map_err(|e| {
                invalid("metrics_listen", format!("{s:?} is not ADDR:PORT ({e}); use \"off\" to disable"))
            })?),
            None => Some(DEFAULT_METRICS_LISTEN.parse().expect("valid default")),
        };

        let limits = LimitsConfig {
            default_rank_quota_bytes: opt_size(&file.limits.default_rank_quota, "limits.default_rank_quota")?
                .unwrap_or(0),
            default_job_quota_bytes: opt_size(&file.limits.default_job_quota, "limits.default_job_quota")?
                .unwrap_or(0),
            jobs: file
                .limits
                .jobs
                .iter()
                .map(|(k, v)| {
                    // A key no job id can match would be a quota that never applies.
                    crate::service::validate::job_id(k)
                        .map_err(|e| invalid(&format!("limits.jobs.{k:?}"), e.message()))?;
                    let bytes = own_quota(&format!("limits.jobs.{k}"), v, "the job", "job")?;
                    Ok((k.clone(), bytes))
                })
                .collect::<Result<_, ConfigError>>()?,
            ranks: file
                .limits
                .ranks
                .iter()
                .map(|(k, v)| {
                    let key = format!("limits.ranks.{k:?}");
                    let (job, rank) = parse_job_rank(k).ok_or_else(|| {
                        invalid(&key, "a key \"JOB:RANK\" with RANK a number, e.g. \"train:0\"")
                    })?;
                    crate::service::validate::job_id(job).map_err(|e| invalid(&key, e.message()))?;
                    Ok(((job.to_string(), rank), own_quota(&key, v, "the rank", "rank")?))
                })
                .collect::<Result<_, ConfigError>>()?,
            devices: file
                .limits
                .devices
                .iter()
                .map(|(k, v)| Ok((k.clone(), v.bytes(&format!("limits.devices.{k}"))?)))
                .collect::<Result<_, ConfigError>>()?,
        };

        let defaults = GuardsConfig::default();
        let guards = GuardsConfig {
            max_sessions_per_uid: file.guards.max_sessions_per_uid.unwrap_or(defaults.max_sessions_per_uid),
            max_grants_per_session: file
                .guards
                .max_grants_per_session
                .unwrap_or(defaults.max_grants_per_session),
            max_message_bytes: match &file.guards.max_message_bytes {
                Some(v) => usize::try_from(v.bytes("guards.max_message_bytes")?)
                    .map_err(|_| invalid("guards.max_message_bytes", "too large"))?,
                None => defaults.max_message_bytes,
            },
            max_plan_buffers: file.guards.max_plan_buffers.unwrap_or(defaults.max_plan_buffers),
        };
        if guards.max_sessions_per_uid == 0 {
            return Err(invalid("guards.max_sessions_per_uid", "must be at least 1"));
        }
        if guards.max_grants_per_session == 0 {
            return Err(invalid("guards.max_grants_per_session", "must be at least 1"));
        }
        if guards.max_message_bytes < 4096 {
            return Err(invalid("guards.max_message_bytes", "must be at least 4KiB"));
        }
        if guards.max_plan_buffers == 0 {
            return Err(invalid("guards.max_plan_buffers", "must be at least 1"));
        }

        let hd = HostConfig::default();
        let host = HostConfig {
            devices: args.host_devices.or(file.host.devices).unwrap_or(hd.devices),
            capacity_bytes: match &args.host_capacity {
                Some(s) => parse_size(s).map_err(|e| invalid("--host-capacity", e.to_string()))?,
                None => opt_size(&file.host.capacity, "host.capacity")?.unwrap_or(hd.capacity_bytes),
            },
            granularity_bytes: opt_size(&file.host.granularity, "host.granularity")?
                .unwrap_or(hd.granularity_bytes),
        };
        if host.devices == 0 || host.devices > 64 {
            return Err(invalid("host.devices", "between 1 and 64"));
        }
        if host.granularity_bytes < 4096 || !host.granularity_bytes.is_power_of_two() {
            return Err(invalid("host.granularity", "a power of two of at least 4KiB"));
        }
        if host.capacity_bytes < host.granularity_bytes {
            return Err(invalid("host.capacity", "at least one granule"));
        }
        // Grants are whole granules: a capacity that is not could never be granted whole.
        if !host.capacity_bytes.is_multiple_of(host.granularity_bytes) {
            return Err(invalid(
                "host.capacity",
                format!(
                    "a multiple of host.granularity ({})",
                    crate::units::format_size(host.granularity_bytes)
                ),
            ));
        }
        // A memfd's size is an off_t, and the ledger sums capacities over devices: keep both
        // far from overflowing.
        if host.capacity_bytes > MAX_HOST_CAPACITY {
            return Err(invalid("host.capacity", "at most 1024TiB per device"));
        }

        let cd = CudaConfig::default();
        let cuda = CudaConfig {
            reserve_bytes: opt_size(&file.cuda.reserve, "cuda.reserve")?.unwrap_or(cd.reserve_bytes),
            devices: file.cuda.devices.unwrap_or_default(),
            warm_stock_bytes: opt_size(&file.cuda.warm_stock, "cuda.warm_stock")?
                .unwrap_or(cd.warm_stock_bytes),
        };

        let drain_timeout = match file.drain_timeout_seconds {
            Some(s) if s.is_finite() && (0.0..=3600.0).contains(&s) => Duration::from_secs_f64(s),
            Some(_) => return Err(invalid("drain_timeout_seconds", "between 0 and 3600")),
            None => Duration::from_secs(10),
        };

        // Clients may ask for at most MAX_TIME_BUDGET per plan; the default they get when they
        // ask for none must not be longer.
        let max_plan_ms = crate::planning::MAX_TIME_BUDGET.as_millis() as u64;
        let plan_time_budget = match file.plan_time_budget_ms {
            Some(ms) if ms <= max_plan_ms => Duration::from_millis(ms),
            Some(_) => {
                return Err(invalid(
                    "plan_time_budget_ms",
                    format!(
                        "at most {max_plan_ms} (what a client may ask for with PlanInput.time_budget_ms)"
                    ),
                ));
            }
            None => Duration::from_millis(200),
        };
        let plan_cores = match file.plan_cores {
            Some(0) => {
                return Err(invalid(
                    "plan_cores",
                    "at least 1 (the cores the daemon's plans use between them)",
                ));
            }
            Some(n) => n,
            None => node_cores(),
        };

        Ok(Config {
            socket,
            fd_socket,
            socket_mode,
            socket_group: args.socket_group.clone().or(file.socket_group),
            backend: args.backend.or(file.backend).unwrap_or(BackendChoice::Auto),
            metrics_listen,
            log_format: args.log_format.or(file.log_format).unwrap_or(LogFormat::Text),
            access: AccessConfig {
                allowed_uids: file.access.allowed_uids.unwrap_or_default(),
                allowed_gids: file.access.allowed_gids.unwrap_or_default(),
                admin_uids: file.access.admin_uids.unwrap_or_default(),
            },
            limits,
            guards,
            host,
            cuda,
            drain_timeout,
            plan_time_budget,
            plan_cores,
        })
    }
}

/// The cores this process may run on (the node's, or its container's CPU quota): `plan_cores`'
/// default. Two where the system does not say.
pub fn node_cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

fn opt_size(v: &Option<SizeValue>, key: &str) -> Result<Option<u64>, ConfigError> {
    v.as_ref().map(|v| v.bytes(key)).transpose()
}

/// The daemon's socket path when none is configured: `/run/graphpool/...` when this process
/// may write that directory (it exists and is writable, or could be created), else under
/// `$XDG_RUNTIME_DIR` — so a daemon run by a user on a node with the system install does not
/// try to bind in a directory it cannot write.
pub fn default_socket_path() -> Result<PathBuf, ConfigError> {
    socket_path_from(Path::new(SYSTEM_SOCKET), std::env::var_os("XDG_RUNTIME_DIR"))
}

/// [`default_socket_path`] with the system path and `$XDG_RUNTIME_DIR` given.
fn socket_path_from(
    system: &Path,
    xdg_runtime_dir: Option<std::ffi::OsString>,
) -> Result<PathBuf, ConfigError> {
    let dir = system.parent().expect("has parent");
    let usable = if dir.is_dir() { is_writable(dir) } else { std::fs::create_dir_all(dir).is_ok() };
    if usable {
        return Ok(system.to_path_buf());
    }
    match xdg_runtime_dir {
        Some(x) if !x.is_empty() => Ok(PathBuf::from(x).join("graphpool").join("graphpool.sock")),
        _ => Err(ConfigError::NoSocketPath),
    }
}

fn is_writable(dir: &Path) -> bool {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: `c` is a valid NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// The daemon's effective uid.
pub fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_run_with_no_file() {
        let c = Config::from_toml("socket = \"/tmp/x/graphpool.sock\"").unwrap();
        assert_eq!(c.socket_mode, 0o660);
        assert_eq!(c.fd_socket, PathBuf::from("/tmp/x/graphpool-fd.sock"));
        assert_eq!(c.backend, BackendChoice::Auto);
        assert_eq!(c.metrics_listen, Some(DEFAULT_METRICS_LISTEN.parse().unwrap()));
        assert_eq!(c.host.devices, 2);
    }

    #[test]
    fn file_values_are_read() {
        let c = Config::from_toml(
            r#"
            socket = "/tmp/g.sock"
            backend = "host"
            metrics_listen = "off"
            socket_mode = "0600"
            [limits]
            default_rank_quota = "8GiB"
            jobs = { train = "40GiB" }
            ranks = { "train:0" = "8GiB", "a:b:3" = "1GiB" }
            [host]
            devices = 4
            capacity = "1GiB"
            "#,
        )
        .unwrap();
        assert_eq!(c.backend, BackendChoice::Host);
        assert_eq!(c.metrics_listen, None);
        assert_eq!(c.socket_mode, 0o600);
        assert_eq!(c.limits.default_rank_quota_bytes, 8 << 30);
        assert_eq!(c.limits.jobs["train"], 40 << 30);
        // The rank follows the last ':', as job ids may hold one.
        assert_eq!(c.limits.ranks[&("train".to_string(), 0)], 8 << 30);
        assert_eq!(c.limits.ranks[&("a:b".to_string(), 3)], 1 << 30);
        assert_eq!(c.host.devices, 4);
        assert_eq!(c.host.capacity_bytes, 1 << 30);
    }

    #[test]
    fn flags_override_file() {
        let file =
            Config::parse_file(Path::new("f"), "socket = \"/tmp/a.sock\"\nbackend = \"cuda\"").unwrap();
        let args = DaemonArgs {
            socket: Some("/tmp/b.sock".into()),
            backend: Some(BackendChoice::Host),
            ..Default::default()
        };
        let c = Config::build(file, &args).unwrap();
        assert_eq!(c.socket, PathBuf::from("/tmp/b.sock"));
        assert_eq!(c.backend, BackendChoice::Host);
    }

    #[test]
    fn errors_name_the_key() {
        let e =
            Config::from_toml("socket = \"/tmp/a\"\n[limits]\ndefault_rank_quota = \"lots\"").unwrap_err();
        assert!(e.to_string().contains("limits.default_rank_quota"), "{e}");
        let e = Config::from_toml("socket = \"/tmp/a\"\nbogus = 1").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = Config::from_toml("socket = \"/tmp/a\"\nmetrics_listen = \"nowhere\"").unwrap_err();
        assert!(e.to_string().contains("metrics_listen"), "{e}");
    }

    #[test]
    fn values_that_would_make_no_sense_are_refused_naming_the_key() {
        let cases = [
            // 0 would lift the default quota off the job (SetLimits reads 0 as "no own quota").
            ("[limits]\ndefault_job_quota = \"8MiB\"\njobs = { train = 0 }", "limits.jobs.train"),
            ("[limits]\nranks = { \"train:0\" = 0 }", "limits.ranks.\"train:0\""),
            ("[limits]\nranks = { \"train\" = \"1GiB\" }", "limits.ranks.\"train\""),
            ("[limits]\nranks = { \"train:first\" = \"1GiB\" }", "limits.ranks.\"train:first\""),
            ("[limits]\nranks = { \":0\" = \"1GiB\" }", "limits.ranks.\":0\""),
            ("[guards]\nmax_plan_buffers = 0", "guards.max_plan_buffers"),
            ("plan_cores = 0", "plan_cores"),
            // Grants are whole granules: 3 MiB of 2 MiB granules can never be granted whole.
            ("[host]\ncapacity = \"3MiB\"\ngranularity = \"2MiB\"", "host.capacity"),
        ];
        for (toml, key) in cases {
            let e = Config::from_toml(&format!("socket = \"/tmp/a\"\n{toml}")).unwrap_err();
            assert!(e.to_string().contains(key), "{toml}: {e}");
        }
        let c = Config::from_toml("socket = \"/tmp/a\"\n[limits]\njobs = { train = \"1GiB\" }").unwrap();
        assert_eq!(c.limits.jobs["train"], 1 << 30);
    }

    #[test]
    fn the_system_socket_is_chosen_only_where_its_directory_is_writable() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let xdg = Some(std::ffi::OsString::from("/run/user/1000"));
        // A directory that can be created, or exists and is writable: the system path.
        let created = tmp.path().join("new").join("graphpool.sock");
        assert_eq!(socket_path_from(&created, xdg.clone()).unwrap(), created);
        assert!(tmp.path().join("new").is_dir());
        assert_eq!(socket_path_from(&created, None).unwrap(), created);
        // One that exists but this process may not write: `$XDG_RUNTIME_DIR`, or an error
        // without it (root may write anywhere, so this half needs another uid).
        let locked = tmp.path().join("locked");
        std::fs::create_dir(&locked).unwrap();
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
        if current_uid() != 0 {
            let system = locked.join("graphpool.sock");
            assert_eq!(
                socket_path_from(&system, xdg).unwrap(),
                PathBuf::from("/run/user/1000/graphpool/graphpool.sock")
            );
            assert!(matches!(socket_path_from(&system, None), Err(ConfigError::NoSocketPath)));
        }
    }

    #[test]
    fn a_derived_fd_socket_path_too_long_for_a_socket_is_refused() {
        // 100 bytes: a valid socket path, but graphpool-fd.sock next to it is 111.
        let socket = format!("/tmp/{}/g.sock", "d".repeat(88));
        assert_eq!(socket.len(), 100);
        let e = Config::from_toml(&format!("socket = \"{socket}\"")).unwrap_err();
        assert!(e.to_string().contains("invalid value for fd_socket"), "{e}");
        let ok = Config::from_toml(&format!("socket = \"{socket}\"\nfd_socket = \"/tmp/gfd.sock\"")).unwrap();
        assert_eq!(ok.fd_socket, PathBuf::from("/tmp/gfd.sock"));
    }

    #[test]
    fn job_quotas_must_name_a_valid_job_id() {
        let c =
            Config::from_toml("socket = \"/tmp/a\"\n[limits]\njobs = { \"train-1\" = \"1GiB\" }").unwrap();
        assert_eq!(c.limits.jobs["train-1"], 1 << 30);
        for bad in ["train 1", ""] {
            let text = format!("socket = \"/tmp/a\"\n[limits]\njobs = {{ \"{bad}\" = \"1GiB\" }}");
            let e = Config::from_toml(&text).unwrap_err();
            assert!(
                e.to_string().contains("limits.jobs") && e.to_string().contains("job_id"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn host_capacity_is_range_checked() {
        let c = Config::from_toml("socket = \"/tmp/a\"\n[host]\ncapacity = \"1024TiB\"").unwrap();
        assert_eq!(c.host.capacity_bytes, MAX_HOST_CAPACITY);
        let e = Config::from_toml("socket = \"/tmp/a\"\n[host]\ncapacity = 9223372036854775808").unwrap_err();
        assert!(e.to_string().contains("host.capacity"), "{e}");
    }

    #[test]
    fn plan_time_budget_and_cores_are_read_and_checked() {
        let c = Config::from_toml("socket = \"/tmp/a\"\nplan_time_budget_ms = 500").unwrap();
        assert_eq!(c.plan_time_budget, Duration::from_millis(500));
        // The plans' cores: every core of the node unless the file says how many.
        assert_eq!(c.plan_cores, node_cores());
        assert_eq!(Config::from_toml("socket = \"/tmp/a\"\nplan_cores = 3").unwrap().plan_cores, 3);
        for bad in [10_001u64, u64::MAX >> 1] {
            let e =
                Config::from_toml(&format!("socket = \"/tmp/a\"\nplan_time_budget_ms = {bad}")).unwrap_err();
            assert!(e.to_string().contains("plan_time_budget_ms"), "{bad}: {e}");
        }
    }

    #[test]
    fn access_allow_list() {
        let open = AccessConfig::default();
        assert!(open.allows(1234, 1234));
        let closed = AccessConfig { allowed_uids: vec![1000], allowed_gids: vec![50], admin_uids: vec![] };
        assert!(closed.allows(1000, 1));
        assert!(closed.allows(7, 50));
        assert!(!closed.allows(7, 7));
        assert!(closed.allows(0, 0));
    }
}
