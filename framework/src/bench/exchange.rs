//! `dtrain bench allreduce --compress M…`: the whole compressed exchange of one layer
//! (memory → compress → the method's collective → decompress and average), timed against
//! the dense all-reduce, one layer size at a time.
//!
//! This is the benchmark of Dryden et al. (2016, ALGORITHMS.md §16.5): their synthetic
//! layer benchmark times one-bit, threshold and adaptive quantization against
//! `MPI_Allreduce` for layers of growing size, and finds adaptive quantization fastest on
//! the largest layers. Here every method runs through the trainer's own
//! [`Exchanger`] on real worker processes, over any transport
//! and any emulated link, so the crossover size where compression starts to pay shows up
//! per fabric.
//!
//! Each worker holds one synthetic gradient per size (a `rows × cols` matrix of its own
//! seeded Gaussian values with σ = [`GRAD_SCALE`], the shape Dryden's per-column statistics
//! see) and exchanges a rotation of it `iters` times after `warmup` untimed calls;
//! error-feedback memories carry over between calls as in training, so a threshold
//! method's traffic grows with the calls until its residuals reach a steady state (give
//! it enough `--iters`). Every reported time is the maximum over ranks of that rank's mean
//! per call.
//!
//! The payloads travel as in training: by default (`--collective auto`) each method's
//! layer takes the route the trainer's automatic choice picks for it on this link and worker
//! count ([`crate::exchange::auto`]: the dense all-reduce, or the method's payloads through
//! the all-gather, the sparse or the compressed all-reduce), and every row names the
//! collective it took; `--collective` forces one.

use std::time::Instant;

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::{Collective, CompressorConfig, RunFacts, RunUse};

use super::common::{Op, Options, Row};
use super::compress::parse_method;
use super::gradient::{synthesize, Shape};
use crate::exchange::bucket::{BucketPolicy, ParamInfo};
use crate::exchange::{Exchanger, GatherCollective};

pub use super::common::Breakdown;

/// Standard deviation of the synthetic gradient values: gradient-sized, so that the
/// threshold methods' default τ (0.01) sits at 10 σ and error feedback decides, over the
/// calls, how much crosses it (Strom's data-dependent size).
pub const GRAD_SCALE: f32 = 1e-3;

/// The layer shape used for `n` elements: the most square `rows × cols` with a
/// power-of-two `cols` that divides `n` (a 1-D vector when `n` is odd).
pub fn layer_shape(n: usize) -> Vec<usize> {
    if n < 2 {
        return vec![n.max(1)];
    }
    let mut cols = 1usize;
    while cols * 2 <= n / (cols * 2) && n.is_multiple_of(cols * 2) {
        cols *= 2;
    }
    if cols == 1 {
        vec![n]
    } else {
        vec![n / cols, cols]
    }
}

/// Resolves a method spec (`name` or `name:key=value,…`) for a run on `world` ranks, with
/// the values the trainer would fill in (ScaleCom's worker count).
pub fn method_for(spec: &str, world: usize) -> Result<CompressorConfig, String> {
    let mut m = parse_method(spec)?;
    m.resolve(&RunFacts {
        workers: world,
        steps_per_epoch: 0,
    });
    Ok(m)
}

/// Checks the method specs of `opts` (at the launcher, before any process starts).
pub fn validate(opts: &Options) -> Result<(), String> {
    if opts.methods.is_empty() {
        return match opts.collective {
            Some(c) => Err(format!(
                "--collective {c} chooses how the payloads of --compress methods travel; \
                 name the methods"
            )),
            None => Ok(()),
        };
    }
    if opts.op != Op::AllReduce {
        return Err(format!(
            "--compress measures a gradient exchange (an all-reduce of f32 values); it does \
             not apply to --op {}",
            opts.op
        ));
    }
    // `auto` (the default) takes only collectives the method accepts: checked as its own.
    let collective = opts
        .collective
        .unwrap_or_default()
        .fixed()
        .unwrap_or(Collective::AllGather);
    for m in &opts.methods {
        let cfg = method_for(m, opts.workers)?;
        cfg.build()
            .map_err(|e| format!("--compress {m}: {}: {}", e.field, e.reason))?;
        cfg.check(&RunUse {
            collective,
            parameter_server: false,
            memory: &cfg.default_memory(),
        })
        .map_err(|e| {
            format!(
                "--compress {m} with --collective {collective}: {}",
                e.reason
            )
        })?;
    }
    if let Some(&b) = opts.sizes.iter().find(|&&b| b < 4) {
        return Err(format!(
            "size {b} B holds no f32 value; the exchange needs at least 4 B"
        ));
    }
    Ok(())
}

