use super::*;
use crate::bench::compress::parse_method;
use dtrain_comms::{channel_mesh, ChannelTransport, CommConfig};
use dtrain_compress::dgc::{DgcConfig, Warmup};
use dtrain_compress::fft::FftConfig;
use dtrain_compress::scalecom::ScaleComConfig;
use dtrain_compress::schedule::ThetaSchedule;
use dtrain_compress::{Aggregation, Ctx, Payload, Rng};

fn params() -> Vec<ParamInfo> {
    shapes(&[vec![64, 3, 3, 3], vec![64], vec![128, 64], vec![10]])
}

/// Five buckets with the policy of [`policy`]: [1728], [8192], [2048], [2000, 600]
/// compressed, one dense bucket of the 1-D tensors.
fn params2() -> Vec<ParamInfo> {
    shapes(&[
        vec![64, 3, 3, 3],
        vec![64],
        vec![128, 64],
        vec![10],
        vec![32, 64],
        vec![32],
        vec![50, 40],
        vec![20, 30],
        vec![7],
    ])
}

fn shapes(s: &[Vec<usize>]) -> Vec<ParamInfo> {
    s.iter()
        .enumerate()
        .map(|(i, shape)| ParamInfo {
            name: format!("p{i}"),
            shape: shape.clone(),
        })
        .collect()
}

fn policy(elems: usize) -> BucketPolicy {
    BucketPolicy {
        bucket_bytes: 4 * elems,
        dense_1d: true,
        ..BucketPolicy::default()
    }
}

fn grad(rank: usize, n: usize, step: u64) -> Vec<f32> {
    let mut r = Rng::for_step(99, step, rank as u64, 0);
    (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect()
}

/// Runs `f(rank, communicator)` on `world` in-process ranks; returns every rank's result.
fn on_ranks<R: Send>(
    world: usize,
    f: impl Fn(usize, &mut Communicator<ChannelTransport>) -> R + Sync,
) -> Vec<R> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = channel_mesh(world)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                s.spawn(move || f(rank, &mut Communicator::new(t, CommConfig::default())))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// One rank's results of `steps` exchanges (the averaged gradients) and their stats.
type Trace = (Vec<Vec<f32>>, Vec<ExchangeStats>);

struct Setup {
    params: Vec<ParamInfo>,
    policy: BucketPolicy,
    method: CompressorConfig,
    memory: MemoryConfig,
    overlap: bool,
    gather: GatherCollective,
    server_ef: Option<bool>,
    /// The link `auto` models (`None`: it probes the in-process one).
    link: Option<LinkSpec>,
    /// The ranks' hosts (`None`: not set, the flat all-reduce).
    hosts: Option<Topology>,
}

impl Setup {
    fn new(method: CompressorConfig) -> Self {
        Setup {
            params: params2(),
            policy: policy(3000),
            memory: method.default_memory(),
            method,
            overlap: true,
            gather: GatherCollective::AllGather,
            server_ef: None,
            link: None,
            hosts: None,
        }
    }

    fn n(&self) -> usize {
        self.params.iter().map(|p| p.numel()).sum()
    }

    fn exchanger(&self) -> Exchanger {
        let mut ex =
            Exchanger::new(&self.params, &self.policy, &self.method, &self.memory, 7).unwrap();
        ex.set_overlap(self.overlap);
        ex.set_gather_collective(self.gather);
        ex.set_server_error_feedback(self.server_ef);
        ex.set_link(self.link);
        if let Some(h) = &self.hosts {
            ex.set_topology(h);
        }
        ex
    }

    /// Exchanges steps `steps` on `ex` for `rank`.
    fn steps(
        &self,
        ex: &mut Exchanger,
        comm: &mut Communicator<ChannelTransport>,
        rank: usize,
        steps: std::ops::Range<u64>,
    ) -> Trace {
        let n = self.n();
        steps
            .map(|s| {
                let mut g = grad(rank, n, s);
                let st = ex.exchange(comm, &mut g, s).unwrap();
                assert_eq!(st.elements as usize, n);
                (g, st)
            })
            .unzip()
    }

    fn run(&self, world: usize, steps: u64) -> Vec<Trace> {
        on_ranks(world, |rank, comm| {
            let mut ex = self.exchanger();
            self.steps(&mut ex, comm, rank, 0..steps)
        })
    }
}

/// Asserts bit-identity, naming the first differing element (not dumping the vectors).
fn assert_same(a: &[f32], b: &[f32], what: impl std::fmt::Display) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}

fn differ(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits())
}

