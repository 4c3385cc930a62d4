//! `dtrain bench compress --device D [--verify]`: the device codecs (`dtrain-device`) on
//! the same input as the host bench, beside the host codecs.
//!
//! The input is uploaded once, as a gradient already on the device would be. A device
//! compression is timed from the launch to its payload bytes on the host (the one copy per
//! bucket the device path makes); a device decompression from the payload bytes on the host
//! to the sum written on the device (upload included). Each is the best of `repeat` runs
//! after a warm-up (the first run compiles the kernels). The host columns are
//! [`super::compress::run`]'s on the same input, segments and thread count.
//!
//! `verify` checks every device payload against the host codec's for the same input and
//! segments — bytes equal — and the device decoder against the host decoder on that
//! payload — the sums equal bit for bit; a row that differs says where. A method without a
//! device codec runs on the host only and says so (`on` = `host`).
//!
//! Built without a device runtime (features `wgpu` / `cuda`), [`run`] refuses with the
//! command that builds one.

use serde::Serialize;

use super::compress::Options;

/// What [`run`] measured: the device, its memory's reference speed and a row per method.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceBench {
    /// The device's name (`cuda:0 (cuda)`, `wgpu:cpu (wgpu<wgsl>)`).
    pub device: String,
    /// The device's memory bandwidth as one copy kernel reaches it on the same input: bytes
    /// read plus bytes written (`8·n`) per second, in GB/s — what a codec that reads its
    /// input once is measured beside (its GB/s are of `f32` input: half the copy's bytes).
    pub copy_gbps: f64,
    /// A row per method.
    pub rows: Vec<DeviceRow>,
}

/// One method's row.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceRow {
    /// Method name as given (with parameters, if any).
    pub method: String,
    /// `device`, or `host` where the method has no device codec (the device columns are
    /// then empty).
    pub on: &'static str,
    /// Elements in the input.
    pub elements: usize,
    /// Encoded payload size in bytes (header included).
    pub payload_bytes: usize,
    /// Device compression, GB/s of f32 input (payload on the host included).
    pub device_compress_gbps: Option<f64>,
    /// Device decompression, GB/s of f32 output (payload upload included).
    pub device_decompress_gbps: Option<f64>,
    /// The host codec's compression on the same input, GB/s.
    pub host_compress_gbps: f64,
    /// The host codec's decompression, GB/s.
    pub host_decompress_gbps: f64,
    /// `device_compress_gbps / host_compress_gbps`.
    pub compress_speedup: Option<f64>,
    /// With `verify`: `pass`, or `FAIL: …` saying where the device differs from the host.
    pub verify: Option<String>,
    /// The parts of a device codec that still run on the host (FFT's transform), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_parts: Option<&'static str>,
}

impl DeviceRow {
    /// Whether `verify` found a difference.
    pub fn failed(&self) -> bool {
        self.verify
            .as_deref()
            .is_some_and(|v| !v.starts_with("pass"))
    }
}

/// The device, its copy bandwidth and a row per method of `opts` (every method with a
/// device codec when `opts.methods` is empty).
pub fn run(
    input: &[f32],
    opts: &Options,
    device: &str,
    verify: bool,
) -> Result<DeviceBench, String> {
    refuse_options(opts)?;
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return enabled::run(input, opts, device, verify);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (input, verify);
        Err(format!(
            "--device {device}: this dtrain was built without a device runtime; build it \
             with `cargo build --release -p dtrain-cli --features wgpu` (Vulkan, Metal, DX12) \
             or `--features cuda`"
        ))
    }
}

