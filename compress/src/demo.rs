//! `demo`: Decoupled Momentum (DeMo; Peng, Quesnelle & Kingma, "DeMo: Decoupled Momentum
//! Optimization", arXiv 2411.19870), the method Nous Research's Psyche trains with.
//!
//! Each worker keeps a momentum and sends only its fast-moving components, found in the
//! frequency domain; the slow rest stays in the momentum, which is therefore also the error
//! feedback:
//! ```text
//! m ← β·m + g                                  β = 0.999 (the residual memory, β·e + 1·g)
//! q = TopK_tile(DCT(m)) per tile of ≤ chunk × chunk values
//! m ← m − IDCT(q)                              what was sent leaves the momentum
//! u = sign(mean_workers IDCT(q))               all-gathered; the step is lr·u (signSGD-like)
//! ```
//! In dtrain: this compressor (the tiled DCT, the Top-k and the sparse wire format), its
//! default memory (residual, `beta = 0.999`, `gamma = 1`), and its [`Combine::MajorityVote`]
//! (the update is the sign of the mean of the decoded payloads, which is the sign of the
//! inverse transform of the mean coefficients since the transform is linear). Pair it with
//! `train.optimizer = "sgd"`, `momentum = 0` (the momentum is the memory's) and a sign-sized
//! learning rate, as the reference implementation extends SGD. The reference accumulates
//! `lr·g` into the momentum; with the sign step only the direction matters, so `gamma = 1`
//! here changes nothing but the scale of the state.
//!
//! # The transform
//! A segment with a known shape `[rows, cols, …]` (the trainer hands over the parameter
//! shapes; three or more dimensions are seen as `[shape[0], the rest]`) is cut into tiles of
//! `a × b` values, `a` the largest divisor of `rows` not above `chunk` and `b` likewise for
//! `cols` (the reference's rule: tiles divide the tensor exactly); an unknown shape, or a
//! 1-D tensor, is one row. Each tile gets the orthonormal 2-D DCT-II `Y = D_a·X·D_bᵀ`
//! (`D_n[k][i] = c_k·cos(π(2i + 1)k / 2n)`, `c_0 = √(1/n)`, else `√(2/n)`); the inverse is
//! the transpose. A tile keeps its `k` largest coefficients (`min(k, a·b)`).
//!
//! # Body, per segment of `n` values
//! ```text
//! u32 rows | u32 tile rows a | u32 tile cols b     (rows·cols = n, a | rows, b | cols,
//!                                                   a, b ≤ 1 024)
//! the chunked Top-k body of crate::chunked over the tile-major coefficients, chunk a·b
//! ```
//! Values travel as f32 (`values = "f32"`, default) or as signs with one magnitude per
//! segment (`values = "sign"`, the paper's sign-only variant: 1 bit per value). Indices are
//! `⌈log₂ a·b⌉` bits (12 for 64 × 64 tiles). Aggregation: all-gather.
//!
//! # Against the reference code
//! Checked against the reference optimizer (bloc97/DeMo's `DeMo(torch.optim.SGD)`, read in
//! a copy, not copied) and Psyche's `shared/modeling/src/distro.rs`: the defaults
//! (`compression_chunk = 64`, `compression_topk = 32`, `compression_decay = 0.999`), the
//! tile rule (the largest divisor of each side not above the chunk), the orthonormal DCT-II
//! per tile, the Top-k by magnitude per tile, the removal of what was sent from the
//! momentum, the all-gather and the sign of the decoded update are the same. Where dtrain
//! differs:
//! * **Aggregation.** The reference scatters every worker's kept coefficients with
//!   `scatter_reduce(…, "mean")`: a coefficient is the mean over the workers *that sent
//!   it*, then the tile is inverse-transformed and its sign taken. dtrain sums the
//!   coefficients (non-senders count as 0), the mean over all workers. The sign of one
//!   coefficient is the same either way, but the inverse transform mixes coefficients,
//!   and the reference weights one sent by a single worker as much as one sent by all; so
//!   the two updates can differ in sign where coefficients of different support overlap.
//!   `mean = "senders"` is the reference's rule (the joint decoder divides each summed
//!   coefficient by its senders, times P); the default stays the mean over all workers,
//!   the sum of the single decodes that the property suite checks for every method.
//! * **Scale.** The reference accumulates `lr·g` (`delta += lr·grad`); dtrain's memory
//!   `γ = 1` accumulates `g`. Under the sign step only the direction counts, but a
//!   schedule's lr then weighs old and new gradients differently in the reference.
//! * **Weight decay.** The reference decays the parameters (`p *= 1 − lr·wd`) outside the
//!   momentum; with `train.optimizer = "sgd"` dtrain's weight decay enters the gradient,
//!   and so the momentum. The `low_comm_gpt` rows run without weight decay.
//! * **Sign values.** Psyche sends sign bits and decodes them as ±1; dtrain's `values =
//!   "sign"` decodes them as ± the segment's mean magnitude (equal to ±1 up to one scale per
//!   tensor and worker, which the final sign sees only through the mixing above).
//! * Psyche adds a look-ahead (`p += sign(delta)·lr` before the next step, taken back
//!   after) for its overlapped rounds; not in the paper, not here.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::chunked::{self, Coding, Encoder};
use crate::compressor::{Aggregation, Combine, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::memory::MemoryConfig;
use crate::registry::{Method, RunUse};
use crate::rng::Rng;
use crate::wire::{Reader, Writer};

/// The largest tile side a payload may declare (bounds a decoder's work on bad input).
pub const MAX_TILE: usize = 1024;

/// How DeMo's kept coefficients travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DemoValues {
    /// Exact f32 coefficients (default).
    #[default]
    F32,
    /// Their signs, all with the segment's mean magnitude (1 bit per value).
    Sign,
}

