//! Synchronisation through collectives: the [`Exchanger`] averages every step's gradient
//! in place, identically on every rank.

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::compressor::first_non_finite;
use dtrain_compress::Collective;
use dtrain_models::Model;

use super::periodic::{PeriodicState, PERIODIC_SECTION};
use super::{GradientSync, SyncError, Update};
use crate::checkpoint::Checkpoint;
use crate::exchange::{DeviceGradient, Exchanger, ExchangerState};
use dtrain_records::StepRecord;

/// The collective path (`[cluster] mode = "collective"`).
pub(crate) struct Collectives {
    exchanger: Exchanger,
}

/// Prefix of the compressed all-reduce's server-residual sections.
pub(crate) const SERVER_SECTION: &str = "srv/";

impl Collectives {
    /// Synchronises through `exchanger`.
    pub(crate) fn new(exchanger: Exchanger) -> Self {
        Collectives { exchanger }
    }

    /// Multiplies the method's θ by `factor` (the recover policy).
    pub(super) fn scale_exchanger_theta(&mut self, factor: f64) {
        self.exchanger.scale_theta(factor);
    }

    /// Averages `buf` (this rank's gradient of `step`, or a periodic synchronisation's
    /// parameter change) in place through the exchanger, records the phase times, bytes
    /// and the method's figures in `record`, and says whether the average is non-finite.
    pub(super) fn exchange<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        buf: &mut [f32],
        step: u64,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        self.exchange_with(comm, buf, None, step, false, record)
    }

    /// [`Collectives::exchange`]; `prechecked`: every rank's `buf` was checked for
    /// non-finite values ([`Exchanger::exchange_checked`]); with `on_device` the gradient
    /// is that one, on the device ([`Exchanger::exchange_device`]), and `buf` receives the
    /// average — or, where the pair's flag says so, the device buffer does.
    fn exchange_with<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        buf: &mut [f32],
        on_device: Option<(&DeviceGradient, bool)>,
        step: u64,
        prechecked: bool,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        let st = match on_device {
            Some((g, mean_there)) => self
                .exchanger
                .exchange_device(comm, buf, g, mean_there, step, prechecked),
            None => self.exchanger.exchange_checked(comm, buf, step, prechecked),
        }
        .map_err(SyncError::Exchange)?;
        let time = &mut record.time;
        time.compress_s = st.compress_s;
        time.communicate_s += st.communicate_s;
        time.decompress_s = st.decompress_s;
        time.wait_s = st.wait_s;
        if let Some((name, v)) = self.exchanger.ratio_metric() {
            record.ratio_name = Some(name.to_string());
            record.ratio = Some(v);
        }
        record.bytes_sent = st.bytes_sent;
        record.bytes_received = st.bytes_received;
        record.payload_bytes = st.payload_bytes;
        // With DLCP the step records carry its drops.
        if self.exchanger.is_lossy() {
            record.lossy_dropped = Some(if st.lossy_elems > 0 {
                st.lossy_dropped as f64 / st.lossy_elems as f64
            } else {
                0.0
            });
            record.retransmitted = Some(st.retransmitted);
        }
        let non_finite = st
            .non_finite
            .unwrap_or_else(|| first_non_finite(buf).is_some());
        Ok(non_finite)
    }

    /// Restores the exchanger's part of a checkpoint (`exchanger`, `mem/*`, `srv/*`).
    pub(super) fn restore_exchanger(
        &mut self,
        ck: &Checkpoint,
        memory_keys: &[u64],
    ) -> Result<(), SyncError> {
        self.restore_in(ck, "", memory_keys)
    }

    /// [`Collectives::restore_exchanger`] from the sections under `prefix` (what
    /// [`Collectives::save_in`] wrote there).
    pub(super) fn restore_in(
        &mut self,
        ck: &Checkpoint,
        prefix: &str,
        memory_keys: &[u64],
    ) -> Result<(), SyncError> {
        let mut ex: ExchangerState = ck.json(&format!("{prefix}exchanger"))?;
        for key in memory_keys {
            ex.memory
                .insert(*key, ck.f32(&format!("{prefix}mem/{key}"))?);
        }
        let server_prefix = format!("{prefix}{SERVER_SECTION}");
        let servers: Vec<(u64, String)> = ck
            .names()
            .filter_map(|n| {
                let key = n.strip_prefix(server_prefix.as_str())?;
                Some((key.parse().ok()?, n.to_string()))
            })
            .collect();
        for (key, name) in servers {
            ex.server_memory.insert(key, ck.f32(&name)?);
        }
        self.exchanger.import_state(ex).map_err(SyncError::State)
    }

    /// Writes the exchanger's state into `ck` under `prefix` (`{prefix}exchanger`,
    /// `{prefix}mem/<bucket>`, `{prefix}srv/<bucket>`) and returns the per-rank memories'
    /// keys.
    pub(super) fn save_in(&self, ck: &mut Checkpoint, prefix: &str) -> Result<Vec<u64>, SyncError> {
        let mut ex = self.exchanger.export_state().map_err(SyncError::Exchange)?;
        // The memories are large: stored as raw f32 sections, not JSON.
        let mem = std::mem::take(&mut ex.memory);
        let srv = std::mem::take(&mut ex.server_memory);
        ck.put_json(&format!("{prefix}exchanger"), &ex);
        for (k, v) in &mem {
            ck.put_f32(&format!("{prefix}mem/{k}"), v);
        }
        for (k, v) in &srv {
            ck.put_f32(&format!("{prefix}{SERVER_SECTION}{k}"), v);
        }
        Ok(mem.keys().copied().collect())
    }

    /// Empties every error-feedback memory ([`Exchanger::clear_memories`]).
    pub(super) fn clear_memories(&mut self) {
        self.exchanger.clear_memories();
    }
}

