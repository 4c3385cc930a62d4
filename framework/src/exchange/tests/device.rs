//! The exchange with its buckets encoded on a device (`[compress] device`; issue #51, item 4:
//! "a 2-rank exchange on the device path giving the CPU path's mean"). On the device
//! `DTRAIN_TEST_DEVICE` names (default `wgpu`: Mesa's lavapipe in CI).
//!
//! Every rank's averaged gradient at every step, and the memories exported at the end, are
//! the host path's bit for bit — through the all-gather and the sparse all-reduce, with and
//! without overlap, for methods with each kind of device memory — and a checkpoint's state
//! moves between the two paths.

use super::*;

fn test_device() -> String {
    std::env::var("DTRAIN_TEST_DEVICE").unwrap_or_else(|_| {
        if cfg!(feature = "wgpu") {
            "wgpu".into()
        } else {
            "cuda:0".into()
        }
    })
}

/// `setup`'s exchanger, its buckets on the test device when `device`.
fn exchanger(setup: &Setup, device: bool) -> (Exchanger, Option<DeviceUse>) {
    let mut ex = setup.exchanger();
    let used = device.then(|| ex.set_codec_device(&test_device()).unwrap());
    (ex, used)
}

/// Steps `steps` on every rank, from the state `from` when given; each rank's trace and its
/// exchanger's state at the end.
fn run(
    setup: &Setup,
    world: usize,
    device: bool,
    steps: std::ops::Range<u64>,
    from: Option<&[ExchangerState]>,
) -> Vec<(Trace, ExchangerState)> {
    on_ranks(world, |rank, comm| {
        let (mut ex, _) = exchanger(setup, device);
        if let Some(states) = from {
            ex.import_state(states[rank].clone()).unwrap();
        }
        let trace = setup.steps(&mut ex, comm, rank, steps.clone());
        (trace, ex.export_state().unwrap())
    })
}

fn assert_same_runs(host: &[(Trace, ExchangerState)], dev: &[(Trace, ExchangerState)], what: &str) {
    for (rank, (h, d)) in host.iter().zip(dev).enumerate() {
        for (step, (a, b)) in h.0 .0.iter().zip(&d.0 .0).enumerate() {
            assert_same(b, a, format!("{what}: rank {rank}, step {step}"));
        }
        assert_eq!(h.0 .1.len(), d.0 .1.len());
        for (a, b) in h.0 .1.iter().zip(&d.0 .1) {
            assert_eq!(a.payload_bytes, b.payload_bytes, "{what}: payload bytes");
        }
        assert_eq!(
            h.1.memory.keys().collect::<Vec<_>>(),
            d.1.memory.keys().collect::<Vec<_>>()
        );
        for (k, m) in &h.1.memory {
            assert_same(
                &d.1.memory[k],
                m,
                format!("{what}: rank {rank}, memory of bucket {k}"),
            );
        }
        // The compressors' state (PowerSGD's warm-started Q, kept by its device codec).
        assert_eq!(
            h.1.compressors, d.1.compressors,
            "{what}: rank {rank}, compressor state"
        );
    }
}

#[test]
fn two_ranks_on_the_device_path_average_as_the_host_path() {
    let dgc = CompressorConfig::Dgc(DgcConfig {
        ratio: 0.05,
        warmup: Warmup::Exponential { epochs: 1 },
        min_sparse_len: 1000,
        steps_per_epoch: 4,
        ..DgcConfig::default()
    });
    for (method, gather, overlap) in [
        (dgc.clone(), GatherCollective::AllGather, true),
        (dgc.clone(), GatherCollective::SparseAllReduce, false),
        // Each owner's range encoded on the device, DGC's momentum memory learning from
        // them together; the owners' reduce on the host.
        (dgc, GatherCollective::CompressedAllReduce, true),
        (
            parse_method("topk:ratio=0.02").unwrap(),
            GatherCollective::CompressedAllReduce,
            false,
        ),
        (
            parse_method("topk:ratio=0.02").unwrap(),
            GatherCollective::AllGather,
            false,
        ),
        (
            parse_method("signsgd").unwrap(),
            GatherCollective::AllGather,
            true,
        ),
        (
            parse_method("fp16").unwrap(),
            GatherCollective::AllGather,
            true,
        ),
        // Signum's worker momentum (its default memory) kept on the device.
        (
            parse_method("signum").unwrap(),
            GatherCollective::AllGather,
            false,
        ),
        (
            parse_method("ef-signsgd:sum=exact").unwrap(),
            GatherCollective::AllGather,
            true,
        ),
        // PowerSGD's agreement on the device: P = M·Q there, all-reduced, Q_w there, the
        // summed payload decoded there; its residual learns from the mean, Q warm-starts.
        (
            parse_method("powersgd:rank=2").unwrap(),
            GatherCollective::AllGather,
            true,
        ),
        (
            parse_method("powersgd:rank=1,warm_start=false,bf16=true,start_step=2").unwrap(),
            GatherCollective::AllGather,
            false,
        ),
    ] {
        let what = format!("{} over {gather:?}", method.name());
        let mut setup = Setup::new(method);
        setup.gather = gather;
        setup.overlap = overlap;
        let (_, used) = exchanger(&setup, true);
        let used = used.unwrap();
        assert!(
            used.buckets > 0 && used.buckets == used.compressed,
            "{what}: {used}"
        );
        assert!(used.host_because.is_empty(), "{what}: {used}");
        let host = run(&setup, 2, false, 0..5, None);
        let dev = run(&setup, 2, true, 0..5, None);
        assert_same_runs(&host, &dev, &what);
        // A checkpoint of either path carries on in the other: the host's state on the
        // device, the device's on the host.
        let host_states: Vec<ExchangerState> = host.iter().map(|r| r.1.clone()).collect();
        let dev_states: Vec<ExchangerState> = dev.iter().map(|r| r.1.clone()).collect();
        let host_on = run(&setup, 2, false, 5..8, Some(&dev_states));
        let dev_on = run(&setup, 2, true, 5..8, Some(&host_states));
        assert_same_runs(&host_on, &dev_on, &format!("{what}, resumed"));
    }
}