/// Why `mean = "senders"` needs every payload at the decoder (the refusal's reason).
pub(crate) const SENDERS_NEED: &str =
    "mean = \"senders\" averages each coordinate over the workers that sent it";

/// Over which workers the receivers average a coefficient (DeMo's `mean`, SparseLoCo's).
/// With `Senders` the method refuses the collectives that sum payloads on the way.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DemoMean {
    /// Over every worker, a worker that did not send it counting 0 (default): the sum of
    /// the workers' decodes.
    #[default]
    Workers,
    /// Over the workers that sent it, as the reference's `scatter_reduce(…, "mean")`.
    Senders,
}

/// Configuration of [`Demo`] (`mean` selects the aggregation; see [`DemoMean`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DemoConfig {
    /// Tile side: tiles are at most `chunk × chunk` (default 64; at most 1 024).
    #[serde(default = "default_chunk")]
    pub chunk: usize,
    /// Coefficients kept per tile (default 32).
    #[serde(default = "default_k")]
    pub k: usize,
    /// How kept coefficients travel (default `"f32"`).
    #[serde(default)]
    pub values: DemoValues,
    /// Over which workers a coefficient is averaged (default `"workers"`; `"senders"` is
    /// the reference code's rule, see the module docs).
    #[serde(default, skip_serializing_if = "is_workers")]
    pub mean: DemoMean,
}

/// Whether `m` is the default (for `skip_serializing_if`).
pub(crate) fn is_workers(m: &DemoMean) -> bool {
    *m == DemoMean::Workers
}

/// Turns the sum over `payloads` payloads of each coordinate into its mean over the
/// `senders` that sent it, times the payload count: the caller's mean over all payloads
/// then leaves the senders' mean ([`DemoMean::Senders`]). Coordinates no one sent stay.
pub(crate) fn scale_to_senders(sum: &mut [f32], senders: &[u32], payloads: usize) {
    let p = payloads as f32;
    for (c, &n) in sum.iter_mut().zip(senders) {
        if n > 0 {
            *c *= p / n as f32;
        }
    }
}

fn default_chunk() -> usize {
    64
}
fn default_k() -> usize {
    32
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            chunk: default_chunk(),
            k: default_k(),
            values: DemoValues::default(),
            mean: DemoMean::default(),
        }
    }
}

impl Method for DemoConfig {
    const NAME: &'static str = "demo";
    const ABOUT: &'static str =
        "DeMo: Top-k (32) of each 64×64 DCT tile of the momentum (β 0.999); update = sign of mean";
    const ID: MethodId = MethodId(24);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::Residual {
            beta: 0.999,
            gamma: 1.0,
        }
    }

    /// The tiles follow whole tensors; the compressed all-reduce cuts buckets into ranges.
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        run.needs_whole_tensors("demo transforms whole tensors")?;
        if self.mean == DemoMean::Senders {
            run.needs_every_payload(SENDERS_NEED)?;
        }
        Ok(())
    }
}

