//! Byte and bit codecs shared by every payload format.
//!
//! All multi-byte fields are little-endian. Bit streams are packed LSB-first into bytes: the
//! first code occupies the lowest bits of the first byte. A [`Reader`] checks every length
//! against the bytes actually present before it slices or allocates, so a hostile length
//! field yields [`WireError::Truncated`] instead of a huge allocation.

use crate::error::WireError;

/// Appends fields to a payload buffer.
#[derive(Debug, Default)]
pub struct Writer<'a> {
    buf: Option<&'a mut Vec<u8>>,
}

impl<'a> Writer<'a> {
    /// A writer appending to `buf`.
    pub fn new(buf: &'a mut Vec<u8>) -> Self {
        Writer { buf: Some(buf) }
    }

    #[inline]
    fn b(&mut self) -> &mut Vec<u8> {
        self.buf.as_mut().expect("writer has a buffer")
    }

    /// Bytes written so far (including what the buffer held before).
    pub fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// Whether nothing has been written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reserve room for `n` more bytes.
    pub fn reserve(&mut self, n: usize) {
        self.b().reserve(n);
    }

    /// One byte.
    #[inline]
    pub fn u8(&mut self, v: u8) {
        self.b().push(v);
    }

    /// A little-endian `u32`.
    #[inline]
    pub fn u32(&mut self, v: u32) {
        self.b().extend_from_slice(&v.to_le_bytes());
    }

    /// A little-endian `u64`.
    #[inline]
    pub fn u64(&mut self, v: u64) {
        self.b().extend_from_slice(&v.to_le_bytes());
    }

    /// A little-endian `f32`.
    #[inline]
    pub fn f32(&mut self, v: f32) {
        self.b().extend_from_slice(&v.to_le_bytes());
    }

    /// Raw bytes.
    pub fn bytes(&mut self, v: &[u8]) {
        self.b().extend_from_slice(v);
    }

    /// A slice of `f32` as consecutive little-endian words.
    pub fn f32_slice(&mut self, v: &[f32]) {
        let b = self.b();
        b.reserve(v.len() * 4);
        for x in v {
            b.extend_from_slice(&x.to_le_bytes());
        }
    }

    /// A slice of `u32` as consecutive little-endian words.
    pub fn u32_slice(&mut self, v: &[u32]) {
        let b = self.b();
        b.reserve(v.len() * 4);
        for x in v {
            b.extend_from_slice(&x.to_le_bytes());
        }
    }

    /// Appends `nbytes` zero bytes and returns them for in-place filling (bit packing).
    pub fn zeroed(&mut self, nbytes: usize) -> &mut [u8] {
        let b = self.b();
        let start = b.len();
        b.resize(start + nbytes, 0);
        &mut b[start..]
    }

    /// The sign bits of `x`, `⌈n/8⌉` bytes: bit `j` (LSB-first) is 1 iff `x_j ≥ 0` (−0.0
    /// included); the unused bits of the last byte are 0. Read back with
    /// [`Reader::sign_bits`].
    pub fn sign_bits(&mut self, x: &[f32]) {
        let bits = self.zeroed(x.len().div_ceil(8));
        for (byte, chunk) in bits.iter_mut().zip(x.chunks(8)) {
            let mut b = 0u8;
            for (k, v) in chunk.iter().enumerate() {
                b |= u8::from(*v >= 0.0) << k;
            }
            *byte = b;
        }
    }
}

