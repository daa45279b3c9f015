//! Admission of the daemon's two sockets (gRPC and fd) at accept: the allow-list, and per-uid
//! connection caps.
//!
//! Each socket has one [`ConnLimit`]. [`ConnLimit::admit_peer`] reads nothing from the
//! connection: it takes the peer's uid and gid (`SO_PEERCRED`, read at accept) and closes the
//! connection at once when the peer is not on the allow-list (`access.allowed_uids` /
//! `access.allowed_gids`; counted in `graphpool_peers_refused_total{transport}`), or when its
//! uid already holds [`per_uid_cap`] connections on that socket (counted in
//! `graphpool_connections_refused_total{transport}`). Both refusals are
//! logged as `WARN` lines, at most one per uid, socket and kind of refusal every
//! [`WARNING_INTERVAL`], each carrying the number of refusals left unlogged since the previous
//! line ([`Warnings`]). An admitted connection holds a [`Slot`] and gives its place back when
//! the slot is dropped, i.e. when the connection closes.
//!
//! Every uid is counted, root and the daemon's own uid included: the cap is far above what
//! the sessions a uid may hold need, so only a client that leaks or floods connections meets it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::config::{AccessConfig, GuardsConfig};
use crate::metrics::Metrics;
use crate::service::segments::Transport;

/// Connections a uid may hold on each socket per session it may have: a rank needs one on
/// each (gRPC for its session stream, the fd socket for its segments); the rest is room for
/// the CLI, reconnects and helper processes.
pub const CONNECTIONS_PER_SESSION: usize = 4;

/// Shortest time between two warnings about one uid's refused connections on one socket (one
/// interval for refusals at the cap, one for refusals by the allow-list).
pub const WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// Number of uids whose allow-list refusals one socket remembers before it forgets those it
/// last warned about [`WARNING_INTERVAL`] ago or more (see [`UidWarnings`]).
pub const TRACKED_UIDS: usize = 1024;

/// The rate limit of one kind of warning: at most one line per [`WARNING_INTERVAL`], and the
/// events that were not logged in between are counted for the next line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Warnings {
    /// When the last line was logged.
    warned_at: Option<Instant>,
    /// Events not logged since then.
    unlogged: u64,
}

