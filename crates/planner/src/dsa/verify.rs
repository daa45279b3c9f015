//! Checking a placement against the rules of the problem, independently of how it was
//! made: what every plan is tested with, and what `graphpool plan` runs on another
//! allocator's offsets.

use std::collections::{BTreeMap, HashMap};

use super::Buffer;

/// A placement that breaks a rule (see [`verify`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// Wrong number of offsets.
    #[error("{got} offsets for {expected} buffers")]
    Count {
        /// Buffers.
        expected: usize,
        /// Offsets.
        got: usize,
    },
    /// Two buffers live at the same time share bytes.
    #[error("buffers {a} and {b} are live at the same time and overlap in memory")]
    Overlap {
        /// One buffer.
        a: usize,
        /// The other.
        b: usize,
    },
    /// Two buffers of one alias group were given different offsets.
    #[error("buffers {a} and {b} are in the same alias group but at different offsets")]
    Alias {
        /// One buffer.
        a: usize,
        /// The other.
        b: usize,
    },
    /// A buffer's offset plus its size is past the last byte of a 64-bit address space.
    #[error("buffer {0} ends past 2^64 bytes (offset + size)")]
    PastAddressSpace(usize),
}

/// Checks a placement: one offset per buffer, members of a group at one offset, and no two
/// items live at the same time sharing a byte. `O(n log n)`.
pub fn verify(buffers: &[Buffer], offsets: &[u64]) -> Result<(), VerifyError> {
    if buffers.len() != offsets.len() {
        return Err(VerifyError::Count { expected: buffers.len(), got: offsets.len() });
    }
    let mut first_of_group: HashMap<u32, usize> = HashMap::new();
    for (i, b) in buffers.iter().enumerate() {
        if let Some(g) = b.group {
            let f = *first_of_group.entry(g).or_insert(i);
            if offsets[f] != offsets[i] {
                return Err(VerifyError::Alias { a: f, b: i });
            }
        }
    }
    // Sweep over time with the live buffers keyed by offset. Members of one group may
    // coincide; they are the same memory, as high as its largest member *live now*.
    let mut events: Vec<(u64, bool, usize)> = Vec::new();
    for (i, b) in buffers.iter().enumerate() {
        if b.size > 0 && offsets[i].checked_add(b.size).is_none() {
            return Err(VerifyError::PastAddressSpace(i));
        }
        if b.is_live() {
            events.push((b.start, true, i));
            events.push((b.end, false, i));
        }
    }
    events.sort_unstable();
    let key = |i: usize| (offsets[i], buffers[i].group.map_or(u64::MAX - i as u64, |g| g as u64));
    let top_of = |i: usize| offsets[i] + buffers[i].size;
    // (offset, owner) -> its live members (top, buffer), sorted: the highest is the last.
    let mut live: BTreeMap<(u64, u64), Vec<(u64, usize)>> = BTreeMap::new();
    let highest = |members: &Vec<(u64, usize)>| *members.last().expect("a live entry has members");
    for (_, is_start, i) in events {
        let k = key(i);
        let member = (top_of(i), i);
        if !is_start {
            let members = live.get_mut(&k).expect("ended buffer is live");
            let at = members.binary_search(&member).expect("it is recorded");
            members.remove(at);
            if members.is_empty() {
                live.remove(&k);
            }
            continue;
        }
        if let Some(members) = live.get_mut(&k) {
            let at = members.partition_point(|m| *m < member);
            members.insert(at, member);
            // Same group at the same offset: check the grown extent against the next one.
            if let Some((_, next)) = live.range((k.0, k.1 + 1)..).next()
                && offsets[highest(next).1] < member.0
            {
                return Err(VerifyError::Overlap { a: i, b: highest(next).1 });
            }
            continue;
        }
        if let Some((_, below)) = live.range(..k).next_back()
            && highest(below).0 > offsets[i]
        {
            return Err(VerifyError::Overlap { a: highest(below).1, b: i });
        }
        if let Some((&(no, _), above)) = live.range(k..).next()
            && no < member.0
        {
            return Err(VerifyError::Overlap { a: i, b: highest(above).1 });
        }
        live.insert(k, vec![member]);
    }
    Ok(())
}
