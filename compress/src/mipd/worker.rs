//! The MIPD worker side (see the [module docs](crate::mipd)): significance, the adaptive
//! keep count, the [`Mipd`] encoder and the per-layer wire body ([`decode_layer`]).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::codebook::{code_width, fit_codebook, nearest, MAX_LEVELS};
use super::MipdConfig;
use crate::compressor::{
    effective_segments, first_non_finite, write_frame_header, Aggregation, Compressor, MethodId,
    MAX_ELEMS,
};
use crate::error::{CompressError, WireError};
use crate::registry::Method;
use crate::rng::Rng;
use crate::select::{abs_key, top_k, Scratch};
use crate::wire::{
    bytes_for_bits, elias_gamma_len, elias_gamma_put, f32_at, BitReader, BitWriter, GammaReader,
    Reader, Writer,
};

const GAPS: u8 = 0;
const BITMAP: u8 = 1;

/// How significant a coordinate is, i.e. which entries of a layer are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Significance {
    /// `|w_j · g_j|`: the first-order Taylor estimate of the loss change if the update of
    /// `w_j` were dropped (the template's placeholder). Default.
    ///
    /// Caveat (measured, `framework/examples/mipd_ps.rs`): a parameter at exactly zero
    /// scores zero and is never kept while anything else in its layer scores above zero,
    /// so it can never move away from zero. Softmax regression from a zero start stalls
    /// near 85 % test accuracy with it, where `|g|` matches the dense PS.
    #[default]
    Taylor,
    /// `|g_j|`: plain magnitude, as top-k uses (for comparison).
    Gradient,
}

/// What the encoder did with one layer (for tests, logs and metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerStats {
    /// Elements in the layer.
    pub len: usize,
    /// Entries kept (`k = ρ_l·n`).
    pub kept: usize,
    /// Code-book levels sent.
    pub levels: usize,
    /// Whether the indices went as a bitmap (else as Elias-gamma gaps).
    pub bitmap: bool,
    /// Body bytes of the layer.
    pub bytes: usize,
}

impl LayerStats {
    /// The layer's keep ratio ρ_l = k/n.
    pub fn ratio(&self) -> f64 {
        if self.len == 0 {
            0.0
        } else {
            self.kept as f64 / self.len as f64
        }
    }
}

/// The MIPD worker-side encoder (see the [module docs](crate::mipd)).
#[derive(Debug, Clone)]
pub struct Mipd {
    cfg: MipdConfig,
    scores: Vec<f32>,
    keys: Vec<u32>,
    scratch: Scratch,
    idx: Vec<u32>,
    vals: Vec<f32>,
    sorted: Vec<f32>,
    stats: Vec<LayerStats>,
}

/// Writes `significance(w_j, g_j)` into `out` (resized): `|w_j·g_j|` or `|g_j|`, as finite
/// non-negative values (an overflowing product saturates at `f32::MAX`). Without
/// parameters, or when every Taylor score is zero while some gradient is not, the scores
/// are `|g_j|` (see the [module docs](crate::mipd)).
pub fn significance(kind: Significance, params: Option<&[f32]>, grads: &[f32], out: &mut Vec<f32>) {
    out.clear();
    if let (Significance::Taylor, Some(w)) = (kind, params) {
        out.extend(
            w.iter()
                .zip(grads)
                .map(|(&w, &g)| (w * g).abs().min(f32::MAX)),
        );
        if out.iter().any(|&s| s > 0.0) || grads.iter().all(|&g| g == 0.0) {
            return;
        }
        out.clear();
    }
    out.extend(grads.iter().map(|g| g.abs()));
}

/// The number of entries MIPD keeps of a layer with significance `scores` (finite, ≥ 0):
/// the smallest `k` whose `k` largest scores hold at least `mass · Σ scores`, clamped to
/// `[max(1, ⌈ρ_min·n⌉), max(that, ⌈ρ_max·n⌉)]` (capped at `n`); the lower bound when all
/// scores are zero. Sums are in f64. `keys` is scratch.
pub fn keep_count(scores: &[f32], cfg: &MipdConfig, keys: &mut Vec<u32>) -> usize {
    let n = scores.len();
    if n == 0 {
        return 0;
    }
    let k_min = ((cfg.min_ratio * n as f64).ceil() as usize).clamp(1, n);
    let k_max = ((cfg.max_ratio * n as f64).ceil() as usize).clamp(k_min, n);
    let total: f64 = scores.iter().map(|&s| s as f64).sum();
    if total <= 0.0 {
        return k_min;
    }
    // Non-negative finite f32 order like their bit patterns.
    keys.clear();
    keys.extend(scores.iter().map(|s| s.to_bits()));
    mass_count(keys, cfg.mass * total).clamp(k_min, k_max)
}

