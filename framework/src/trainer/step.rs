//! One training step: batch, forward, backward, the control all-reduce, the gradient
//! synchronisation ([`crate::sync`]), the update.

use std::time::Instant;

use dtrain_comms::Transport;
use dtrain_compress::compressor::first_non_finite;
use dtrain_models::pool::on_pool_for;
use dtrain_models::{FlatTensor, Metrics};

use super::{Phases, StepRecord, TrainError, Trainer, CTL_LEN, RNG};
use crate::config::NonFinitePolicy;
use crate::exchange::DeviceGradient;
use crate::optim::clip_to_norm;
use crate::ps_mode::Ready;
use crate::sync::{SyncError, Update};

/// What a step ended with.
pub(super) enum StepOutcome {
    /// A record for `metrics.jsonl` (the update applied, or skipped by the policy).
    Done(Box<StepRecord>),
    /// The recover policy rolled the run back to its last checkpoint.
    RolledBack,
}

impl<T: Transport> Trainer<T> {
    /// Runs step `self.step`, batch `j` of `epoch` (with `train.accumulate = k`: micro-batches
    /// `j·k … j·k + k − 1`, whose gradients are averaged into `self.grads`). `solo`: a local
    /// step this rank runs alone, without the control all-reduce (live membership's catch-up,
    /// see `membership.rs`): the record holds this rank's own loss and accuracy.
    pub(super) fn train_step(
        &mut self,
        epoch: u64,
        j: usize,
        solo: bool,
    ) -> Result<StepOutcome, TrainError> {
        let step = self.step;
        let t0 = Instant::now();
        let (mut data_s, mut forward_s, mut backward_s) = (0.0, 0.0, 0.0);
        let k = self.plan.config.train.accumulate.max(1) as usize;
        let mut metrics: Option<Metrics> = None;
        // On a GPU whose codecs read the gradient where it lies, it stays there as one flat
        // tensor (summed over micro-batches there too).
        let stays = self.gradient_stays_on_device();
        let mut flat: Option<FlatTensor> = None;
        for micro in 0..k {
            let ta = Instant::now();
            let device = self.model.device().clone();
            let batch = self.data.train_batch(epoch, j * k + micro, &device);
            let tb = Instant::now();
            // Dropout masks: a pure function of (seed, step, rank) and the micro-batch, drawn
            // while this thread holds burn's global RNG (see `RNG`): seeded here, drawn in the
            // forward pass. Taken on this thread, never on a pool thread, so a pool thread that
            // steals another rank's pass while this one waits never blocks on it.
            let rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
            let seed = mix(self.plan.config.seed, step, self.rank as u64);
            device.seed(if micro == 0 {
                seed
            } else {
                mix(seed, micro as u64, 0)
            });
            // On the CPU, forward and backward each run on rayon's pool: one hand-off per
            // pass instead of one per parallel operation (`dtrain_models::pool`).
            let model = &mut self.model;
            let out = on_pool_for(&device, || model.forward_loss(batch));
            drop(rng);
            let out = out.map_err(|source| TrainError::Model { step, source })?;
            let tc = Instant::now();
            let m: Metrics = out.metrics;
            if stays {
                let g = on_pool_for(&device, || self.model.backward_flat(out.loss));
                flat = Some(match flat.take() {
                    None => g,
                    Some(sum) => sum + g,
                });
            } else if micro == 0 {
                let grads = &mut self.grads;
                on_pool_for(&device, || self.model.backward_into(out.loss, grads));
            } else {
                let mut g = std::mem::take(&mut self.micro_grads);
                g.resize(self.grads.len(), 0.0);
                on_pool_for(&device, || self.model.backward_into(out.loss, &mut g));
                for (a, b) in self.grads.iter_mut().zip(&g) {
                    *a += b;
                }
                self.micro_grads = g;
            }
            match &mut metrics {
                None => metrics = Some(m),
                Some(all) => all.merge(&m),
            }
            data_s += (tb - ta).as_secs_f64();
            forward_s += (tc - tb).as_secs_f64();
            backward_s += tc.elapsed().as_secs_f64();
        }
        if k > 1 {
            let inv = 1.0 / k as f32;
            match flat.take() {
                Some(sum) => flat = Some(sum.mul_scalar(inv)),
                None => self.grads.iter_mut().for_each(|g| *g *= inv),
            }
        }
        let m = metrics.unwrap_or_default();
        let on_device = match flat {
            Some(f) => {
                let t = Instant::now();
                let g = self.device_gradient(f)?;
                backward_s += t.elapsed().as_secs_f64();
                Some(g)
            }
            None => None,
        };
        let t3 = Instant::now();
        // A dense exchange checks the average it makes, and a non-finite value on any rank
        // stays non-finite in it (`Exchanger::is_dense`), so scanning here too would be a
        // second pass over the gradient for the same answer (~2 % of the MLP's step). A
        // compressor may drop a NaN, and the parameter server aggregates elsewhere: scan.
        // (A vectorised scan: `iter().any(!is_finite)` is a scalar loop that cost ~0.15 ms
        // per scan on the 535 k-parameter MLP, 5 % of its step.)
        let bad_grad = self.sync.scans_gradient()
            && match &on_device {
                Some(g) => g
                    .first_non_finite()
                    .map_err(|reason| TrainError::Sync { step, reason })?
                    .is_some(),
                None => first_non_finite(&self.grads).is_some(),
            };
        let bad_loss = !m.loss.is_finite();
        // Asynchronous parameter server: no lock-step control all-reduce; the record holds
        // this worker's own loss and accuracy.
        let async_ps = !self.sync.lockstep();
        let per_rank = self.world > 1 && !async_ps && !solo;
        let t_sync = Instant::now();
        let local_s = (t_sync - self.left_exchange.unwrap_or(t0)).as_secs_f64();
        let ctl = &mut self.ctl;
        ctl.clear();
        ctl.extend([
            if bad_loss {
                0.0
            } else {
                (m.loss * m.count as f64) as f32
            },
            m.count as f32,
            m.correct as f32,
            bad_loss as u8 as f32,
            bad_grad as u8 as f32,
            // A stop request (SIGTERM / SIGINT to this rank): every rank learns of it here,
            // in the same step, and all stop after it.
            self.stop.as_ref().is_some_and(|s| s.signal().is_some()) as u8 as f32,
            // A newcomer waits to take a lost worker's place (live membership): every
            // member learns of it here, and all admit it before the next step.
            (self.live.is_some() && !self.comm.waiting_joiners().is_empty()) as u8 as f32,
        ]);
        if per_rank {
            // Each rank fills its own slot; the sum delivers every rank's time to all.
            ctl.resize(CTL_LEN + self.world, 0.0);
            ctl[CTL_LEN + self.rank] = local_s as f32;
        }
        if !async_ps && !solo {
            self.comm
                .all_reduce_sum(ctl)
                .map_err(|source| TrainError::Comm { step, source })?;
        }
        if !solo {
            self.progressed(step, super::membership::Progress::Controlled);
        }
        let t4 = Instant::now();
        // Until the exchange (or the PS round) ends the step, this was the last collective.
        self.left_exchange = Some(t4);
        let ctl = &self.ctl;
        let (slowest_rank, behind_slowest_s) = if per_rank {
            // The first of equal maxima: every rank picks the same one.
            let (r, max) = ctl[CTL_LEN..]
                .iter()
                .enumerate()
                .fold((0, f32::MIN), |a, (r, &v)| if v > a.1 { (r, v) } else { a });
            (Some(r), Some((max as f64 - local_s).max(0.0)))
        } else {
            (None, None)
        };
        let ctl: [f32; CTL_LEN] = ctl[..CTL_LEN].try_into().expect("control values");
        if let (true, Some(l)) = (ctl[6] > 0.0, &mut self.live) {
            l.newcomer_waiting = true;
        }
        if ctl[5] > 0.0 && self.stopping.is_none() {
            // The signal this rank got, or (when another rank got it) SIGTERM, which is
            // what the launcher forwards.
            let own = self.stop.as_ref().and_then(|s| s.signal());
            self.stopping = Some(own.unwrap_or(crate::signals::SIGTERM));
        }
        let count = ctl[1].max(1.0) as f64;
        let loss = if ctl[3] > 0.0 {
            f64::NAN
        } else {
            ctl[0] as f64 / count
        };
        let accuracy = ctl[2] as f64 / count;
        let spike = match (self.plan.config.failure.spike_ratio, self.best_loss) {
            (Some(r), Some(best))
                if self.plan.config.failure.non_finite == NonFinitePolicy::Recover =>
            {
                loss > r * best
            }
            _ => false,
        };
        let time = Phases {
            data_s,
            forward_s,
            backward_s,
            communicate_s: (t4 - t3).as_secs_f64(),
            sync_s: (t4 - t_sync).as_secs_f64(),
            ..Phases::default()
        };
        let lr = self.lr_at(step);
        let mut record = Box::new(StepRecord {
            step,
            epoch,
            loss: Some(loss),
            accuracy: Some(accuracy),
            lr: Some(lr),
            ratio_name: None,
            ratio: None,
            bytes_sent: 0,
            bytes_received: 0,
            payload_bytes: 0,
            skipped: false,
            samples: ctl[1] as u64,
            time,
            lossy_dropped: None,
            retransmitted: None,
            server_s: None,
            slowest_rank,
            behind_slowest_s,
            param_hash: None,
        });
        if async_ps && (ctl[3] > 0.0 || ctl[4] > 0.0) {
            // The servers' step clock needs this step's push from every worker: push zeros.
            self.grads.fill(0.0);
            self.skipped += 1;
            record.skipped = true;
        } else if ctl[3] > 0.0 || ctl[4] > 0.0 || spike {
            let what = if ctl[3] > 0.0 || spike {
                "loss"
            } else {
                "gradient"
            };
            return self.bad_step(what, *record, t0);
        }
        self.consecutive_bad = 0;
        if loss.is_finite() {
            self.best_loss = Some(self.best_loss.map_or(loss, |b| b.min(loss)));
        }
        if let Some(c) = self.plan.local_clip() {
            // A vote of signs: each worker clips its own gradient (see `Plan::clip_local`).
            clip_to_norm(&mut self.grads, c);
        }
        // With the optimizer on the device, the average is made there too (unless a clip of
        // the averaged gradient needs it on the host first).
        let mean_on_device =
            on_device.is_some() && self.device_moments.is_some() && self.plan.mean_clip().is_none();
        let update = match &on_device {
            Some(g) => self.sync.sync_device(
                &mut self.comm,
                self.model.as_ref(),
                &mut self.grads,
                g,
                mean_on_device,
                step,
                lr,
                &mut record,
            ),
            None => self.sync.sync(
                &mut self.comm,
                self.model.as_ref(),
                &mut self.grads,
                step,
                lr,
                &mut record,
            ),
        }
        .map_err(|e| self.step_error(e))?;
        self.left_exchange = Some(Instant::now());
        let t5 = Instant::now();
        match update {
            Update::Averaged { non_finite: true } => {
                // Identical on every rank (the averaged gradient is), so every rank decides
                // alike.
                return self.bad_step("gradient", *record, t0);
            }
            Update::Averaged { non_finite: false } | Update::Local => {
                if let Some(c) = self.plan.mean_clip() {
                    // The averaged gradient is identical on every rank, so is its clipping
                    // (a local step clips this rank's own gradient).
                    clip_to_norm(&mut self.grads, c);
                }
                match on_device.filter(|_| mean_on_device) {
                    Some(mean) => self.apply_on_device(mean, lr)?,
                    None => {
                        let grads = std::mem::take(&mut self.grads);
                        self.apply(&grads, lr);
                        self.grads = grads;
                    }
                }
            }
            Update::Aggregates(ready) => {
                for r in ready {
                    self.apply_aggregate(r);
                }
            }
        }
        record.time.optimizer_s = t5.elapsed().as_secs_f64();
        // Under live membership: this rank's update of the step is applied.
        self.applied(step, &record);
        self.end_step(step, record, t0)
    }

