//! `dtrain bench …` and the hidden `dtrain bench-worker`: argument tables and the calls
//! into `dtrain_framework::bench`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use dtrain_framework::bench::{self, gradient::Shape};

#[derive(Subcommand, Debug)]
pub(crate) enum BenchCommand {
    /// Compression throughput, bits per element and relative error of every method.
    Compress(CompressArgs),
    /// Collective bandwidth over N local worker processes (nccl-tests-style table).
    Allreduce(AllreduceArgs),
    /// Training-step time of each model (forward, backward) on the CPU or a GPU; with
    /// `--reference cpu`, the same step on the CPU from the same weights and batch, timed
    /// beside it and compared (relative error of the loss and the gradients).
    Models(ModelsArgs),
}

/// `--tf32-emulation`: when the reference step also runs with TF32 emulated.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tf32Emulation {
    /// When the device turns out to multiply in TF32.
    Auto,
    /// Always (needs --reference).
    On,
    /// Never.
    Off,
}

#[derive(Args, Debug)]
pub(crate) struct ModelsArgs {
    /// Models, `kind/variant` or `kind/variant:key=value;key=value` (comma-separated, or
    /// repeated). Default: one per family (mlp/mnist, lenet/lenet5, alexnet/cifar,
    /// vgg/vgg11, resnet/resnet20, lstm/word, gpt/mini).
    #[arg(long, value_delimiter = ' ', num_args = 1..)]
    models: Vec<String>,
    /// The device measured: cpu, cuda, cuda:N, wgpu, wgpu:N, wgpu:cpu.
    #[arg(long, default_value = "cpu")]
    device: dtrain_framework::device::DeviceKind,
    /// Also run each step here from the same weights and batch (dropout off), and fail when
    /// the loss or the gradients differ by more than --tolerance (relative).
    #[arg(long)]
    reference: Option<dtrain_framework::device::DeviceKind>,
    /// Largest relative error that passes the comparison.
    #[arg(long, default_value_t = 1e-3)]
    tolerance: f64,
    /// When the device turns out to multiply f32 matrices in TF32 (burn's CUDA backend on
    /// tensor-core GPUs; measured before the models run), the tolerance of the families
    /// whose products the CPU's TF32 emulation does not cover (the LSTM, the GPT). The
    /// others pass within --tf32-factor times the emulated reference's error.
    #[arg(long)]
    tf32_tolerance: Option<f64>,
    /// Also run the reference step with TF32 emulated on the CPU (every product's operands
    /// converted to TF32: rounded, then truncated): auto (when the device multiplies in
    /// TF32), on, or off.
    #[arg(long, value_enum, default_value_t = Tf32Emulation::Auto)]
    tf32_emulation: Tf32Emulation,
    /// On a TF32 device, a family the emulation covers passes within this many times the
    /// emulated references' larger error (and always within --tolerance).
    #[arg(long, default_value_t = 2.0)]
    tf32_factor: f64,
    /// Whether the device may multiply f32 matrices in TF32 where it has the type
    /// (`cluster.allow_tf32`): true (burn's behaviour) or false (f32 throughout; the
    /// comparison then holds every model to --tolerance).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    allow_tf32: bool,
    /// On a device that multiplies in f32, a model passes within this many times the change
    /// one rounding of its weights (each times 1 ± 2^-24) makes to the reference's step,
    /// where that is above --tolerance (ResNet-20 amplifies rounding ~10^4-fold); 0 turns it
    /// off.
    #[arg(long, default_value_t = 4.0)]
    perturb_factor: f64,
    /// Examples per batch (default: 32 images, or 20 sequences).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence for language models.
    #[arg(long, default_value_t = 35)]
    seq_len: usize,
    /// Untimed steps first (the first step, with any kernel compilation, counts as one).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Seed of the synthetic batch and of the initial weights.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the results as JSON to this file (the table is still printed).
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
}