impl DemoConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<Demo, ConfigError> {
        crate::sparseloco::check_chunk("chunk", self.chunk, MAX_TILE)?;
        if self.k == 0 {
            return Err(ConfigError::new("k", "must be at least 1"));
        }
        Ok(Demo {
            chunk: self.chunk,
            k: self.k,
            coding: match self.values {
                DemoValues::F32 => Coding::F32,
                DemoValues::Sign => Coding::Sign,
            },
            mean: self.mean,
            rows: SegmentRows::default(),
            enc: Encoder::default(),
            coef: Vec::new(),
            tile: Vec::new(),
            shared: Mutex::new(Shared {
                limit: self.chunk,
                ..Shared::default()
            }),
        })
    }
}

/// DeMo's compressor (see the [module docs](self)).
#[derive(Debug)]
pub struct Demo {
    chunk: usize,
    k: usize,
    coding: Coding,
    mean: DemoMean,
    /// Rows of each segment of the bucket.
    rows: SegmentRows,
    enc: Encoder,
    /// Scratch: a segment's tile-major coefficients.
    coef: Vec<f32>,
    /// Scratch: one tile.
    tile: Vec<f32>,
    /// What the decoders (`&self`) reuse: the DCT matrices and the joint decode's buffers.
    shared: Mutex<Shared>,
}

/// The DCT matrices by side, built once, and the joint decode's scratch.
#[derive(Debug, Default)]
struct Shared {
    /// The DCT matrices built so far, of sides up to `limit` (every side this
    /// compressor's encoder makes, and so its peers'); a larger side, which only bad input
    /// declares, is built for its call and not kept, so the map stays bounded.
    dct: BTreeMap<usize, Arc<Dct>>,
    /// The configured chunk: the largest side kept.
    limit: usize,
    /// The summed coefficients of a bucket.
    coef: Vec<f32>,
    /// How many payloads sent each coefficient (with [`DemoMean::Senders`]).
    senders: Vec<u32>,
    /// One tile.
    tile: Vec<f32>,
}

impl Shared {
    /// The DCT matrix of side `n`: built once and kept when `n ≤ limit`, else built for
    /// this call.
    fn side(&mut self, n: usize) -> Arc<Dct> {
        if n > self.limit {
            return Arc::new(Dct::new(n));
        }
        self.dct
            .entry(n)
            .or_insert_with(|| Arc::new(Dct::new(n)))
            .clone()
    }

    /// The tiling of a `rows`-row segment of `n` values in `a × b` tiles.
    fn tiling(&mut self, rows: usize, n: usize, a: usize, b: usize) -> Tiling {
        Tiling {
            cols: n / rows,
            a,
            b,
            da: self.side(a),
            db: self.side(b),
        }
    }
}

/// The rows of each segment of a bucket, as the encoder meets them (the tiled encoders'
/// view of [`Compressor::set_segment_shapes`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct SegmentRows {
    /// Rows of each segment (1: no shape known, or 1-D).
    rows: Vec<usize>,
    /// Index of the next segment.
    next: usize,
}

impl SegmentRows {
    /// Takes the segments' shapes: three or more dimensions are `[shape[0], the rest]`.
    pub(crate) fn set(&mut self, shapes: &[Vec<usize>]) {
        self.rows = shapes
            .iter()
            .map(|s| if s.len() >= 2 { s[0].max(1) } else { 1 })
            .collect();
    }

    /// Starts a bucket's encode at its first segment.
    pub(crate) fn restart(&mut self) {
        self.next = 0;
    }

    /// The rows of the next segment, of `n` values: 1 when no shape is known or its rows do
    /// not divide `n`.
    pub(crate) fn next(&mut self, n: usize) -> usize {
        let rows = self.rows.get(self.next).copied().unwrap_or(1);
        self.next += 1;
        if rows == 0 || !n.is_multiple_of(rows) {
            1
        } else {
            rows
        }
    }
}

