//! The compressed optimizers against independent f64 transcriptions of DeepSpeed's
//! `OnebitAdam` and `ZeroOneAdam` step functions, on in-process ranks fed synthetic
//! gradients. The exchanges are exact averages here (exchangers without compression), so
//! what is compared is the optimizers' own arithmetic and schedules; the 1-bit all-reduce
//! is tested with the exchanger, and end to end in `framework/tests`.

use dtrain_comms::{channel_mesh, CommConfig, Communicator};
use dtrain_compress::MemoryConfig;

use super::{compressed_optimizer, Collectives, Update};
use crate::config::RunConfig;
use crate::exchange::Exchanger;
use dtrain_records::StepRecord;

const MODEL: &str = r#"
name = "t"
seed = 3
[model]
kind = "mlp"
in_channels = 1
image_size = 4
hidden = [6]
[data]
kind = "synthetic"
shape = [1, 4, 4]
train_len = 64
batch_size = 8
[train]
lr = 0.01
weight_decay = 0.01
"#;

/// Rank `r`'s synthetic gradient of `step`, element `i`: never zero, different per rank.
fn grad(r: usize, step: u64, i: usize) -> f32 {
    let x = (i as f32 * 0.37 + step as f32 * 1.3 + r as f32 * 2.1).sin();
    0.1 * x + if x >= 0.0 { 0.02 } else { -0.02 }
}

/// The learning rate of `step` (it varies, so that 0/1 Adam's Σηᵢ is exercised).
fn lr(step: u64) -> f64 {
    0.01 * (1.0 + (step % 3) as f64 * 0.5)
}

/// Runs `steps` steps of the optimizer configured by MODEL + `sets` on `world` in-process
/// ranks, as the trainer does (sync, the optimizer's update, after_update), with exact
/// exchanges; returns every rank's initial and final parameters.
fn drive(sets: &[&str], world: usize, steps: u64) -> Vec<(Vec<f32>, Vec<f32>)> {
    drive_with(sets, world, steps, true, grad)
}

