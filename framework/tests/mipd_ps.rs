//! MIPD over the real parameter-server machinery: three worker threads and two server
//! threads on the in-process transport, asynchronous (staleness 2), workers training a
//! quadratic with the aggregates as they arrive. Every aggregate every worker pulls must
//! equal, byte for byte, what a [`MipdServer`] computes directly from the recorded pushes.

use std::thread;
use std::time::Duration;

use dtrain_comms::channel_mesh;
use dtrain_comms::ps::{Aggregate, PsConfig, PsLayout, PsNode};
use dtrain_compress::mipd::{layers_in, Halves, MipdConfig, MipdServerConfig};
use dtrain_compress::CompressorConfig;
use dtrain_framework::ps_mode::sharded::{ShardedAggregator, ShardedWorker};

/// SplitMix64, for deterministic test data.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(seed: u64) -> f32 {
    (mix(seed) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

struct WorkerLog {
    /// pushes[step][shard]
    pushes: Vec<Vec<Vec<u8>>>,
    /// Aggregates in the order they were returned.
    aggregates: Vec<Aggregate>,
    /// Whether the first step returned before its aggregate (the worker ran ahead).
    ran_ahead: bool,
    params: Vec<f32>,
    loss: (f64, f64),
}

fn loss(p: &[f32], target: &[f32]) -> f64 {
    p.iter()
        .zip(target)
        .map(|(a, b)| 0.5 * ((a - b) as f64).powi(2))
        .sum()
}

#[test]
fn async_ps_with_mipd_equals_the_reference_server() {
    let (workers, servers, len, steps) = (3usize, 2usize, 5000usize, 12u64);
    let layers = vec![0..3000, 3000..3050, 3050..4990, 4990..5000];
    let layout = PsLayout::new(
        workers + servers,
        (0..workers).collect(),
        (workers..workers + servers).collect(),
        len,
    )
    .unwrap();
    let cfg = PsConfig {
        staleness: 2,
        timeout: Duration::from_secs(20),
        ..PsConfig::default()
    };
    let mcfg = MipdConfig {
        max_ratio: 0.1,
        lambda: 0.5,
        halves: Halves::Blocked,
        ..MipdConfig::default()
    };
    let scfg: MipdServerConfig = mcfg.server();
    let method = CompressorConfig::from(mcfg);
    let target: Vec<f32> = (0..len as u64).map(|i| unit(i + 77)).collect();
    let init: Vec<f32> = (0..len as u64).map(|i| 2.0 * unit(i)).collect();

    let handles: Vec<_> = channel_mesh(workers + servers)
        .into_iter()
        .map(|t| {
            let (layout, cfg, layers) = (layout.clone(), cfg.clone(), layers.clone());
            let method = method.clone();
            let (target, mut params) = (target.clone(), init.clone());
            thread::spawn(move || {
                let agg = ShardedAggregator::new(&layout, layers.clone(), &method).unwrap();
                let mut node = PsNode::new(t, layout.clone(), cfg, agg).unwrap();
                let Some(wi) = layout.worker_index(node.rank()) else {
                    node.serve().unwrap();
                    return None;
                };
                let mut worker = ShardedWorker::new(&layout, &layers, &method, false).unwrap();
                let mut log = WorkerLog {
                    pushes: Vec::new(),
                    aggregates: Vec::new(),
                    ran_ahead: false,
                    params: Vec::new(),
                    loss: (loss(&params, &target), 0.0),
                };
                let mut update = vec![0f32; len];
                let lr = 0.2 / workers as f32;
                let mut apply =
                    |aggs: Vec<Aggregate>, params: &mut Vec<f32>, log: &mut WorkerLog| {
                        for a in aggs {
                            // A fresh worker decodes alike: the pull depends on nothing
                            // but the layout, the layers and the half rule.
                            worker_apply(&layout, &layers, &method, &a, &mut update);
                            params
                                .iter_mut()
                                .zip(&update)
                                .for_each(|(p, u)| *p -= lr * u);
                            log.aggregates.push(a);
                        }
                    };
                for t in 0..steps {
                    // Worker 2 is slow at first, then everyone jitters.
                    let ms = if wi == 2 && t == 0 {
                        60
                    } else {
                        mix(t * 10 + wi as u64) % 4
                    };
                    thread::sleep(Duration::from_millis(ms));
                    // Gradient of ½‖p − target‖² plus worker/step noise.
                    let grads: Vec<f32> = params
                        .iter()
                        .zip(&target)
                        .enumerate()
                        .map(|(i, (p, q))| {
                            p - q + 0.05 * unit(i as u64 ^ (t << 20) ^ ((wi as u64) << 40))
                        })
                        .collect();
                    let payloads = worker.payloads(&params, &grads).unwrap();
                    log.pushes.push(payloads.clone());
                    let aggs = node.step(payloads, worker.reduction()).unwrap();
                    if t == 0 {
                        log.ran_ahead = aggs.is_empty();
                    }
                    apply(aggs, &mut params, &mut log);
                }
                let rest = node.finish().unwrap();
                apply(rest, &mut params, &mut log);
                log.loss.1 = loss(&params, &target);
                log.params = params;
                Some(log)
            })
        })
        .collect();
    let logs: Vec<WorkerLog> = handles
        .into_iter()
        .filter_map(|h| h.join().expect("rank panicked"))
        .collect();
    assert_eq!(logs.len(), workers);

    // The reference: one MipdServer per shard fed the recorded pushes in worker order.
    for j in 0..servers {
        let r = layout.shard_range(j);
        let mut server = scfg.init(r.len(), &layers_in(&layers, r.clone())).unwrap();
        let mut want = Vec::new();
        for step in 0..steps {
            let pushes: Vec<&[u8]> = logs
                .iter()
                .map(|l| l.pushes[step as usize][j].as_slice())
                .collect();
            server.aggregate(step, &pushes, &mut want).unwrap();
            for (wi, l) in logs.iter().enumerate() {
                let a = &l.aggregates[step as usize];
                assert_eq!(a.step, step, "worker {wi} got aggregates in order");
                assert_eq!(a.shards[j], want, "worker {wi}, shard {j}, step {step}");
            }
        }
    }
    for (wi, l) in logs.iter().enumerate() {
        assert_eq!(l.aggregates.len(), steps as usize, "worker {wi}");
        eprintln!("worker {wi}: loss {:.1} -> {:.1}", l.loss.0, l.loss.1);
        // Same aggregates in the same order from the same start: the same model.
        assert_eq!(l.params, logs[0].params, "worker {wi}");
        assert!(
            l.loss.1 < 0.5 * l.loss.0,
            "worker {wi}: loss {} -> {}",
            l.loss.0,
            l.loss.1
        );
    }
    // Asynchronous for real: the fast worker pushed step 1 before step 0 was aggregated.
    assert!(
        logs[0].ran_ahead,
        "worker 0 should run ahead of the slow worker"
    );
}

/// Decodes an aggregate with a fresh [`MipdWorker`] (decoding is stateless) and returns
/// its step.
/// Decodes `a` with a new worker of the same method (the decoder checks the step of every
/// shard's pull against `a.step`).
fn worker_apply(
    layout: &PsLayout,
    layers: &[std::ops::Range<usize>],
    method: &CompressorConfig,
    a: &Aggregate,
    out: &mut [f32],
) {
    let w = ShardedWorker::new(layout, layers, method, false).unwrap();
    w.apply(a, out).unwrap();
}
