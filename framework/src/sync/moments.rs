//! Adam's moments as the compressed optimizers keep them (DeepSpeed's `exp_avg` and
//! `exp_avg_sq`), their updates in `torch.optim`'s order of operations, and their part of a
//! checkpoint.
//!
//! ```text
//! absorb(g):          m ← β₁·m + (1−β₁)·g      v ← β₂·v + (1−β₂)·g²
//! absorb_first(g):    m ← β₁·m + (1−β₁)·g      (the variance is frozen, or not refreshed)
//! local_momentum(g):  g ← β₁·m + (1−β₁)·g      (a rank's own momentum; m unchanged)
//! direction(d):       d ← m / (√v + ε)
//! ```
//! **The momentum mask.** A 1-bit code cannot say 0: a coordinate whose gradient was exactly
//! zero all through the dense steps (a dead ReLU unit, an embedding row never looked up,
//! BERT's position embeddings past the sequence length) has `v = 0`, and what a compressed
//! exchange hands back there is ± the tensor's scale — divided by `√0 + ε`, a step of
//! 10⁸ times that scale. DeepSpeed asks its users for an `exp_avg_mask` of such
//! coordinates; here the mask is `v ≠ 0`, applied to every compressed exchange's result
//! ([`Moments::mask`]), so those coordinates keep `m = 0` and do not move, as they did not
//! during the dense steps.
//!
//! No bias correction: DeepSpeed's `OnebitAdam` and `ZeroOneAdam` take a `bias_correction`
//! argument and never use it, and the frozen variance of 1-bit Adam is the raw `v` of the
//! last warm-up step. (With Adam's learning rate, the early steps are therefore larger than
//! Adam's: `1/√(1−β₂ᵗ)` times at step t, about 3.2× at step 100 with β₂ = 0.999 — which is
//! why DeepSpeed's recipes warm the learning rate up.)

use serde::{Deserialize, Serialize};

use super::SyncError;
use crate::checkpoint::Checkpoint;
use crate::optim::OptimizerConfig;

const M_SECTION: &str = "sync/adam/m";
const V_SECTION: &str = "sync/adam/v";
/// The section naming the compressed optimizer that wrote a checkpoint ([`AdamState`]).
pub(crate) const ADAM_SECTION: &str = "sync/adam";

/// What a compressed optimizer writes into [`ADAM_SECTION`]: its name, and its counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct AdamState<C> {
    /// `train.optimizer`.
    pub(crate) optimizer: String,
    /// The optimizer's own counters.
    pub(crate) counters: C,
}

/// The name of the compressed optimizer that wrote `ck`, if one did.
pub(crate) fn written_by(ck: &Checkpoint) -> Option<String> {
    #[derive(Deserialize)]
    struct Name {
        optimizer: String,
    }
    if !ck.names().any(|n| n == ADAM_SECTION) {
        return None;
    }
    ck.json::<Name>(ADAM_SECTION).ok().map(|n| n.optimizer)
}

/// The first and second moments of every parameter, flat, in the model's order.
pub(super) struct Moments {
    beta1: f32,
    beta2: f32,
    eps: f32,
    /// The first moment `m`.
    pub(super) m: Vec<f32>,
    /// The second moment `v`.
    pub(super) v: Vec<f32>,
    /// Both moments on the device of a GPU worker's gradient (1-bit Adam's `sync_device`),
    /// newer than `m` and `v` while they are there ([`Moments::settle`] brings them back).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    device: Option<(dtrain_device::Gpu, dtrain_device::adam::DeviceAdamMoments)>,
}

/// A device operation's failure, as the exchange reports one.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn device_error(e: dtrain_device::DeviceError) -> SyncError {
    super::device_failure(format!("the Adam moments on the device: {e}"))
}

impl Moments {
    /// Zero moments of `n` parameters, with β₁, β₂ and ε of `cfg`.
    pub(super) fn new(n: usize, cfg: &OptimizerConfig) -> Self {
        Moments {
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            m: vec![0.0; n],
            v: vec![0.0; n],
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            device: None,
        }
    }