/// [`drive`] with the gradient `grad`, and, unless `exact`, the run's own compressed
/// exchanger (the 1-bit code with worker and server residuals).
fn drive_with(
    sets: &[&str],
    world: usize,
    steps: u64,
    exact: bool,
    grad: fn(usize, u64, usize) -> f32,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("cluster.workers={world}"));
    let cfg = RunConfig::parse(MODEL, "t.toml", &sets).unwrap();
    let plan = cfg.validate("t.toml", None).unwrap();
    let handles: Vec<_> = channel_mesh(world)
        .into_iter()
        .map(|t| {
            let plan = plan.clone();
            let exact_exchange = exact;
            std::thread::spawn(move || {
                let mut comm = Communicator::new(t, CommConfig::default());
                let rank = comm.rank();
                let device = dtrain_models::cpu_device();
                let mut model = crate::trainer::build_model(&plan, &device).unwrap();
                let infos = crate::trainer::param_infos(model.as_ref());
                let exact = || {
                    Collectives::new(
                        Exchanger::new(
                            &infos,
                            &plan.buckets,
                            &dtrain_compress::baseline(),
                            &MemoryConfig::None,
                            plan.config.seed,
                        )
                        .unwrap(),
                    )
                };
                let n = model.table().num_params();
                let compressed = if exact_exchange {
                    exact()
                } else {
                    Collectives::new(crate::trainer::build_exchanger(&plan, &infos).unwrap())
                };
                let mut sync = compressed_optimizer(
                    plan.compressed_optimizer.unwrap(),
                    exact(),
                    compressed,
                    n,
                    &plan,
                );
                let mut opt = plan.optimizer.build().unwrap();
                let mut p0 = vec![0.0; n];
                model.read_params(&mut p0);
                let mut record = StepRecord::default();
                for step in 0..steps {
                    let mut g: Vec<f32> = (0..n).map(|i| grad(rank, step, i)).collect();
                    let eta = lr(step);
                    let up = sync
                        .sync(&mut comm, model.as_ref(), &mut g, step, eta, &mut record)
                        .unwrap();
                    assert!(matches!(
                        up,
                        Update::Averaged { non_finite: false } | Update::Local
                    ));
                    opt.begin(0, n);
                    model.update_params(&mut |off, p| {
                        opt.apply(0, off, p, &g[off..off + p.len()], eta as f32)
                    });
                    let bad = sync
                        .after_update(&mut comm, model.as_mut(), step, &mut record)
                        .unwrap();
                    assert!(!bad);
                }
                let mut p = vec![0.0; n];
                model.read_params(&mut p);
                (p0, p)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b).abs())
        .fold(0f64, f64::max);
    assert!(
        worst < 2e-5 * scale,
        "{what}: max abs diff {worst} (scale {scale})"
    );
}

/// 1-bit Adam, as `OnebitAdam.step` computes it (f64; exact averages).
fn onebit_reference(p0: &[f32], world: usize, steps: u64, freeze: u64) -> Vec<f64> {
    let (b1, b2, eps, wd) = (0.9f64, 0.999f64, 1e-8f64, 0.01f64);
    let n = p0.len();
    let mut p: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
    let (mut m, mut v) = (vec![0f64; n], vec![0f64; n]);
    for step in 0..steps {
        let t = step + 1;
        for i in 0..n {
            let gbar = (0..world).map(|r| grad(r, step, i) as f64).sum::<f64>() / world as f64;
            if t <= freeze {
                // Warm-up: DDP's all-reduced gradient into both moments.
                m[i] = b1 * m[i] + (1.0 - b1) * gbar;
                v[i] = b2 * v[i] + (1.0 - b2) * gbar * gbar;
            } else {
                // Each worker's exp_avg.mul_(β₁).add_(1−β₁, gᵢ), then their average.
                m[i] = (0..world)
                    .map(|r| b1 * m[i] + (1.0 - b1) * grad(r, step, i) as f64)
                    .sum::<f64>()
                    / world as f64;
            }
            let update = m[i] / (v[i].sqrt() + eps) + wd * p[i];
            p[i] -= lr(step) * update;
        }
    }
    p
}

#[test]
fn onebit_adam_is_deepspeeds_step_with_exact_averages() {
    let (steps, freeze) = (14, 6);
    let runs = drive(
        &["train.optimizer=\"onebit-adam\"", "train.freeze_step=6"],
        2,
        steps,
    );
    let want = onebit_reference(&runs[0].0, 2, steps, freeze);
    for (r, (_, p)) in runs.iter().enumerate() {
        assert_close(p, &want, &format!("rank {r}"));
    }
    // The freeze matters: without it (plain Adam moments all along, no bias correction)
    // the result differs, so the test can fail.
    let unfrozen = onebit_reference(&runs[0].0, 2, steps, steps);
    let d = unfrozen
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f64, f64::max);
    assert!(d > 1e-4, "freezing changed nothing ({d})");
}