/// Options shared by the `bench allreduce` launcher and its workers.
#[derive(Args, Debug)]
pub(crate) struct CollectiveArgs {
    /// Transport: tcp, quic, shm, hybrid (shared memory among the ranks of one host, TCP
    /// between hosts), or mpi (dtrain's ring over MPI point-to-point under
    /// mpirun; needs the `mpi` feature; native `MPI_Allreduce` is compared side by side by
    /// the comms example `mpi_allreduce`).
    #[arg(long, default_value = "tcp")]
    transport: bench::allreduce::TransportKind,
    /// Collective: allreduce, allgather or broadcast.
    #[arg(long, default_value = "allreduce")]
    op: bench::allreduce::Op,
    /// Sizes in bytes: `1K..256M` (powers of two) or a list `1K,64M`.
    #[arg(long, default_value = "1K..64M")]
    sizes: String,
    /// Emulated egress bandwidth per worker, e.g. 1Gbit.
    #[arg(long)]
    bandwidth: Option<String>,
    /// Emulated one-way latency per worker, e.g. 100us.
    #[arg(long)]
    latency: Option<String>,
    /// Timed calls per size (0: chosen by size).
    #[arg(long, default_value_t = 0)]
    iters: usize,
    /// Untimed calls per size before timing.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Time one layer's whole compressed exchange per method instead of the bare
    /// collective (Dryden et al.'s layer-size benchmark): comma-separated or repeated,
    /// `name` or `name:key=value;key=value`, e.g. `--compress none,onebit,adaptive-threshold`.
    /// Speed-ups are against `none` at the same size.
    #[arg(long)]
    compress: Vec<String>,
    /// How the --compress methods' payloads travel: auto (the default: the trainer's choice
    /// per layer, by the α–β model on this link), or forced: allgather, sparse-allreduce or
    /// compressed-allreduce (each row prints the collective it took).
    #[arg(long)]
    collective: Option<dtrain_framework::exchange::GatherCollective>,
}

#[derive(Args, Debug)]
pub(crate) struct AllreduceArgs {
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[command(flatten)]
    common: CollectiveArgs,
    /// Limit for the whole run, in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct WorkerArgs {
    /// Rendezvous address (host:port).
    #[arg(long)]
    rendezvous: std::net::SocketAddr,
    /// This rank.
    #[arg(long)]
    rank: usize,
    /// Number of ranks.
    #[arg(long)]
    world: usize,
    #[command(flatten)]
    common: CollectiveArgs,
}

pub(crate) fn collective_options(
    c: &CollectiveArgs,
    workers: usize,
    timeout: u64,
) -> Result<bench::allreduce::Options> {
    Ok(bench::allreduce::Options {
        transport: c.transport,
        workers,
        sizes: bench::allreduce::parse_sizes(&c.sizes).map_err(anyhow::Error::msg)?,
        op: c.op,
        bandwidth: c.bandwidth.clone(),
        latency: c.latency.clone(),
        iters: c.iters,
        warmup: c.warmup,
        timeout: std::time::Duration::from_secs(timeout),
        methods: c.compress.iter().flat_map(|m| split_methods(m)).collect(),
        collective: c.collective,
    })
}

