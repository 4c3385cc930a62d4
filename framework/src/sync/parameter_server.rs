//! Synchronisation through the parameter server (`[cluster] mode = "ps"`, see
//! [`crate::ps_mode`]): every step's gradient is pushed to the servers and their
//! aggregates are applied as they arrive, each with its own step's learning rate.

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::Collective;
use dtrain_models::Model;
use serde::{Deserialize, Serialize};

use super::{GradientSync, SyncError, Update};
use crate::checkpoint::Checkpoint;
use crate::ps_mode::{PsCodecState, PsState, Ready};
use dtrain_compress::sharded::ServerState;
use dtrain_records::StepRecord;

/// The parameter-server path.
pub(crate) struct ParameterServer<T: Transport> {
    ps: PsState<T>,
}

impl<T: Transport> ParameterServer<T> {
    /// Synchronises through the joined parameter server `ps`.
    pub(crate) fn new(ps: PsState<T>) -> Self {
        ParameterServer { ps }
    }
}

/// The scalar part of the server state of a method with its own protocol (section
/// `ps/<kind>/server`; the state's named sections are the raw sections `ps/<kind>/<name>`,
/// e.g. MIPD's `smoothed`, `carry` and `received`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct ServerMeta {
    /// The shard the rank serves.
    shard: usize,
    /// The server's next step (the checkpoint's step).
    next_step: u64,
}

/// The name of the meta section among a server's sections.
const META: &str = "server";

impl<T: Transport> GradientSync<T> for ParameterServer<T> {
    fn lockstep(&self) -> bool {
        self.ps.staleness() == 0
    }

    fn scans_gradient(&self) -> bool {
        true
    }

    fn sync(
        &mut self,
        _comm: &mut Communicator<T>,
        model: &dyn Model,
        grads: &mut [f32],
        step: u64,
        _lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        let (ready, pst) = self
            .ps
            .step(step, |p| model.read_params(p), grads)
            .map_err(SyncError::Comm)?;
        record.server_s = Some(pst.server_s);
        let time = &mut record.time;
        time.compress_s = pst.encode_s;
        time.communicate_s += pst.communicate_s;
        time.wait_s = pst.communicate_s;
        time.decompress_s = pst.decode_s;
        record.bytes_sent = pst.bytes_sent;
        record.bytes_received = pst.bytes_received;
        record.payload_bytes = pst.payload_bytes;
        Ok(Update::Aggregates(ready))
    }

    fn drain(&mut self) -> Result<Vec<Ready>, SyncError> {
        self.ps.drain().map_err(SyncError::Comm)
    }

    fn finish(&mut self) -> Result<Vec<Ready>, SyncError> {
        self.ps.finish().map_err(SyncError::Comm)
    }

    fn start_at(&mut self, step: u64) -> Result<(), SyncError> {
        // The servers count trainer steps: every rank restarts the clock here.
        self.ps.start_at(step).map_err(SyncError::Comm)
    }

    fn collectives(&self) -> (Collective, Vec<Collective>) {
        (Collective::ParameterServer, Vec::new())
    }

    fn theta_scale(&self) -> f64 {
        1.0
    }

    fn scale_theta(&mut self, _factor: f64) {}

    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError> {
        // Compressed pushes: each shard's compressor state (JSON) and memory (raw f32); a
        // method with its own protocol: its worker residual, and the server state of the
        // shard this rank serves.
        let st = self.ps.export_state();
        ck.put_json("ps/state", &st);
        for (k, v) in &st.memory {
            ck.put_f32(&format!("ps/mem/{k}"), v);
        }
        if let Some((shard, server)) = &st.server {
            let prefix = format!("ps/{}/", self.ps.method());
            ck.put_json(
                &format!("{prefix}{META}"),
                &ServerMeta {
                    shard: *shard,
                    next_step: server.next_step,
                },
            );
            for (name, bytes) in &server.sections {
                ck.put_bytes(&format!("{prefix}{name}"), bytes.clone());
            }
        }
        // The memories here are per shard, named `ps/mem/…`; none is an exchanger's.
        Ok(Vec::new())
    }

    fn restore(
        &mut self,
        ck: &Checkpoint,
        _memory_keys: &[u64],
        step: u64,
    ) -> Result<(), SyncError> {
        let bad = SyncError::State;
        let names: Vec<String> = ck.names().map(|n| n.to_string()).collect();
        let mut st: PsCodecState = if names.iter().any(|n| n == "ps/state") {
            ck.json("ps/state")?
        } else {
            Default::default()
        };
        for n in &names {
            if let Some(k) = n.strip_prefix("ps/mem/") {
                let k: u64 = k
                    .parse()
                    .map_err(|_| bad(format!("bad section name {n:?}")))?;
                st.memory.insert(k, ck.f32(n)?);
            }
        }
        let prefix = format!("ps/{}/", self.ps.method());
        let meta = format!("{prefix}{META}");
        if names.contains(&meta) {
            let m: ServerMeta = ck.json(&meta)?;
            if m.next_step != step {
                return Err(bad(format!(
                    "its {} server state is at step {}, the checkpoint at step {step}",
                    self.ps.method(),
                    m.next_step
                )));
            }
            let mut server = ServerState {
                next_step: m.next_step,
                ..ServerState::default()
            };
            for n in &names {
                if let Some(name) = n.strip_prefix(&prefix).filter(|&s| s != META) {
                    server
                        .sections
                        .insert(name.to_string(), ck.bytes(n)?.to_vec());
                }
            }
            st.server = Some((m.shard, server));
        }
        self.ps.import_state(st).map_err(bad)
    }
}