/// Every rank holds bit-identical results at every step.
fn assert_ranks_agree(res: &[Trace], what: &str) {
    for (r, other) in res.iter().enumerate().skip(1) {
        for (s, g) in other.0.iter().enumerate() {
            assert_same(g, &res[0].0[s], format!("{what}: rank {r} step {s}"));
        }
    }
}

/// Runs `steps` exchanges of `method` (with its default memory) on `world` ranks.
fn run(world: usize, method: &str, steps: u64) -> Vec<Vec<Vec<f32>>> {
    let mut setup = Setup::new(parse_method(method).unwrap());
    setup.params = params();
    setup.policy = policy(4000);
    setup.run(world, steps).into_iter().map(|t| t.0).collect()
}

#[test]
fn uncompressed_exchange_is_the_mean_and_identical_on_all_ranks() {
    for world in [1usize, 2, 3, 4] {
        let res = run(world, "none", 2);
        let n = res[0][0].len();
        for step in 0..2u64 {
            let s = step as usize;
            for other in &res[1..] {
                assert_eq!(other[s], res[0][s], "bit-identical");
            }
            let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, n, step)).collect();
            for (i, got) in res[0][s].iter().enumerate() {
                let mean: f64 = grads.iter().map(|g| g[i] as f64).sum::<f64>() / world as f64;
                assert!((*got as f64 - mean).abs() < 1e-6);
            }
        }
    }
}

/// The uncompressed exchange sums contiguous buckets where they lie and gathers the
/// others; either way it must give the bits of gather → sum all-reduce → scatter × 1/P
/// bucket by bucket (what the pipelined path computes), on every rank.
#[test]
fn uncompressed_exchange_in_place_matches_gather_sum_scatter_bit_for_bit() {
    let policies = [
        // Several buckets, all contiguous: summed in place.
        BucketPolicy {
            bucket_bytes: 4 * 3000,
            ..BucketPolicy::default()
        },
        // 1-D tensors bypass into one bucket of non-adjacent ranges: gathered.
        policy(3000),
    ];
    for (pi, pol) in policies.iter().enumerate() {
        for world in [1usize, 2, 3, 4] {
            let mut setup = Setup::new(parse_method("none").unwrap());
            setup.policy = pol.clone();
            let n = setup.n();
            let buckets = bucket::plan(&setup.params, pol);
            let in_place = buckets.iter().filter(|b| contiguous(b).is_some()).count();
            assert!(
                if pi == 0 {
                    in_place == buckets.len() && buckets.len() > 2
                } else {
                    in_place < buckets.len()
                },
                "policy {pi}: {in_place} of {} buckets contiguous",
                buckets.len()
            );
            let got = setup.run(world, 2);
            let want = on_ranks(world, |rank, comm| {
                (0..2u64)
                    .map(|s| {
                        let mut g = grad(rank, n, s);
                        let mut buf = Vec::new();
                        for b in &buckets {
                            bucket::gather(b, &g, &mut buf);
                            comm.all_reduce_sum(&mut buf).unwrap();
                            assert!(!bucket::scatter(b, &buf, 1.0 / world as f32, &mut g));
                        }
                        g
                    })
                    .collect::<Vec<_>>()
            });
            for (rank, ((g, st), w)) in got.iter().zip(&want).enumerate() {
                for (s, w) in w.iter().enumerate() {
                    let what = format!("policy {pi} world {world} rank {rank} step {s}");
                    assert_same(&g[s], w, what);
                    assert_eq!(st[s].payload_bytes, 4 * n as u64);
                    assert_eq!(st[s].non_finite, (world > 1).then_some(false));
                }
            }
        }
    }
}

#[test]
fn compressed_exchanges_agree_across_ranks_for_every_aggregation_kind() {
    // topk: gather; randomk: summable; fp16: dense.
    for method in ["topk:ratio=0.05", "randomk:ratio=0.2", "fp16"] {
        let res = run(3, method, 3);
        for (step, mine) in res[0].iter().enumerate() {
            assert_eq!(&res[1][step], mine, "{method}");
            assert_eq!(&res[2][step], mine, "{method}");
            assert!(mine.iter().any(|&v| v != 0.0), "{method}");
        }
    }
    // fp16 is close to the true mean.
    let res = run(2, "fp16", 1);
    let n = res[0][0].len();
    let (g0, g1) = (grad(0, n, 0), grad(1, n, 0));
    for (i, got) in res[0][0].iter().enumerate() {
        let mean = (g0[i] + g1[i]) / 2.0;
        assert!((got - mean).abs() < 1e-3);
    }
}

