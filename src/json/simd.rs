//! The scanners' SIMD: blocks of bytes searched for JSON's special bytes
//! at once, SSE2 on x86_64 (every x86_64 has it; `safe_arch` wraps the
//! intrinsics safely) and eight-byte words in a `u64` on any other target
//! (and in the tests, against SSE2).

// Eight bytes at a time, in safe code: a byte of `x ^ (ONES * c)` is zero
// where `x` holds `c`. In `zeros(v)` the lowest set high bit marks the first
// zero byte exactly (a false mark can only sit above a true one), so the
// first match of any of several masks is the lowest bit of their union.
// On x86_64 only the tests use these (the scanners use SSE2 there).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
pub(super) const ONES: u64 = 0x0101_0101_0101_0101;
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
pub(super) const HIGH: u64 = 0x8080_8080_8080_8080;

#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
pub(super) fn zeros(v: u64) -> u64 {
    v.wrapping_sub(ONES) & !v & HIGH
}

/// The scanners' blocks: 16 bytes in an SSE2 register on x86_64 (every
/// x86_64 has SSE2; `safe_arch` wraps the intrinsics safely), a bit per
/// byte and no false marks: twice the eight-byte words kept for other
/// targets at no risk, and indentation and long strings are most of a
/// pretty-printed completion.
#[cfg(target_arch = "x86_64")]
pub(super) mod sse2 {
    use safe_arch::*;

    pub const W: usize = 16;

    pub struct Block(m128i);

    /// The 16 bytes at `i`, if there are 16.
    #[inline(always)]
    pub fn load(b: &[u8], i: usize) -> Option<Block> {
        let bytes: [u8; 16] = b.get(i..i + 16)?.try_into().ok()?;
        Some(Block(load_unaligned_m128i(&bytes)))
    }

    /// The offset of the first marked byte of a non-zero mask.
    #[inline(always)]
    pub fn first(m: u32) -> usize {
        m.trailing_zeros() as usize
    }

    #[inline(always)]
    fn eq(v: m128i, c: u8) -> m128i {
        cmp_eq_mask_i8_m128i(v, set_splat_i8_m128i(c as i8))
    }

    #[inline(always)]
    fn mask(m: m128i) -> u32 {
        move_mask_i8_m128i(m) as u32
    }

    impl Block {
        #[inline(always)]
        pub fn quote_or_escape(&self) -> u32 {
            mask(bitor_m128i(eq(self.0, b'"'), eq(self.0, b'\\')))
        }

        /// Bytes other than JSON's four whitespace characters.
        #[inline(always)]
        pub fn not_ws(&self) -> u32 {
            let ws = bitor_m128i(
                bitor_m128i(eq(self.0, b' '), eq(self.0, b'\n')),
                bitor_m128i(eq(self.0, b'\r'), eq(self.0, b'\t')),
            );
            !mask(ws) & 0xffff
        }
    }