/// A gradient that is on the device already (a GPU worker's, `Exchanger::exchange_device`):
/// the buckets with a device encoder are encoded from it where it lies, the others' ranges
/// are read back (the host buffer holds NaNs before, so a range the exchange took from the
/// host unread would show), and every rank's average and memory are the host path's bit for
/// bit.
#[test]
fn a_gradient_on_the_device_is_exchanged_where_it_lies_as_the_host_path() {
    for (spec, gather, overlap, mean_there) in [
        ("dgc:ratio=0.05", GatherCollective::AllGather, true, false),
        ("dgc:ratio=0.05", GatherCollective::AllGather, true, true),
        (
            "topk:ratio=0.02",
            GatherCollective::SparseAllReduce,
            false,
            false,
        ),
        (
            "topk:ratio=0.02",
            GatherCollective::SparseAllReduce,
            false,
            true,
        ),
        ("topk:ratio=0.02", GatherCollective::AllGather, false, true),
        ("signum", GatherCollective::AllGather, false, true),
        ("signsgd", GatherCollective::AllGather, false, true),
        ("fp16", GatherCollective::AllGather, true, false),
        ("fp16", GatherCollective::AllGather, true, true),
        (
            "topk:ratio=0.02",
            GatherCollective::CompressedAllReduce,
            false,
            false,
        ),
        (
            "topk:ratio=0.02",
            GatherCollective::CompressedAllReduce,
            true,
            true,
        ),
        ("powersgd:rank=2", GatherCollective::AllGather, true, false),
        ("powersgd:rank=2", GatherCollective::AllGather, false, true),
    ] {
        let what = format!(
            "{spec} over {gather:?}, the gradient on the device{}",
            if mean_there { ", the mean there" } else { "" }
        );
        let mut setup = Setup::new(parse_method(spec).unwrap());
        setup.gather = gather;
        setup.overlap = overlap;
        let host = run(&setup, 2, false, 0..4, None);
        let handed = on_ranks(2, |rank, comm| {
            let gpu = dtrain_device::Gpu::open(test_device().parse().unwrap()).unwrap();
            let mut ex = setup.exchanger();
            ex.set_codec_gpu(&gpu);
            assert!(ex.reads_device_gradient(), "{what}");
            let n = setup.n();
            let trace: Trace = (0..4)
                .map(|s| {
                    let g = grad(rank, n, s);
                    let on = DeviceGradient::new(gpu.clone(), gpu.upload(&g)).unwrap();
                    let mut out = vec![f32::NAN; n];
                    let st = ex
                        .exchange_device(comm, &mut out, &on, mean_there, s, false)
                        .unwrap();
                    if mean_there {
                        // The average is the device buffer's; the host holds only what
                        // it made.
                        assert_eq!(st.non_finite, Some(false), "{what}");
                        // Through the all-gather and the sparse all-reduce, and PowerSGD's
                        // agreement, the device buckets' averages never reached the host:
                        // their ranges there are still NaN.
                        let untouched = out.iter().filter(|v| v.is_nan()).count();
                        let gathers = parse_method(spec).unwrap().build().unwrap().aggregation()
                            == Aggregation::Gather;
                        let agrees = spec.starts_with("powersgd");
                        assert_eq!(
                            untouched > 0,
                            gathers || agrees,
                            "{what}: {untouched} host values left"
                        );
                        out = gpu.download(on.buffer()).unwrap();
                    }
                    (out, st)
                })
                .unzip();
            (trace, ex.export_state().unwrap())
        });
        assert_same_runs(&host, &handed, &what);
    }
    // A gradient of another length is refused before anything moves.
    let setup = Setup::new(parse_method("topk:ratio=0.02").unwrap());
    on_ranks(1, |_, comm| {
        let gpu = dtrain_device::Gpu::open(test_device().parse().unwrap()).unwrap();
        let mut ex = setup.exchanger();
        ex.set_codec_gpu(&gpu);
        let n = setup.n();
        let short = DeviceGradient::new(gpu.clone(), gpu.upload(&vec![0.0; n - 1])).unwrap();
        let e = ex
            .exchange_device(comm, &mut vec![0.0; n], &short, false, 0, false)
            .unwrap_err();
        assert!(matches!(e, ExchangeError::Length { .. }), "{e}");
    });
}