#[test]
fn wrong_length_is_an_error() {
    let mut comm = Communicator::new(channel_mesh(1).pop().unwrap(), CommConfig::default());
    let cfg = CompressorConfig::default_for("topk").unwrap();
    let mut ex = Exchanger::new(
        &params(),
        &BucketPolicy::default(),
        &cfg,
        &MemoryConfig::None,
        0,
    )
    .unwrap();
    let mut g = vec![0f32; 3];
    assert!(matches!(
        ex.exchange(&mut comm, &mut g, 0),
        Err(ExchangeError::Length { .. })
    ));
}

/// Indices of the `k` largest `|x|` (ties → smaller index), ascending.
fn brute_top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].abs().total_cmp(&x[a].abs()).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort();
    idx
}

/// ALGORITHMS.md §12.2, computed directly: per step and compressed bucket, `u_i = m_i +
/// g_i`; the leader `t mod P` picks the top-k of its `u` per segment; every rank sends
/// its `u` at those indices; the result is their average; `m_i ← (1 − β)·m_i + β·(u_i −
/// c_i)`. Dense buckets are plain means.
fn clt_k_reference(
    setup: &Setup,
    world: usize,
    steps: u64,
    ratio: f64,
    beta: f32,
) -> Vec<Vec<f32>> {
    let n = setup.n();
    let plan = bucket::plan(&setup.params, &setup.policy);
    let mut mem: Vec<BTreeMap<u64, Vec<f32>>> = vec![BTreeMap::new(); world];
    let mut out = Vec::new();
    for t in 0..steps {
        let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, n, t)).collect();
        let mut want = vec![0f32; n];
        for b in &plan {
            let mut bufs = Vec::new();
            for g in &grads {
                let mut v = Vec::new();
                bucket::gather(b, g, &mut v);
                bufs.push(v);
            }
            let mut avg = vec![0f32; b.len()];
            if !b.compressed {
                for (j, a) in avg.iter_mut().enumerate() {
                    *a = (bufs.iter().map(|v| v[j] as f64).sum::<f64>() / world as f64) as f32;
                }
            } else {
                let u: Vec<Vec<f32>> = (0..world)
                    .map(|r| {
                        let m = mem[r].get(&b.id);
                        (0..b.len())
                            .map(|j| m.map_or(0.0, |m| m[j]) + bufs[r][j])
                            .collect()
                    })
                    .collect();
                let leader = (t % world as u64) as usize;
                let mut kept = Vec::new();
                for s in &b.segments {
                    let k = dtrain_compress::topk::k_for(s.len(), ratio);
                    kept.extend(
                        brute_top_k(&u[leader][s.clone()], k)
                            .into_iter()
                            .map(|j| j + s.start),
                    );
                }
                for (r, ur) in u.iter().enumerate() {
                    let mut c = vec![0f32; b.len()];
                    for &j in &kept {
                        c[j] = ur[j];
                    }
                    let m = mem[r].entry(b.id).or_insert_with(|| vec![0.0; b.len()]);
                    for j in 0..b.len() {
                        m[j] = (1.0 - beta) * m[j] + beta * (ur[j] - c[j]);
                    }
                }
                for &j in &kept {
                    avg[j] = (u.iter().map(|ur| ur[j] as f64).sum::<f64>() / world as f64) as f32;
                }
            }
            assert!(!bucket::scatter(b, &avg, 1.0, &mut want));
        }
        out.push(want);
    }
    out
}

#[test]
fn scalecom_on_three_ranks_is_clt_k_with_a_low_pass_memory() {
    let (world, steps, beta) = (3, 7u64, 0.5f32);
    // `workers` is left at its default (1): the exchanger supplies the world size.
    let mut setup = Setup::new(parse_method("scalecom:ratio=0.05").unwrap());
    setup.memory = MemoryConfig::LowPass { beta };
    let want = clt_k_reference(&setup, world, steps, 0.05, beta);
    let mut default_workers = Vec::new();
    for overlap in [true, false] {
        setup.overlap = overlap;
        let res = setup.run(world, steps);
        default_workers = res[0].0.clone();
        assert_ranks_agree(&res, "scalecom");
        for (t, got) in res[0].0.iter().enumerate() {
            let mut nonzero = 0;
            for (j, (&a, &b)) in got.iter().zip(&want[t]).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "overlap {overlap} step {t} element {j}: {a} vs reference {b}"
                );
                // Unsent coordinates are exactly zero, as in the reference.
                assert_eq!(a == 0.0, b == 0.0, "step {t} element {j}");
                nonzero += (a != 0.0) as usize;
            }
            assert!(nonzero > 100, "step {t}: {nonzero}");
        }
        // Traffic: the index broadcast plus k values per bucket, not a gather of P
        // payloads.
        for st in &res[1].1 {
            assert!(st.bytes_sent > 0 && st.payload_bytes > 0);
        }
    }
    // An explicit, different `workers` in the config is overridden the same way.
    setup.method = CompressorConfig::ScaleCom(ScaleComConfig {
        ratio: 0.05,
        workers: 5,
    });
    let res = setup.run(world, 3);
    for (t, got) in res[0].0.iter().enumerate() {
        assert_same(got, &default_workers[t], format!("workers = 5, step {t}"));
    }
}