    /// Step `step` from its update on (applied; its record so far `record`, begun at
    /// `t0`): a periodic synchronisation's round exchange, the comparison of the replicas.
    /// Live membership's survivors of a cut round exchange that can run again
    /// (`GradientSync::reruns_round`) go on from here (see `recovery.rs`).
    pub(super) fn end_step(
        &mut self,
        step: u64,
        mut record: Box<StepRecord>,
        t0: Instant,
    ) -> Result<StepOutcome, TrainError> {
        // A periodic synchronisation ends its round here (the parameter change's exchange
        // adds to the record's communication figures).
        let non_finite = self
            .sync
            .after_update(&mut self.comm, self.model.as_mut(), step, &mut record)
            .map_err(|e| self.step_error(e))?;
        if non_finite {
            return self.bad_step("averaged parameter change", *record, t0);
        }
        self.progressed(step, super::membership::Progress::Exchanged);
        if self.replica_check_due(step) {
            record.time.step_s = t0.elapsed().as_secs_f64();
            match self.check_replicas(step) {
                Ok(hash) => record.param_hash = Some(hash),
                Err(e) => {
                    // The update is applied: under live membership the step is finished,
                    // and its record is kept for the logs.
                    self.keep_unlogged(step, &record);
                    return Err(e);
                }
            }
        }
        record.time.step_s = t0.elapsed().as_secs_f64();
        Ok(StepOutcome::Done(record))
    }

