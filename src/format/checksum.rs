//! A fast 64-bit checksum of bytes, stable across builds and machines: what the prompt cache
//! stores to detect damage, and what [`crate::format::Gguf::fingerprint`] identifies a model
//! file by. Not cryptographic: it detects accidents, not tampering.

/// Hashes 8-byte words with `h = (h ^ w) * P` (then a shift-xor): each step is a bijection of
/// `h`, so a change confined to one word always changes the result.
pub fn checksum(bytes: &[u8]) -> u64 {
    const P: u64 = 0x0000_0100_0000_01b3;
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(P);
        h ^= h >> 29;
    }
    let mut tail = [0u8; 8];
    tail[..words.remainder().len()].copy_from_slice(words.remainder());
    (h ^ u64::from_le_bytes(tail)).wrapping_mul(P)
}

#[cfg(test)]
mod tests {
    use super::checksum;

    /// Every single-bit change of a buffer changes its checksum, and so does its length.
    #[test]
    fn every_bit_flip_and_length_changes_it() {
        let b: Vec<u8> = (0..100u32).map(|i| (i * 37 % 251) as u8).collect();
        let h = checksum(&b);
        for i in 0..b.len() {
            for bit in 0..8 {
                let mut c = b.clone();
                c[i] ^= 1 << bit;
                assert_ne!(checksum(&c), h, "byte {i} bit {bit}");
            }
        }
        assert_ne!(checksum(&b[..99]), h);
        assert_ne!(checksum(&[0u8; 8]), checksum(&[0u8; 9]));
    }
}