/// Every registered method at its defaults, plus denser variants of the sparsifiers
/// (so that every bucket really is sparse or really is summed).
fn all_kinds() -> Vec<CompressorConfig> {
    let mut v: Vec<CompressorConfig> = dtrain_compress::METHODS
        .iter()
        .map(|m| (m.default)())
        .collect();
    v.extend(
        [
            "randomk:ratio=0.2",
            "topk:ratio=0.05",
            "scalecom:ratio=0.05",
        ]
        .iter()
        .map(|m| parse_method(m).unwrap()),
    );
    v.push(CompressorConfig::Dgc(DgcConfig {
        ratio: 0.05,
        min_sparse_len: 1000,
        ..DgcConfig::default()
    }));
    v
}

#[test]
fn sparse_all_reduce_gives_the_all_gather_gradients_bit_for_bit() {
    let mut covered = std::collections::BTreeSet::new();
    for world in [1usize, 2, 4] {
        for method in all_kinds() {
            let name = method.name();
            let mut setup = Setup::new(method);
            if setup
                .exchanger()
                .pipes()
                .next()
                .map(|p| p.compressor().aggregation())
                != Some(Aggregation::Gather)
                || name == "fft"
            {
                // (FFT's gathered path sums spectra — one inverse transform — so its
                // result differs by rounding; the config refuses fft + sparse-allreduce.)
                continue;
            }
            covered.insert(name);
            let gathered = setup.run(world, 3);
            setup.gather = GatherCollective::SparseAllReduce;
            let sparse = setup.run(world, 3);
            for overlap in [false, true] {
                setup.overlap = overlap;
                let sparse2 = setup.run(world, 2);
                for r in 0..world {
                    assert_same(
                        &sparse2[r].0[1],
                        &sparse[r].0[1],
                        format!("{name} overlap {overlap}"),
                    );
                }
            }
            assert_ranks_agree(&sparse, name);
            for r in 0..world {
                for s in 0..3 {
                    assert_same(
                        &sparse[r].0[s],
                        &gathered[r].0[s],
                        format!("{name}: P={world} rank {r} step {s}"),
                    );
                }
            }
        }
    }
    // Every sparse method of the literature goes through it.
    for m in ["topk", "dgc", "threshold", "gradient-dropping"] {
        assert!(covered.contains(m), "{m} not covered: {covered:?}");
    }
}

#[test]
fn overlap_is_bit_identical_to_the_sequential_path_for_every_aggregation_kind() {
    let world = 3;
    for method in all_kinds() {
        let name = method.name();
        let mut setup = Setup::new(method);
        assert_eq!(setup.exchanger().buckets().count(), 5);
        setup.overlap = false;
        let seq = setup.run(world, 3);
        setup.overlap = true;
        let ovl = setup.run(world, 3);
        assert_ranks_agree(&seq, name);
        assert_ranks_agree(&ovl, name);
        for r in 0..world {
            for s in 0..3 {
                assert_same(
                    &ovl[r].0[s],
                    &seq[r].0[s],
                    format!("{name}: rank {r} step {s}"),
                );
                let (a, b) = (&seq[r].1[s], &ovl[r].1[s]);
                // Same collectives, same bytes sent (received bytes may include early
                // messages of a faster peer's next collective, so they vary).
                assert_eq!(
                    (a.bytes_sent, a.payload_bytes),
                    (b.bytes_sent, b.payload_bytes),
                    "{name}"
                );
                // Sequentially every collective blocks the caller.
                assert_eq!(a.wait_s, a.communicate_s, "{name}");
                for x in [a, b] {
                    for t in [x.compress_s, x.communicate_s, x.wait_s, x.decompress_s] {
                        assert!(t.is_finite() && t >= 0.0, "{name}: {x:?}");
                    }
                    assert!(x.communicate_s > 0.0 && x.bytes_sent > 0, "{name}");
                }
            }
        }
    }
}