/// Where tile-major position `pos` of a tensor with `cols` columns, cut in `a × b` tiles
/// (row-major tiles, each row-major), lies: its tile's origin (row, column) in the tensor
/// and its (row, column) inside the tile.
pub(crate) fn tile_position(
    pos: usize,
    cols: usize,
    a: usize,
    b: usize,
) -> ((usize, usize), (usize, usize)) {
    let tile = pos / (a * b);
    let tiles_per_row = cols / b;
    (
        ((tile / tiles_per_row) * a, (tile % tiles_per_row) * b),
        ((pos % (a * b)) / b, pos % b),
    )
}

/// The largest divisor of `n` not above `limit` (`n ≥ 1`).
pub(crate) fn tile_side(n: usize, limit: usize) -> usize {
    (1..=limit.min(n))
        .rev()
        .find(|d| n.is_multiple_of(*d))
        .unwrap_or(1)
}

/// The orthonormal DCT-II matrix of size `n`, row-major (`d[k·n + i]`).
fn dct_matrix(n: usize) -> Vec<f32> {
    let mut d = vec![0f32; n * n];
    for k in 0..n {
        let c = if k == 0 {
            (1.0 / n as f64).sqrt()
        } else {
            (2.0 / n as f64).sqrt()
        };
        for i in 0..n {
            let a = std::f64::consts::PI * (2 * i + 1) as f64 * k as f64 / (2 * n) as f64;
            d[k * n + i] = (c * a.cos()) as f32;
        }
    }
    d
}

/// The DCT matrix of one side and its transpose (so that every product runs along rows).
#[derive(Debug)]
struct Dct {
    /// `D[k·n + i]`.
    d: Vec<f32>,
    /// `Dᵀ[i·n + k] = D[k·n + i]`.
    t: Vec<f32>,
}

impl Dct {
    fn new(n: usize) -> Dct {
        let d = dct_matrix(n);
        let mut t = vec![0f32; n * n];
        for k in 0..n {
            for i in 0..n {
                t[i * n + k] = d[k * n + i];
            }
        }
        Dct { d, t }
    }
}

/// A segment's tiling: `rows × cols`, tiles `a × b`, and the two DCT matrices.
struct Tiling {
    cols: usize,
    a: usize,
    b: usize,
    da: Arc<Dct>,
    db: Arc<Dct>,
}

