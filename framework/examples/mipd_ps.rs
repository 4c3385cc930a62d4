//! Dense parameter server against MIPD over the real PS machinery (ALGORITHMS.md §14).
//!
//! `cargo run --release -p dtrain-framework --example mipd_ps [steps] [workers]`
//!
//! **Part 1 — traffic and server CPU.** A 784-512-256-10 MLP (535 818 parameters, six
//! layers W1 b1 W2 b2 W3 b3) trained by `workers` worker threads against two server
//! threads on the in-process transport, asynchronous with staleness 2. The gradients are
//! **synthetic**, with a different distribution per layer: W1 Laplace (scale 2e-4) with the
//! columns of 150 always-blank input pixels exactly zero, b1 Gaussian (1e-3), W2 Gaussian
//! (5e-4), b2 Gaussian (2e-3), W3 Student-t with 2 degrees of freedom (2e-3), b3 Gaussian
//! (1e-2); each worker's gradient is a step-wide shared component plus half as much
//! worker noise, so workers agree partly, as on real data. Parameters start Kaiming-uniform
//! (biases 0) and are updated with every aggregate. Reported per step: bytes each worker
//! pushes and pulls (counted at the transport, PS headers included), the servers' thread
//! CPU time inside `aggregate` and over the whole serve loop (`CLOCK_THREAD_CPUTIME_ID`,
//! summed over servers), and each worker's encode CPU time.
//!
//! **Part 2 — accuracy parity.** Softmax regression (784 → 10, 7 850 parameters, layers W
//! and b) on a synthetic 10-class Gaussian-mixture data set, trained with plain SGD over
//! the same PS (dense mean vs MIPD, whose sum is divided by the worker count); test
//! accuracy and loss are reported.
//!
//! Both parts also run MIPD with worker-side error feedback (`ShardedWorker::new(…, true)`)
//! and with `|g|` instead of the Taylor significance `|w·g|`.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use dtrain_comms::ps::{
    f32_payload, Aggregate, AggregateError, Aggregator, DenseF32, PsConfig, PsLayout, PsNode,
    Reduction, ShardPushes,
};
use dtrain_comms::{channel_mesh, Transport};
use dtrain_compress::mipd::{Halves, MipdConfig, Significance};
use dtrain_compress::CompressorConfig;
use dtrain_framework::ps_mode::sharded::{ShardedAggregator, ShardedWorker};

/// CPU time of the calling thread, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID is supported on
    // Linux and only reads the calling thread's clock.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// SplitMix64 stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    fn laplace(&mut self) -> f64 {
        let u = self.unit() - 0.5;
        -u.signum() * (1.0 - 2.0 * u.abs()).ln()
    }
    fn student2(&mut self) -> f64 {
        let z = self.gauss();
        let c = self.gauss().powi(2) + self.gauss().powi(2);
        z / (c / 2.0).sqrt()
    }
}

/// The MLP's layers: (name, fan-in, length).
const MLP: [(&str, usize, usize); 6] = [
    ("W1", 784, 784 * 512),
    ("b1", 0, 512),
    ("W2", 512, 512 * 256),
    ("b2", 0, 256),
    ("W3", 256, 256 * 10),
    ("b3", 0, 10),
];

fn mlp_layers() -> Vec<Range<usize>> {
    let mut at = 0;
    MLP.iter()
        .map(|&(_, _, n)| {
            at += n;
            at - n..at
        })
        .collect()
}

fn mlp_init() -> Vec<f32> {
    let mut rng = Rng(1);
    let mut p = Vec::new();
    for &(_, fan_in, n) in &MLP {
        let bound = if fan_in == 0 {
            0.0
        } else {
            (6.0 / fan_in as f64).sqrt()
        };
        p.extend((0..n).map(|_| ((2.0 * rng.unit() - 1.0) * bound) as f32));
    }
    p
}

/// Synthetic per-layer gradient of `worker` at `step` (see the module docs).
fn mlp_grad(step: u64, worker: usize, out: &mut Vec<f32>) {
    out.clear();
    let mut shared = Rng(step * 1_000_003 + 17);
    let mut own = Rng(step * 1_000_003 + 1000 + worker as u64);
    for (l, &(_, _, n)) in MLP.iter().enumerate() {
        let draw = |r: &mut Rng| -> f64 {
            match l {
                0 => 2e-4 * r.laplace(),
                1 => 1e-3 * r.gauss(),
                2 => 5e-4 * r.gauss(),
                3 => 2e-3 * r.gauss(),
                4 => 2e-3 * r.student2(),
                _ => 1e-2 * r.gauss(),
            }
        };
        for i in 0..n {
            // W1 is [512 out][784 in]: the first 150 pixels of every row never light up.
            let g = if l == 0 && i % 784 < 150 {
                0.0
            } else {
                draw(&mut shared) + 0.5 * draw(&mut own)
            };
            out.push(g as f32);
        }
    }
}