#[test]
fn a_failing_compression_is_an_error_on_both_paths() {
    for overlap in [true, false] {
        let mut setup = Setup::new(parse_method("topk:ratio=0.05").unwrap());
        setup.overlap = overlap;
        let n = setup.n();
        let res = on_ranks(1, |_, comm| {
            let mut ex = setup.exchanger();
            let mut g = vec![0.5f32; n];
            g[3000] = f32::NAN; // in the second compressed bucket
            ex.exchange(comm, &mut g, 0)
        });
        assert!(
            matches!(res[0], Err(ExchangeError::Compress { bucket: 1, .. })),
            "{:?}",
            res[0]
        );
    }
}

#[test]
fn ratio_metric_and_theta_scale_follow_the_schedules() {
    let n = params2().iter().map(|p| p.numel()).sum::<usize>();
    let sched = ThetaSchedule::Inv {
        theta0: 0.9,
        tau: 2.0,
    };
    let fft = CompressorConfig::Fft(FftConfig {
        theta_schedule: Some(sched.clone()),
        ..FftConfig::default()
    });
    let setup = Setup::new(fft);
    let res = on_ranks(1, |_, comm| {
        let mut ex = setup.exchanger();
        let mut plain = setup.exchanger();
        assert_eq!(ex.ratio_metric(), Some(("theta", sched.theta(0, 0))));
        assert_eq!(ex.theta_scale(), 1.0);
        let mut sizes = Vec::new();
        for s in 0..4u64 {
            let mut g = grad(0, n, s);
            let st = ex.exchange(comm, &mut g, s).unwrap();
            let mut h = grad(0, n, s);
            let pt = plain.exchange(comm, &mut h, s).unwrap();
            let scale = if s >= 2 { 0.5 * 0.5 } else { 1.0 };
            assert_eq!(
                ex.ratio_metric(),
                Some(("theta", sched.theta(s, 0) * scale))
            );
            sizes.push((st.payload_bytes, pt.payload_bytes));
            if s == 1 {
                assert!(ex.scale_theta(0.5));
                // Applies at once, on top of the schedule's current value...
                assert_eq!(ex.ratio_metric(), Some(("theta", sched.theta(1, 0) * 0.5)));
                assert!(ex.scale_theta(0.5));
                assert_eq!(ex.theta_scale(), 0.25);
            }
        }
        sizes
    });
    // ... and keeps more bins at every later step than the unscaled run.
    let sizes = &res[0];
    assert_eq!(sizes[0].0, sizes[0].1);
    assert_eq!(sizes[1].0, sizes[1].1);
    assert!(
        sizes[2].0 > sizes[2].1 && sizes[3].0 > sizes[3].1,
        "{sizes:?}"
    );

    // DGC: the warm-up density of the last step.
    let warmup = Warmup::Exponential { epochs: 3 };
    let dgc = CompressorConfig::Dgc(DgcConfig {
        ratio: 0.01,
        steps_per_epoch: 1,
        warmup: warmup.clone(),
        min_sparse_len: 1000,
        ..DgcConfig::default()
    });
    let setup = Setup::new(dgc);
    on_ranks(1, |_, comm| {
        let mut ex = setup.exchanger();
        assert_eq!(
            ex.ratio_metric(),
            Some(("density", warmup.density(0, 0.01)))
        );
        for s in 0..5u64 {
            let mut g = grad(0, n, s);
            ex.exchange(comm, &mut g, s).unwrap();
            assert_eq!(
                ex.ratio_metric(),
                Some(("density", warmup.density(s, 0.01)))
            );
        }
        assert!(!ex.scale_theta(0.5));
        assert_eq!(ex.theta_scale(), 1.0);
    });

    for (m, want) in [
        ("topk:ratio=0.05", Some(("density", 0.05))),
        ("randomk:ratio=0.2", Some(("density", 0.2))),
        ("scalecom:ratio=0.03", Some(("density", 0.03))),
        ("gradient-dropping:drop_ratio=0.75", Some(("density", 0.25))),
        ("qsgd", None),
        ("fp16", None),
        ("none", None),
    ] {
        let mut ex = Setup::new(parse_method(m).unwrap()).exchanger();
        assert_eq!(ex.ratio_metric(), want, "{m}");
        assert!(!ex.scale_theta(0.5), "{m}");
        assert_eq!(ex.theta_scale(), 1.0, "{m}");
    }
}