/// `‖a − b‖ / ‖b‖`.
fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}

/// FFT with residual error feedback on the device path: each rank encodes on the device
/// (the spectral residual kept there) and decodes the gathered payloads' mean there (the
/// summed spectra's inverse transforms). With the host's forward transform the payloads
/// and the residuals are the host path's bit for bit and every averaged gradient is the
/// host path's within 1e-5 (L2, relative: another inverse transform); with the device's
/// own transform within 1e-3 (a kept bin may differ where energies nearly tie). The ranks
/// agree bit for bit, and a checkpoint of either path carries on in the other.
#[test]
fn fft_on_the_device_path_averages_as_the_host_path_within_rounding() {
    for (spec, exact) in [
        ("fft:theta=0.8,chunk=512,transform=\"host\"", true),
        ("fft:transform=\"host\"", true),
        ("fft", false),
    ] {
        let mut setup = Setup::new(parse_method(spec).unwrap());
        setup.memory = MemoryConfig::RESIDUAL;
        let (_, used) = exchanger(&setup, true);
        let used = used.unwrap();
        assert!(
            used.buckets > 0 && used.buckets == used.compressed,
            "{spec}: {used}"
        );
        let tol = if exact { 1e-5 } else { 1e-3 };
        let check =
            |host: &[(Trace, ExchangerState)], dev: &[(Trace, ExchangerState)], what: &str| {
                let traces: Vec<Trace> = dev.iter().map(|r| r.0.clone()).collect();
                assert_ranks_agree(&traces, what);
                for (rank, (h, d)) in host.iter().zip(dev).enumerate() {
                    for (step, (a, b)) in h.0 .0.iter().zip(&d.0 .0).enumerate() {
                        let rel = relative_l2(b, a);
                        assert!(rel <= tol, "{what}: rank {rank}, step {step}: {rel:e}");
                    }
                    if exact {
                        for (k, m) in &h.1.memory {
                            assert_same(
                                &d.1.memory[k],
                                m,
                                format!("{what}: rank {rank}, memory {k}"),
                            );
                        }
                    }
                }
            };
        let host = run(&setup, 2, false, 0..5, None);
        let dev = run(&setup, 2, true, 0..5, None);
        check(&host, &dev, spec);
        let host_states: Vec<ExchangerState> = host.iter().map(|r| r.1.clone()).collect();
        let dev_states: Vec<ExchangerState> = dev.iter().map(|r| r.1.clone()).collect();
        let host_on = run(&setup, 2, false, 5..8, Some(&host_states));
        let dev_on = run(&setup, 2, true, 5..8, Some(&dev_states));
        let dev_from_host = run(&setup, 2, true, 5..8, Some(&host_states));
        check(&host_on, &dev_on, &format!("{spec}, resumed"));
        if exact {
            check(
                &host_on,
                &dev_from_host,
                &format!("{spec}, the host's state on the device"),
            );
        }
    }
}

#[test]
fn what_has_no_device_form_stays_on_the_host_and_says_why() {
    // QSGD has no device codec yet: every bucket on the host, the exchange unchanged.
    let setup = Setup::new(parse_method("qsgd").unwrap());
    let (_, used) = exchanger(&setup, true);
    let used = used.unwrap();
    assert_eq!(used.buckets, 0, "{used}");
    assert!(used.compressed > 0);
    assert!(used.to_string().contains("qsgd"), "{used}");
    let host = run(&setup, 2, false, 0..2, None);
    let dev = run(&setup, 2, true, 0..2, None);
    assert_same_runs(&host, &dev, "qsgd");
    // The compressed all-reduce encodes owners' ranges, which FFT's spectral residual (its
    // own, per bucket) cannot follow: on the host, said once.
    let mut setup = Setup::new(parse_method("fft").unwrap());
    setup.memory = MemoryConfig::RESIDUAL;
    setup.gather = GatherCollective::CompressedAllReduce;
    let (_, used) = exchanger(&setup, true);
    let used = used.unwrap();
    assert_eq!(used.buckets, 0, "{used}");
    assert_eq!(used.host_because.len(), 1, "{used}");
    assert!(used.to_string().contains("compressed all-reduce"), "{used}");
    // A device that does not exist is an error naming it.
    let e = setup.exchanger().set_codec_device("wgpu:7").unwrap_err();
    assert!(e.contains("wgpu:7"), "{e}");
}
