use super::*;
use crate::device::DeviceKind;
use crate::exchange::GatherCollective;
use dtrain_compress::{CompressorConfig, MemoryConfig};

const GOOD: &str = r#"
name = "t"
seed = 3
[model]
kind = "mlp"
[data]
kind = "synthetic"
shape = [1, 4, 4]
batch_size = 8
[train]
lr = 0.1
momentum = 0.9
[cluster]
workers = 2
[compress]
kind = "topk"
ratio = 0.1
bucket_mb = 1
"#;

fn parse(text: &str, sets: &[&str]) -> Result<Plan, ConfigError> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(text, "t.toml", &sets)?.validate("t.toml", Some(1000))
}

#[test]
fn a_good_config_validates_with_derived_values() {
    let p = parse(GOOD, &[]).unwrap();
    assert_eq!(p.steps_per_epoch, 1000 / 2 / 8);
    assert_eq!(p.total_steps, 62);
    assert_eq!(p.memory, MemoryConfig::RESIDUAL);
    assert_eq!(p.buckets.bucket_bytes, 1 << 20);
    assert_eq!(p.optimizer.momentum, 0.9);
}

#[test]
fn overrides_apply_before_validation() {
    let p = parse(
        GOOD,
        &["train.lr=0.5", "cluster.workers=4", "train.max_steps=3"],
    )
    .unwrap();
    assert_eq!(p.lr.lr, 0.5);
    assert_eq!(p.config.cluster.workers, 4);
    assert_eq!(p.total_steps, 3);
    let p = parse(GOOD, &["compress.kind=none", "compress.ratio=0.1"]);
    assert!(p.is_err(), "none has no ratio");
    let p = parse(GOOD, &["name=other"]).unwrap();
    assert_eq!(p.config.name, "other");
}

#[test]
fn the_transport_defaults_to_auto_and_every_kind_round_trips() {
    let p = parse(GOOD, &[]).unwrap();
    assert_eq!(p.config.cluster.transport, TransportKind::Auto);
    for k in ["auto", "tcp", "quic", "shm", "hybrid", "mpi"] {
        let p = parse(GOOD, &[&format!("cluster.transport=\"{k}\"")]).unwrap();
        assert_eq!(p.config.cluster.transport.to_string(), k);
        assert_eq!(
            k.parse::<TransportKind>().unwrap(),
            p.config.cluster.transport
        );
        // What the run directory's config.toml holds reads back the same.
        let again = RunConfig::parse(&p.config.to_toml(), "c.toml", &[]).unwrap();
        assert_eq!(again.cluster.transport, p.config.cluster.transport);
    }
    let e = parse(GOOD, &["cluster.transport=\"udp\""]).unwrap_err();
    assert!(e.to_string().contains("transport"), "{e}");
}

#[test]
fn tf32_is_allowed_by_default_and_a_refusal_survives_the_run_directory() {
    let p = parse(GOOD, &[]).unwrap();
    assert!(p.config.cluster.allow_tf32);
    // The default is left out of the run directory's config.toml; a refusal is written.
    assert!(!p.config.to_toml().contains("allow_tf32"));
    let off = parse(GOOD, &["cluster.allow_tf32=false"]).unwrap();
    assert!(!off.config.cluster.allow_tf32);
    let again = RunConfig::parse(&off.config.to_toml(), "c.toml", &[]).unwrap();
    assert!(!again.cluster.allow_tf32);
    let e = parse(GOOD, &["cluster.allow_tf32=\"no\""]).unwrap_err();
    assert!(e.to_string().contains("allow_tf32"), "{e}");
}