/// Runs `2k` steps straight, and `k` steps → export (through JSON) → a new exchanger →
/// import → `k` steps; `hook` runs before every step on both. Returns every rank's
/// (straight, resumed, fresh-without-import) results of steps `k..2k`.
fn resume(
    setup: &Setup,
    world: usize,
    k: u64,
    hook: impl Fn(&mut Exchanger, u64) + Sync,
) -> Vec<[Vec<Vec<f32>>; 3]> {
    on_ranks(world, |rank, comm| {
        let n = setup.n();
        let step = |ex: &mut Exchanger, comm: &mut Communicator<ChannelTransport>, s| {
            hook(ex, s);
            let mut g = grad(rank, n, s);
            ex.exchange(comm, &mut g, s).unwrap();
            g
        };
        let mut straight = setup.exchanger();
        let all: Vec<Vec<f32>> = (0..2 * k).map(|s| step(&mut straight, comm, s)).collect();
        let mut first = setup.exchanger();
        for s in 0..k {
            assert_same(&step(&mut first, comm, s), &all[s as usize], "first half");
        }
        let json = serde_json::to_string(&first.export_state().unwrap()).unwrap();
        drop(first);
        let state: ExchangerState = serde_json::from_str(&json).unwrap();
        let mut second = setup.exchanger();
        second.import_state(state.clone()).unwrap();
        assert_eq!(second.export_state().unwrap(), state);
        let resumed: Vec<Vec<f32>> = (k..2 * k).map(|s| step(&mut second, comm, s)).collect();
        let mut fresh = setup.exchanger();
        let fresh: Vec<Vec<f32>> = (k..2 * k).map(|s| step(&mut fresh, comm, s)).collect();
        [all[k as usize..].to_vec(), resumed, fresh]
    })
}

fn assert_resumes_bit_identically(name: &str, res: &[[Vec<Vec<f32>>; 3]]) {
    for (r, [straight, resumed, fresh]) in res.iter().enumerate() {
        for (s, (a, b)) in straight.iter().zip(resumed).enumerate() {
            assert_same(a, b, format!("{name}: rank {r}, step k+{s}"));
        }
        // The state matters: without it the run diverges at once.
        assert!(differ(&straight[0], &fresh[0]), "{name}: rank {r}");
    }
}

#[test]
fn resume_from_exported_state_is_bit_identical() {
    let k = 4;
    // Top-k with residual error feedback.
    let setup = Setup::new(parse_method("topk:ratio=0.05").unwrap());
    assert_eq!(setup.memory, MemoryConfig::RESIDUAL);
    assert_resumes_bit_identically("topk", &resume(&setup, 2, k, |_, _| {}));

    // DGC: momentum-corrected memory, warm-up crossing the checkpoint.
    let setup = Setup::new(CompressorConfig::Dgc(DgcConfig {
        ratio: 0.02,
        steps_per_epoch: 2,
        warmup: Warmup::Exponential { epochs: 4 },
        min_sparse_len: 1000,
        ..DgcConfig::default()
    }));
    assert!(setup.memory.owns_momentum());
    assert_resumes_bit_identically("dgc", &resume(&setup, 2, k, |_, _| {}));

    // FFT with a θ schedule and a recover scale applied before the checkpoint.
    let setup = Setup::new(CompressorConfig::Fft(FftConfig {
        theta_schedule: Some(ThetaSchedule::Poly {
            theta0: 0.9,
            total_steps: 20,
            power: 1.0,
        }),
        ..FftConfig::default()
    }));
    let res = resume(&setup, 2, k, |ex, s| {
        if s == 1 {
            assert!(ex.scale_theta(0.5));
        }
    });
    assert_resumes_bit_identically("fft", &res);

    // FFT with error feedback, its residual kept as spectra (the main job's setting).
    let mut setup = Setup::new(parse_method("fft:theta=0.8").unwrap());
    setup.memory = MemoryConfig::RESIDUAL;
    assert_resumes_bit_identically("fft + spectral residual", &resume(&setup, 2, k, |_, _| {}));

    // ScaleCom on three ranks with a low-pass memory.
    let mut setup = Setup::new(parse_method("scalecom:ratio=0.05").unwrap());
    setup.memory = MemoryConfig::LowPass { beta: 0.5 };
    assert_resumes_bit_identically("scalecom", &resume(&setup, 3, k, |_, _| {}));
}

#[test]
fn every_method_resumes_bit_identically() {
    // Catches compressor state that is neither re-derived from the step nor exported.
    for method in all_kinds() {
        let name = method.name();
        let res = resume(&Setup::new(method), 2, 2, |_, _| {});
        for (r, [straight, resumed, _]) in res.iter().enumerate() {
            for (s, (a, b)) in straight.iter().zip(resumed).enumerate() {
                assert_same(a, b, format!("{name}: rank {r}, step k+{s}"));
            }
        }
    }
}

