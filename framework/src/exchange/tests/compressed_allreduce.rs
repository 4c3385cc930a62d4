//! The compressed all-reduce through the exchanger (`compress.collective =
//! "compressed-allreduce"`): the owners' re-encoded sums, agreement, overlap and resume for
//! every method it takes, server residuals, bytes.

use super::*;

/// The methods the compressed all-reduce takes, among [`all_kinds`].
pub(super) fn chunkable_kinds() -> Vec<CompressorConfig> {
    all_kinds()
        .into_iter()
        .filter(|m| {
            !m.passthrough()
                && m.check(&dtrain_compress::RunUse {
                    collective: Collective::CompressedAllReduce,
                    parameter_server: false,
                    memory: &m.default_memory(),
                })
                .is_ok()
        })
        .collect()
}

#[test]
fn compressed_all_reduce_is_the_owners_re_encoded_sums() {
    // One bucket of two layers on three ranks, 1-bit SGD with residual error feedback on
    // both sides (deterministic: no RNG): computed by hand with pipelines, bit for bit,
    // over two steps so both residuals matter.
    let mut setup = Setup::new(parse_method("onebit").unwrap());
    setup.params = shapes(&[vec![40, 25], vec![300]]);
    setup.policy = BucketPolicy {
        bucket_bytes: 1 << 20,
        ..BucketPolicy::default()
    };
    setup.gather = GatherCollective::CompressedAllReduce;
    // 1-bit SGD's owners keep no residual by default (`owner_error_feedback`): ask for one.
    setup.server_ef = Some(true);
    assert_eq!(setup.memory, MemoryConfig::RESIDUAL);
    let (world, n) = (3usize, setup.n());
    let layers = [0..1000, 1000..1300];
    let res = setup.run(world, 2);
    assert_ranks_agree(&res, "onebit");

    let method = parse_method("onebit").unwrap();
    let pipe = || {
        Pipeline::new(
            method.build().unwrap(),
            MemoryConfig::RESIDUAL.build().unwrap(),
        )
    };
    let mut workers: Vec<Pipeline> = (0..world).map(|_| pipe()).collect();
    let mut owners: Vec<Pipeline> = (0..world).map(|_| pipe()).collect();
    let ranges: Vec<_> = (0..world)
        .map(|q| dtrain_comms::segment_range(n, world, q))
        .collect();
    for step in 0..2u64 {
        let shares: Vec<Vec<Payload>> = (0..world)
            .map(|r| {
                let ctx = Ctx {
                    step,
                    rank: r as u32,
                    bucket: 0,
                    segments: &layers,
                };
                let mut out = Vec::new();
                workers[r]
                    .compress_chunks(
                        &grad(r, n, step),
                        &ctx,
                        &ranges,
                        &mut Rng::seed_from_u64(0),
                        &mut out,
                    )
                    .unwrap();
                out
            })
            .collect();
        let mut want = vec![0.0f32; n];
        for q in 0..world {
            let mut segs = Vec::new();
            dtrain_compress::chunk_segments(&layers, ranges[q].clone(), &mut segs);
            let ctx = Ctx {
                step,
                rank: q as u32,
                bucket: 0,
                segments: &segs,
            };
            let views: Vec<&[u8]> = (0..world).map(|r| shares[r][q].as_bytes()).collect();
            let mut sum = Payload::new();
            owners[q]
                .reduce_shares(
                    &views,
                    ranges[q].len(),
                    &ctx,
                    &mut Rng::seed_from_u64(0),
                    &mut sum,
                )
                .unwrap();
            owners[q]
                .decompress_add(sum.as_bytes(), &mut want[ranges[q].clone()])
                .unwrap();
        }
        want.iter_mut().for_each(|v| *v *= 1.0 / world as f32);
        assert_same(&res[0].0[step as usize], &want, format!("step {step}"));
    }
}

#[test]
fn compressed_all_reduce_agrees_overlaps_and_resumes_for_every_method_it_takes() {
    let kinds = chunkable_kinds();
    let names: Vec<&str> = kinds.iter().map(|m| m.name()).collect();
    for must in [
        "qsgd", "terngrad", "onebit", "signsgd", "natural", "fp16", "bf16", "topk",
    ] {
        assert!(names.contains(&must), "{must} not among {names:?}");
    }
    for method in kinds {
        let name = method.name();
        let mut setup = Setup::new(method);
        setup.gather = GatherCollective::CompressedAllReduce;
        let with = setup.run(3, 3);
        assert_ranks_agree(&with, name);
        setup.overlap = false;
        let sequential = setup.run(3, 3);
        for s in 0..3 {
            assert_same(
                &sequential[0].0[s],
                &with[0].0[s],
                format!("{name}: overlap, step {s}"),
            );
        }
        setup.overlap = true;
        // Resume: worker and server residuals (and compressor state) carry the run on.
        let res = resume(&setup, 3, 2, |_, _| {});
        for (r, [straight, resumed, _]) in res.iter().enumerate() {
            for (s, (a, b)) in straight.iter().zip(resumed).enumerate() {
                assert_same(a, b, format!("{name}: rank {r}, step k+{s}"));
            }
        }
    }
}