/// Measures every (size, method) pair of `opts` on a connected communicator (every rank
/// calls this with the same options). Rows come size by size, methods in the given order.
pub fn measure<T: Transport>(c: &mut Communicator<T>, opts: &Options) -> Result<Vec<Row>, String> {
    let world = c.world_size();
    let link = opts.link()?;
    let rank = c.rank();
    let mut rows = Vec::new();
    for &bytes in &opts.sizes {
        let n = bytes / 4;
        let shape = layer_shape(n);
        let params = [ParamInfo {
            name: "layer".into(),
            shape,
        }];
        let mut grad0 = synthesize(Shape::Gaussian, n, 1000 + rank as u64 * 7919 + n as u64);
        for g in &mut grad0 {
            *g *= GRAD_SCALE;
        }
        let mut grad = grad0.clone();
        let iters = opts.iters_for(bytes);
        for spec in &opts.methods {
            let method = method_for(spec, world)?;
            let policy = BucketPolicy {
                bucket_bytes: usize::MAX / 2,
                ..BucketPolicy::default()
            };
            let mut ex = Exchanger::new(&params, &policy, &method, &method.default_memory(), 11)
                .map_err(|e| format!("{spec}: {}: {}", e.field, e.reason))?;
            // The trainer's choice: `auto` (the default) measures this link (or models the
            // emulated one) and this method on this layer, like a training run's set-up.
            ex.set_gather_collective(opts.collective.unwrap_or_default());
            ex.set_link(Some(link));
            if ex.gather_collective() == GatherCollective::Auto {
                let report = ex
                    .choose_collectives(c)
                    .map_err(|e| format!("{spec}: choosing the collective: {e}"))?;
                if rank == 0 && !report.buckets.is_empty() {
                    // What the choice rests on, beside the table (rank 0's stderr).
                    eprintln!("{spec}, {bytes} B: {report}");
                }
            }
            let took: Vec<&str> = ex.collectives().iter().map(|c| c.name()).collect();
            let took = took.join("+");
            let mut step = 0u64;
            let mut call = |c: &mut Communicator<T>, grad: &mut Vec<f32>| {
                // A different gradient each call with the same statistics: grad0 rotated.
                let off = (step as usize).wrapping_mul(7919) % n;
                grad[..n - off].copy_from_slice(&grad0[off..]);
                grad[n - off..].copy_from_slice(&grad0[..off]);
                let st = ex
                    .exchange(c, grad, step)
                    .map_err(|e| format!("{spec}: {e}"));
                step += 1;
                st
            };
            for _ in 0..opts.warmup {
                call(c, &mut grad)?;
            }
            c.barrier().map_err(|e| e.to_string())?;
            let before = c.total_bytes();
            let (mut total, mut comp, mut comm, mut dec) = (0.0f64, 0.0, 0.0, 0.0);
            for _ in 0..iters {
                let t0 = Instant::now();
                let st = call(c, &mut grad)?;
                total += t0.elapsed().as_secs_f64();
                comp += st.compress_s;
                comm += st.communicate_s;
                dec += st.decompress_s;
            }
            let sent = (c.total_bytes().sent - before.sent) / iters as u64;
            let k = iters as f64;
            let mut el = [
                (total / k) as f32,
                (comp / k) as f32,
                (comm / k) as f32,
                (dec / k) as f32,
            ];
            c.all_reduce_max(&mut el).map_err(|e| e.to_string())?;
            let time = el[0] as f64;
            let algbw = bytes as f64 / time / 1e9;
            rows.push(Row {
                bytes,
                count: n,
                iters,
                time_us: time * 1e6,
                algbw_gbs: algbw,
                busbw_gbs: algbw * Op::AllReduce.bus_factor(world),
                predicted_us: None,
                sent_per_call: sent,
                method: Some(spec.clone()),
                breakdown: Some(Breakdown {
                    compress_us: el[1] as f64 * 1e6,
                    communicate_us: el[2] as f64 * 1e6,
                    decompress_us: el[3] as f64 * 1e6,
                }),
                collective: Some(took),
            });
        }
    }
    Ok(rows)
}