#[test]
fn errors_name_the_field() {
    let cases: &[(&[&str], &str)] = &[
        (&["train.lrr=0.1"], "train.lrr"),
        (&["train.lr=-1"], "train.lr"),
        (&["cluster.workers=0"], "cluster.workers"),
        (&["cluster.heartbeat_s=0"], "cluster.heartbeat_s"),
        (&["cluster.peer_timeout_s=1.5"], "cluster.peer_timeout_s"),
        (&["data.batch_size=1000"], "data.batch_size"),
        (&["compress.ratio=2.0"], "compress.ratio"),
        (&["compress.error_feedback=3"], "compress.error_feedback"),
        (&["data.seq_len=5"], "data.seq_len"),
        (&["train.lr_schedule=\"wavy\""], "train.lr_schedule"),
        (&["network.bandwidth=\"fast\""], "network.bandwidth"),
        (&["train.optimizer=\"adam\""], "train.momentum"),
        (&["cluster.device=\"tpu\""], "cluster.device"),
        (&["checkpoint.keep=0"], "checkpoint.keep"),
        (&["checkpoint.grace_s=0"], "checkpoint.grace_s"),
        (&["checkpoint.grace_s=nan"], "checkpoint.grace_s"),
        (&["checkpoint.grace=5"], "checkpoint.grace"),
    ];
    for (sets, field) in cases {
        let e = parse(GOOD, sets).unwrap_err();
        assert_eq!(e.file, "t.toml");
        assert!(e.field.starts_with(field), "{sets:?}: {e}");
    }
    // A GPU in a build without the `cuda` feature is refused at validation.
    let cuda = parse(GOOD, &["cluster.device=\"cuda:1\""]);
    if crate::device::CUDA_BUILT {
        assert_eq!(
            cuda.unwrap().config.cluster.device,
            DeviceKind::Cuda(Some(1))
        );
    } else {
        let e = cuda.unwrap_err();
        assert_eq!(e.field, "cluster.device");
        assert!(e.message.contains("--features cuda"), "{e}");
    }
    let wgpu = parse(GOOD, &["cluster.device=\"wgpu:cpu\""]);
    if crate::device::WGPU_TRAIN_BUILT {
        assert_eq!(
            wgpu.unwrap().config.cluster.device,
            DeviceKind::Wgpu(dtrain_models::wgpu::Adapter::Cpu)
        );
    } else {
        let e = wgpu.unwrap_err();
        assert_eq!(e.field, "cluster.device");
        assert!(e.message.contains("--features wgpu-train"), "{e}");
    }
    let e = parse("name = \"x\"\n[model]\nkind = \"mlp\"\n", &[]).unwrap_err();
    assert!(e.message.contains("data"), "{e}");
    let e = parse("name = 1", &[]).unwrap_err();
    assert!(e.to_string().starts_with("t.toml: "), "{e}");
}

#[test]
fn sweep_variants_replace_values_and_extend_the_name() {
    let text = format!(
        "{GOOD}\n[[sweep]]\nlabel = \"a\"\ncompress = {{ kind = \"topk\", ratio = 0.1 }}\n\
         [[sweep]]\nlabel = \"b\"\n\"cluster.workers\" = 3\n"
    );
    // The base ignores the sweep.
    let base = RunConfig::parse(&text, "t.toml", &[]).unwrap();
    assert_eq!(base.name, "t");
    let a = RunConfig::parse_variant(&text, "t.toml", Some("a"), &[]).unwrap();
    assert_eq!(a.name, "t-a");
    assert_eq!(
        a.compress.get("kind").and_then(|v| v.as_str()),
        Some("topk")
    );
    // The inline table replaced [compress] whole.
    assert_eq!(a.compress.len(), 2, "{:?}", a.compress);
    let b = RunConfig::parse_variant(&text, "t.toml", Some("b"), &["cluster.workers=5".into()])
        .unwrap();
    // --set applies after the variant.
    assert_eq!((b.name.as_str(), b.cluster.workers), ("t-b", 5));
    let b = RunConfig::parse_variant(&text, "t.toml", Some("b"), &[]).unwrap();
    assert_eq!(b.cluster.workers, 3);
    assert_eq!(b.compress, base.compress);
    let e = RunConfig::parse_variant(&text, "t.toml", Some("c"), &[]).unwrap_err();
    assert_eq!(e.field, "sweep");
    assert!(e.message.contains("a, b"), "{e}");
    // Resolved configs carry no sweep: they round-trip as plain configs.
    let again = RunConfig::parse(&a.to_toml(), "config.toml", &[]).unwrap();
    assert_eq!(again, a);
}

#[test]
fn bad_sweeps_name_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "[[sweep]]\ncompress = { kind = \"none\" }\n",
            "sweep[0].label",
        ),
        ("[[sweep]]\nlabel = \"x y\"\nseed = 1\n", "sweep[0].label"),
        (
            "[[sweep]]\nlabel = \"x\"\nseed = 1\n[[sweep]]\nlabel = \"x\"\nseed = 2\n",
            "sweep[1].label",
        ),
        ("[[sweep]]\nlabel = \"x\"\n", "sweep[0]"),
        ("sweep = 3\n", "sweep"),
    ];
    for (extra, field) in cases {
        let p = dir.path().join("s.toml");
        // `sweep = 3` must precede the tables to stay a top-level key.
        let text = if extra.starts_with("sweep =") {
            format!("{extra}{GOOD}")
        } else {
            format!("{GOOD}\n{extra}")
        };
        std::fs::write(&p, text).unwrap();
        let e = sweep_entries(&p).unwrap_err();
        assert_eq!(e.field, field, "{extra:?}: {e}");
    }
    let p = dir.path().join("plain.toml");
    std::fs::write(&p, GOOD).unwrap();
    assert!(sweep_entries(&p).unwrap().is_empty());
}