/// The host bench's options the device bench does not measure yet, refused by name.
fn refuse_options(opts: &Options) -> Result<(), String> {
    let refused = [
        (
            opts.error_feedback,
            "--error-feedback (the device memories are not written yet)",
        ),
        (
            opts.workers > 1,
            "--workers above 1 (the joint device decoders are not written yet)",
        ),
        (
            opts.rounds > 0,
            "--rounds (the device bench reports no error column yet)",
        ),
    ];
    match refused.iter().find(|(on, _)| *on) {
        Some((_, what)) => Err(format!("--device does not take {what}")),
        None => Ok(()),
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod enabled {
    use std::time::Instant;

    use dtrain_compress::fft::{FftConfig, TransformAt};
    use dtrain_compress::{decompress_add, Compressor, Ctx, Payload, Rng, METHODS};
    use dtrain_device::{device_codec, DeviceCodec, DeviceSpec, Gpu, GpuBuffer};

    use super::super::compress::{parse_method, segment_shapes, segments, Options};
    use super::{DeviceBench, DeviceRow};

    pub(super) fn run(
        input: &[f32],
        opts: &Options,
        device: &str,
        verify: bool,
    ) -> Result<DeviceBench, String> {
        let spec: DeviceSpec = device.parse().map_err(|e| format!("--device: {e}"))?;
        let gpu = Gpu::open(spec).map_err(|e| format!("--device: {e}"))?;
        let specs: Vec<String> = if opts.methods.is_empty() {
            METHODS
                .iter()
                .filter(|m| device_codec(&(m.default)()).is_some())
                .map(|m| m.name.to_string())
                .collect()
        } else {
            opts.methods.clone()
        };
        let segs = segments(input.len(), opts)?;
        // The host bench's context: step 1, rank 0, bucket 0.
        let ctx = Ctx {
            step: 1,
            segments: &segs,
            ..Ctx::default()
        };
        let grad = gpu.upload(input);
        let shapes = segment_shapes(opts);
        // A device codec as the host bench builds its host codec: told the tensors' shapes.
        let codec_for = |cfg: &dtrain_compress::CompressorConfig| {
            device_codec(cfg).map(|mut c| {
                if let Some(s) = &shapes {
                    c.set_segment_shapes(s);
                }
                c
            })
        };
        let gb = 4.0 * input.len() as f64 / 1e9;
        // The memory's reference: one copy kernel over the input, timed as the codecs are.
        let copy = gpu.zeros(input.len());
        let t_copy = best_of(opts.repeat, || {
            gpu.copy_into(&grad, &copy, 0);
            gpu.sync().map_err(|e| format!("a copy on {gpu}: {e}"))
        })?;
        drop(copy);
        let mut rows = Vec::new();
        for spec in specs {
            let host = super::super::compress::run(
                input,
                &Options {
                    methods: vec![spec.clone()],
                    ..opts.clone()
                },
            )?
            .remove(0);
            let mut row = DeviceRow {
                method: spec.clone(),
                on: "host",
                elements: input.len(),
                payload_bytes: host.payload_bytes,
                device_compress_gbps: None,
                device_decompress_gbps: None,
                host_compress_gbps: host.compress_gbps,
                host_decompress_gbps: host.decompress_gbps,
                compress_speedup: None,
                verify: None,
                host_parts: None,
            };
            let cfg = parse_method(&spec)?;
            if let Some(mut codec) = codec_for(&cfg) {
                let err = |e: dtrain_device::DeviceError| format!("{spec} on {gpu}: {e}");
                let mut payload = Payload::new();
                let t_c = best_of(opts.repeat, || {
                    let mut rng = Rng::for_step(0, 1, 0, 0);
                    codec
                        .encode(&gpu, &grad, &ctx, &mut rng, &mut payload)
                        .map_err(err)
                })?;
                let out = gpu.zeros(input.len());
                let t_d = best_of(opts.repeat, || {
                    codec
                        .decode_add(&gpu, payload.as_bytes(), &out)
                        .and_then(|()| gpu.sync())
                        .map_err(err)
                })?;
                row.on = "device";
                row.host_parts = codec.host_parts();
                row.payload_bytes = payload.encoded_len();
                row.device_compress_gbps = Some(gb / t_c);
                row.device_decompress_gbps = Some(gb / t_d);
                row.compress_speedup = Some(gb / t_c / host.compress_gbps);
                if verify {
                    // A fresh codec's first payload, as the fresh host codec's: the timed
                    // rounds moved the state of the stateful ones (PowerSGD's Q).
                    let mut fresh = codec_for(&cfg).expect("a device codec");
                    let mut first = Payload::new();
                    fresh
                        .encode(
                            &gpu,
                            &grad,
                            &ctx,
                            &mut Rng::for_step(0, 1, 0, 0),
                            &mut first,
                        )
                        .map_err(err)?;
                    row.verify = Some(check(
                        &gpu,
                        fresh.as_ref(),
                        &cfg,
                        shapes.as_deref(),
                        input,
                        &ctx,
                        &first,
                    )?);
                }
            }
            rows.push(row);
        }
        Ok(DeviceBench {
            device: gpu.to_string(),
            copy_gbps: 2.0 * gb / t_copy,
            rows,
        })
    }

    /// The best time of `repeat` runs of `f` after one warm-up, in seconds.
    fn best_of(repeat: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        let mut best = f64::INFINITY;
        for i in 0..=repeat.max(1) {
            let t = Instant::now();
            f()?;
            if i > 0 {
                best = best.min(t.elapsed().as_secs_f64());
            }
        }
        Ok(best.max(1e-12))
    }

    /// `pass`, or where the device payload or the device decoder differs from the host's.
    fn check(
        gpu: &Gpu,
        codec: &dyn DeviceCodec,
        cfg: &dtrain_compress::CompressorConfig,
        shapes: Option<&[Vec<usize>]>,
        input: &[f32],
        ctx: &Ctx<'_>,
        payload: &Payload,
    ) -> Result<String, String> {
        let mut host = cfg.build().map_err(|e| e.to_string())?;
        if let Some(s) = shapes {
            host.set_segment_shapes(s);
        }
        let expected = dtrain_compress::compress_new(
            host.as_mut(),
            input,
            ctx,
            &mut Rng::for_step(0, 1, 0, 0),
        )
        .map_err(|e| e.to_string())?;
        if let dtrain_compress::CompressorConfig::Fft(c) = cfg {
            if c.transform == TransformAt::Device {
                return check_fft(gpu, c, host.as_ref(), input, ctx, payload, &expected);
            }
        }
        let (d, h) = (payload.as_bytes(), expected.as_bytes());
        if matches!(cfg, dtrain_compress::CompressorConfig::PowerSgd(_)) && d != h {
            // Sums of products: a device that fuses a multiply and an add (CUDA's compiler
            // does) rounds differently in the last bit. The payload must still be one the
            // host decodes, of the host's length, to the host's reconstruction.
            return Ok(check_rounded(
                host.as_ref(),
                input.len(),
                d,
                h,
                "sums of products",
            ));
        }
        if let Some(i) = (0..d.len().min(h.len())).find(|&i| d[i] != h[i]) {
            return Ok(format!(
                "FAIL: payload byte {i} differs (of {} / host {})",
                d.len(),
                h.len()
            ));
        }
        if d.len() != h.len() {
            return Ok(format!(
                "FAIL: payload of {} bytes, host {}",
                d.len(),
                h.len()
            ));
        }
        let mut want = vec![0f32; input.len()];
        decompress_add(host.as_ref(), h, &mut want).map_err(|e| e.to_string())?;
        let out: GpuBuffer = gpu.zeros(input.len());
        codec.decode_add(gpu, h, &out).map_err(|e| e.to_string())?;
        let got = gpu.download(&out).map_err(|e| e.to_string())?;
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            return Ok(format!(
                "FAIL: decoded element {i} is {} (host {})",
                got[i], want[i]
            ));
        }
        // A joint decoder on the device (FFT's inverse transforms): within rounding.
        let out: GpuBuffer = gpu.zeros(input.len());
        if let Some(mean) = codec.decode_mean(gpu, &[h], 1.0, &out) {
            if let Err((_, e)) = mean {
                return Ok(format!(
                    "FAIL: the device decoder refuses the host payload: {e}"
                ));
            }
            let dec = relative_l2(&gpu.download(&out).map_err(|e| e.to_string())?, &want);
            return Ok(if dec <= 1e-5 {
                format!("pass (device decode within {dec:.1e})")
            } else {
                format!("FAIL: the device decode differs by {dec:.1e} (L2, relative)")
            });
        }
        Ok("pass".into())
    }

    /// `--verify` of a payload whose bytes may differ from the host's `h` by rounding only
    /// (`why`): `d` must be of `h`'s length and decode, with the host decoder, within
    /// [`super::ROUNDED_RECONSTRUCTION_TOLERANCE`] of `h`'s reconstruction.
    fn check_rounded(host: &dyn Compressor, n: usize, d: &[u8], h: &[u8], why: &str) -> String {
        if d.len() != h.len() {
            return format!("FAIL: payload of {} bytes, host {}", d.len(), h.len());
        }
        let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
        if let Err(e) = decompress_add(host, d, &mut got) {
            return format!("FAIL: the host decoder refuses the device payload: {e}");
        }
        if let Err(e) = decompress_add(host, h, &mut want) {
            return format!("FAIL: the host decoder refuses the host payload: {e}");
        }
        let err = relative_l2(&got, &want);
        if err <= super::ROUNDED_RECONSTRUCTION_TOLERANCE {
            format!("pass (bytes differ: {why} rounded apart; decoded within {err:.1e})")
        } else {
            format!("FAIL: the device payload decodes {err:.1e} (L2, relative) from the host's")
        }
    }

    /// `‖got − want‖ / ‖want‖` (the plain difference's norm where `want` is zero).
    fn relative_l2(got: &[f32], want: &[f32]) -> f64 {
        let (mut diff, mut norm) = (0f64, 0f64);
        for (g, w) in got.iter().zip(want) {
            diff += ((g - w) as f64).powi(2);
            norm += (*w as f64).powi(2);
        }
        if norm > 0.0 {
            (diff / norm).sqrt()
        } else {
            diff.sqrt()
        }
    }

    /// `--verify` of FFT with the device's own transform: the same codec with the host's
    /// transform must write the host's bytes (selection, quantization, packing and framing
    /// exact), and the device payload must be one the host decoder reads, of the host
    /// payload's length, reconstructing the host's within [`super::FFT_RECONSTRUCTION_TOLERANCE`].
    fn check_fft(
        gpu: &Gpu,
        cfg: &FftConfig,
        host: &dyn Compressor,
        input: &[f32],
        ctx: &Ctx<'_>,
        payload: &Payload,
        expected: &Payload,
    ) -> Result<String, String> {
        let exact = dtrain_compress::CompressorConfig::Fft(FftConfig {
            transform: TransformAt::Host,
            ..cfg.clone()
        });
        let mut codec = device_codec(&exact).ok_or("fft has a device codec")?;
        let mut with_host = Payload::new();
        codec
            .encode(
                gpu,
                &gpu.upload(input),
                ctx,
                &mut Rng::for_step(0, 1, 0, 0),
                &mut with_host,
            )
            .map_err(|e| e.to_string())?;
        let (d, h) = (with_host.as_bytes(), expected.as_bytes());
        if d != h {
            let i = (0..d.len().min(h.len()))
                .find(|&i| d[i] != h[i])
                .unwrap_or(d.len().min(h.len()));
            return Ok(format!(
                "FAIL: with the host's transform, payload byte {i} differs"
            ));
        }
        if payload.as_bytes().len() != h.len() {
            return Ok(format!(
                "FAIL: payload of {} bytes, host {}",
                payload.as_bytes().len(),
                h.len()
            ));
        }
        let (mut got, mut want) = (vec![0f32; input.len()], vec![0f32; input.len()]);
        if let Err(e) = decompress_add(host, payload.as_bytes(), &mut got) {
            return Ok(format!(
                "FAIL: the host decoder refuses the device payload: {e}"
            ));
        }
        decompress_add(host, h, &mut want).map_err(|e| e.to_string())?;
        let rel = relative_l2(&got, &want);
        if rel > super::FFT_RECONSTRUCTION_TOLERANCE {
            return Ok(format!(
                "FAIL: the device transform's reconstruction differs by {rel:.1e} (L2, relative)"
            ));
        }
        // The device's joint decode (its inverse transforms) of the host's payload.
        let out: GpuBuffer = gpu.zeros(input.len());
        let mean = codec
            .decode_mean(gpu, &[h], 1.0, &out)
            .ok_or("fft decodes jointly")?;
        if let Err((_, e)) = mean {
            return Ok(format!(
                "FAIL: the device decoder refuses the host payload: {e}"
            ));
        }
        let dec = relative_l2(&gpu.download(&out).map_err(|e| e.to_string())?, &want);
        Ok(if dec <= 1e-5 {
            format!(
                "pass (host transform: bytes equal; device transform: reconstruction within \
                 {rel:.1e}; device decode within {dec:.1e})"
            )
        } else {
            format!("FAIL: the device decode differs by {dec:.1e} (L2, relative)")
        })
    }
}

/// The largest relative difference (L2) between the reconstructions of the device's FFT
/// payload and the host's that `--verify` passes with the device's own transform: its spectra
/// are the host's within rounding (about 1e-7 of a chunk's largest bin, `tests/transform.rs`
/// of dtrain-device), but where two bins' energies nearly tie the device may keep the other
/// one, and each such swap moves the reconstruction by about one bin's share.
pub const FFT_RECONSTRUCTION_TOLERANCE: f64 = 1e-2;

/// The largest relative difference (L2) between the reconstructions of a PowerSGD payload
/// made on the device and the host's that `--verify` passes where their bytes differ: its
/// sums of products round apart where the device fuses multiplies and adds (CUDA; about
/// 1e-7 relative), and the Gram–Schmidt of `P` amplifies that where `P`'s columns are
/// nearly dependent. On lavapipe the bytes are equal.
pub const ROUNDED_RECONSTRUCTION_TOLERANCE: f64 = 1e-4;

/// The rows as a table.
pub fn table(rows: &[DeviceRow]) -> String {
    let w = rows
        .iter()
        .map(|r| r.method.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut s = format!(
        "{:<w$}  {:>6}  {:>9}  {:>10}  {:>12}  {:>10}  {:>12}  {:>8}  {}\n",
        "method",
        "on",
        "bits/elem",
        "comp GB/s",
        "decomp GB/s",
        "host comp",
        "host decomp",
        "comp x",
        "verify"
    );
    let opt = |v: Option<f64>, prec: usize| match v {
        Some(v) => format!("{v:.prec$}"),
        None => "—".into(),
    };
    for r in rows {
        s.push_str(&format!(
            "{:<w$}  {:>6}  {:>9.3}  {:>10}  {:>12}  {:>10.3}  {:>12.3}  {:>8}  {}\n",
            r.method,
            r.on,
            8.0 * r.payload_bytes as f64 / r.elements.max(1) as f64,
            opt(r.device_compress_gbps, 3),
            opt(r.device_decompress_gbps, 3),
            r.host_compress_gbps,
            r.host_decompress_gbps,
            opt(r.compress_speedup, 2),
            r.verify.as_deref().unwrap_or(match r.on {
                "host" => "— (no device codec)",
                _ => "",
            }),
        ));
    }
    for r in rows.iter().filter(|r| r.host_parts.is_some()) {
        s.push_str(&format!(
            "{}: on the host: {}\n",
            r.method,
            r.host_parts.unwrap_or_default()
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_the_device_bench_cannot_measure_are_refused_by_name() {
        let opts = Options {
            error_feedback: true,
            ..Options::default()
        };
        let e = run(&[1.0; 8], &opts, "wgpu", false).unwrap_err();
        assert!(e.contains("--error-feedback"), "{e}");
        let opts = Options {
            workers: 4,
            ..Options::default()
        };
        let e = run(&[1.0; 8], &opts, "wgpu", false).unwrap_err();
        assert!(e.contains("--workers"), "{e}");
    }

    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    #[test]
    fn without_a_runtime_the_device_bench_says_how_to_build_one() {
        let e = run(&[1.0; 8], &Options::default(), "wgpu", true).unwrap_err();
        assert!(e.contains("--features wgpu"), "{e}");
    }
}