    /// Whether this step's gradient stays on the device as one flat tensor: the worker
    /// trains on a GPU (its optimizer steps there), the synchronisation takes the gradient
    /// where it lies (`GradientSync::reads_device_gradient`: codecs on that device,
    /// `compress.device = "auto"`, or a periodic synchronisation's local steps), and no
    /// rank-local pass needs it whole on the host first (a clip of each worker's own
    /// gradient does).
    fn gradient_stays_on_device(&self) -> bool {
        cfg!(any(feature = "cuda", feature = "wgpu-train"))
            && self.device_moments.is_some()
            && self.plan.local_clip().is_none()
            && self.sync.reads_device_gradient()
    }

    /// The flat gradient tensor `flat` as the exchange's device gradient: its buffer on
    /// the model's device, read in place by the codecs (burn's client, which queues their
    /// kernels behind burn's), once the device has finished computing it.
    fn device_gradient(&self, flat: FlatTensor) -> Result<DeviceGradient, TrainError> {
        let step = self.step;
        #[cfg(any(feature = "cuda", feature = "wgpu-train"))]
        {
            let fail = |reason: String| TrainError::Sync {
                step,
                reason: format!("handing the gradient to the device codecs: {reason}"),
            };
            let cube = dtrain_models::cube::cube_buffer(flat).map_err(fail)?;
            let spec = crate::device::CodecDevice::Auto
                .resolve(
                    self.plan.config.cluster.device,
                    crate::device::local_rank(self.comm.members()[self.comm.rank()]),
                )
                .ok_or_else(|| fail("the worker is not on a GPU".into()))?;
            let gpu = dtrain_device::Gpu::with_client(
                cube.client,
                spec.parse().map_err(|e| fail(format!("{e}")))?,
            );
            let buf = gpu
                .adopt(cube.handle, cube.len)
                .map_err(|e| fail(e.to_string()))?;
            // burn runs its work lazily: without this boundary the backward pass would be
            // timed as the first codec's compression.
            gpu.sync().map_err(|e| fail(e.to_string()))?;
            DeviceGradient::new(gpu, buf).map_err(fail)
        }
        #[cfg(not(any(feature = "cuda", feature = "wgpu-train")))]
        {
            let _ = flat;
            Err(TrainError::Sync {
                step,
                reason: "this build keeps no gradient on a device".into(),
            })
        }
    }

