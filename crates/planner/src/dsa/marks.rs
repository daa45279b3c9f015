//! Marks on items that all clear in O(1): each mark records the generation it was made in.

/// A set of marked items (indices below the `n` of the last [`Marks::clear`]).
#[derive(Debug, Default, Clone)]
pub(super) struct Marks {
    stamp: Vec<u32>,
    generation: u32,
}

impl Marks {
    /// Unmarks every item, and makes room for items below `n`.
    pub(super) fn clear(&mut self, n: usize) {
        if self.stamp.len() < n {
            self.stamp.resize(n, 0);
        }
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.stamp.fill(0);
            self.generation = 1;
        }
    }

    /// Marks item `i`; whether it was unmarked.
    #[inline]
    pub(super) fn mark(&mut self, i: usize) -> bool {
        let fresh = self.stamp[i] != self.generation;
        self.stamp[i] = self.generation;
        fresh
    }

    /// Whether item `i` is marked.
    #[inline]
    pub(super) fn marked(&self, i: usize) -> bool {
        self.stamp[i] == self.generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clearing_unmarks_everything_even_when_the_generation_wraps() {
        let mut m = Marks::default();
        m.clear(4);
        assert!(m.mark(1) && !m.mark(1) && m.marked(1) && !m.marked(2));
        m.clear(4);
        assert!(!m.marked(1));
        m.mark(3);
        m.generation = u32::MAX;
        m.mark(2);
        m.clear(6);
        assert!((0..6).all(|i| !m.marked(i)), "a wrap must not revive old marks");
        assert!(m.mark(5));
    }
}