impl<T: Transport> GradientSync<T> for Collectives {
    fn lockstep(&self) -> bool {
        true
    }

    fn scans_gradient(&self) -> bool {
        !self.exchanger.is_dense()
    }

    fn sync(
        &mut self,
        comm: &mut Communicator<T>,
        _model: &dyn Model,
        grads: &mut [f32],
        step: u64,
        _lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        // The trainer scanned `grads` on every rank when this exchange needs it
        // (`scans_gradient`), and a step with a non-finite gradient does not get here.
        let prechecked = GradientSync::<T>::scans_gradient(self);
        let non_finite = self.exchange_with(comm, grads, None, step, prechecked, record)?;
        Ok(Update::Averaged { non_finite })
    }

    fn reads_device_gradient(&self) -> bool {
        self.exchanger.reads_device_gradient()
    }

    fn sync_device(
        &mut self,
        comm: &mut Communicator<T>,
        _model: &dyn Model,
        grads: &mut [f32],
        on_device: &DeviceGradient,
        mean_to_device: bool,
        step: u64,
        _lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        // As `sync`: the trainer scanned the device gradient (`scans_gradient`).
        let prechecked = GradientSync::<T>::scans_gradient(self);
        let on_device = Some((on_device, mean_to_device));
        let non_finite = self.exchange_with(comm, grads, on_device, step, prechecked, record)?;
        Ok(Update::Averaged { non_finite })
    }

    fn collectives(&self) -> (Collective, Vec<Collective>) {
        let per_bucket = self.exchanger.collectives();
        let main = per_bucket
            .iter()
            .copied()
            .find(|c| !c.is_dense())
            .or_else(|| per_bucket.first().copied())
            .unwrap_or(Collective::AllReduce);
        if per_bucket.iter().all(|&c| c == main) {
            (main, Vec::new())
        } else {
            (main, per_bucket)
        }
    }

    fn theta_scale(&self) -> f64 {
        self.exchanger.theta_scale()
    }

    fn scale_theta(&mut self, factor: f64) {
        self.scale_exchanger_theta(factor);
    }

    /// Checkpoint sections are `mem/<bucket>` (worker memories, whose keys the checkpoint
    /// lists) and `srv/<bucket>` (the compressed all-reduce's server residuals, found by
    /// name).
    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError> {
        self.save_in(ck, "")
    }

    fn restore(
        &mut self,
        ck: &Checkpoint,
        memory_keys: &[u64],
        _step: u64,
    ) -> Result<(), SyncError> {
        if ck.names().any(|n| n == PERIODIC_SECTION) {
            let st: PeriodicState = ck.json(PERIODIC_SECTION)?;
            if !st.identical {
                return Err(SyncError::State(format!(
                    "it was written between two synchronisations of sync.kind = {:?} (the \
                     replicas differ); resume with that [sync] table, or from a checkpoint at \
                     a synchronisation",
                    st.kind
                )));
            }
        }
        self.restore_exchanger(ck, memory_keys)
    }
}