#[test]
fn import_refuses_state_of_another_plan_method_or_shape() {
    let topk = parse_method("topk:ratio=0.05").unwrap();
    let setup = Setup::new(topk.clone());
    let n = setup.n();
    let state = on_ranks(1, |_, comm| {
        let mut ex = setup.exchanger();
        let mut g = grad(0, n, 0);
        ex.exchange(comm, &mut g, 0).unwrap();
        ex.export_state().unwrap()
    })
    .pop()
    .unwrap();
    assert_eq!(state.memory.len(), 4, "one residual per compressed bucket");

    let err = |mut ex: Exchanger, st: ExchangerState| {
        let before = ex.export_state().unwrap();
        let e = ex.import_state(st).unwrap_err();
        assert_eq!(
            ex.export_state().unwrap(),
            before,
            "a refused import changes nothing"
        );
        e
    };
    // Another bucket policy, another model.
    let mut other = Setup::new(topk.clone());
    other.policy = policy(5000);
    let e = err(other.exchanger(), state.clone());
    assert!(e.contains("bucket plan"), "{e}");
    let mut other = Setup::new(topk.clone());
    other.params = params();
    let e = err(other.exchanger(), state.clone());
    assert!(e.contains("bucket plan"), "{e}");
    // Another method or memory.
    let e = err(
        Setup::new(parse_method("randomk").unwrap()).exchanger(),
        state.clone(),
    );
    assert!(e.contains("method"), "{e}");
    let mut other = Setup::new(topk.clone());
    other.memory = MemoryConfig::LowPass { beta: 1.0 };
    let e = err(other.exchanger(), state.clone());
    assert!(e.contains("memory"), "{e}");
    // Damaged contents.
    let mut bad = state.clone();
    bad.memory.get_mut(&0).unwrap().pop();
    let e = err(setup.exchanger(), bad);
    assert!(e.contains("bucket 0"), "{e}");
    let mut bad = state.clone();
    bad.memory.insert(4, vec![0.0; 113]);
    let e = err(setup.exchanger(), bad);
    assert!(e.contains("not compressed"), "{e}");
    let mut bad = state.clone();
    bad.version = 99;
    assert!(err(setup.exchanger(), bad).contains("version"));
    let mut bad = state.clone();
    bad.compressors
        .insert(1, BTreeMap::from([("theta_scale".to_string(), 0.5)]));
    let e = err(setup.exchanger(), bad);
    assert!(e.contains("bucket 1"), "{e}");
    // FFT: a bad value in the third bucket rolls back the first two.
    let fft = Setup::new(parse_method("fft").unwrap());
    let mut st = fft.exchanger().export_state().unwrap();
    for (_, c) in st.compressors.iter_mut() {
        c.insert("theta_scale".into(), 0.5);
    }
    st.compressors
        .get_mut(&2)
        .unwrap()
        .insert("theta_base".into(), 1.5);
    let e = err(fft.exchanger(), st);
    assert!(e.contains("bucket 2"), "{e}");
    // FFT keeps its residual as spectra: a residual over the signal (an older build's, or
    // `spectral_feedback = false`) is refused, not misread, and the other way round.
    let mut fft = fft;
    fft.memory = MemoryConfig::RESIDUAL;
    let spectral = fft.exchanger().export_state().unwrap();
    assert_eq!(spectral.memory_kind, "residual/spectra");
    let mut signal = Setup::new(parse_method("fft:spectral_feedback=false").unwrap());
    signal.memory = MemoryConfig::RESIDUAL;
    let st = signal.exchanger().export_state().unwrap();
    assert_eq!(st.memory_kind, "residual");
    let e = err(fft.exchanger(), st);
    assert!(e.contains("memory"), "{e}");
    let e = err(signal.exchanger(), spectral);
    assert!(e.contains("residual/spectra"), "{e}");
    // The good state imports.
    setup.exchanger().import_state(state).unwrap();
}

#[test]
fn voting_methods_update_by_the_sign_of_the_summed_signs() {
    // Every tensor compressed (no dense 1-D bypass): the whole gradient is voted on, on
    // three ranks (no ties) and on two (ties give 0), over all-gather, sparse all-reduce and
    // the compressed all-reduce (each owner re-encodes the sum of the signs with signSGD:
    // the sign of the summed signs).
    for (world, gather) in [
        (3usize, GatherCollective::AllGather),
        (2, GatherCollective::AllGather),
        (3, GatherCollective::SparseAllReduce),
        (3, GatherCollective::CompressedAllReduce),
    ] {
        let mut setup = Setup::new(parse_method("signsgd").unwrap());
        setup.params = params();
        setup.policy = BucketPolicy {
            bucket_bytes: 4 * 4000,
            ..BucketPolicy::default()
        };
        setup.gather = gather;
        let n = setup.n();
        let res = setup.run(world, 2);
        assert_ranks_agree(&res, "signsgd");
        for s in 0..2u64 {
            let want: Vec<f32> = (0..n)
                .map(|j| {
                    let votes: f32 = (0..world)
                        .map(|r| if grad(r, n, s)[j] >= 0.0 { 1.0 } else { -1.0 })
                        .sum();
                    votes.signum() * f32::from(votes != 0.0)
                })
                .collect();
            assert_same(
                &res[0].0[s as usize],
                &want,
                format!("{world} ranks {gather:?} step {s}"),
            );
        }
    }
}