impl Warnings {
    /// Whether an event at `now` is to be logged: `Some(n)`, `n` being the events that were
    /// not logged since the previous line; `None` while the rate limit holds (the event is
    /// then counted for the next line).
    pub fn due(&mut self, now: Instant) -> Option<u64> {
        match self.warned_at {
            Some(t) if now.saturating_duration_since(t) < WARNING_INTERVAL => {
                self.unlogged += 1;
                None
            }
            _ => {
                self.warned_at = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }

    /// Whether the rate limit still holds at `now`, i.e. a line was logged less than
    /// [`WARNING_INTERVAL`] before.
    fn holds(&self, now: Instant) -> bool {
        self.warned_at.is_some_and(|t| now.saturating_duration_since(t) < WARNING_INTERVAL)
    }
}

/// [`Warnings`] of each uid, for refusals that leave no other per-uid state behind (the
/// allow-list's). When [`TRACKED_UIDS`] uids are remembered and another one is refused, those
/// whose rate limit has lapsed are forgotten (the next refusal of such a uid is logged at
/// once, as it would have been, but without the count of refusals left unlogged before), so
/// the table stays small unless that many uids are refused within one interval.
#[derive(Debug, Clone, Default)]
pub struct UidWarnings {
    table: Arc<Mutex<HashMap<u32, Warnings>>>,
}

impl UidWarnings {
    /// [`Warnings::due`] of `uid`'s warnings.
    pub fn due(&self, uid: u32, now: Instant) -> Option<u64> {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if table.len() >= TRACKED_UIDS && !table.contains_key(&uid) {
            table.retain(|_, w| w.holds(now));
        }
        table.entry(uid).or_default().due(now)
    }

    /// uids remembered.
    pub fn tracked(&self) -> usize {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// Connections one uid may hold on one socket at once:
/// [`CONNECTIONS_PER_SESSION`] × `guards.max_sessions_per_uid`.
pub fn per_uid_cap(guards: &GuardsConfig) -> usize {
    (guards.max_sessions_per_uid as usize).saturating_mul(CONNECTIONS_PER_SESSION)
}

/// A connection refused because its uid already holds as many as it may on that socket.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{socket} connection refused: uid {uid} already holds {cap} connections to graphpoold's {socket} socket, \
     the most one uid may ({per_session} × guards.max_sessions_per_uid); close the clients it no longer \
     uses, or raise guards.max_sessions_per_uid",
    per_session = CONNECTIONS_PER_SESSION
)]
pub struct AtCap {
    /// The socket: `gRPC` or `fd`.
    pub socket: &'static str,
    /// The uid refused.
    pub uid: u32,
    /// The cap it met.
    pub cap: usize,
    /// `Some(n)` when this refusal is to be logged, `n` being the refusals of this uid on this
    /// socket that were not logged since the last warning; `None` while the rate limit holds.
    pub warn: Option<u64>,
}

/// One uid's connections on one socket.
#[derive(Debug, Default)]
struct Entry {
    open: usize,
    /// The rate limit of this uid's warnings about refusals at the cap.
    warnings: Warnings,
}

type Table = Arc<Mutex<HashMap<u32, Entry>>>;

/// Locks the table; a panic elsewhere while it was held leaves counts that are still whole
/// (every update is a single step), so a poisoned lock is used as is.
fn lock(table: &Table) -> MutexGuard<'_, HashMap<u32, Entry>> {
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The per-uid connection counts and cap of one socket, and the rate limit of its warnings.
#[derive(Debug, Clone)]
pub struct ConnLimit {
    transport: Transport,
    cap: usize,
    table: Table,
    /// The rate limit of the warnings about peers not on the allow-list.
    unlisted: UidWarnings,
}

/// A place taken by an admitted connection; dropping it gives the place back.
#[derive(Debug)]
pub struct Slot {
    table: Table,
    uid: u32,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut table = lock(&self.table);
        if let Some(e) = table.get_mut(&self.uid) {
            e.open = e.open.saturating_sub(1);
            if e.open == 0 {
                table.remove(&self.uid);
            }
        }
    }
}

impl ConnLimit {
    /// A limit of `cap` connections per uid on the socket of `transport`.
    pub fn new(transport: Transport, cap: usize) -> Self {
        ConnLimit { transport, cap, table: Arc::default(), unlisted: UidWarnings::default() }
    }

    /// The cap.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Connections `uid` holds now.
    pub fn open(&self, uid: u32) -> usize {
        lock(&self.table).get(&uid).map_or(0, |e| e.open)
    }

    /// The socket's name in logs and messages.
    fn socket(&self) -> &'static str {
        match self.transport {
            Transport::Grpc => "gRPC",
            Transport::FdSocket => "fd",
        }
    }

    /// Takes a place for a connection of `uid` at time `now`, or refuses it when the uid holds
    /// [`ConnLimit::cap`] already.
    pub fn admit(&self, uid: u32, now: Instant) -> Result<Slot, AtCap> {
        let mut table = lock(&self.table);
        let e = table.entry(uid).or_default();
        if e.open >= self.cap {
            let warn = e.warnings.due(now);
            let refused = AtCap { socket: self.socket(), uid, cap: self.cap, warn };
            if e.open == 0 {
                // A cap of 0 admits nobody; keep no entry for a uid that holds nothing.
                table.remove(&uid);
            }
            return Err(refused);
        }
        e.open += 1;
        Ok(Slot { table: self.table.clone(), uid })
    }

    /// Admits a connection of `uid` (process `pid`, when known), or refuses it: the refusal
    /// is counted in `metrics` and logged, within the rate limit. The caller closes a refused
    /// connection.
    pub fn admit_or_refuse(&self, uid: u32, pid: Option<u32>, metrics: &Metrics) -> Option<Slot> {
        match self.admit(uid, Instant::now()) {
            Ok(slot) => Some(slot),
            Err(refused) => {
                metrics.connection_refused(self.transport.as_str());
                if let Some(unlogged) = refused.warn {
                    tracing::warn!(
                        socket = self.transport.as_str(),
                        uid,
                        pid,
                        limit = self.cap,
                        unlogged,
                        "{refused}"
                    );
                }
                None
            }
        }
    }