#[test]
fn compressed_allreduce_takes_quantizers_and_refuses_what_cannot_be_cut() {
    for kind in [
        "qsgd", "terngrad", "onebit", "signsgd", "natural", "fp16", "bf16", "topk",
    ] {
        let p = parse(
            GOOD,
            &[&format!(
                "compress={{ kind = \"{kind}\", collective = \"compressed-allreduce\" }}"
            )],
        )
        .unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(
            p.collective,
            GatherCollective::CompressedAllReduce,
            "{kind}"
        );
    }
    // Summable lanes are already all-reduced; two-phase methods agree on whole buffers;
    // meProp's columns needs whole matrices; a parameter server is not a collective.
    for (method, why) in [
        ("randomk", "summable"),
        ("powersgd", "summable"),
        ("scalecom", "summable"),
        ("columns", "whole"),
    ] {
        let e = parse(
            GOOD,
            &[&format!(
                "compress={{ kind = \"{method}\", collective = \"compressed-allreduce\" }}"
            )],
        )
        .unwrap_err();
        assert_eq!(e.field, "compress.collective", "{method}: {e}");
        assert!(e.message.contains(why), "{method}: {e}");
    }
    let e = parse(
        GOOD,
        &[
            "compress={ kind = \"qsgd\", collective = \"compressed-allreduce\" }",
            "cluster.mode=\"ps\"",
        ],
    )
    .unwrap_err();
    assert_eq!(e.field, "compress.collective", "{e}");
    // The server residual: explicit, for the compressed all-reduce only, not for votes.
    let car = |extra: &str| {
        parse(
            GOOD,
            &[&format!(
                "compress={{ collective = \"compressed-allreduce\", {extra} }}"
            )],
        )
    };
    let p = car("kind = \"onebit\", server_error_feedback = true").unwrap();
    assert_eq!(p.server_error_feedback, Some(true));
    assert_eq!(car("kind = \"qsgd\"").unwrap().server_error_feedback, None);
    for (extra, why) in [
        ("kind = \"signsgd\", server_error_feedback = true", "vote"),
        (
            "kind = \"qsgd\", server_error_feedback = 1",
            "true or false",
        ),
    ] {
        let e = car(extra).unwrap_err();
        assert_eq!(e.field, "compress.server_error_feedback", "{e}");
        assert!(e.message.contains(why), "{e}");
    }
    let e = parse(
        GOOD,
        &["compress={ kind = \"qsgd\", collective = \"allgather\", server_error_feedback = true }"],
    )
    .unwrap_err();
    assert!(e.message.contains("compressed-allreduce"), "{e}");
    // Under "auto" (the default) a bucket may take the compressed all-reduce: accepted.
    let p = parse(
        GOOD,
        &["compress={ kind = \"qsgd\", server_error_feedback = true }"],
    )
    .unwrap();
    assert_eq!(p.collective, crate::exchange::GatherCollective::Auto);
    assert_eq!(p.server_error_feedback, Some(true));
}

#[test]
fn sparse_allreduce_is_for_gathered_payloads_only() {
    let p = parse(
        GOOD,
        &[
            "compress.kind=\"topk\"",
            "compress.collective=\"sparse-allreduce\"",
        ],
    )
    .unwrap();
    assert_eq!(p.collective, GatherCollective::SparseAllReduce);
    // The default is the automatic choice per bucket (issue #22).
    let p = parse(GOOD, &["compress.kind=\"topk\""]).unwrap();
    assert_eq!(p.collective, GatherCollective::Auto);
    let e = parse(
        GOOD,
        &["compress={ kind = \"fp16\", collective = \"sparse-allreduce\" }"],
    )
    .unwrap_err();
    assert_eq!(e.field, "compress.collective", "{e}");
    let e = parse(GOOD, &["compress.collective=\"ring\""]).unwrap_err();
    assert_eq!(e.field, "compress.collective", "{e}");
}

#[test]
fn dgc_moves_momentum_into_the_memory_and_rejects_adam() {
    let p = parse(GOOD, &["compress.kind=dgc", "compress.ratio=0.01"]).unwrap();
    assert!(p.memory.owns_momentum());
    assert_eq!(p.optimizer.momentum, 0.0);
    let CompressorConfig::Dgc(d) = &p.method else {
        panic!()
    };
    assert_eq!(d.steps_per_epoch, p.steps_per_epoch);
    let e = parse(
        GOOD,
        &[
            "compress.kind=dgc",
            "compress.ratio=0.01",
            "train.optimizer=adam",
            "train.momentum=0",
        ],
    )
    .unwrap_err();
    assert_eq!(e.field, "train.optimizer");
}