/// Smallest `k` such that the `k` largest of `v` (non-negative f32 bit patterns) sum to at
/// least `need`; `v.len()` if they never do. Quickselect on the mass: O(n) on average.
fn mass_count(v: &mut [u32], mut need: f64) -> usize {
    let val = |b: u32| f32::from_bits(b) as f64;
    let (mut lo, mut hi, mut acc) = (0usize, v.len(), 0usize);
    loop {
        let len = hi - lo;
        if len <= 64 {
            let s = &mut v[lo..hi];
            s.sort_unstable_by(|a, b| b.cmp(a));
            for (i, &x) in s.iter().enumerate() {
                need -= val(x);
                if need <= 0.0 {
                    return acc + i + 1;
                }
            }
            return acc + len;
        }
        let mid = len / 2;
        v[lo..hi].select_nth_unstable_by(mid, |a, b| b.cmp(a));
        let upper: f64 = v[lo..lo + mid].iter().map(|&x| val(x)).sum();
        if upper >= need {
            hi = lo + mid;
        } else {
            need -= upper;
            acc += mid;
            lo += mid;
        }
    }
}

impl Mipd {
    /// A fresh encoder for `cfg` (checked by [`MipdConfig::init`]), with empty scratch.
    pub(super) fn new(cfg: MipdConfig) -> Self {
        Mipd {
            cfg,
            scores: Vec::new(),
            keys: Vec::new(),
            scratch: Scratch::default(),
            idx: Vec::new(),
            vals: Vec::new(),
            sorted: Vec::new(),
            stats: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &MipdConfig {
        &self.cfg
    }

    /// Per-layer statistics of the last encode (one entry per layer, in order).
    pub fn last_stats(&self) -> &[LayerStats] {
        &self.stats
    }

    /// Encodes the gradient `grads` of a model (or shard) whose parameters are `params`,
    /// laid out in the layers `layers` (contiguous, in order, tiling the buffer; empty means
    /// one layer), into `out` (cleared first). The framing is the shared one of
    /// [`crate::compressor`]: decode with [`crate::decompress_add`] on a [`Mipd`] of any
    /// configuration.
    ///
    /// Fails on buffers of different lengths, non-finite values, buffers over the wire
    /// format's limit and layer lists that do not tile the buffer.
    pub fn encode(
        &mut self,
        params: &[f32],
        grads: &[f32],
        layers: &[Range<usize>],
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        if params.len() != grads.len() {
            return Err(CompressError::BadSegments(format!(
                "{} parameters for {} gradient entries",
                params.len(),
                grads.len()
            )));
        }
        self.encode_inner(Some(params), grads, layers, out)
    }

    fn encode_inner(
        &mut self,
        params: Option<&[f32]>,
        grads: &[f32],
        layers: &[Range<usize>],
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        let n = grads.len();
        if n > MAX_ELEMS {
            return Err(CompressError::TooLarge(n));
        }
        if let Some((index, value)) = first_non_finite(grads) {
            return Err(CompressError::NonFinite { index, value });
        }
        if let Some((index, value)) = params.and_then(first_non_finite) {
            return Err(CompressError::NonFinite { index, value });
        }
        let segs = effective_segments(n, layers)?;
        out.clear();
        self.stats.clear();
        let mut w = Writer::new(out);
        write_frame_header(&mut w, MipdConfig::ID, n, &segs);
        for s in &segs {
            let p = params.map(|p| &p[s.clone()]);
            self.encode_layer(p, &grads[s.clone()], &mut w);
        }
        Ok(())
    }

    /// Encodes one layer's body (gradient `g`, parameters `w` if known).
    fn encode_layer(&mut self, w: Option<&[f32]>, g: &[f32], out: &mut Writer<'_>) {
        let n = g.len();
        let start = out.len();
        significance(self.cfg.significance, w, g, &mut self.scores);
        let k = keep_count(&self.scores, &self.cfg, &mut self.keys);
        let scores = &self.scores;
        top_k(
            n,
            k,
            |i| abs_key(scores[i]),
            &mut self.scratch,
            &mut self.idx,
        );
        debug_assert_eq!(self.idx.len(), k);
        out.u32(k as u32);
        if k == 0 {
            self.stats.push(LayerStats {
                len: n,
                kept: 0,
                levels: 0,
                bitmap: false,
                bytes: out.len() - start,
            });
            return;
        }
        // Indices: Elias-gamma gaps or a bitmap, whichever is smaller.
        let mut prev = -1i64;
        let mut gap_bits = 0u64;
        for &i in &self.idx {
            gap_bits += elias_gamma_len((i as i64 - prev) as u32);
            prev = i as i64;
        }
        let gap_bytes = bytes_for_bits(gap_bits);
        let bitmap = n.div_ceil(8) < gap_bytes;
        if bitmap {
            out.u8(BITMAP);
            out.u32(n.div_ceil(8) as u32);
            let bm = out.zeroed(n.div_ceil(8));
            for &i in &self.idx {
                bm[(i >> 3) as usize] |= 1 << (i & 7);
            }
        } else {
            out.u8(GAPS);
            out.u32(gap_bytes as u32);
            let mut bw = BitWriter::new(out.zeroed(gap_bytes));
            let mut prev = -1i64;
            for &i in &self.idx {
                elias_gamma_put(&mut bw, (i as i64 - prev) as u32);
                prev = i as i64;
            }
            bw.finish();
        }
        // Values: code-book fitted to the kept values, then codes.
        self.vals.clear();
        self.vals.extend(self.idx.iter().map(|&i| g[i as usize]));
        self.sorted.clear();
        self.sorted.extend_from_slice(&self.vals);
        self.sorted.sort_unstable_by(f32::total_cmp);
        let levels = fit_codebook(&self.sorted, 1usize << self.cfg.bits, self.cfg.lloyd_iters);
        out.u32(levels.len() as u32);
        out.f32_slice(&levels);
        let width = code_width(levels.len());
        let mut bw = BitWriter::new(out.zeroed(bytes_for_bits(k as u64 * width as u64)));
        if width > 0 {
            for &v in &self.vals {
                bw.put(nearest(&levels, v) as u32, width);
            }
        }
        bw.finish();
        self.stats.push(LayerStats {
            len: n,
            kept: k,
            levels: levels.len(),
            bitmap,
            bytes: out.len() - start,
        });
    }
}

/// Reads one layer body of `n` elements and calls `visit(index, value)` for every kept
/// entry in ascending index order. Validates everything; never panics.
pub fn decode_layer(
    r: &mut Reader<'_>,
    n: usize,
    mut visit: impl FnMut(usize, f32),
) -> Result<(), WireError> {
    let k = r.u32("mipd kept count")? as usize;
    if k > n {
        return Err(WireError::Invalid("mipd: more kept entries than elements"));
    }
    if k == 0 {
        return Ok(());
    }
    let layout = r.u8("mipd index layout")?;
    let m = r.u32("mipd index bytes")? as usize;
    let idx = r.take(m, "mipd indices")?;
    let l = r.u32("mipd code-book size")? as usize;
    if l == 0 || l > k.min(MAX_LEVELS) {
        return Err(WireError::Invalid("mipd: code-book size out of range"));
    }
    let lv = r.take_items(l, 4, "mipd code-book")?;
    let mut prev = f32::NEG_INFINITY;
    for j in 0..l {
        let v = f32_at(lv, j);
        if !v.is_finite() || v <= prev {
            return Err(WireError::Invalid(
                "mipd: code-book not finite and strictly ascending",
            ));
        }
        prev = v;
    }
    let width = code_width(l);
    let codes = r.take(bytes_for_bits(k as u64 * width as u64), "mipd value codes")?;
    let mut cr = BitReader::new(codes);
    let mut code = || -> Result<f32, WireError> {
        let c = cr.get(width) as usize;
        if c >= l {
            return Err(WireError::Invalid("mipd: code outside the code-book"));
        }
        Ok(f32_at(lv, c))
    };
    match layout {
        GAPS => {
            let mut br = GammaReader::new(idx);
            let mut next = 0u64;
            for _ in 0..k {
                let gap = br
                    .get()
                    .ok_or(WireError::Invalid("mipd: malformed index gap"))?;
                if br.bits_read() > 8 * m as u64 {
                    return Err(WireError::Invalid("mipd: index gaps overrun their bytes"));
                }
                let i = next + gap as u64 - 1;
                if i >= n as u64 {
                    return Err(WireError::IndexOutOfRange { index: i, len: n });
                }
                visit(i as usize, code()?);
                next = i + 1;
            }
            if bytes_for_bits(br.bits_read()) != m {
                return Err(WireError::Invalid(
                    "mipd: index gaps do not fill their bytes",
                ));
            }
            let pad = (8 - br.bits_read() % 8) % 8;
            if br.peek() & ((1u64 << pad) - 1) != 0 {
                return Err(WireError::Invalid("mipd: index padding bits are not zero"));
            }
        }
        BITMAP => {
            if m != n.div_ceil(8) {
                return Err(WireError::Invalid("mipd: bitmap of the wrong length"));
            }
            let set: usize = idx.iter().map(|b| b.count_ones() as usize).sum();
            if set != k {
                return Err(WireError::Invalid(
                    "mipd: bitmap population differs from count",
                ));
            }
            if !n.is_multiple_of(8) && (idx[m - 1] >> (n % 8)) != 0 {
                return Err(WireError::Invalid(
                    "mipd: bitmap has bits past the layer end",
                ));
            }
            for (bi, &b) in idx.iter().enumerate() {
                let mut b = b;
                while b != 0 {
                    let bit = b.trailing_zeros() as usize;
                    b &= b - 1;
                    visit(bi * 8 + bit, code()?);
                }
            }
        }
        _ => return Err(WireError::Invalid("mipd: unknown index layout")),
    }
    let used = k as u64 * width as u64;
    let pad = (8 - used % 8) % 8;
    if pad > 0 && cr.get(pad as u32) != 0 {
        return Err(WireError::Invalid("mipd: code padding bits are not zero"));
    }
    Ok(())
}

impl Compressor for Mipd {
    fn method(&self) -> MethodId {
        MipdConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn begin(&mut self, _grad: &[f32], _ctx: &crate::compressor::Ctx<'_>) {
        self.stats.clear();
    }
    /// Through the generic seam the parameters are unknown: significance is `|g_j|`.
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        self.encode_layer(None, x, w);
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        decode_layer(r, out.len(), |i, v| out[i] += v)
    }
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, read_frame, Ctx};
    use crate::mipd::tests::sample;
    use crate::test_util::fuzz_decoder;

    /// Per layer of the payload: the (index, value) pairs it carries, via the decoder.
    fn kept_entries(bytes: &[u8], n: usize) -> Vec<Vec<(usize, f32)>> {
        let (mut r, segs) = read_frame(MipdConfig::ID, bytes, n).unwrap();
        let mut out = Vec::new();
        for s in segs {
            let mut v = Vec::new();
            decode_layer(&mut r, s.len(), |i, x| v.push((i, x))).unwrap();
            out.push(v);
        }
        assert_eq!(r.remaining(), 0);
        out
    }

    /// Independent reference of the keep rule: sort, accumulate, clamp.
    fn brute_keep(scores: &[f32], cfg: &MipdConfig) -> usize {
        let n = scores.len();
        let k_min = ((cfg.min_ratio * n as f64).ceil() as usize).clamp(1, n);
        let k_max = ((cfg.max_ratio * n as f64).ceil() as usize).clamp(k_min, n);
        let mut s: Vec<f64> = scores.iter().map(|&x| x as f64).collect();
        let total: f64 = s.iter().sum();
        if total == 0.0 {
            return k_min;
        }
        s.sort_by(|a, b| b.total_cmp(a));
        let mut acc = 0.0;
        let mut k = n;
        for (i, x) in s.iter().enumerate() {
            acc += x;
            if acc >= cfg.mass * total {
                k = i + 1;
                break;
            }
        }
        k.clamp(k_min, k_max)
    }

    /// A six-layer model: parameters and gradients of different distributions and scales.
    fn model(seed: u64) -> (Vec<f32>, Vec<f32>, Vec<Range<usize>>) {
        let sizes = [4000usize, 40, 2000, 25, 700, 3];
        let (mut w, mut g, mut layers, mut at) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for (l, &n) in sizes.iter().enumerate() {
            let s = seed * 100 + l as u64;
            w.extend(sample(l % 3, n, 0.1 * (l + 1) as f32, s));
            g.extend(sample((l + 1) % 3, n, 0.01 / (l + 1) as f32, s + 50));
            layers.push(at..at + n);
            at += n;
        }
        (w, g, layers)
    }

    #[test]
    fn layer_keep_counts_match_the_adaptive_ratio() {
        for (mass, min_ratio, max_ratio, sig) in [
            (0.5, 0.001, 0.05, Significance::Taylor),
            (0.5, 0.001, 1.0, Significance::Taylor),
            (0.9, 0.01, 0.3, Significance::Gradient),
            (1.0, 0.2, 1.0, Significance::Taylor),
        ] {
            let cfg = MipdConfig {
                mass,
                min_ratio,
                max_ratio,
                significance: sig,
                ..MipdConfig::default()
            };
            let mut c = cfg.init().unwrap();
            for seed in 0..3 {
                let (w, g, layers) = model(seed);
                let mut bytes = Vec::new();
                c.encode(&w, &g, &layers, &mut bytes).unwrap();
                let kept = kept_entries(&bytes, g.len());
                let mut scores = Vec::new();
                for (l, r) in layers.iter().enumerate() {
                    significance(
                        cfg.significance,
                        Some(&w[r.clone()]),
                        &g[r.clone()],
                        &mut scores,
                    );
                    let k = brute_keep(&scores, &cfg);
                    let stats = c.last_stats()[l];
                    assert_eq!(stats.kept, k, "layer {l} cfg {cfg:?}");
                    assert_eq!(kept[l].len(), k, "layer {l}: payload carries ρ_l·n entries");
                    assert_eq!(stats.ratio(), k as f64 / r.len() as f64);
                    // The kept entries are the most significant ones.
                    let mut is_kept = vec![false; r.len()];
                    kept[l].iter().for_each(|&(i, _)| is_kept[i] = true);
                    let min_kept = (0..r.len())
                        .filter(|&i| is_kept[i])
                        .map(|i| scores[i])
                        .fold(f32::INFINITY, f32::min);
                    let max_dropped = (0..r.len())
                        .filter(|&i| !is_kept[i])
                        .map(|i| scores[i])
                        .fold(0.0, f32::max);
                    assert!(min_kept >= max_dropped, "layer {l}");
                }
            }
        }
    }

    #[test]
    fn keep_ratio_adapts_to_the_score_distribution() {
        let cfg = MipdConfig {
            mass: 0.5,
            min_ratio: 0.0001,
            max_ratio: 1.0,
            ..MipdConfig::default()
        };
        let mut keys = Vec::new();
        // Flat scores: half the entries hold half the mass.
        let flat = vec![1.0f32; 1000];
        assert_eq!(keep_count(&flat, &cfg, &mut keys), 500);
        // One dominant entry holds more than half the mass.
        let mut peaked = vec![0.001f32; 1000];
        peaked[123] = 10.0;
        assert_eq!(keep_count(&peaked, &cfg, &mut keys), 1);
        // All-zero scores keep the lower bound; the upper bound caps.
        assert_eq!(keep_count(&[0.0; 1000], &cfg, &mut keys), 1);
        let capped = MipdConfig {
            max_ratio: 0.1,
            ..cfg.clone()
        };
        assert_eq!(keep_count(&flat, &capped, &mut keys), 100);
        // Random layers: the quickselect agrees with the sorted reference.
        for seed in 0..20 {
            let s: Vec<f32> = sample(seed as usize % 3, 1 + 997 * seed as usize, 1.0, seed)
                .iter()
                .map(|x| x.abs())
                .collect();
            assert_eq!(
                keep_count(&s, &cfg, &mut keys),
                brute_keep(&s, &cfg),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn taylor_significance_uses_the_parameters() {
        // Same gradients; the parameters decide which entries matter.
        let g = [1.0f32, 0.5, 0.25, 0.125];
        let w = [0.0f32, 0.0, 0.0, 100.0];
        let cfg = MipdConfig {
            mass: 0.5,
            min_ratio: 0.25,
            max_ratio: 0.25,
            ..MipdConfig::default()
        };
        let mut c = cfg.init().unwrap();
        let mut bytes = Vec::new();
        c.encode(&w, &g, &[], &mut bytes).unwrap();
        assert_eq!(kept_entries(&bytes, 4)[0], vec![(3, 0.125)]);
        let mut c = MipdConfig {
            significance: Significance::Gradient,
            ..cfg.clone()
        }
        .init()
        .unwrap();
        c.encode(&w, &g, &[], &mut bytes).unwrap();
        assert_eq!(kept_entries(&bytes, 4)[0], vec![(0, 1.0)]);
        // All-zero parameters (fresh biases): falls back to |g|.
        let mut c = cfg.init().unwrap();
        c.encode(&[0.0; 4], &g, &[], &mut bytes).unwrap();
        assert_eq!(kept_entries(&bytes, 4)[0], vec![(0, 1.0)]);
    }

    #[test]
    fn round_trip_is_exact_for_indices_and_codes() {
        let mut rng = Rng::seed_from_u64(5);
        for (n, ratio, bits) in [
            (10_000usize, 0.01, 4u32),
            (10_000, 0.5, 2),
            (37, 0.2, 1),
            (1, 1.0, 16),
        ] {
            // Values from a set of 2^bits distinct values: the code-book is exact.
            let set: Vec<f32> = (0..1usize << bits.min(4))
                .map(|i| (i as f32 - 3.5) * 0.01)
                .collect();
            let g: Vec<f32> = (0..n)
                .map(|_| set[rng.below(set.len() as u64) as usize])
                .collect();
            let w: Vec<f32> = (0..n).map(|_| rng.next_f32() + 0.5).collect();
            let cfg = MipdConfig {
                min_ratio: ratio,
                max_ratio: ratio,
                bits,
                ..MipdConfig::default()
            };
            let mut c = cfg.init().unwrap();
            let mut bytes = Vec::new();
            c.encode(&w, &g, &[], &mut bytes).unwrap();
            let mut scores = Vec::new();
            significance(cfg.significance, Some(&w), &g, &mut scores);
            let k = crate::topk::k_for(n, ratio);
            let mut want = Vec::new();
            top_k(
                n,
                k,
                |i| abs_key(scores[i]),
                &mut Scratch::default(),
                &mut want,
            );
            let got = &kept_entries(&bytes, n)[0];
            let got_idx: Vec<u32> = got.iter().map(|&(i, _)| i as u32).collect();
            assert_eq!(got_idx, want, "indices exact (n {n} ratio {ratio})");
            for &(i, v) in got {
                assert_eq!(v.to_bits(), g[i].to_bits(), "value exact");
            }
            let s = c.last_stats()[0];
            assert_eq!(
                s.bitmap,
                ratio >= 0.5 && n > 8,
                "layout choice, n {n} ratio {ratio}"
            );
            assert_eq!(s.bytes + 12, bytes.len());
            // The same payload through the generic decoder.
            let mut out = vec![0f32; n];
            decompress(&c, &bytes, &mut out).unwrap();
            for &(i, v) in got {
                assert_eq!(out[i], v);
            }
        }
        // Through the generic Compressor seam (|g| significance).
        let g = sample(0, 500, 1.0, 3);
        let mut c = MipdConfig::default().init().unwrap();
        let segs = [0..200, 200..500];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let p = compress_new(&mut c, &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let p2 = compress_new(&mut c, &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        assert_eq!((p.as_bytes(), c.last_stats().len()), (p2.as_bytes(), 2));
        let mut mine = MipdConfig {
            significance: Significance::Gradient,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let mut bytes = Vec::new();
        mine.encode(&vec![0.0; 500], &g, &segs, &mut bytes).unwrap();
        assert_eq!(p.as_bytes(), &bytes[..]);
    }

    #[test]
    fn decoder_survives_mutated_payloads() {
        let mut c = MipdConfig {
            max_ratio: 0.4,
            bits: 3,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let mut valid = Vec::new();
        for (n, layers) in [
            (300usize, vec![0..200, 200..300]),
            (40, vec![]),
            (1, vec![]),
        ] {
            let mut b = Vec::new();
            for dist in 0..3 {
                c.encode(
                    &sample(0, n, 1.0, 4),
                    &sample(dist, n, 0.1, dist as u64),
                    &layers,
                    &mut b,
                )
                .unwrap();
                valid.push((b.clone(), n));
            }
        }
        fuzz_decoder(&c, &valid, 4000, 17);
    }
}