/// 0/1 Adam, as `ZeroOneAdam.step` computes it (f64; exact averages), with the variance
/// phase ending after step `var_freeze` (counted from 1).
fn zeroone_reference(
    p0: &[f32],
    world: usize,
    steps: u64,
    (var_freeze, kappa, local_scaler, clipper): (u64, u64, u64, u64),
) -> Vec<Vec<f64>> {
    let (b1, b2, eps, wd) = (0.9f64, 0.999f64, 1e-8f64, 0.01f64);
    let n = p0.len();
    let mut p: Vec<Vec<f64>> = vec![p0.iter().map(|&x| x as f64).collect(); world];
    let mut m = vec![vec![0f64; n]; world];
    let mut v = vec![0f64; n];
    let mut comm_buffer = vec![vec![0f64; n]; world];
    let (mut var_interval, mut var_counter) = (1u64, 0u64);
    let (mut local_interval, mut local_counter) = (1u64, 0u64);
    let mut lrs = 0f64;
    for step in 0..steps {
        let t = step + 1;
        let eta = lr(step);
        if t <= var_freeze {
            let refresh = t % var_interval == 0;
            for i in 0..n {
                let gbar = (0..world).map(|r| grad(r, step, i) as f64).sum::<f64>() / world as f64;
                if refresh {
                    v[i] = b2 * v[i] + (1.0 - b2) * gbar * gbar;
                }
                for r in 0..world {
                    m[r][i] = b1 * m[r][i] + (1.0 - b1) * gbar;
                    let update = m[r][i] / (v[i].sqrt() + eps) + wd * p[r][i];
                    p[r][i] -= eta * update;
                }
            }
            if refresh {
                var_counter += 1;
                if var_counter == kappa {
                    var_counter = 0;
                    var_interval *= 2;
                }
            }
            continue;
        }
        lrs += eta;
        for r in 0..world {
            for i in 0..n {
                m[r][i] = b1 * m[r][i] + (1.0 - b1) * grad(r, step, i) as f64;
                let update = m[r][i] / (v[i].sqrt() + eps) + wd * p[r][i];
                p[r][i] -= eta * update;
                comm_buffer[r][i] -= eta * update;
            }
        }
        if t % local_interval == 0 {
            for i in 0..n {
                let den = v[i].sqrt() + eps;
                let avg = (0..world).map(|r| comm_buffer[r][i] * den).sum::<f64>() / world as f64;
                for r in 0..world {
                    p[r][i] -= comm_buffer[r][i];
                    m[r][i] = -avg / lrs;
                    p[r][i] += avg / den;
                    comm_buffer[r][i] = 0.0;
                }
            }
            lrs = 0.0;
        }
        local_counter += 1;
        if local_counter == local_scaler {
            local_counter = 0;
            local_interval = (local_interval * 2).min(clipper);
        }
    }
    p
}

#[test]
fn zeroone_adam_is_deepspeeds_step_with_exact_averages() {
    // κ = 2: variance refreshed at t = 1, 2, 4, 6, 8, 12 (the interval doubles every two
    // refreshes); frozen after t = 12; the
    // local interval doubles every 3 frozen steps up to 4: synchronisations at t = 13, 14,
    // 15, 16, 18, 20, 24, 28, 32, 36 (36 steps end at one, so the replicas agree).
    let (steps, schedule) = (36, (12, 2, 3, 4));
    let runs = drive(
        &[
            "train.optimizer=\"zeroone-adam\"",
            "train.var_freeze_step=12",
            "train.var_update_scaler=2",
            "train.local_step_scaler=3",
            "train.local_step_clipper=4",
        ],
        2,
        steps,
    );
    let want = zeroone_reference(&runs[0].0, 2, steps, schedule);
    for (r, (_, p)) in runs.iter().enumerate() {
        assert_close(p, &want[r], &format!("rank {r}"));
    }
    // Between two synchronisations the replicas differ (local steps happened).
    let mid = drive(
        &[
            "train.optimizer=\"zeroone-adam\"",
            "train.var_freeze_step=12",
            "train.var_update_scaler=2",
            "train.local_step_scaler=3",
            "train.local_step_clipper=4",
        ],
        2,
        34,
    );
    let want = zeroone_reference(&mid[0].0, 2, 34, schedule);
    assert_close(&mid[0].1, &want[0], "rank 0 between synchronisations");
    assert_close(&mid[1].1, &want[1], "rank 1 between synchronisations");
    assert!(
        mid[0].1 != mid[1].1,
        "local steps left the replicas identical"
    );
}

/// Rank-dependent gradients that are exactly zero on every third parameter.
fn holey(r: usize, step: u64, i: usize) -> f32 {
    if i.is_multiple_of(3) {
        0.0
    } else {
        grad(r, step, i)
    }
}