/// Formats exchange rows: per size and method the time per call, its split, rank 0's
/// bytes sent, and the speed-up against `none` at the same size (or against the first
/// method when `none` was not measured).
pub fn table(opts: &Options, rows: &[Row]) -> String {
    let mut s = format!(
        "# dtrain bench allreduce --compress: one layer per size, transport {}, {} worker processes on 127.0.0.1{}\n",
        opts.transport,
        opts.workers,
        opts.link_note()
    );
    s += "# time: per exchange (memory + compress + collective + decompress), max over ranks; \
          speed-up vs none at the same size\n";
    s += &format!(
        "# {:>10} {:>13} {:<24} {:<20} {:>6} {:>11} {:>10} {:>11} {:>10} {:>12} {:>8}\n",
        "size(B)",
        "layer",
        "method",
        "collective",
        "iters",
        "time(us)",
        "comp(us)",
        "comm(us)",
        "dec(us)",
        "sent(B)",
        "speedup"
    );
    for r in rows {
        let base = rows
            .iter()
            .filter(|x| x.bytes == r.bytes)
            .find(|x| x.method.as_deref() == Some(dtrain_compress::BASELINE))
            .or_else(|| rows.iter().find(|x| x.bytes == r.bytes));
        let speedup = base.map_or(1.0, |b| b.time_us / r.time_us);
        let b = r.breakdown.unwrap_or_default();
        let shape = layer_shape(r.count);
        let layer = shape
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("x");
        s += &format!(
            "  {:>10} {:>13} {:<24} {:<20} {:>6} {:>11.1} {:>10.1} {:>11.1} {:>10.1} {:>12} {:>7.2}x\n",
            r.bytes,
            layer,
            r.method.as_deref().unwrap_or("-"),
            r.collective.as_deref().unwrap_or("-"),
            r.iters,
            r.time_us,
            b.compress_us,
            b.communicate_us,
            b.decompress_us,
            r.sent_per_call,
            speedup
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TransportKind;
    use std::time::Duration;

    #[test]
    fn layer_shapes_are_square_ish_matrices() {
        assert_eq!(layer_shape(1 << 20), vec![1024, 1024]);
        assert_eq!(layer_shape(1 << 21), vec![2048, 1024]);
        assert_eq!(layer_shape(256), vec![16, 16]);
        assert_eq!(layer_shape(6), vec![3, 2]);
        assert_eq!(layer_shape(7), vec![7]);
        assert_eq!(layer_shape(1), vec![1]);
        for n in [2usize, 12, 96, 1000, 1 << 17] {
            assert_eq!(layer_shape(n).iter().product::<usize>(), n);
        }
    }

    fn opts(methods: &[&str]) -> Options {
        Options {
            transport: TransportKind::Tcp,
            workers: 3,
            sizes: vec![16 << 10, 64 << 10],
            op: Op::AllReduce,
            bandwidth: None,
            latency: None,
            iters: 2,
            warmup: 1,
            timeout: Duration::from_secs(30),
            methods: methods.iter().map(|s| s.to_string()).collect(),
            collective: None,
        }
    }

    /// Every method's exchange runs on 3 in-process ranks; the rows agree across ranks,
    /// and the compressed methods send fewer bytes than the dense all-reduce. The collective
    /// is forced: under `auto` a bucket may go dense on the fast in-process link, whenever
    /// the probe and the codec timings say so (a loaded CI machine once sent 1-bit SGD's
    /// buckets dense).
    #[test]
    fn measure_times_every_method_and_compressed_ones_send_less() {
        let mut o = opts(&[
            "none",
            "onebit",
            "threshold",
            "adaptive-threshold",
            "topk:ratio=0.01",
        ]);
        o.collective = Some(GatherCollective::AllGather);
        validate(&o).unwrap();
        let oc = o.clone();
        let rows: Vec<Vec<Row>> =
            super::super::on_channel_mesh(3, move |c| measure(c, &oc).unwrap());
        for rs in &rows {
            assert_eq!(rs.len(), 2 * 5);
            for (r, r0) in rs.iter().zip(&rows[0]) {
                assert_eq!(r.time_us, r0.time_us);
                assert_eq!(r.method, r0.method);
            }
        }
        for size_rows in rows[0].chunks(5) {
            let dense = &size_rows[0];
            assert_eq!(dense.method.as_deref(), Some("none"));
            for r in &size_rows[1..] {
                assert!(r.time_us > 0.0 && r.breakdown.is_some());
                assert!(
                    r.sent_per_call * 4 < dense.sent_per_call,
                    "{:?} sent {} vs dense {}",
                    r.method,
                    r.sent_per_call,
                    dense.sent_per_call
                );
            }
        }
        let t = table(&o, &rows[0]);
        assert!(t.contains("adaptive-threshold") && t.contains("speedup"));
        assert!(t.contains("128x128") && t.contains("64x64"), "{t}");
    }

    #[test]
    fn bad_method_specs_and_ops_are_refused_before_launch() {
        assert!(validate(&opts(&["nope"]))
            .unwrap_err()
            .contains("unknown method"));
        assert!(validate(&opts(&["topk:ratio=2"]))
            .unwrap_err()
            .contains("ratio"));
        let mut o = opts(&["onebit"]);
        o.op = Op::AllGather;
        assert!(validate(&o).unwrap_err().contains("--op allgather"));
        let mut o = opts(&["onebit"]);
        o.sizes = vec![2];
        assert!(validate(&o).unwrap_err().contains("at least 4 B"));
    }
}