/// Reads fields from a payload with bounds checks on every access.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`, positioned at its start.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Bytes read so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The next `n` bytes, or `Truncated` naming `what`.
    #[inline]
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if n > self.remaining() {
            return Err(WireError::Truncated {
                what,
                needed: n,
                available: self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// `count` items of `size` bytes each, with overflow-safe length checking.
    #[inline]
    pub fn take_items(
        &mut self,
        count: usize,
        size: usize,
        what: &'static str,
    ) -> Result<&'a [u8], WireError> {
        let n = count.checked_mul(size).ok_or(WireError::Truncated {
            what,
            needed: usize::MAX,
            available: self.remaining(),
        })?;
        self.take(n, what)
    }

    /// One byte.
    #[inline]
    pub fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }

    /// A little-endian `u32`.
    #[inline]
    pub fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A little-endian `u64`.
    #[inline]
    pub fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A little-endian `f32`.
    #[inline]
    pub fn f32(&mut self, what: &'static str) -> Result<f32, WireError> {
        Ok(f32::from_bits(self.u32(what)?))
    }

    /// The `⌈n/8⌉` sign-bit bytes of [`Writer::sign_bits`] for `n` elements, with the unused
    /// bits of the last byte checked to be 0.
    pub fn sign_bits(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        let bits = self.take(n.div_ceil(8), what)?;
        if !n.is_multiple_of(8) && bits[n / 8] >> (n % 8) != 0 {
            return Err(WireError::Invalid(what));
        }
        Ok(bits)
    }

    /// A finite little-endian `f32` (`Invalid(what)` otherwise).
    #[inline]
    pub fn finite_f32(&mut self, what: &'static str) -> Result<f32, WireError> {
        let v = self.f32(what)?;
        if v.is_finite() {
            Ok(v)
        } else {
            Err(WireError::Invalid(what))
        }
    }
}

/// Reads the `i`-th little-endian `f32` of a byte slice holding packed `f32`s.
#[inline(always)]
pub fn f32_at(bytes: &[u8], i: usize) -> f32 {
    let b = &bytes[4 * i..4 * i + 4];
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Reads the `i`-th little-endian `u32` of a byte slice holding packed `u32`s.
#[inline(always)]
pub fn u32_at(bytes: &[u8], i: usize) -> u32 {
    let b = &bytes[4 * i..4 * i + 4];
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Number of bytes that hold `bits` bits.
#[inline]
pub const fn bytes_for_bits(bits: u64) -> usize {
    bits.div_ceil(8) as usize
}

/// Packs `codes` (each `< 2^width`, `1 <= width <= 32`) LSB-first into `out`, which must hold
/// `bytes_for_bits(codes.len() * width)` zeroed bytes.
pub fn pack_bits(codes: impl IntoIterator<Item = u32>, width: u32, out: &mut [u8]) {
    let mut w = BitWriter::new(out);
    for c in codes {
        w.put(c, width);
    }
    w.finish();
}

/// Streaming LSB-first bit packer into a fixed byte slice.
pub struct BitWriter<'a> {
    out: &'a mut [u8],
    acc: u64,
    nacc: u32,
    pos: usize,
}

impl<'a> BitWriter<'a> {
    /// A packer writing into `out` (which should be zeroed and large enough).
    pub fn new(out: &'a mut [u8]) -> Self {
        BitWriter {
            out,
            acc: 0,
            nacc: 0,
            pos: 0,
        }
    }

    /// Appends the low `width` bits of `code` (`width <= 32`).
    #[inline(always)]
    pub fn put(&mut self, code: u32, width: u32) {
        debug_assert!(width <= 32);
        self.acc |= (code as u64) << self.nacc;
        self.nacc += width;
        if self.nacc >= 32 {
            let w = (self.acc as u32).to_le_bytes();
            self.out[self.pos..self.pos + 4].copy_from_slice(&w);
            self.pos += 4;
            self.acc >>= 32;
            self.nacc -= 32;
        }
    }

    /// Flushes the partial last word (only the bytes that hold bits).
    pub fn finish(mut self) {
        while self.nacc > 0 {
            self.out[self.pos] = self.acc as u8;
            self.pos += 1;
            self.acc >>= 8;
            self.nacc = self.nacc.saturating_sub(8);
        }
    }
}

/// Streaming LSB-first bit reader over a byte slice. Reads past the end yield zero bits;
/// callers validate the slice length against the expected bit count first.
pub struct BitReader<'a> {
    buf: &'a [u8],
    acc: u64,
    nacc: u32,
    pos: usize,
    consumed: u64,
}