#[test]
fn powersgd_averages_the_rank_r_approximations_and_feeds_back_the_aggregate_error() {
    // One 64 × 48 matrix, one bucket, three ranks: the exchange is the summed agreement on
    // P, the all-reduce of Q and the mean P̂·Q̄ᵀ; each rank's residual is its own
    // compensated gradient minus that mean (PyTorch's powerSGD_hook), not minus its own
    // approximation.
    let mut setup = Setup::new(parse_method("powersgd:rank=2").unwrap());
    setup.params = shapes(&[vec![64, 48]]);
    setup.policy = policy(1 << 20);
    let n = setup.n();
    for world in [1usize, 3] {
        let res = on_ranks(world, |rank, comm| {
            let mut ex = setup.exchanger();
            let mut g = grad(rank, n, 0);
            let st = ex.exchange(comm, &mut g, 0).unwrap();
            (g, st, ex.export_state().unwrap())
        });
        let mean = &res[0].0;
        for (rank, (g, st, state)) in res.iter().enumerate() {
            assert_same(g, mean, format!("{world} ranks, rank {rank}"));
            // r·(m + c) floats on the wire, plus the framing.
            assert!(st.payload_bytes < (4 * 2 * (64 + 48) + 64) as u64, "{st:?}");
            let mem = state.memory.values().next().expect("one compressed bucket");
            let own = grad(rank, n, 0);
            for j in 0..n {
                assert!(
                    (mem[j] - (own[j] - mean[j])).abs() <= 1e-6 * (1.0 + own[j].abs()),
                    "{world} ranks, rank {rank}, element {j}"
                );
            }
        }
        // The mean is a rank-2 matrix: compare with the mean gradient's own low-rank fit.
        let avg: Vec<f32> = (0..n)
            .map(|j| (0..world).map(|r| grad(r, n, 0)[j]).sum::<f32>() / world as f32)
            .collect();
        let err: f32 = avg.iter().zip(mean).map(|(a, b)| (a - b).powi(2)).sum();
        let norm: f32 = avg.iter().map(|a| a * a).sum();
        assert!(
            err < norm,
            "{world} ranks: the approximation is no better than zero"
        );
    }
}

/// `powersgd:bf16=true`: the agreement and the lanes travel and are summed as bfloat16 —
/// about half the bytes — every rank gets the same bits, and the mean stays within
/// bfloat16's precision of the f32 exchange's.
#[test]
fn powersgd_in_bfloat16_halves_its_bytes_and_stays_near_the_f32_exchange() {
    let run = |method: &str| {
        let mut setup = Setup::new(parse_method(method).unwrap());
        setup.params = shapes(&[vec![64, 48], vec![48]]);
        setup.policy = policy(1 << 20);
        let n = setup.n();
        on_ranks(3, |rank, comm| {
            let mut ex = setup.exchanger();
            let mut g = grad(rank, n, 0);
            let st = ex.exchange(comm, &mut g, 0).unwrap();
            (g, st)
        })
    };
    let (f32s, bf16s) = (run("powersgd:rank=2"), run("powersgd:rank=2,bf16=true"));
    for (rank, (g, _)) in bf16s.iter().enumerate() {
        assert_same(g, &bf16s[0].0, format!("bf16, rank {rank}"));
    }
    let (a, b) = (&f32s[0].0, &bf16s[0].0);
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(worst > 0.0 && worst < 2e-2 * scale, "{worst} of {scale}");
    let sent = |r: &[(Vec<f32>, ExchangeStats)]| r[0].1.bytes_sent as f64;
    let ratio = sent(&bf16s) / sent(&f32s);
    assert!(ratio < 0.7, "bf16 sends {ratio} of f32's bytes");
    assert!(bf16s[0].1.payload_bytes < f32s[0].1.payload_bytes * 3 / 4);
}

mod auto;
mod compressed_allreduce;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod device;
mod in_place;
mod non_finite;