    /// The moments on `gpu` (uploaded from the host's the first time, or when they were
    /// on another device).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn on_device(
        &mut self,
        gpu: &dtrain_device::Gpu,
    ) -> Result<&mut dtrain_device::adam::DeviceAdamMoments, SyncError> {
        if self
            .device
            .as_ref()
            .is_some_and(|(g, _)| g.spec() != gpu.spec())
        {
            self.settle()?;
        }
        if self.device.is_none() {
            let d = dtrain_device::adam::DeviceAdamMoments::upload(
                gpu, &self.m, &self.v, self.beta1, self.beta2, self.eps,
            )
            .map_err(device_error)?;
            self.device = Some((gpu.clone(), d));
        }
        Ok(&mut self.device.as_mut().expect("uploaded").1)
    }

    /// Runs `op` on the moments on `on_device`'s device (uploaded there if they are not),
    /// with that gradient's buffer.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub(super) fn with_device(
        &mut self,
        on_device: &crate::exchange::DeviceGradient,
        op: impl FnOnce(
            &mut dtrain_device::adam::DeviceAdamMoments,
            &dtrain_device::Gpu,
            &dtrain_device::GpuBuffer,
        ) -> Result<(), dtrain_device::DeviceError>,
    ) -> Result<(), SyncError> {
        let gpu = on_device.gpu();
        op(self.on_device(gpu)?, gpu, on_device.buffer()).map_err(device_error)
    }

    /// The end of a compressed optimizer's step on the device: the direction
    /// `m / (√v + ε)` written into `on_device`'s buffer, and copied into `grads` unless
    /// `mean_to_device` (the trainer then applies it from the host).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub(super) fn direction_on_device(
        &mut self,
        on_device: &crate::exchange::DeviceGradient,
        grads: &mut [f32],
        mean_to_device: bool,
    ) -> Result<(), SyncError> {
        self.with_device(on_device, |d, gpu, buf| d.direction(gpu, buf))?;
        super::update_from_device(grads, on_device, mean_to_device)
    }

    /// Brings the moments on the device back into `m` and `v` (before a step on the host).
    pub(super) fn settle(&mut self) -> Result<(), SyncError> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if let Some((gpu, d)) = self.device.take() {
            (self.m, self.v) = d.download(&gpu).map_err(device_error)?;
        }
        Ok(())
    }

    /// A dense step: both moments take the (averaged) gradient `g`.
    pub(super) fn absorb(&mut self, g: &[f32]) {
        let (b1, b2) = (self.beta1, self.beta2);
        for ((m, v), &g) in self.m.iter_mut().zip(&mut self.v).zip(g) {
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
        }
    }

    /// The first moment alone takes `g`; the variance stays.
    pub(super) fn absorb_first(&mut self, g: &[f32]) {
        let b1 = self.beta1;
        for (m, &g) in self.m.iter_mut().zip(g) {
            *m = b1 * *m + (1.0 - b1) * g;
        }
    }

    /// Replaces `g` (this rank's gradient) by this rank's momentum `β₁·m + (1−β₁)·g`,
    /// leaving `m` as it is.
    pub(super) fn local_momentum(&self, g: &mut [f32]) {
        let b1 = self.beta1;
        for (g, &m) in g.iter_mut().zip(&self.m) {
            *g = b1 * m + (1.0 - b1) * *g;
        }
    }

    /// Zeroes `x` where the variance is exactly zero: what a compressed exchange returns
    /// there is the code's error, not a gradient (see the [module docs](self)).
    pub(super) fn mask(&self, x: &mut [f32]) {
        for (x, &v) in x.iter_mut().zip(&self.v) {
            if v == 0.0 {
                *x = 0.0;
            }
        }
    }

    /// Writes the direction `m / (√v + ε)` into `out`.
    pub(super) fn direction(&self, out: &mut [f32]) {
        let eps = self.eps;
        for ((d, &m), &v) in out.iter_mut().zip(&self.m).zip(&self.v) {
            *d = m / (v.sqrt() + eps);
        }
    }

    /// `√v_j + ε`, the factor between a parameter change and a momentum (0/1 Adam).
    pub(super) fn denominators(&self) -> impl Iterator<Item = f32> + '_ {
        let eps = self.eps;
        self.v.iter().map(move |&v| v.sqrt() + eps)
    }

    /// 0/1 Adam's synchronisation from the averaged change `ū` (in momentum units, as
    /// [`Moments::denominators`] scales it): `m ← ū·inv` when `inv` is given, and
    /// `anchor ← anchor + ū/(√v + ε)`.
    pub(super) fn take_change(&mut self, anchor: &mut [f32], u: &[f32], inv: Option<f32>) {
        let eps = self.eps;
        for (((a, m), &u), &v) in anchor.iter_mut().zip(&mut self.m).zip(u).zip(&self.v) {
            if let Some(inv) = inv {
                *m = u * inv;
            }
            *a += u / (v.sqrt() + eps);
        }
    }

    /// Writes both moments into `ck` (the device's, when they are there).
    pub(super) fn save(&self, ck: &mut Checkpoint) -> Result<(), SyncError> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if let Some((gpu, d)) = &self.device {
            let (m, v) = d.download(gpu).map_err(device_error)?;
            ck.put_f32(M_SECTION, &m);
            ck.put_f32(V_SECTION, &v);
            return Ok(());
        }
        ck.put_f32(M_SECTION, &self.m);
        ck.put_f32(V_SECTION, &self.v);
        Ok(())
    }

    /// Restores what [`Moments::save`] wrote, checking the lengths.
    pub(super) fn restore(&mut self, ck: &Checkpoint) -> Result<(), SyncError> {
        let (m, v) = (ck.f32(M_SECTION)?, ck.f32(V_SECTION)?);
        let n = self.m.len();
        if m.len() != n || v.len() != n {
            return Err(SyncError::State(format!(
                "its Adam moments hold {} and {} values, this model has {n} parameters",
                m.len(),
                v.len()
            )));
        }
        self.m = m;
        self.v = v;
        // The next step on the device takes them up again.
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            self.device = None;
        }
        Ok(())
    }
}