/// An aggregator that adds the thread CPU time spent inside `aggregate` to a counter.
struct Timed<A> {
    inner: A,
    ns: Arc<AtomicU64>,
}

impl<A: Aggregator> Aggregator for Timed<A> {
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        let t0 = thread_cpu_ns();
        let r = self.inner.aggregate(input);
        self.ns.fetch_add(thread_cpu_ns() - t0, Relaxed);
        r
    }
}

/// The aggregator of either mode.
enum Either {
    Dense(DenseF32),
    Mipd(Box<ShardedAggregator>),
}

impl Aggregator for Either {
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        match self {
            Either::Dense(a) => a.aggregate(input),
            Either::Mipd(a) => a.aggregate(input),
        }
    }
}

#[derive(Clone)]
enum Mode {
    Dense,
    /// The method (encoder and server settings), worker-side error feedback.
    Mipd(CompressorConfig, bool),
}

/// `grad(worker, step, params, out)`.
type GradFn = dyn Fn(usize, u64, &[f32], &mut Vec<f32>) + Send + Sync;

/// What a training function needs: the initial parameters, the layers, the gradient of
/// worker `w` at step `t` for parameters `p`, the learning rate, and an evaluation.
struct Task {
    init: Vec<f32>,
    layers: Vec<Range<usize>>,
    grad: Arc<GradFn>,
    lr: f32,
}

struct Row {
    push_bytes: f64,
    pull_bytes: f64,
    aggregate_ms: f64,
    serve_ms: f64,
    encode_ms: f64,
    params: Vec<f32>,
}

/// Runs `steps` asynchronous PS steps (staleness 2) with `workers` workers and 2 servers.
fn run(mode: &Mode, task: &Task, workers: usize, steps: u64) -> Row {
    let servers = 2;
    let len = task.init.len();
    let layout = PsLayout::new(
        workers + servers,
        (0..workers).collect(),
        (workers..workers + servers).collect(),
        len,
    )
    .expect("layout");
    let cfg = PsConfig {
        staleness: 2,
        timeout: Duration::from_secs(120),
        ..PsConfig::default()
    };
    let agg_ns = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = channel_mesh(workers + servers)
        .into_iter()
        .map(|t| {
            let (layout, cfg, mode, agg_ns) =
                (layout.clone(), cfg.clone(), mode.clone(), agg_ns.clone());
            let (mut params, layers, grad, lr) = (
                task.init.clone(),
                task.layers.clone(),
                task.grad.clone(),
                task.lr,
            );
            thread::spawn(move || {
                let inner = match &mode {
                    Mode::Dense => Either::Dense(DenseF32),
                    Mode::Mipd(m, _) => Either::Mipd(Box::new(
                        ShardedAggregator::new(&layout, layers.clone(), m).expect("config"),
                    )),
                };
                let agg = Timed { inner, ns: agg_ns };
                let mut node = PsNode::new(t, layout.clone(), cfg, agg).expect("node");
                let Some(wi) = layout.worker_index(node.rank()) else {
                    let t0 = thread_cpu_ns();
                    node.serve().expect("serve");
                    return (0, thread_cpu_ns() - t0, Vec::new(), (0, 0));
                };
                let mut worker = match &mode {
                    Mode::Dense => None,
                    Mode::Mipd(m, ef) => {
                        Some(ShardedWorker::new(&layout, &layers, m, *ef).expect("config"))
                    }
                };
                let scale = lr / workers as f32;
                let (mut g, mut upd) = (Vec::new(), vec![0f32; len]);
                let mut encode_ns = 0;
                let mut apply =
                    |aggs: Vec<Aggregate>, params: &mut [f32], worker: &Option<ShardedWorker>| {
                        for a in aggs {
                            match worker {
                                None => upd = a.dense(),
                                Some(w) => {
                                    w.apply(&a, &mut upd).expect("pull decodes");
                                }
                            }
                            params
                                .iter_mut()
                                .zip(&upd)
                                .for_each(|(p, u)| *p -= scale * u);
                        }
                    };
                for step in 0..steps {
                    grad(wi, step, &params, &mut g);
                    let t0 = thread_cpu_ns();
                    let (payloads, how) = match &mut worker {
                        None => (
                            (0..layout.num_shards())
                                .map(|j| f32_payload(&g[layout.shard_range(j)]))
                                .collect(),
                            Reduction::SUM,
                        ),
                        Some(w) => (w.payloads(&params, &g).expect("encode"), w.reduction()),
                    };
                    encode_ns += thread_cpu_ns() - t0;
                    let aggs = node.step(payloads, how).expect("step");
                    apply(aggs, &mut params, &worker);
                }
                let rest = node.finish().expect("finish");
                apply(rest, &mut params, &worker);
                let b = node.transport().bytes();
                (
                    encode_ns,
                    0,
                    if wi == 0 { params } else { Vec::new() },
                    (b.sent, b.received),
                )
            })
        })
        .collect();
    let mut row = Row {
        push_bytes: 0.0,
        pull_bytes: 0.0,
        aggregate_ms: 0.0,
        serve_ms: 0.0,
        encode_ms: 0.0,
        params: Vec::new(),
    };
    for h in handles {
        let (enc, serve, params, (sent, recv)) = h.join().expect("thread");
        row.encode_ms += enc as f64;
        row.serve_ms += serve as f64;
        row.push_bytes += sent as f64;
        row.pull_bytes += recv as f64;
        if !params.is_empty() {
            row.params = params;
        }
    }
    let per_step = steps as f64;
    let per_worker_step = (workers as u64 * steps) as f64;
    row.aggregate_ms = agg_ns.load(Relaxed) as f64 / 1e6 / per_step;
    row.serve_ms /= 1e6 * per_step;
    row.encode_ms /= 1e6 * per_worker_step;
    row.push_bytes /= per_worker_step;
    row.pull_bytes /= per_worker_step;
    row
}