#[test]
fn clip_norm_clips_the_average_or_becomes_dgcs_local_clipping() {
    use dtrain_compress::dgc::Clip;
    for bad in ["0", "-1", "nan"] {
        let e = parse(GOOD, &[&format!("train.clip_norm={bad}")]).unwrap_err();
        assert_eq!(e.field, "train.clip_norm", "{e}");
    }
    let p = parse(GOOD, &["train.clip_norm=5"]).unwrap();
    assert_eq!(p.clip_norm, Some(5.0));
    assert!(parse(GOOD, &[]).unwrap().clip_norm.is_none());
    // DGC: local clipping at clip_norm/√N inside the memory, not a second clip after.
    let p = parse(
        GOOD,
        &[
            "compress.kind=dgc",
            "train.clip_norm=5",
            "cluster.workers=4",
        ],
    )
    .unwrap();
    assert_eq!(p.clip_norm, None);
    let MemoryConfig::DgcMomentum { clip, .. } = p.memory else {
        panic!("{:?}", p.memory)
    };
    assert_eq!(
        clip,
        Clip::Norm {
            max_norm: 5.0,
            workers: 4
        }
    );
    // Both an explicit memory clip and clip_norm: ambiguous, refused.
    let mem = "compress.memory={kind=\"dgc-momentum\", clip={kind=\"value\", max=0.5}}";
    let e = parse(GOOD, &["compress.kind=dgc", "train.clip_norm=5", mem]).unwrap_err();
    assert_eq!(e.field, "train.clip_norm", "{e}");
    let p = parse(GOOD, &["compress.kind=dgc", mem]).unwrap();
    let MemoryConfig::DgcMomentum { clip, .. } = p.memory else {
        panic!()
    };
    assert_eq!(clip, Clip::Value { max: 0.5 });
}

#[test]
fn scalecom_gets_the_worker_count_and_memory_keys_are_checked() {
    let p = parse(GOOD, &["compress.kind=scalecom", "cluster.workers=3"]).unwrap();
    let CompressorConfig::ScaleCom(s) = &p.method else {
        panic!()
    };
    assert_eq!(s.workers, 3);
    let e = parse(
        GOOD,
        &[
            "compress.memory.kind=residual",
            "compress.error_feedback=true",
        ],
    )
    .unwrap_err();
    assert_eq!(e.field, "compress.error_feedback");
    let p = parse(GOOD, &["compress.error_feedback=false"]).unwrap();
    assert_eq!(p.memory, MemoryConfig::None);
}

#[test]
fn model_and_data_must_agree() {
    let e = parse(GOOD, &["data.kind=moby-dick", "data.shape=[]"]).unwrap_err();
    assert!(e.field.starts_with("data."), "{e}");
}

#[test]
fn live_membership_is_the_default_wherever_a_run_can_have_it() {
    let live = |sets: &[&str]| parse(GOOD, sets).unwrap().config.live_membership();
    assert!(live(&[]), "the default is live");
    assert!(live(&["cluster.transport=\"quic\""]));
    assert!(!live(&["cluster.membership=\"fixed\""]));
    // DiLoCo copies the state only before the steps that end a round, and none in the
    // every-step phase before `switch_step`: live by default; Streaming DiLoCo whose
    // exchanges block their step too.
    let diloco = ["sync.kind=\"diloco\"", "sync.period=4"];
    assert!(live(&diloco));
    assert!(live(&[diloco[0], diloco[1], "sync.switch_step=8"]));
    let streaming = [
        "sync.kind=\"streaming-diloco\"",
        "sync.period=4",
        "sync.in_flight=false",
    ];
    assert!(live(&streaming));
    // 0/1 Adam: its cut synchronisations run again, no copy kept.
    assert!(live(&[
        "train.optimizer=\"zeroone-adam\"",
        "train.momentum=0"
    ]));
    // An exchange in flight across steps cannot run live: the default is fixed there.
    assert!(!live(&[streaming[0], streaming[1]]));
    // Where it cannot run, the default is fixed; asked for, it is refused naming why.
    for set in ["cluster.mode=\"ps\"", "cluster.transport=\"mpi\""] {
        assert!(!live(&[set]), "{set}");
        let e = parse(GOOD, &[set, "cluster.membership=\"live\""]).unwrap_err();
        assert_eq!(e.field, "cluster.membership", "{set}: {e}");
    }
    // Under live membership the transports wait for the step deadline, not the peer
    // timeout, and keep accepting newcomers.
    let p = parse(GOOD, &["cluster.timeout_s=90"]).unwrap();
    let l = p.config.cluster.liveness(p.config.live_membership());
    assert!(l.accept_joiners);
    assert_eq!(l.peer_timeout.as_secs(), 90);
}