/// Reads the [`AdamState`] of `optimizer` from `ck`, refusing a checkpoint that another
/// optimizer wrote.
pub(super) fn restore_state<C: serde::de::DeserializeOwned>(
    ck: &Checkpoint,
    optimizer: &str,
) -> Result<C, SyncError> {
    match written_by(ck) {
        Some(name) if name == optimizer => {
            let st: AdamState<C> = ck.json(ADAM_SECTION)?;
            Ok(st.counters)
        }
        other => Err(SyncError::State(format!(
            "it was written with train.optimizer = {:?}, this run has {optimizer:?} (a \
             compressed optimizer's moments and residuals live in its own sections)",
            other.as_deref().unwrap_or("sgd, adam or adamw")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_follow_the_formulas() {
        let cfg = OptimizerConfig {
            beta1: 0.5,
            beta2: 0.75,
            eps: 0.25,
            ..OptimizerConfig::default()
        };
        let mut mo = Moments::new(2, &cfg);
        mo.absorb(&[2.0, -4.0]);
        // m = 0.5·g, v = 0.25·g².
        assert_eq!(mo.m, [1.0, -2.0]);
        assert_eq!(mo.v, [1.0, 4.0]);
        let mut d = [0.0; 2];
        mo.direction(&mut d);
        assert_eq!(d, [1.0 / 1.25, -2.0 / 2.25]);
        let mut g = [4.0, 0.0];
        mo.local_momentum(&mut g);
        assert_eq!(g, [2.5, -1.0]);
        assert_eq!(mo.m, [1.0, -2.0], "local_momentum leaves m alone");
        mo.absorb_first(&[3.0, 2.0]);
        assert_eq!(mo.m, [2.0, 0.0]);
        assert_eq!(mo.v, [1.0, 4.0], "absorb_first leaves v alone");
        let den: Vec<f32> = mo.denominators().collect();
        assert_eq!(den, [1.25, 2.25]);
    }

    #[test]
    fn the_state_round_trips_and_names_its_writer() {
        let cfg = OptimizerConfig::default();
        let mut a = Moments::new(3, &cfg);
        a.absorb(&[1.0, -2.0, 0.5]);
        let mut ck = Checkpoint::new();
        a.save(&mut ck).unwrap();
        ck.put_json(
            ADAM_SECTION,
            &AdamState {
                optimizer: "onebit-adam".into(),
                counters: 7u64,
            },
        );
        let mut b = Moments::new(3, &cfg);
        b.restore(&ck).unwrap();
        assert_eq!((a.m, a.v), (b.m.clone(), b.v.clone()));
        assert_eq!(written_by(&ck).as_deref(), Some("onebit-adam"));
        assert_eq!(restore_state::<u64>(&ck, "onebit-adam").unwrap(), 7);
        let e = restore_state::<u64>(&ck, "zeroone-adam").unwrap_err();
        assert!(
            matches!(&e, SyncError::State(m) if m.contains("onebit-adam") && m.contains("zeroone-adam")),
            "{e:?}"
        );
        let e = restore_state::<u64>(&Checkpoint::new(), "onebit-adam").unwrap_err();
        assert!(matches!(&e, SyncError::State(m) if m.contains("sgd, adam or adamw")));
        // Another model size is refused.
        let mut c = Moments::new(4, &cfg);
        assert!(matches!(c.restore(&ck), Err(SyncError::State(_))));
    }
}