impl Tiling {
    /// The tiles' top-left positions, tile-major (row of tiles by row of tiles).
    fn origins(&self, rows: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..rows / self.a)
            .flat_map(move |tr| (0..self.cols / self.b).map(move |tc| (tr * self.a, tc * self.b)))
    }

    /// `Y = D_a·X·D_bᵀ` of every tile of `x` into `coef` (tile-major, each tile row-major).
    /// `t` is scratch.
    fn forward(&self, rows: usize, x: &[f32], coef: &mut Vec<f32>, t: &mut Vec<f32>) {
        let (a, b, cols) = (self.a, self.b, self.cols);
        coef.clear();
        coef.resize(x.len(), 0.0);
        t.clear();
        t.resize(a * b, 0.0);
        for (tile, (r0, c0)) in self.origins(rows).enumerate() {
            // t = D_a·X (a × b)
            t.fill(0.0);
            for i in 0..a {
                let row = &x[(r0 + i) * cols + c0..][..b];
                for k in 0..a {
                    let d = self.da.d[k * a + i];
                    for (tv, &xv) in t[k * b..][..b].iter_mut().zip(row) {
                        *tv += d * xv;
                    }
                }
            }
            // Y = t·D_bᵀ, row by row: Y[k] = Σ_j t[k][j]·(D_bᵀ)[j] (contiguous, vectorizes).
            let y = &mut coef[tile * a * b..][..a * b];
            for k in 0..a {
                let yrow = &mut y[k * b..][..b];
                for (j, &tv) in t[k * b..][..b].iter().enumerate() {
                    for (yv, &d) in yrow.iter_mut().zip(&self.db.t[j * b..][..b]) {
                        *yv += tv * d;
                    }
                }
            }
        }
    }

    /// Adds the inverse transform of every tile of `coef` (tile-major) into `out`: a tile
    /// with few non-zero coefficients one by one ([`Tiling::add_inverse`]), a fuller one
    /// densely, `X = D_aᵀ·Y·D_b`, whichever takes fewer multiplications. `t` is scratch.
    fn inverse_add(&self, rows: usize, coef: &[f32], out: &mut [f32], t: &mut Vec<f32>) {
        let (a, b, cols) = (self.a, self.b, self.cols);
        t.clear();
        t.resize(a * b, 0.0);
        for (tile, (r0, c0)) in self.origins(rows).enumerate() {
            let y = &coef[tile * a * b..][..a * b];
            let nnz = y.iter().filter(|v| **v != 0.0).count();
            if nnz * a * b <= a * b * (a + b) {
                for (i, &v) in y.iter().enumerate() {
                    if v != 0.0 {
                        self.add_inverse(tile * a * b + i, v, out);
                    }
                }
                continue;
            }
            // t = D_aᵀ·Y (a × b)
            t.fill(0.0);
            for k in 0..a {
                let yrow = &y[k * b..][..b];
                for i in 0..a {
                    let d = self.da.d[k * a + i];
                    for (tv, &yv) in t[i * b..][..b].iter_mut().zip(yrow) {
                        *tv += d * yv;
                    }
                }
            }
            // X = t·D_b, added into the tile.
            for i in 0..a {
                let orow = &mut out[(r0 + i) * cols + c0..][..b];
                for l in 0..b {
                    let tv = t[i * b + l];
                    if tv == 0.0 {
                        continue;
                    }
                    for (o, &d) in orow.iter_mut().zip(&self.db.d[l * b..][..b]) {
                        *o += tv * d;
                    }
                }
            }
        }
    }

    /// Adds `IDCT` of the coefficient `y` at tile-major position `pos` into `out`:
    /// `X[i][j] += D_a[p][i]·y·D_b[q][j]`.
    fn add_inverse(&self, pos: usize, y: f32, out: &mut [f32]) {
        let (a, b, cols) = (self.a, self.b, self.cols);
        let ((r0, c0), (p, q)) = tile_position(pos, cols, a, b);
        let dq = &self.db.d[q * b..][..b];
        for i in 0..a {
            let s = y * self.da.d[p * a + i];
            for (o, &d) in out[(r0 + i) * cols + c0..][..b].iter_mut().zip(dq) {
                *o += s * d;
            }
        }
    }
}

/// Reads and checks a segment's tiling (`rows`, tile sides `a × b`) for `n` values, and
/// that the chunked body that follows says chunk `a·b`.
pub(crate) fn read_tiling(
    r: &mut Reader<'_>,
    n: usize,
) -> Result<(usize, usize, usize), WireError> {
    let rows = r.u32("rows")? as usize;
    let a = r.u32("tile rows")? as usize;
    let b = r.u32("tile columns")? as usize;
    if rows == 0 || !n.is_multiple_of(rows) {
        return Err(WireError::Invalid("rows do not divide the segment"));
    }
    if a == 0 || b == 0 || a > MAX_TILE || b > MAX_TILE {
        return Err(WireError::Invalid("tile sides out of range"));
    }
    if !rows.is_multiple_of(a) || !(n / rows).is_multiple_of(b) {
        return Err(WireError::Invalid("tiles do not divide the tensor"));
    }
    if r.clone().u32("chunk length")? as usize != a * b {
        return Err(WireError::Invalid("the chunk is not one tile"));
    }
    Ok((rows, a, b))
}

impl Demo {
    /// [`Compressor::joint_decompress_add`]: sums every payload's coefficients, then
    /// inverse-transforms each segment once.
    fn joint(&self, payloads: &[&[u8]], out: &mut [f32]) -> Result<(), (usize, WireError)> {
        let (mut coef, mut t, mut senders) = {
            let mut sh = self.lock();
            (
                std::mem::take(&mut sh.coef),
                std::mem::take(&mut sh.tile),
                std::mem::take(&mut sh.senders),
            )
        };
        coef.clear();
        coef.resize(out.len(), 0.0);
        senders.clear();
        if self.mean == DemoMean::Senders {
            senders.resize(out.len(), 0);
        }
        let result = self.joint_into(payloads, out, &mut coef, &mut senders, &mut t);
        let mut sh = self.lock();
        (sh.coef, sh.tile, sh.senders) = (coef, t, senders);
        result
    }