    /// Applies `grads` (identical on every rank) with learning rate `lr`: the update is
    /// written straight into each parameter tensor's storage, with no flat parameter buffer
    /// and no copy back into the module; on a GPU it runs there.
    fn apply(&mut self, grads: &[f32], lr: f64) {
        if let Some(moments) = &mut self.device_moments {
            // On a GPU: the gradient goes up once, the parameters stay there.
            moments.step(&mut self.optimizer, self.model.as_mut(), grads, lr as f32);
            return;
        }
        self.optimizer.begin(0, self.num_params());
        let optimizer = &mut self.optimizer;
        self.model.update_params(&mut |offset, p| {
            optimizer.apply(0, offset, p, &grads[offset..offset + p.len()], lr as f32)
        });
    }

    /// Applies the average `mean` (the device gradient's buffer, which the exchange
    /// overwrote with it) on the device: it becomes a burn tensor in place, and the
    /// optimizer step runs there.
    fn apply_on_device(&mut self, mean: DeviceGradient, lr: f64) -> Result<(), TrainError> {
        let step = self.step;
        let mean = mean
            .into_tensor(self.model.device())
            .map_err(|reason| TrainError::Sync {
                step,
                reason: format!("the average as a tensor on the device: {reason}"),
            })?;
        let moments = self
            .device_moments
            .as_mut()
            .expect("the average is made on the device only with the optimizer there");
        moments.step_tensor(&mut self.optimizer, self.model.as_mut(), mean, lr as f32);
        Ok(())
    }