/// A coordinate whose gradient was zero through the dense steps has `v = 0`: the 1-bit
/// code hands back ± a scale there, and unmasked it would step by scale/ε. Masked, it stays
/// where it was (no weight decay here), and everything stays finite.
#[test]
fn coordinates_without_variance_do_not_move_after_the_freeze() {
    for sets in [
        vec!["train.optimizer=\"onebit-adam\"", "train.freeze_step=3"],
        vec![
            "train.optimizer=\"zeroone-adam\"",
            "train.var_freeze_step=6",
            "train.var_update_scaler=2",
        ],
    ] {
        let mut sets = sets;
        sets.push("train.weight_decay=0");
        for (r, (p0, p)) in drive_with(&sets, 2, 12, false, holey).iter().enumerate() {
            assert!(p.iter().all(|x| x.is_finite()), "{sets:?} rank {r}");
            for (i, (a, b)) in p0.iter().zip(p).enumerate() {
                if i % 3 == 0 {
                    assert_eq!(a, b, "{sets:?} rank {r}: parameter {i} moved");
                }
            }
            let moved = p0.iter().zip(p).filter(|(a, b)| a != b).count();
            assert!(moved > p.len() / 2, "{sets:?} rank {r}: only {moved} moved");
        }
    }
}

/// The compressed optimizers with the gradient on the device (`OnebitAdam::sync_device`,
/// `ZeroOneAdam::sync_device`; issue #51): their moments kept there, their exchanges
/// encoding their buckets there (the 1-bit code with DeepSpeed's RMS scale from exact sums,
/// through the compressed all-reduce), 0/1 Adam's local steps exchanging nothing, and the
/// direction written into the device buffer — every step's direction and the parameters
/// after it the host path's bit for bit, driven as the trainer drives them (the update,
/// then `after_update`: 0/1 Adam's rounds), with a step on the host between (the moments
/// come back) and a checkpoint's round trip (they go up again).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn compressed_optimizers_on_the_device_are_the_host_path_bit_for_bit() {
    let onebit = ["train.optimizer=\"onebit-adam\"", "train.freeze_step=3"];
    let zeroone = [
        "train.optimizer=\"zeroone-adam\"",
        "train.var_freeze_step=5",
        "train.var_update_scaler=2",
        "train.local_step_scaler=2",
        "train.local_step_clipper=2",
    ];
    for (opt, steps, host_step, restore_before) in [
        (&onebit[..], 9, 5, 7),
        // Variance phase (dense and 1-bit steps), then local steps and rounds; the host
        // step is a local one, the restore lands between two rounds.
        (&zeroone[..], 12, 7, 10),
    ] {
        let host = drive_on_device(opt, steps, None);
        let dev = drive_on_device(opt, steps, Some((host_step, restore_before)));
        for (rank, (h, d)) in host.iter().zip(&dev).enumerate() {
            for (step, (a, b)) in h.iter().zip(d).enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{}, rank {rank}, step {step}", opt[0]);
                assert_eq!(bits(&b.0), bits(&a.0), "{what}: the direction");
                assert_eq!(bits(&b.1), bits(&a.1), "{what}: the parameters");
                assert_eq!(a.0[3], 0.0, "{what}: the masked coordinate moved");
            }
        }
        // The steps differ from one another (the comparison can fail).
        assert_ne!(host[0][2].0, host[0][steps as usize - 1].0);
    }
}