    /// A bit per quote, backslash and bracket of 64 bytes, four blocks.
    #[inline(always)]
    pub fn marks64(block: &[u8; 64]) -> super::Marks {
        let mut m = super::Marks {
            quote: 0,
            backslash: 0,
            bracket: 0,
        };
        for (k, bytes) in block.chunks_exact(W).enumerate() {
            let bytes: &[u8; 16] = bytes.try_into().unwrap_or(&[0; 16]);
            let v = load_unaligned_m128i(bytes);
            // `| 0x20` folds `[` into `{` and `]` into `}`, nothing else.
            let y = bitor_m128i(v, set_splat_i8_m128i(0x20));
            let at = |x| u64::from(mask(x)) << (k * W);
            m.quote |= at(eq(v, b'"'));
            m.backslash |= at(eq(v, b'\\'));
            m.bracket |= at(bitor_m128i(eq(y, b'{'), eq(y, b'}')));
        }
        m
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use sse2 as lanes;
#[cfg(not(target_arch = "x86_64"))]
pub(super) use swar as lanes;

/// Eight bytes as a `u64`, a high bit per marked byte (see [`zeros`]): any
/// target. On x86_64 only the tests use it, against [`sse2`].
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
pub(super) mod swar {
    use super::{zeros, ONES};

    pub const W: usize = 8;

    pub struct Block(u64);

    #[inline(always)]
    pub fn load(b: &[u8], i: usize) -> Option<Block> {
        let w: [u8; 8] = b.get(i..i + 8)?.try_into().ok()?;
        Some(Block(u64::from_le_bytes(w)))
    }

    #[inline(always)]
    pub fn first(m: u64) -> usize {
        m.trailing_zeros() as usize / 8
    }

    impl Block {
        #[inline(always)]
        pub fn quote_or_escape(&self) -> u64 {
            zeros(self.0 ^ (ONES * u64::from(b'"'))) | zeros(self.0 ^ (ONES * u64::from(b'\\')))
        }
    }

    /// A bit per quote, backslash and bracket of 64 bytes, byte by byte:
    /// other targets' blocks, and the definition the SSE2 blocks are
    /// tested against.
    pub fn marks64(block: &[u8; 64]) -> super::Marks {
        let mut m = super::Marks {
            quote: 0,
            backslash: 0,
            bracket: 0,
        };
        for (k, &c) in block.iter().enumerate() {
            let bit = 1u64 << k;
            match c {
                b'"' => m.quote |= bit,
                b'\\' => m.backslash |= bit,
                b'{' | b'}' | b'[' | b']' => m.bracket |= bit,
                _ => {}
            }
        }
        m
    }
}

/// The index of the first quote or backslash at or after `i`: a block at a
/// time over a string's first bytes (most are short), memchr past them.
#[inline]
pub(super) fn next_quote_or_escape(b: &[u8], mut i: usize) -> Option<usize> {
    let far = i + 64;
    while let Some(v) = lanes::load(b, i) {
        let m = v.quote_or_escape();
        if m != 0 {
            return Some(i + lanes::first(m));
        }
        i += lanes::W;
        if i >= far {
            return Some(i + memchr::memchr2(b'"', b'\\', b.get(i..)?)?);
        }
    }
    let k = b.get(i..)?.iter().position(|&c| c == b'"' || c == b'\\')?;
    Some(i + k)
}

/// simdjson's escape scan: the bytes escaped by a backslash (the byte after
/// each odd-length run), given whether the previous block ended on an
/// escaping backslash; `carry` becomes whether this one does.
pub(super) fn escaped_by(backslash: u64, carry: &mut u64) -> u64 {
    const ODD: u64 = 0xAAAA_AAAA_AAAA_AAAA;
    if backslash == 0 {
        return std::mem::take(carry);
    }
    let potential = backslash & !*carry;
    let maybe_escaped = potential << 1;
    let terminal = ((maybe_escaped | ODD).wrapping_sub(potential)) ^ ODD;
    let escaped = terminal ^ (backslash | *carry);
    *carry = (terminal & backslash) >> 63;
    escaped
}

/// Bit `k` set where an odd number of bits `0..=k` are: from the opening
/// quote of a string up to (not including) its closing one.
pub(super) fn prefix_xor(mut x: u64) -> u64 {
    for s in [1, 2, 4, 8, 16, 32] {
        x ^= x << s;
    }
    x
}

/// A block's bits: quotes, backslashes and brackets of any kind.
pub(super) struct Marks {
    pub quote: u64,
    pub backslash: u64,
    pub bracket: u64,
}

/// The marks of the 64 bytes at `base` and a bit per byte that is in `b`
/// (all set but at the end); `None` past the end.
#[inline(always)]
pub(super) fn block_marks(b: &[u8], base: usize) -> Option<(Marks, u64)> {
    let rest = b.get(base..).filter(|r| !r.is_empty())?;
    if let Some(block) = rest.first_chunk::<64>() {
        return Some((lanes::marks64(block), u64::MAX));
    }
    // The last bytes, padded with spaces (no mark).
    let mut block = [b' '; 64];
    block[..rest.len()].copy_from_slice(rest);
    Some((lanes::marks64(&block), (1u64 << rest.len()) - 1))
}

/// How [`Scan::string`] finds the quotes, backslashes and control
/// characters of a block of `W` bytes: `marks` sets bits `FIELD << (k <<
/// SHIFT)` for byte `k`, and the lowest mark is always a true one.
pub(super) trait Block {
    const W: usize;
    const SHIFT: u32;
    const FIELD: u64;
    fn marks(w: &[u8]) -> u64;
}

/// Eight bytes in a `u64`: any target. On x86_64 only the tests use it,
/// against [`Sse2`] and serde.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
pub(super) struct Swar;

impl Block for Swar {
    const W: usize = 8;
    const SHIFT: u32 = 3;
    const FIELD: u64 = 0xff;

    /// The high bit of a byte, in safe code. A byte of `x ^ (ONES * c)` is
    /// zero where `x` holds `c`; `x - ONES * 0x20` borrows in a byte below
    /// 0x20, and `!x` keeps bytes of 0x80 and up out. A false mark can only
    /// sit above a true one, so the lowest mark is always true.
    fn marks(w: &[u8]) -> u64 {
        let x = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        zeros(x ^ (ONES * u64::from(b'"')))
            | zeros(x ^ (ONES * u64::from(b'\\')))
            | (x.wrapping_sub(ONES * 0x20) & !x & HIGH)
    }
}

/// 32 bytes as two SSE2 registers (every x86_64 has SSE2; `safe_arch` wraps
/// the intrinsics safely): a bit per byte, no false marks. A history's
/// prose, CJK and base64 run hundreds of bytes between escapes, so wider
/// blocks than [`Swar`]'s pay; 64-byte blocks gained nothing over 32.
#[cfg(target_arch = "x86_64")]
pub(super) struct Sse2;

#[cfg(target_arch = "x86_64")]
impl Block for Sse2 {
    const W: usize = 32;
    const SHIFT: u32 = 0;
    const FIELD: u64 = 1;

    fn marks(w: &[u8]) -> u64 {
        use safe_arch::*;
        let half = |k: usize| {
            let bytes: [u8; 16] = w
                .get(k..k + 16)
                .and_then(|s| s.try_into().ok())
                .unwrap_or([0; 16]);
            let v = load_unaligned_m128i(&bytes);
            let quote = cmp_eq_mask_i8_m128i(v, set_splat_i8_m128i(b'"' as i8));
            let slash = cmp_eq_mask_i8_m128i(v, set_splat_i8_m128i(b'\\' as i8));
            // Bytes below 0x20: unchanged by an unsigned min with 0x1f.
            let control = cmp_eq_mask_i8_m128i(min_u8_m128i(v, set_splat_i8_m128i(0x1f)), v);
            let m = bitor_m128i(bitor_m128i(quote, slash), control);
            u64::from(move_mask_i8_m128i(m) as u16)
        };
        half(0) | half(16) << 16
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) type Native = Sse2;
#[cfg(not(target_arch = "x86_64"))]
pub(super) type Native = Swar;
