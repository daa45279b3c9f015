//! A fast seeded hash for the hash maps of the planner's hot loops, whose keys are integers.

/// Hashing for the planner's integer keys (coarsening's (rank, size) keys, the online aligned
/// construction's offsets): a multiply-rotate mix per word from a seed drawn once per process
/// (SipHash made coarsening a 100k list take a quarter of a second; the seed keeps a client
/// from choosing keys that collide).
#[derive(Clone, Copy)]
pub(super) struct KeyHashing(u64);

impl Default for KeyHashing {
    fn default() -> Self {
        static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        KeyHashing(*SEED.get_or_init(|| {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(0x6b65_7973u64)
        }))
    }
}

impl std::hash::BuildHasher for KeyHashing {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(self.0)
    }
}

/// The hasher of [`KeyHashing`].
pub(super) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        // The table indexes by the low bits: fold the well-mixed high bits into them.
        self.0 ^ (self.0 >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(26) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