    /// [`Demo::joint`] with its buffers: `coef` zeroed, as long as `out`; `senders` zeroed
    /// and as long with [`DemoMean::Senders`], else empty.
    fn joint_into(
        &self,
        payloads: &[&[u8]],
        out: &mut [f32],
        coef: &mut [f32],
        senders: &mut [u32],
        t: &mut Vec<f32>,
    ) -> Result<(), (usize, WireError)> {
        // Each segment's range and tiling, as the first payload has them.
        let mut segs: Vec<(std::ops::Range<usize>, usize, usize, usize)> = Vec::new();
        for (i, p) in payloads.iter().enumerate() {
            let mut k = 0;
            crate::compressor::decode_frame(self, p, out.len(), |r, seg| {
                let (rows, a, b) = read_tiling(r, seg.len())?;
                let this = (seg.clone(), rows, a, b);
                if i == 0 {
                    segs.push(this);
                } else if segs.get(k) != Some(&this) {
                    return Err(WireError::Invalid(
                        "payloads cut or tile the buffer differently",
                    ));
                }
                k += 1;
                let at = seg.start;
                let c = &mut coef[seg];
                match senders.get_mut(at..at + c.len()) {
                    Some(n) => chunked::read(r, c.len(), |pos, y| {
                        c[pos] += y;
                        n[pos] += 1;
                    }),
                    None => chunked::read(r, c.len(), |pos, y| c[pos] += y),
                }
            })
            .map_err(|e| (i, e))?;
            if k != segs.len() {
                return Err((i, WireError::Invalid("payloads cut the buffer differently")));
            }
        }
        if !senders.is_empty() {
            scale_to_senders(coef, senders, payloads.len());
        }
        for (seg, rows, a, b) in segs {
            let tiling = self.lock().tiling(rows, seg.len(), a, b);
            tiling.inverse_add(rows, &coef[seg.clone()], &mut out[seg], t);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Compressor for Demo {
    fn method(&self) -> MethodId {
        DemoConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn combine(&self) -> Combine {
        Combine::MajorityVote
    }
    fn set_segment_shapes(&mut self, shapes: &[Vec<usize>]) {
        self.rows.set(shapes);
    }
    fn begin(&mut self, _grad: &[f32], _ctx: &crate::Ctx<'_>) {
        self.rows.restart();
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let rows = self.rows.next(n);
        let (a, b) = (
            tile_side(rows, self.chunk),
            tile_side(n / rows.max(1), self.chunk),
        );
        w.u32(rows as u32);
        w.u32(a as u32);
        w.u32(b as u32);
        let tiling = self
            .shared
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .tiling(rows, n, a, b);
        let mut coef = std::mem::take(&mut self.coef);
        tiling.forward(rows, x, &mut coef, &mut self.tile);
        self.enc
            .write(&coef, a * b, self.k.min(a * b), self.coding, w);
        self.coef = coef;
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let (rows, a, b) = read_tiling(r, out.len())?;
        let tiling = self.lock().tiling(rows, out.len(), a, b);
        chunked::read(r, out.len(), |pos, y| tiling.add_inverse(pos, y, out))
    }
    /// The linearity shortcut: the workers' sparse coefficients are summed in the DCT
    /// domain and each tile is inverse-transformed once, densely where that is cheaper
    /// than the kept coefficients one by one — `O(n·(a + b))` a bucket instead of
    /// `O(P·k·n)` (64 workers' decodes took 16× one worker's in `dtrain simulate`'s
    /// projection of `low_comm_gpt`). Differs from decoding each payload by float rounding
    /// only, and is the same on every rank (payloads in rank order). Payloads that tile a
    /// segment differently are refused, naming the first that differs. With `mean =
    /// "senders"` each summed coefficient is scaled by `P / (payloads that sent it)` before
    /// the inverse transform, so that the caller's mean is the reference's mean over the
    /// senders; the joint decode is then, by design, not the sum of the single decodes.
    fn joint_decompress_add(
        &self,
        payloads: &[&[u8]],
        out: &mut [f32],
    ) -> Option<Result<(), (usize, WireError)>> {
        Some(self.joint(payloads, out))
    }
    /// `None`: the body's size depends on the tensor's shape, not its length alone.
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx, Payload};

    fn encode(c: &mut Demo, x: &[f32], shapes: &[Vec<usize>]) -> Payload {
        crate::test_util::compress_shaped(c, x, shapes)
    }

    /// `‖x − y‖² / ‖x‖²`.
    fn rel_err(x: &[f32], y: &[f32]) -> f64 {
        let err: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        err / x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>()
    }

    fn signal(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.013).sin() + 0.2 * ((i * 7 % 13) as f32 - 6.0) / 6.0)
            .collect()
    }

    #[test]
    fn tiles_divide_like_the_reference() {
        assert_eq!(tile_side(256, 64), 64);
        assert_eq!(tile_side(6858, 64), 54);
        assert_eq!(tile_side(6857, 64), 1);
        assert_eq!(tile_side(10, 64), 10);
    }

    #[test]
    fn the_dct_is_orthonormal() {
        for n in [1, 5, 64] {
            let d = dct_matrix(n);
            for i in 0..n {
                for j in 0..n {
                    let dot: f32 = (0..n).map(|k| d[i * n + k] * d[j * n + k]).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-5, "n {n} ({i},{j}) {dot}");
                }
            }
        }
    }