fn mipd(bits: u32, lambda: f64, halves: Halves, ef: bool) -> Mode {
    mipd_with(Significance::Taylor, bits, lambda, halves, ef)
}

fn mipd_with(significance: Significance, bits: u32, lambda: f64, halves: Halves, ef: bool) -> Mode {
    Mode::Mipd(
        MipdConfig {
            significance,
            bits,
            lambda,
            halves,
            ..MipdConfig::default()
        }
        .into(),
        ef,
    )
}

fn modes() -> Vec<(String, Mode)> {
    vec![
        ("dense PS (f32 sum)".into(), Mode::Dense),
        (
            "MIPD b=4 λ=0.5 halves=blocked".into(),
            mipd(4, 0.5, Halves::Blocked, false),
        ),
        (
            "MIPD b=4 λ=0.5 halves=off".into(),
            mipd(4, 0.5, Halves::Off, false),
        ),
        (
            "MIPD b=4 λ=0 halves=blocked".into(),
            mipd(4, 0.0, Halves::Blocked, false),
        ),
        (
            "MIPD b=8 λ=0.5 halves=interleaved".into(),
            mipd(8, 0.5, Halves::Interleaved, false),
        ),
        (
            "MIPD b=4 λ=0.5 halves=blocked + worker EF".into(),
            mipd(4, 0.5, Halves::Blocked, true),
        ),
        (
            "MIPD b=4 λ=0 halves=blocked + worker EF".into(),
            mipd(4, 0.0, Halves::Blocked, true),
        ),
        (
            "MIPD \\|g\\| significance b=4 λ=0.5 halves=blocked".into(),
            mipd_with(Significance::Gradient, 4, 0.5, Halves::Blocked, false),
        ),
        (
            "MIPD \\|g\\| significance b=4 λ=0.5 halves=blocked + worker EF".into(),
            mipd_with(Significance::Gradient, 4, 0.5, Halves::Blocked, true),
        ),
    ]
}

// ---- Part 2: softmax regression on a synthetic Gaussian mixture.

const D: usize = 784;
const C: usize = 10;

struct Data {
    x: Vec<f32>,
    y: Vec<usize>,
}

fn mixture(n: usize, seed: u64) -> Data {
    let mut means = Rng(4242);
    let mu: Vec<f32> = (0..C * D).map(|_| (0.15 * means.gauss()) as f32).collect();
    let mut rng = Rng(seed);
    let mut x = Vec::with_capacity(n * D);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let c = (rng.next() % C as u64) as usize;
        y.push(c);
        x.extend((0..D).map(|j| mu[c * D + j] + rng.gauss() as f32));
    }
    Data { x, y }
}