/// Every rank's direction and parameters after each of `steps` steps of the compressed
/// optimizer of MODEL + `sets` (with the 1-bit code from exact sums) on two in-process
/// ranks; with `device = Some((host_step, restore_before))` the gradient is handed over on
/// the test device, but at step `host_step` (through the host), and before step
/// `restore_before` the state is saved and restored into a new synchronisation.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn drive_on_device(
    sets: &[&str],
    steps: u64,
    device: Option<(u64, u64)>,
) -> Vec<Vec<(Vec<f32>, Vec<f32>)>> {
    use crate::checkpoint::Checkpoint;
    use crate::exchange::DeviceGradient;

    let spec = std::env::var("DTRAIN_TEST_DEVICE").unwrap_or_else(|_| {
        if cfg!(feature = "wgpu") {
            "wgpu".into()
        } else {
            "cuda:0".into()
        }
    });
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.extend(
        [
            "compress.kind=\"ef-signsgd\"",
            "compress.scale=\"rms\"",
            "compress.sum=\"exact\"",
            "cluster.workers=2",
        ]
        .map(String::from),
    );
    let cfg = RunConfig::parse(MODEL, "t.toml", &sets).unwrap();
    let plan = cfg.validate("t.toml", None).unwrap();
    let handles: Vec<_> = channel_mesh(2)
        .into_iter()
        .map(|t| {
            let plan = plan.clone();
            let spec = spec.clone();
            std::thread::spawn(move || {
                let mut comm = Communicator::new(t, CommConfig::default());
                let rank = comm.rank();
                let mut model =
                    crate::trainer::build_model(&plan, &dtrain_models::cpu_device()).unwrap();
                let infos = crate::trainer::param_infos(model.as_ref());
                let n = model.table().num_params();
                let gpu = dtrain_device::Gpu::open(spec.parse().unwrap()).unwrap();
                let build = || {
                    let dense = Exchanger::new(
                        &infos,
                        &plan.buckets,
                        &dtrain_compress::baseline(),
                        &MemoryConfig::None,
                        plan.config.seed,
                    )
                    .unwrap();
                    let mut ex = crate::trainer::build_exchanger(&plan, &infos).unwrap();
                    if device.is_some() {
                        ex.set_codec_gpu(&gpu);
                        assert!(
                            ex.reads_device_gradient(),
                            "no bucket encoded on the device"
                        );
                    }
                    compressed_optimizer::<dtrain_comms::ChannelTransport>(
                        plan.compressed_optimizer.unwrap(),
                        Collectives::new(dense),
                        Collectives::new(ex),
                        n,
                        &plan,
                    )
                };
                let mut sync = build();
                assert_eq!(sync.reads_device_gradient(), device.is_some());
                let mut opt = plan.optimizer.build().unwrap();
                let mut record = StepRecord::default();
                let mut out = Vec::new();
                for step in 0..steps {
                    if device.is_some_and(|(_, r)| r == step) {
                        let mut ck = Checkpoint::new();
                        let keys = sync.save(&mut ck).unwrap();
                        sync = build();
                        sync.restore(&ck, &keys, step).unwrap();
                    }
                    let mut g: Vec<f32> = (0..n).map(|i| grad(rank, step, i)).collect();
                    // One coordinate never moves: its variance stays 0 and it is masked.
                    g[3] = 0.0;
                    let eta = lr(step);
                    let up = if device.is_some_and(|(h, _)| h != step) {
                        let on = DeviceGradient::new(gpu.clone(), gpu.upload(&g)).unwrap();
                        let mut scratch = vec![f32::NAN; n];
                        let up = sync
                            .sync_device(
                                &mut comm,
                                model.as_ref(),
                                &mut scratch,
                                &on,
                                true,
                                step,
                                eta,
                                &mut record,
                            )
                            .unwrap();
                        g = on.gpu().download(on.buffer()).unwrap();
                        up
                    } else {
                        sync.sync(&mut comm, model.as_ref(), &mut g, step, eta, &mut record)
                            .unwrap()
                    };
                    assert!(matches!(
                        up,
                        Update::Averaged { non_finite: false } | Update::Local
                    ));
                    opt.begin(0, n);
                    model.update_params(&mut |off, p| {
                        opt.apply(0, off, p, &g[off..off + p.len()], eta as f32)
                    });
                    let bad = sync
                        .after_update(&mut comm, model.as_mut(), step, &mut record)
                        .unwrap();
                    assert!(!bad);
                    let mut p = vec![0.0; n];
                    model.read_params(&mut p);
                    out.push((g, p));
                }
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}
