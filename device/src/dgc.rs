//! `dgc` on the device, with the `exact` adaptation (the default): Deep Gradient
//! Compression's compressor (the host codec `dtrain_compress::dgc`). With `exact` the host
//! keeps exactly the `k = keep_count(n, density)` largest magnitudes, ties to the smaller
//! index — the sampled threshold is only its way of getting there fast — so the device's
//! top-k (`select`) writes the same payload: the layout byte, then the host's index coding
//! of the kept entries. A segment shorter than `min_sparse_len`, or whose `k` is all of it,
//! goes dense (every value, in order). The density follows the warm-up schedule of the step
//! (`ctx.step`), computed by the host codec itself. The host draws its sample's start from
//! the encoder's Rng; the payload does not depend on it, and the device does not draw.
//!
//! Decoding parses each segment on the host with the host codec's readers and adds on the
//! device. Not here: the `synxlin` and `grace` adaptations (their counts depend on the
//! sample), and DGC's momentum-corrected memory on the device.

use dtrain_compress::dgc::{keep_count, Adaptation, Dgc as HostDgc, DgcConfig};
use dtrain_compress::wire::{f32_at, Writer};
use dtrain_compress::{
    read_frame, sparse, Compressor, Ctx, Method, MethodId, Payload, Rng, WireError,
};

use crate::codec::{begin_payload, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::select::{select, Adds, Rule};

/// The layout bytes of a DGC segment body.
const DENSE: u8 = 0;
const SPARSE: u8 = 1;

/// The `dgc` device codec (`exact` adaptation).
#[derive(Debug, Clone)]
pub struct Dgc {
    /// The host codec: the density of a step comes from it.
    host: HostDgc,
    min_sparse_len: usize,
}

impl Dgc {
    /// The device codec of `cfg`, where it has one: the `exact` adaptation (a config the
    /// host refuses has none either).
    pub fn for_config(cfg: &DgcConfig) -> Option<Dgc> {
        (cfg.adaptation == Adaptation::Exact)
            .then(|| cfg.init().ok())
            .flatten()
            .map(|host| Dgc {
                host,
                min_sparse_len: cfg.min_sparse_len,
            })
    }
}

impl DeviceCodec for Dgc {
    fn method(&self) -> MethodId {
        DgcConfig::ID
    }

    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        self.host.ratio_metric()
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(DgcConfig::ID, grad.len(), ctx.segments, out)?;
        // The step's density (the warm-up schedule), as the host codec sets it.
        self.host.begin(&[], ctx);
        let density = self.host.current_density();
        let jobs: Vec<_> = segs
            .iter()
            .map(|seg| {
                let n = seg.len();
                let k = keep_count(n, density);
                let rule = if n < self.min_sparse_len || k >= n {
                    // Every element, in order: the compaction at key 0 with every equal kept.
                    Rule::From { t: 0, need: u32::MAX }
                } else {
                    Rule::TopK(k)
                };
                (seg.clone(), rule)
            })
            .collect();
        let kept = select(gpu, grad, &jobs, out)?;
        let mut w = Writer::new(out.buffer_mut());
        for ((seg, rule), kept) in jobs.iter().zip(&kept) {
            match rule {
                Rule::TopK(_) => {
                    w.u8(SPARSE);
                    sparse::write_indices(seg.len(), &kept.idx, &mut w);
                }
                Rule::From { .. } => w.u8(DENSE),
            }
            w.bytes(&kept.val);
        }
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(DgcConfig::ID, payload, out.len())?;
        let mut adds = Adds::default();
        for seg in &segs {
            match r.u8("dgc layout")? {
                DENSE => {
                    let vals = r.take_items(seg.len(), 4, "dgc dense values")?;
                    for j in 0..seg.len() {
                        let v = f32_at(vals, j);
                        if !v.is_finite() {
                            return Err(WireError::Invalid("non-finite dense value").into());
                        }
                        adds.push((seg.start + j) as u32, v);
                    }
                }
                SPARSE => adds.read_indexed(&mut r, seg)?,
                _ => return Err(WireError::Invalid("unknown dgc layout").into()),
            }
        }
        adds.finish(gpu, &r, out)
    }
}