    /// Admits a connection of a peer (uid, gid and, when known, pid from `SO_PEERCRED`), or
    /// refuses it: a peer not on `access`'s allow-list is refused first (logged within the
    /// rate limit; it takes no place and is not counted in the connection metrics), then one
    /// past its uid's cap (see [`ConnLimit::admit_or_refuse`]). The caller closes a refused
    /// connection without reading from it.
    pub fn admit_peer(
        &self,
        access: &AccessConfig,
        uid: u32,
        gid: u32,
        pid: Option<u32>,
        metrics: &Metrics,
    ) -> Option<Slot> {
        if !access.allows(uid, gid) {
            metrics.peer_refused(self.transport.as_str());
            if let Some(unlogged) = self.unlisted.due(uid, Instant::now()) {
                tracing::warn!(
                    socket = self.transport.as_str(),
                    pid,
                    uid,
                    gid,
                    unlogged,
                    "refused a peer not on the allow-list (access.allowed_uids / access.allowed_gids): \
                     its {} connection was closed at accept",
                    self.socket()
                );
            }
            return None;
        }
        self.admit_or_refuse(uid, pid, metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_four_connections_per_session() {
        let guards = GuardsConfig { max_sessions_per_uid: 3, ..Default::default() };
        assert_eq!(per_uid_cap(&guards), 12);
        let guards = GuardsConfig { max_sessions_per_uid: u32::MAX, ..Default::default() };
        assert_eq!(per_uid_cap(&guards), (u32::MAX as usize).saturating_mul(4));
    }

    #[test]
    fn counts_per_uid_refuses_past_the_cap_and_frees_on_drop() {
        let limit = ConnLimit::new(Transport::Grpc, 2);
        let now = Instant::now();
        let a = limit.admit(1000, now).unwrap();
        let b = limit.admit(1000, now).unwrap();
        assert_eq!(limit.open(1000), 2);
        let e = limit.admit(1000, now).unwrap_err();
        assert_eq!((e.uid, e.cap, e.socket), (1000, 2, "gRPC"));
        assert!(e.to_string().contains("guards.max_sessions_per_uid"), "{e}");
        // A refusal takes no place, and another uid has its own count.
        assert_eq!(limit.open(1000), 2);
        let other = limit.admit(1001, now).unwrap();
        assert_eq!(limit.open(1001), 1);
        // A closed connection frees its place; the clones of a limit share the counts.
        drop(a);
        assert_eq!(limit.open(1000), 1);
        let c = limit.clone().admit(1000, now).unwrap();
        assert!(limit.admit(1000, now).is_err());
        drop((b, c, other));
        assert_eq!((limit.open(1000), limit.open(1001)), (0, 0));
        assert!(lock(&limit.table).is_empty(), "no entry is kept for a uid that holds nothing");
    }

    #[test]
    fn warnings_are_rate_limited_per_uid_and_count_what_went_unlogged() {
        let limit = ConnLimit::new(Transport::FdSocket, 1);
        let t0 = Instant::now();
        let _held = (limit.admit(7, t0).unwrap(), limit.admit(8, t0).unwrap());
        assert_eq!(limit.admit(7, t0).unwrap_err().warn, Some(0), "the first refusal is logged");
        assert_eq!(limit.admit(7, t0 + Duration::from_secs(1)).unwrap_err().warn, None);
        assert_eq!(limit.admit(7, t0 + Duration::from_secs(2)).unwrap_err().warn, None);
        // Another uid is logged on its own.
        assert_eq!(limit.admit(8, t0 + Duration::from_secs(2)).unwrap_err().warn, Some(0));
        // After the interval the next refusal is logged with the count of those that were not.
        let later = t0 + WARNING_INTERVAL;
        let e = limit.admit(7, later).unwrap_err();
        assert_eq!((e.socket, e.warn), ("fd", Some(2)));
        assert_eq!(limit.admit(7, later).unwrap_err().warn, None);
    }

    #[test]
    fn one_warning_per_interval_with_the_count_of_those_not_logged() {
        let mut w = Warnings::default();
        let t0 = Instant::now();
        assert_eq!(w.due(t0), Some(0), "the first event is logged");
        assert_eq!(w.due(t0), None);
        assert_eq!(w.due(t0 + WARNING_INTERVAL - Duration::from_millis(1)), None);
        assert_eq!(w.due(t0 + WARNING_INTERVAL), Some(2));
        assert_eq!(w.due(t0 + WARNING_INTERVAL), None);
        // A quiet spell longer than the interval: the next event is logged at once.
        assert_eq!(w.due(t0 + 5 * WARNING_INTERVAL), Some(1));
    }

    #[test]
    fn uid_warnings_are_per_uid_and_forget_quiet_uids_when_many() {
        let w = UidWarnings::default();
        let t0 = Instant::now();
        assert_eq!(w.due(1, t0), Some(0));
        assert_eq!(w.due(1, t0), None);
        assert_eq!(w.due(2, t0), Some(0), "another uid is logged on its own");
        assert_eq!(w.clone().due(1, t0), None, "clones share the table");
        assert_eq!(w.due(1, t0 + WARNING_INTERVAL), Some(2));
        // Many uids later: uids 1 and 2, quiet for longer than the interval, make room.
        let t1 = t0 + 3 * WARNING_INTERVAL;
        for uid in 0..TRACKED_UIDS as u32 {
            assert_eq!(w.due(1000 + uid, t1), Some(0));
        }
        assert_eq!(w.tracked(), TRACKED_UIDS);
        assert_eq!(w.due(1, t1), Some(0), "forgotten: logged again, without a count");
        // None is forgotten while its rate limit holds; all are once it has lapsed.
        assert_eq!(w.tracked(), TRACKED_UIDS + 1);
        assert_eq!(w.due(1000, t1), None);
        w.due(5001, t1 + WARNING_INTERVAL);
        assert_eq!(w.tracked(), 1);
    }

    #[test]
    fn peers_off_the_allow_list_are_refused_before_they_count() {
        let metrics = Metrics::new("host");
        let access = AccessConfig { allowed_uids: vec![1000], allowed_gids: vec![50], admin_uids: vec![] };
        let limit = ConnLimit::new(Transport::Grpc, 1);
        assert!(limit.admit_peer(&access, 7, 7, Some(1), &metrics).is_none());
        assert_eq!(limit.open(7), 0, "a refused peer takes no place");
        // The first refusal of a uid is logged, the next ones within the interval are counted.
        assert_eq!(limit.unlisted.due(7, Instant::now()), None);
        assert_eq!(limit.unlisted.tracked(), 1);
        // A listed uid, a listed gid and root are admitted, within the cap.
        let a = limit.admit_peer(&access, 1000, 1, None, &metrics).expect("listed uid");
        let b = limit.admit_peer(&access, 7, 50, None, &metrics).expect("listed gid");
        let c = limit.admit_peer(&access, 0, 0, None, &metrics).expect("root");
        assert!(limit.admit_peer(&access, 1000, 1, None, &metrics).is_none(), "past the cap");
        drop((a, b, c));
        // An empty allow-list admits everyone (the socket's mode and group are the gate).
        let open = AccessConfig::default();
        assert!(limit.admit_peer(&open, 7, 7, None, &metrics).is_some());
    }

    #[test]
    fn a_cap_of_zero_admits_nobody_and_keeps_nothing() {
        let limit = ConnLimit::new(Transport::Grpc, 0);
        assert!(limit.admit(0, Instant::now()).is_err());
        assert!(lock(&limit.table).is_empty());
    }

    #[test]
    fn counts_hold_under_concurrent_admits_and_drops() {
        let limit = ConnLimit::new(Transport::Grpc, 8);
        let admitted = std::sync::atomic::AtomicUsize::new(0);
        let held: Mutex<Vec<Slot>> = Mutex::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for i in 0..1000 {
                        if let Ok(slot) = limit.admit(42, Instant::now()) {
                            admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if i % 100 == 0 {
                                held.lock().unwrap().push(slot);
                            }
                        }
                    }
                });
            }
        });
        let kept = held.lock().unwrap().len();
        assert!(kept <= 8 && admitted.into_inner() >= kept);
        assert_eq!(limit.open(42), kept);
        held.lock().unwrap().clear();
        assert_eq!(limit.open(42), 0);
    }
}