impl<'a> BitReader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        BitReader {
            buf,
            acc: 0,
            nacc: 0,
            pos: 0,
            consumed: 0,
        }
    }

    #[inline(always)]
    fn refill(&mut self) {
        if self.pos + 4 <= self.buf.len() {
            let b = &self.buf[self.pos..self.pos + 4];
            let w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64;
            self.acc |= w << self.nacc;
            self.nacc += 32;
            self.pos += 4;
        } else {
            while self.nacc <= 56 && self.pos < self.buf.len() {
                self.acc |= (self.buf[self.pos] as u64) << self.nacc;
                self.nacc += 8;
                self.pos += 1;
            }
            if self.pos >= self.buf.len() && self.nacc < 32 {
                // Past the end: pad with zeros so reads stay defined.
                self.nacc = 64;
            }
        }
    }

    /// The next `width` bits (`width <= 32`).
    #[inline(always)]
    pub fn get(&mut self, width: u32) -> u32 {
        debug_assert!(width <= 32);
        if self.nacc < width {
            self.refill();
        }
        let v = (self.acc & ((1u64 << width) - 1)) as u32;
        self.acc >>= width;
        self.nacc -= width;
        self.consumed += width as u64;
        v
    }

    /// One bit.
    #[inline(always)]
    pub fn bit(&mut self) -> bool {
        self.get(1) != 0
    }

    /// Consumes the run of 1 bits at the front of the buffered bits (refilling first when
    /// none are buffered) and returns its length, and whether a 0 bit follows it there
    /// (left unread); `false` means the run may go on past the buffered bits, so call again.
    /// A unary code's ones a word at a time rather than a bit at a time.
    #[inline(always)]
    pub fn ones(&mut self) -> (u32, bool) {
        if self.nacc == 0 {
            self.refill();
        }
        let t = self.acc.trailing_ones().min(self.nacc);
        self.acc = self.acc.checked_shr(t).unwrap_or(0);
        self.nacc -= t;
        self.consumed += t as u64;
        (t, self.nacc > 0)
    }

    /// Total bits consumed so far (reads past the end count too, so a caller can compare
    /// this with the bits actually present to detect an overrun).
    pub fn bits_read(&self) -> u64 {
        self.consumed
    }
}

/// Elias-gamma code of `v >= 1`: `floor(log2 v)` zeros, then `v`'s bits from the top.
#[inline]
pub fn elias_gamma_put(w: &mut BitWriter<'_>, v: u32) {
    debug_assert!(v >= 1);
    let nb = 32 - v.leading_zeros(); // bits in v
                                     // (nb-1) zeros
    let mut z = nb - 1;
    while z > 0 {
        let c = z.min(32);
        w.put(0, c);
        z -= c;
    }
    // v's bits MSB-first: write bit by bit reversed into LSB-first stream
    let rev = v.reverse_bits() >> (32 - nb);
    w.put(rev, nb);
}

/// Length in bits of the Elias-gamma code of `v >= 1`.
#[inline]
pub fn elias_gamma_len(v: u32) -> u64 {
    let nb = 32 - v.leading_zeros();
    (2 * nb - 1) as u64
}

/// Reads one Elias-gamma code; `None` if it is malformed (more than 31 leading zeros).
#[inline]
pub fn elias_gamma_get(r: &mut BitReader<'_>) -> Option<u32> {
    let mut zeros = 0;
    while !r.bit() {
        zeros += 1;
        if zeros > 31 {
            return None;
        }
    }
    let rest = if zeros == 0 { 0 } else { r.get(zeros) };
    // rest holds the remaining bits MSB-first reversed (LSB-first stream)
    let rest_msb = if zeros == 0 {
        0
    } else {
        rest.reverse_bits() >> (32 - zeros)
    };
    Some((1u32 << zeros) | rest_msb)
}