    #[test]
    fn keeping_every_coefficient_reconstructs_the_tensor() {
        // k = a·b: the sparse inverse of the full forward is the identity (to f32 rounding),
        // over a matrix, a 1-D tensor and one whose side is prime.
        let shapes = vec![vec![96, 40], vec![30], vec![7, 13]];
        let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
        let x = signal(n);
        let mut c = DemoConfig {
            chunk: 32,
            k: 1024,
            values: DemoValues::F32,
            mean: DemoMean::Workers,
        }
        .init()
        .unwrap();
        let p = encode(&mut c, &x, &shapes);
        let mut out = vec![0f32; n];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        for i in 0..n {
            assert!((out[i] - x[i]).abs() < 1e-4, "{i}: {} vs {}", out[i], x[i]);
        }
    }

    #[test]
    fn a_smooth_tensor_is_mostly_in_few_coefficients() {
        // The tiled DCT concentrates a smooth matrix: 8 of 64×64 coefficients per tile
        // carry nearly all of it, far more than 8 of 4 096 values would.
        let (rows, cols) = (128, 128);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let (r, c) = ((i / cols) as f32, (i % cols) as f32);
                (r * 0.02).cos() + (c * 0.03).sin()
            })
            .collect();
        let mut c = DemoConfig {
            chunk: 64,
            k: 8,
            values: DemoValues::F32,
            mean: DemoMean::Workers,
        }
        .init()
        .unwrap();
        let p = encode(&mut c, &x, &[vec![rows, cols]]);
        let mut out = vec![0f32; x.len()];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        let e = rel_err(&x, &out);
        assert!(e < 1e-3, "relative error {e}");
        // 4 tiles × 8 kept, 12-bit indices, f32 values.
        assert_eq!(p.encoded_len(), 12 + 12 + 9 + 32 * 12 / 8 + 32 * 4);
    }

    #[test]
    fn sign_values_and_the_sign_of_the_mean() {
        let shapes = vec![vec![64, 64]];
        let x = signal(4096);
        let mut c = DemoConfig {
            chunk: 64,
            k: 32,
            values: DemoValues::Sign,
            mean: DemoMean::Workers,
        }
        .init()
        .unwrap();
        assert_eq!(c.combine(), Combine::MajorityVote);
        let p = encode(&mut c, &x, &shapes);
        // 1 bit per kept value, one magnitude.
        assert_eq!(p.encoded_len(), 12 + 12 + 9 + 4 + 32 * 12 / 8 + 32 / 8);
        let mut out = vec![0f32; 4096];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        c.combine().finish(&mut out);
        assert!(out.iter().all(|v| [-1.0, 0.0, 1.0].contains(v)));
        // The sign step points along the signal: positive correlation.
        let dot: f32 = out.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!(dot > 0.0);
    }

    #[test]
    fn without_shapes_a_segment_is_one_row() {
        let x = signal(1000);
        let mut c = DemoConfig::default().init().unwrap();
        let p = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = vec![0f32; 1000];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        // 1000 = 20 tiles of 1 × 50, 32 kept of 50 each.
        let e = rel_err(&x, &out);
        assert!(e < 0.1, "relative error {e}");
    }

    #[test]
    fn the_joint_decode_is_the_sum_of_the_decodes() {
        // Many workers (the dense inverse) and few (coefficient by coefficient), over a
        // matrix and a vector.
        let shapes = vec![vec![64, 96], vec![40]];
        let n = 64 * 96 + 40;
        for workers in [2u64, 9] {
            let mut c = DemoConfig {
                chunk: 32,
                k: 24,
                values: DemoValues::F32,
                mean: DemoMean::Workers,
            }
            .init()
            .unwrap();
            let payloads: Vec<Payload> = (0..workers)
                .map(|w| {
                    let x: Vec<f32> = signal(n)
                        .iter()
                        .map(|v| v * (1.0 + w as f32) - w as f32 * 0.1)
                        .collect();
                    encode(&mut c, &x, &shapes)
                })
                .collect();
            let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
            let mut each = vec![0f32; n];
            for p in &refs {
                crate::compressor::decompress_add(&c, p, &mut each).unwrap();
            }
            let mut joint = vec![0f32; n];
            c.joint_decompress_add(&refs, &mut joint).unwrap().unwrap();
            let scale = each.iter().fold(0f32, |m, v| m.max(v.abs()));
            for i in 0..n {
                assert!(
                    (joint[i] - each[i]).abs() <= 1e-5 * scale,
                    "{workers} workers [{i}]"
                );
            }
            // A payload tiled otherwise is named.
            let mut other = DemoConfig {
                chunk: 16,
                k: 24,
                values: DemoValues::F32,
                mean: DemoMean::Workers,
            }
            .init()
            .unwrap();
            let odd = encode(&mut other, &signal(n), &shapes);
            let mixed = [refs[0], odd.as_bytes()];
            let (i, _) = c
                .joint_decompress_add(&mixed, &mut joint)
                .unwrap()
                .unwrap_err();
            assert_eq!(i, 1);
        }
    }

    /// `mean = "senders"`: two workers that keep disjoint coefficients each count alone
    /// (the sum of the decodes times P = 2), and coefficients both sent are their mean
    /// (the sum itself).
    #[test]
    fn the_senders_mean_weighs_each_coefficient_by_its_senders() {
        let cfg = |mean| DemoConfig {
            chunk: 4,
            k: 1,
            values: DemoValues::F32,
            mean,
        };
        let shapes = vec![vec![4]];
        // The first two DCT basis vectors of length 4: one coefficient each.
        let d = dct_matrix(4);
        let (x0, x1): (Vec<f32>, Vec<f32>) =
            (d[0..4].to_vec(), d[4..8].iter().map(|v| 3.0 * v).collect());
        for (inputs, factor) in [([&x0, &x1], 2.0f32), ([&x0, &x0], 1.0)] {
            let mut sum = vec![0f32; 4];
            for x in inputs {
                sum.iter_mut().zip(x.iter()).for_each(|(s, v)| *s += v);
            }
            for (mean, f) in [(DemoMean::Workers, 1.0), (DemoMean::Senders, factor)] {
                let mut c = cfg(mean).init().unwrap();
                let payloads: Vec<Payload> =
                    inputs.iter().map(|x| encode(&mut c, x, &shapes)).collect();
                let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
                let mut out = vec![0f32; 4];
                c.joint_decompress_add(&refs, &mut out).unwrap().unwrap();
                for (o, s) in out.iter().zip(&sum) {
                    assert!(
                        (o - f * s).abs() < 1e-5,
                        "{mean:?}: {out:?} vs {f} × {sum:?}"
                    );
                }
            }
        }
        // The option round-trips through the TOML and is left out when default.
        let t: DemoConfig = toml::from_str("mean = \"senders\"").unwrap();
        assert_eq!(t.mean, DemoMean::Senders);
        assert!(!toml::to_string(&DemoConfig::default())
            .unwrap()
            .contains("mean"));
    }

    #[test]
    fn refusals_name_the_field() {
        for (cfg, field) in [
            (
                DemoConfig {
                    chunk: 0,
                    ..DemoConfig::default()
                },
                "chunk",
            ),
            (
                DemoConfig {
                    chunk: 2048,
                    ..DemoConfig::default()
                },
                "chunk",
            ),
            (
                DemoConfig {
                    k: 0,
                    ..DemoConfig::default()
                },
                "k",
            ),
        ] {
            assert_eq!(cfg.init().unwrap_err().field, field);
        }
    }
}