#[test]
fn compressed_all_reduce_server_residuals_are_in_the_state_and_must_fit() {
    let mut setup = Setup::new(parse_method("onebit").unwrap());
    setup.gather = GatherCollective::CompressedAllReduce;
    setup.server_ef = Some(true);
    let states = on_ranks(2, |rank, comm| {
        let mut ex = setup.exchanger();
        setup.steps(&mut ex, comm, rank, 0..1);
        ex.export_state().unwrap()
    });
    let compressed = setup.exchanger().buckets().filter(|b| b.compressed).count();
    assert_eq!(states[0].server_memory.len(), compressed);
    assert!(states[0]
        .server_memory
        .values()
        .flatten()
        .any(|&v| v != 0.0));
    // A state taken at two ranks imports (lengths are checked at the first exchange)...
    let mut ex = setup.exchanger();
    ex.import_state(states[0].clone()).unwrap();
    assert_eq!(
        ex.export_state().unwrap(),
        states[0],
        "kept until the owners are built"
    );
    // ...and refuses at three, naming the bucket and the worker counts.
    let errs = on_ranks(3, |rank, comm| {
        let mut ex = setup.exchanger();
        ex.import_state(states[0].clone()).unwrap();
        let mut g = grad(rank, setup.n(), 1);
        ex.exchange(comm, &mut g, 1)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    });
    for e in &errs {
        assert!(
            e.contains("server residual of bucket") && e.contains("3 workers"),
            "{e}"
        );
    }
    // A server residual for a bucket that is not compressed is refused at import.
    let mut bad = states[0].clone();
    let dense = setup
        .exchanger()
        .buckets()
        .find(|b| !b.compressed)
        .unwrap()
        .id;
    bad.server_memory.insert(dense, vec![0.0; 3]);
    assert!(setup.exchanger().import_state(bad).is_err());
}

#[test]
fn owners_keep_a_residual_by_default_under_error_feedback_except_for_sign_quantizers() {
    let residual_values = |method: &str, memory: MemoryConfig, server_ef: Option<bool>| {
        let mut setup = Setup::new(parse_method(method).unwrap());
        setup.memory = memory;
        setup.gather = GatherCollective::CompressedAllReduce;
        setup.server_ef = server_ef;
        let states = on_ranks(2, |rank, comm| {
            let mut ex = setup.exchanger();
            setup.steps(&mut ex, comm, rank, 0..1);
            ex.export_state().unwrap()
        });
        states[0]
            .server_memory
            .values()
            .map(Vec::len)
            .sum::<usize>()
    };
    let ef = MemoryConfig::RESIDUAL;
    assert!(residual_values("natural", ef, None) > 0);
    assert!(residual_values("topk:ratio=0.05", ef, None) > 0);
    assert_eq!(residual_values("natural", MemoryConfig::None, None), 0);
    assert_eq!(residual_values("onebit", ef, None), 0);
    assert_eq!(residual_values("ef-signsgd", ef, None), 0);
    assert!(residual_values("onebit", ef, Some(true)) > 0);
    assert_eq!(residual_values("natural", ef, Some(false)), 0);
    assert!(residual_values("qsgd", MemoryConfig::None, Some(true)) > 0);
    // A vote re-encodes the plain sum, whatever is asked.
    assert_eq!(residual_values("signsgd", ef, Some(true)), 0);
}

#[test]
fn compressed_all_reduce_sends_about_two_payloads_whatever_the_worker_count() {
    // QSGD (4 bits): per-worker bytes at P = 6 stay within 10 % of P = 2's (the all-gather's
    // grow with P − 1: 5× from P = 2 to 6), and the payload bytes are the shares plus the
    // owner's re-encoded sum.
    let sent = |world: usize, gather: GatherCollective| -> u64 {
        let mut setup = Setup::new(parse_method("qsgd:levels=7").unwrap());
        setup.params = shapes(&[vec![300, 200]]);
        setup.policy = policy(1 << 20);
        setup.gather = gather;
        let res = setup.run(world, 1);
        res.iter().map(|t| t.1[0].bytes_sent).max().unwrap()
    };
    let (car2, car6) = (
        sent(2, GatherCollective::CompressedAllReduce),
        sent(6, GatherCollective::CompressedAllReduce),
    );
    let (ag2, ag6) = (
        sent(2, GatherCollective::AllGather),
        sent(6, GatherCollective::AllGather),
    );
    assert!(ag6 > 4 * ag2, "all-gather: {ag2} -> {ag6}");
    assert!(
        car6 <= ag2 * 22 / 10,
        "compressed all-reduce at P = 6: {car6}, one payload {ag2}"
    );
    assert!(
        car6 * 10 <= car2 * 17,
        "compressed all-reduce: {car2} -> {car6}"
    );
}