/// Fast Elias-gamma reader over an LSB-first bit stream (the layout of
/// [`elias_gamma_put`]): it decodes a code from one 64-bit window when the code has at most
/// 27 leading zeros (values below 2^28) and falls back to a bit at a time for longer ones.
///
/// Over any bytes it reads exactly what a [`BitReader`] with [`elias_gamma_get`] and
/// [`BitReader::bit`] reads: the same codes, the same `None` for malformed ones, and the
/// same [`GammaReader::bits_read`] after every call. Bits past the end read as zero and are
/// counted, so the caller detects an overrun by comparing `bits_read` with the bits
/// present. Use it where a stream is mostly gamma codes (index gaps, QSGD's gap, sign,
/// level triples); [`BitReader`] stays the reader for fixed-width codes.
#[derive(Debug, Clone)]
pub struct GammaReader<'a> {
    buf: &'a [u8],
    pos: u64,
}

impl<'a> GammaReader<'a> {
    /// A reader at the start of `buf`.
    #[inline]
    pub fn new(buf: &'a [u8]) -> Self {
        GammaReader { buf, pos: 0 }
    }

    /// The next (at least 57) bits, LSB first, without consuming them; bits past the end
    /// are zero.
    #[inline(always)]
    pub fn peek(&self) -> u64 {
        let b = (self.pos >> 3) as usize;
        let w = match self.buf.get(b..b + 8) {
            Some(s) => u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]),
            None => {
                let mut a = [0u8; 8];
                if let Some(s) = self.buf.get(b..) {
                    a[..s.len()].copy_from_slice(s);
                }
                u64::from_le_bytes(a)
            }
        };
        w >> (self.pos & 7)
    }

    #[inline]
    fn next_bit(&mut self) -> u32 {
        let v = (self.peek() & 1) as u32;
        self.pos += 1;
        v
    }

    /// One bit.
    #[inline]
    pub fn bit(&mut self) -> bool {
        self.next_bit() != 0
    }

    /// One Elias-gamma code; `None` if it is malformed (more than 31 leading zeros).
    #[inline]
    pub fn get(&mut self) -> Option<u32> {
        let w = self.peek();
        let z = w.trailing_zeros();
        if z <= 27 {
            let nb = z + 1;
            let x = ((w >> z) & ((1u64 << nb) - 1)) as u32;
            self.pos += u64::from(z + nb);
            return Some(x.reverse_bits() >> (32 - nb));
        }
        let mut zeros = 0u32;
        while self.next_bit() == 0 {
            zeros += 1;
            if zeros > 31 {
                return None;
            }
        }
        let mut v = 1u32;
        for _ in 0..zeros {
            v = (v << 1) | self.next_bit();
        }
        Some(v)
    }

    /// Total bits consumed so far (reads past the end count too).
    #[inline]
    pub fn bits_read(&self) -> u64 {
        self.pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{
        any, prop_assert_eq, prop_oneof, proptest, ProptestConfig, TestCaseError,
    };

    #[test]
    fn bits_round_trip_all_widths() {
        for width in 1..=32u32 {
            let mask = if width == 32 {
                u32::MAX
            } else {
                (1 << width) - 1
            };
            let codes: Vec<u32> = (0..97u32)
                .map(|i| i.wrapping_mul(2_654_435_761) & mask)
                .collect();
            let mut out = vec![0u8; bytes_for_bits(codes.len() as u64 * width as u64)];
            pack_bits(codes.iter().copied(), width, &mut out);
            let mut r = BitReader::new(&out);
            for &c in &codes {
                assert_eq!(r.get(width), c, "width {width}");
            }
        }
    }

    #[test]
    fn elias_gamma_round_trip() {
        let vals: Vec<u32> = (1..2000).chain([u32::MAX, 1 << 31, 65535]).collect();
        let bits: u64 = vals.iter().map(|&v| elias_gamma_len(v)).sum();
        let mut out = vec![0u8; bytes_for_bits(bits)];
        let mut w = BitWriter::new(&mut out);
        for &v in &vals {
            elias_gamma_put(&mut w, v);
        }
        w.finish();
        let mut r = BitReader::new(&out);
        for &v in &vals {
            assert_eq!(elias_gamma_get(&mut r), Some(v));
        }
        assert_eq!(r.bits_read().div_ceil(8) as usize, out.len());
    }

    #[test]
    fn reader_refuses_huge_lengths() {
        let buf = [1u8, 2, 3];
        let mut r = Reader::new(&buf);
        assert!(r.take_items(usize::MAX / 2, 4, "x").is_err());
        assert!(r.u32("x").is_err());
        assert_eq!(r.u8("x").unwrap(), 1);
    }

    #[test]
    fn fast_gamma_reader_agrees_with_the_bitwise_decoder() {
        let vals: Vec<u32> = (1..3000u32)
            .chain([1 << 27, (1 << 28) - 1, 1 << 28, u32::MAX, 1 << 31, 5, 1])
            .collect();
        let bits: u64 = vals.iter().map(|&v| elias_gamma_len(v)).sum();
        let mut buf = vec![0u8; bytes_for_bits(bits)];
        let mut w = BitWriter::new(&mut buf);
        for &v in &vals {
            elias_gamma_put(&mut w, v);
        }
        w.finish();
        let mut fast = GammaReader::new(&buf);
        let mut slow = BitReader::new(&buf);
        for &v in &vals {
            assert_eq!(fast.get(), Some(v));
            assert_eq!(elias_gamma_get(&mut slow), Some(v));
            assert_eq!(fast.bits_read(), slow.bits_read());
        }
        // 32+ zeros are malformed; reads past the end are zeros.
        let mut z = GammaReader::new(&[0u8; 5]);
        assert_eq!(z.get(), None);
    }

    /// The old bit-at-a-time decoding, step by step beside the fast reader: the same codes,
    /// bits and positions, and `peek` shows the bits that follow.
    fn agree(buf: &[u8], ops: &[bool]) -> Result<(), TestCaseError> {
        let mut fast = GammaReader::new(buf);
        let mut slow = BitReader::new(buf);
        for &gamma in ops {
            if gamma {
                prop_assert_eq!(fast.get(), elias_gamma_get(&mut slow));
            } else {
                prop_assert_eq!(fast.bit(), slow.bit());
            }
            prop_assert_eq!(fast.bits_read(), slow.bits_read());
            let mut next = BitReader::new(buf);
            let mut skip = slow.bits_read();
            while skip > 0 {
                let c = skip.min(32) as u32;
                next.get(c);
                skip -= c as u64;
            }
            let ahead = u64::from(next.get(32)) | u64::from(next.get(25)) << 32;
            prop_assert_eq!(fast.peek() & ((1u64 << 57) - 1), ahead);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

        #[test]
        fn gamma_reader_matches_the_bitwise_decoder_on_arbitrary_bytes(
            buf in proptest::collection::vec(any::<u8>(), 0..48),
            ops in proptest::collection::vec(any::<bool>(), 0..64),
        ) {
            agree(&buf, &ops)?;
            // Mostly zeros: long and malformed codes, reads past the end.
            let sparse: Vec<u8> = buf.iter().map(|&b| if b % 5 == 0 { b } else { 0 }).collect();
            agree(&sparse, &ops)?;
        }

        #[test]
        fn gamma_reader_decodes_what_the_writer_wrote(
            vals in proptest::collection::vec(prop_oneof![1u32..64, 1u32..=u32::MAX], 0..40),
            signs in any::<u64>(),
        ) {
            // Codes interleaved with single bits, as in QSGD's gap, sign, level triples.
            let bits: u64 = vals.iter().map(|&v| elias_gamma_len(v) + 1).sum();
            let mut buf = vec![0u8; bytes_for_bits(bits)];
            let mut w = BitWriter::new(&mut buf);
            for (i, &v) in vals.iter().enumerate() {
                elias_gamma_put(&mut w, v);
                w.put((signs >> (i % 64)) as u32 & 1, 1);
            }
            w.finish();
            let mut r = GammaReader::new(&buf);
            for (i, &v) in vals.iter().enumerate() {
                prop_assert_eq!(r.get(), Some(v));
                prop_assert_eq!(r.bit(), (signs >> (i % 64)) & 1 == 1);
            }
            prop_assert_eq!(r.bits_read(), bits);
            let ops: Vec<bool> = (0..2 * vals.len()).map(|i| i % 2 == 0).collect();
            agree(&buf, &ops)?;
        }
    }
}