pub(crate) fn bench_allreduce(a: AllreduceArgs) -> Result<()> {
    let opts = collective_options(&a.common, a.workers, a.timeout)?;
    let exe = std::env::current_exe().context("locating the dtrain executable")?;
    let rows =
        bench::allreduce::launch(&opts, &exe, &["bench-worker"]).map_err(anyhow::Error::msg)?;
    if a.json {
        let doc = serde_json::json!({
            "op": opts.op,
            "transport": opts.transport,
            "workers": opts.workers,
            "bandwidth": opts.bandwidth,
            "latency": opts.latency,
            "methods": opts.methods,
            "collective": opts.collective.map(|c| c.name()),
            "provenance": measured_now(),
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", bench::allreduce::table(&opts, &rows));
    }
    Ok(())
}

pub(crate) fn bench_worker(a: WorkerArgs) -> Result<()> {
    let opts = collective_options(&a.common, a.world, 0)?;
    let w = bench::allreduce::WorkerArgs {
        rendezvous: a.rendezvous,
        rank: a.rank,
        world: a.world,
        opts,
    };
    bench::allreduce::worker(&w).map_err(|e| anyhow::anyhow!("rank {}: {e}", a.rank))
}

#[derive(Args, Debug)]
pub(crate) struct CompressArgs {
    /// Elements in the synthetic input vector.
    #[arg(long, default_value_t = 4 << 20)]
    elems: usize,
    /// Methods to run (comma-separated, or repeated): `name` or `name:key=value;key=value`.
    /// Default: every registered method with default parameters.
    #[arg(long, value_delimiter = ' ', num_args = 1..)]
    methods: Vec<String>,
    /// Synthetic input: layered (realistic gradient-like), smooth, gaussian.
    #[arg(long, default_value = "layered")]
    input: Shape,
    /// Read the input from a raw little-endian f32 file instead (e.g. a dumped layer gradient).
    #[arg(long)]
    from: Option<PathBuf>,
    /// Use per-layer segments of the layered input (per-tensor statistics).
    #[arg(long)]
    per_layer: bool,
    /// Treat the input as one ROWSxCOLS matrix (PowerSGD, columns), e.g. 1024x1024.
    #[arg(long, value_parser = parse_shape)]
    shape: Option<(usize, usize)>,
    /// Compress the input this many times, stateful methods keeping their state (PowerSGD's
    /// warm-started Q), and report the last round's error; 0: the timed repetitions.
    #[arg(long, default_value_t = 0)]
    rounds: usize,
    /// Timed repetitions per phase; the best is reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// The input is this model's gradient layout (as `bench models` names models, e.g.
    /// `alexnet/cifar`): one segment per parameter tensor, with its shape; sets the size
    /// (`--elems` is ignored).
    #[arg(long, conflicts_with_all = ["per_layer", "shape", "from"])]
    model: Option<String>,
    /// Compress through residual error feedback, as `compress.error_feedback = true` trains:
    /// the compress time includes compensating the gradient and updating the residual.
    #[arg(long)]
    error_feedback: bool,
    /// Decompression decodes this many payloads into their sum, an all-gather receiver's
    /// work at this many workers (with the method's joint decoder where it has one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    workers: u64,
    /// Threads the methods may use (the FFT method encodes its tensors side by side); 1 is
    /// the single-thread figure.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    threads: u64,
    /// Run the device codecs on this device (`wgpu`, `wgpu:N`, `wgpu:cpu`, `cuda`, `cuda:N`)
    /// beside the host codecs; methods without a device codec run on the host and say so.
    /// Needs a dtrain built with `--features wgpu` or `--features cuda`.
    #[arg(long)]
    device: Option<String>,
    /// With --device: check every device payload against the host codec's (bytes equal)
    /// and the device decoder against the host decoder; exits non-zero on a mismatch.
    #[arg(long, requires = "device")]
    verify: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn bench_compress(a: CompressArgs) -> Result<()> {
    let methods: Vec<String> = a.methods.iter().flat_map(|m| split_methods(m)).collect();
    let layers = match &a.model {
        Some(m) => Some(bench::compress::model_layers(m).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let elems = match &layers {
        Some(l) => bench::compress::elements(l),
        None => a.elems,
    };
    let opts = bench::compress::Options {
        methods,
        repeat: a.repeat,
        per_layer: a.per_layer,
        shape: a.shape,
        rounds: a.rounds,
        layers,
        error_feedback: a.error_feedback,
        workers: a.workers as usize,
        threads: a.threads as usize,
    };
    let (input, mut source) = match &a.from {
        Some(p) => (
            bench::gradient::read_f32_file(p).map_err(anyhow::Error::msg)?,
            p.display().to_string(),
        ),
        None => (
            bench::gradient::synthesize(a.input, elems, 42),
            format!("{:?}", a.input).to_lowercase(),
        ),
    };
    if let (Some(m), Some(l)) = (&a.model, &opts.layers) {
        source = format!("{source}, {}'s {} tensors", m, l.len());
    }
    if a.error_feedback {
        source.push_str(", error feedback");
    }
    if a.workers > 1 {
        source.push_str(&format!(", decoding {} payloads", a.workers));
    }
    if let Some(device) = &a.device {
        return bench_compress_device(&a, device, &input, &opts, &source);
    }
    let rows = bench::compress::run(&input, &opts).map_err(anyhow::Error::msg)?;
    if a.json {
        let doc = serde_json::json!({
            "input": source,
            "elements": input.len(),
            "model": a.model,
            "error_feedback": a.error_feedback,
            "workers": a.workers,
            "threads": a.threads,
            "provenance": measured_now(),
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "dtrain bench compress: {} elements ({source}), {}, best of {}",
            input.len(),
            match a.threads {
                1 => "single thread".to_string(),
                t => format!("{t} threads"),
            },
            a.repeat.max(1)
        );
        println!("measured at {}", measured_now().line());
        print!("{}", bench::compress::table(&rows));
    }
    Ok(())
}

/// `bench compress --device`: the device codecs beside the host's, verified on request.
fn bench_compress_device(
    a: &CompressArgs,
    device: &str,
    input: &[f32],
    opts: &bench::compress::Options,
    source: &str,
) -> Result<()> {
    let bench::compress_device::DeviceBench {
        device: name,
        copy_gbps,
        rows,
    } = bench::compress_device::run(input, opts, device, a.verify).map_err(anyhow::Error::msg)?;
    if a.json {
        let doc = serde_json::json!({
            "input": source,
            "elements": input.len(),
            "device": name,
            "device_copy_gbps": copy_gbps,
            "verify": a.verify,
            "provenance": measured_now(),
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "dtrain bench compress: {} elements ({source}) on {name}, host columns on {}, \
             best of {}",
            input.len(),
            match a.threads {
                1 => "one thread".to_string(),
                t => format!("{t} threads"),
            },
            a.repeat.max(1)
        );
        println!("measured at {}", measured_now().line());
        println!(
            "device memory: one copy kernel over the input moves {copy_gbps:.2} GB/s (read + \
             write); in the codecs' unit, f32 input per second, {:.2} GB/s",
            copy_gbps / 2.0
        );
        print!("{}", bench::compress_device::table(&rows));
    }
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| r.failed())
        .map(|r| r.method.as_str())
        .collect();
    if !failed.is_empty() {
        bail!(
            "bench compress --verify: the device differs from the host for {}",
            failed.join(", ")
        );
    }
    Ok(())
}

pub(crate) fn bench_models(a: ModelsArgs) -> Result<()> {
    if !(a.tf32_factor.is_finite() && a.tf32_factor > 0.0) {
        bail!(
            "--tf32-factor must be a positive number, not {}",
            a.tf32_factor
        );
    }
    if !(a.perturb_factor.is_finite() && a.perturb_factor >= 0.0) {
        bail!(
            "--perturb-factor must be 0 or a positive number, not {}",
            a.perturb_factor
        );
    }
    if a.tf32_emulation == Tf32Emulation::On && a.reference.is_none() {
        bail!("--tf32-emulation on runs the reference step again: it needs --reference cpu");
    }
    let models: Vec<String> = a.models.iter().flat_map(|m| split_methods(m)).collect();
    let opts = bench::models::Options {
        models,
        device: a.device,
        reference: a.reference,
        batch: a.batch,
        seq_len: a.seq_len,
        warmup: a.warmup,
        steps: a.steps,
        tolerance: a.tolerance,
        tf32_tolerance: a.tf32_tolerance,
        tf32_emulation: match a.tf32_emulation {
            Tf32Emulation::Auto => None,
            Tf32Emulation::On => Some(true),
            Tf32Emulation::Off => Some(false),
        },
        tf32_factor: a.tf32_factor,
        seed: a.seed,
        perturb_factor: a.perturb_factor,
        allow_tf32: a.allow_tf32,
    };
    if !a.json {
        let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
        println!(
            "dtrain bench models: one training step (forward + loss, backward + flat gradients; \
             no optimizer), median of {} after {} warm-up, CPU threads: {threads}",
            a.steps.max(1),
            a.warmup
        );
        if a.reference.is_none() {
            print!("{}", bench::models::table_header(false));
        }
    }
    let (mut saved, mut save_error) = (Vec::new(), None::<String>);
    let rows = bench::models::run(
        &opts,
        |p| {
            if !a.json {
                let tolerance = if p.tf32 {
                    format!(
                        "the emulated references' larger error x {} (at least {}), {} where the \
                         emulation covers only some products (*)",
                        a.tf32_factor,
                        a.tolerance,
                        a.tf32_tolerance.unwrap_or(a.tolerance)
                    )
                } else if a.perturb_factor > 0.0 {
                    format!(
                        "{} or, where larger, {} x what one rounding of the weights does to \
                         the reference's step",
                        a.tolerance, a.perturb_factor
                    )
                } else {
                    a.tolerance.to_string()
                };
                println!(
                    "f32 matmul 512x512x512 on {} against {}: relative error {:.1e} ({}); \
                     tolerance {tolerance}",
                    a.device,
                    a.reference.map(|r| r.to_string()).unwrap_or_default(),
                    p.matmul_rel_err,
                    if p.tf32 {
                        "TF32 tensor cores"
                    } else {
                        "f32 arithmetic"
                    },
                );
                print!("{}", bench::models::table_header(true));
            }
        },
        |r| {
            if !a.json {
                print!("{}", bench::models::table_row(r));
            }
            // Rewritten after every model, so that a run stopped by a time limit keeps the
            // models it measured (a GPU's first steps can take minutes each).
            if let Some(path) = &a.save {
                saved.push(r.clone());
                let written = serde_json::to_string_pretty(&saved)
                    .map_err(|e| e.to_string())
                    .and_then(|text| std::fs::write(path, text).map_err(|e| e.to_string()));
                if let Err(e) = written {
                    save_error.get_or_insert(format!("writing {}: {e}", path.display()));
                }
            }
        },
    )
    .map_err(anyhow::Error::msg)?;
    if let Some(e) = save_error {
        bail!(e);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    let failed: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            let c = r.check.as_ref().filter(|c| !c.passed)?;
            Some(format!(
                "{} (loss {:.1e}, gradients {:.1e}; tolerance {})",
                r.model, c.loss_rel_err, c.grad_rel_err, c.tolerance
            ))
        })
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} of {} models differ from the reference by more than the tolerance: {}",
            failed.len(),
            rows.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// `ROWSxCOLS`, both at least 1.
pub(crate) fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    let (r, c) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("{s:?}: expected ROWSxCOLS, e.g. 1024x1024"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{s:?}: {v:?} is not a positive integer"))
    };
    Ok((num(r)?, num(c)?))
}

/// Splits `a,b:x=1;y=2,c` into methods; inside a method, `;` separates parameters. Commas
/// inside brackets or quotes stay in their value (`mlp/mnist:hidden=[2048,1024]`).
pub(crate) fn split_methods(s: &str) -> Vec<String> {
    bench::split_top_level(s, ',')
        .into_iter()
        .filter(|m| !m.trim().is_empty())
        .map(|m| m.trim().replace(';', ","))
        .collect()
}

/// The build and machine a bench figure comes from (its JSON's `provenance`).
fn measured_now() -> dtrain_framework::provenance::Provenance {
    dtrain_framework::provenance::provenance(std::time::SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_split_at_commas_outside_arrays() {
        assert_eq!(
            split_methods(
                "none, qsgd:levels=7;bucket=512,mlp/mnist:hidden=[2048,1024];image_size=32"
            ),
            vec![
                "none",
                "qsgd:levels=7,bucket=512",
                "mlp/mnist:hidden=[2048,1024],image_size=32"
            ]
        );
        assert!(split_methods(" , ").is_empty());
    }
}