    /// Applies one parameter-server aggregate (the mean gradient of `r.step`) with that
    /// step's learning rate. A non-finite aggregate is the same on every worker, so every
    /// worker skips it alike.
    pub(super) fn apply_aggregate(&mut self, mut r: Ready) {
        if first_non_finite(&r.grad).is_some() {
            self.skipped += 1;
            return;
        }
        if let Some(c) = self.plan.mean_clip() {
            clip_to_norm(&mut r.grad, c);
        }
        let lr = self.lr_at(r.step);
        self.apply(&r.grad, lr);
    }

    /// The learning rate of `step`.
    pub(super) fn lr_at(&self, step: u64) -> f64 {
        let global_batch = self.plan.config.data.batch_size
            * self.plan.config.train.accumulate.max(1) as usize
            // The configured workers, not the group's size: a smaller group under live
            // membership keeps the schedule.
            * self.plan.config.cluster.workers;
        self.plan.lr.at(
            step as f64 / self.plan.steps_per_epoch as f64,
            self.plan.config.train.epochs as f64,
            global_batch,
        )
    }

    /// Waits for and applies every update still in flight (a parameter server's
    /// aggregates of the steps pushed so far), so that every replica is identical and no
    /// server traffic is in flight before collectives (evaluation, checkpoints). A no-op
    /// where nothing is in flight.
    pub(super) fn drain(&mut self) -> Result<(), TrainError> {
        let ready = self.sync.drain().map_err(|e| self.step_error(e))?;
        for r in ready {
            self.apply_aggregate(r);
        }
        Ok(())
    }

    /// The run ends: applies what is still in flight and leaves the synchronisation.
    pub(super) fn finish_sync(&mut self) -> Result<(), TrainError> {
        let ready = self.sync.finish().map_err(|e| self.step_error(e))?;
        for r in ready {
            self.apply_aggregate(r);
        }
        Ok(())
    }

    /// A synchronisation error at the current step.
    pub(super) fn step_error(&self, e: SyncError) -> TrainError {
        let step = self.step;
        match e {
            SyncError::Comm(source) => TrainError::Comm { step, source },
            SyncError::Exchange(source) => TrainError::Exchange { step, source },
            SyncError::Checkpoint(e) => TrainError::Checkpoint(e),
            SyncError::State(reason) => TrainError::Resume {
                path: "(synchronisation state)".into(),
                reason,
            },
            SyncError::Background(reason) => TrainError::Sync { step, reason },
        }
    }
}

fn mix(a: u64, b: u64, c: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ c.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
