//! When a search stops: at its deadline, or earlier when a search running beside it raises
//! a shared flag because the answer is known (a placement at the lower bound, or the best
//! placement proved optimal).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// A deadline, and optionally flags that stop the search before it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Until<'a> {
    /// The search stops at this instant at the latest.
    pub deadline: Instant,
    /// Raised by whichever search running beside this one knows the answer.
    pub flag: Option<&'a AtomicBool>,
    /// A second flag that stops only this search and the searches it starts (one of several
    /// workers whose work another worker's answer made moot): [`Until::and_raised`].
    pub also: Option<&'a AtomicBool>,
}

impl<'a> Until<'a> {
    /// Stops at `deadline` only.
    pub(crate) fn at(deadline: Instant) -> Until<'static> {
        Until { deadline, flag: None, also: None }
    }

    /// Stops at `deadline` or once `flag` is raised.
    pub(crate) fn or_raised(deadline: Instant, flag: &'a AtomicBool) -> Until<'a> {
        Until { deadline, flag: Some(flag), also: None }
    }

    /// Stops where `self` stops or once `also` is raised; [`Until::raise`] still raises
    /// `self`'s flag only. `self` must have no second flag of its own.
    pub(crate) fn and_raised(self, also: &'a AtomicBool) -> Until<'a> {
        debug_assert!(self.also.is_none(), "one second flag at most");
        Until { also: Some(also), ..self }
    }

    /// Whether the search must stop now.
    pub(crate) fn passed(&self) -> bool {
        self.raised() || Instant::now() > self.deadline
    }

    /// Whether a flag is raised (without reading the clock).
    pub(crate) fn raised(&self) -> bool {
        self.flag.is_some_and(|f| f.load(Ordering::Relaxed))
            || self.also.is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Raises the flag (every search sharing it stops); nothing without a flag.
    pub(crate) fn raise(&self) {
        if let Some(f) = self.flag {
            f.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn stops_at_the_deadline_or_when_raised() {
        let later = Instant::now() + Duration::from_secs(3600);
        let flag = AtomicBool::new(false);
        let until = Until::or_raised(later, &flag);
        assert!(!until.passed());
        until.raise();
        assert!(until.passed() && until.raised());
        assert!(Until::at(Instant::now() - Duration::from_millis(1)).passed());
        let plain = Until::at(later);
        plain.raise();
        assert!(!plain.passed(), "a deadline without a flag stops only at the deadline");
    }

    #[test]
    fn a_second_flag_stops_only_its_own_search() {
        let later = Instant::now() + Duration::from_secs(3600);
        let (shared, own) = (AtomicBool::new(false), AtomicBool::new(false));
        let outer = Until::or_raised(later, &shared);
        let inner = outer.and_raised(&own);
        own.store(true, Ordering::Relaxed);
        assert!(inner.passed() && !outer.passed());
        inner.raise();
        assert!(outer.passed(), "raising the inner search raises the shared flag");
    }
}