/// Mean cross-entropy loss and gradient over rows `rows` of `data`; params are
/// `W [C][D]` then `b [C]`.
fn softmax_loss_grad(
    p: &[f32],
    data: &Data,
    rows: Range<usize>,
    g: Option<&mut Vec<f32>>,
) -> (f64, usize) {
    let (w, b) = p.split_at(C * D);
    let mut gbuf = g;
    if let Some(g) = gbuf.as_deref_mut() {
        g.clear();
        g.resize(C * D + C, 0.0);
    }
    let (mut loss, mut correct) = (0f64, 0usize);
    let m = rows.len() as f32;
    for r in rows {
        let x = &data.x[r * D..(r + 1) * D];
        let mut z = [0f32; C];
        for c in 0..C {
            z[c] = b[c]
                + w[c * D..(c + 1) * D]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum::<f32>();
        }
        let zmax = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = z.iter().map(|v| (v - zmax).exp()).collect();
        let s: f32 = e.iter().sum();
        let y = data.y[r];
        loss += -((e[y] / s) as f64).ln();
        let arg = (0..C).max_by(|&a, &b| z[a].total_cmp(&z[b])).unwrap_or(0);
        correct += usize::from(arg == y);
        if let Some(g) = gbuf.as_deref_mut() {
            for c in 0..C {
                let d = (e[c] / s - f32::from(c == y)) / m;
                g[C * D + c] += d;
                g[c * D..(c + 1) * D]
                    .iter_mut()
                    .zip(x)
                    .for_each(|(gi, xi)| *gi += d * xi);
            }
        }
    }
    (loss, correct)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let steps: u64 = args.next().map_or(10, |s| s.parse().expect("steps"));
    let workers: usize = args.next().map_or(4, |s| s.parse().expect("workers"));

    println!(
        "## Part 1: MLP 784-512-256-10 ({} params, 6 layers), {workers} workers, 2 servers, \
         staleness 2, {steps} steps, synthetic per-layer gradients\n",
        mlp_layers().last().map_or(0, |l| l.end)
    );
    let task = Task {
        init: mlp_init(),
        layers: mlp_layers(),
        grad: Arc::new(|w, t, _p, g| mlp_grad(t, w, g)),
        lr: 0.1,
    };
    println!(
        "| mode | push B/worker/step | pull B/worker/step | total vs dense | server aggregate CPU ms/step | server thread CPU ms/step | worker encode CPU ms/step |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut dense_total = 0.0;
    for (name, mode) in modes() {
        let r = run(&mode, &task, workers, steps);
        let total = r.push_bytes + r.pull_bytes;
        if matches!(mode, Mode::Dense) {
            dense_total = total;
        }
        println!(
            "| {name} | {:.0} | {:.0} | {:.3} | {:.2} | {:.2} | {:.2} |",
            r.push_bytes,
            r.pull_bytes,
            total / dense_total,
            r.aggregate_ms,
            r.serve_ms,
            r.encode_ms
        );
    }
    // Per-layer keep ratios and code-book sizes of one encode.
    // One shard: the whole model, its layers as they are.
    let mut w = MipdConfig::default().init().expect("config");
    let mut g = Vec::new();
    mlp_grad(0, 0, &mut g);
    w.encode(&task.init, &g, &task.layers, &mut Vec::new())
        .expect("encode");
    println!("\nPer layer, default MIPD config (one worker, step 0):\n");
    println!("| layer | n | kept | ρ_l | levels | index layout | body bytes | bits/element |");
    println!("|---|---:|---:|---:|---:|---|---:|---:|");
    for (s, &(name, _, _)) in w.last_stats().iter().zip(&MLP) {
        println!(
            "| {name} | {} | {} | {:.4} | {} | {} | {} | {:.3} |",
            s.len,
            s.kept,
            s.ratio(),
            s.levels,
            if s.bitmap { "bitmap" } else { "gamma gaps" },
            s.bytes,
            8.0 * s.bytes as f64 / s.len as f64
        );
    }

    // Part 2.
    let psteps = 20 * steps;
    println!(
        "\n## Part 2: softmax regression 784→10 on a synthetic 10-class Gaussian mixture, \
         {workers} workers, staleness 2, {psteps} steps, batch 32 per worker, SGD lr 0.5\n"
    );
    let train = Arc::new(mixture(8192, 1));
    let test = mixture(2000, 2);
    let tr = train.clone();
    let task = Task {
        init: vec![0.0; C * D + C],
        layers: vec![0..C * D, C * D..C * D + C],
        grad: Arc::new(move |w, t, p, g| {
            let shard = tr.y.len() / workers;
            let start = w * shard + (t as usize * 32) % (shard - 32);
            softmax_loss_grad(p, &tr, start..start + 32, Some(g));
        }),
        lr: 0.5,
    };
    println!("| mode | test accuracy | test loss | push B/worker/step | pull B/worker/step |");
    println!("|---|---:|---:|---:|---:|");
    for (name, mode) in modes() {
        let r = run(&mode, &task, workers, psteps);
        let (loss, correct) = softmax_loss_grad(&r.params, &test, 0..test.y.len(), None);
        println!(
            "| {name} | {:.4} | {:.4} | {:.0} | {:.0} |",
            correct as f64 / test.y.len() as f64,
            loss / test.y.len() as f64,
            r.push_bytes,
            r.pull_bytes
        );
    }
}
