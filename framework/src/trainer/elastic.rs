//! Resuming a checkpoint written by P workers on P′ ≠ P workers: the redistribution rule.
//!
//! | state | how it carries over |
//! |-------|---------------------|
//! | parameters, optimizer state (momentum, Adam moments and step counts), the recover policy's counters and θ scale | replicated: rank 0's, exactly |
//! | schedules (learning rate, θ, DGC warm-up), RNG streams | functions of `(seed, step, rank, bucket)`: nothing to carry; the new ranks draw their own streams |
//! | data position | in samples: the run continues the epoch at the sample where the checkpoint left it (below) |
//! | error-feedback memories — residual, DGC momentum and velocity, ScaleCom's low-pass filter, local momentum — and DLCP's dropped-value residual | per rank: **every new rank starts with the mean of the P old ranks' memories** |
//! | the compressed all-reduce's server residuals (each old rank's, for its range of a bucket) | laid end to end in rank order (the ranges tile the bucket), scaled by P′/P, and cut into the P′ new ranges: each new rank gets its own |
//! | BatchNorm running statistics | the mean over the old ranks (what evaluation uses anyway) |
//! | compressor state (FFT's θ, PowerSGD's warm-started Q) | identical on every old rank (it is derived from all-reduced values), carried from rank 0; where the ranks' states differ, refused, naming the method |
//! | a periodic `[sync]` kind's anchor and outer momentum (local SGD, DiLoCo) | identical on every rank: rank 0's; the inner optimizer's state is rank 0's too (each rank's own between rounds). Refused when written between two synchronisations: each rank's parameters are then its own |
//! | parameter-server state, a recurrent model's carried state | refused mid-epoch, see below |
//!
//! **Why the mean.** Every memory above is linear in the gradients: it holds, per rank, what
//! that rank has yet to send (or its momentum). The averaged update the replicas apply is
//! `(1/P)·Σ_r sent_r`, so what the P ranks still owe the model is `(1/P)·Σ_r e_r`. Giving each
//! of the P′ new ranks `ē = (1/P)·Σ_r e_r` makes `(1/P′)·Σ_r′ ē = ē`: the pending update is
//! preserved exactly (up to f32 rounding; the sums are taken in f64 in rank order, so every
//! new rank computes the same `ē`). Nothing is lost and nothing is counted twice.
//!
//! **Server residuals.** An owner of the compressed all-reduce re-encodes the *sum* of its
//! range's shares plus its residual, and the replicas apply the sum divided by the worker
//! count: a server residual `s` owes the model `s/P`. Laid end to end, the old owners'
//! residuals are one vector over the bucket; scaled by P′/P it owes the P′ new replicas the
//! same update, and each new owner takes the part of it in its new range.
//!
//! **Data position.** The checkpoint of step `s` by P workers with per-worker batch `b` and
//! `S` steps per epoch is `j = s mod S` steps into epoch `e = s div S`: the first `pos =
//! j·b·P` samples of the epoch's permutation were used. With P′ workers (`S′` steps an
//! epoch, `b·P′` samples a step), the run continues at step `s′ = (e+1)·S′ − R`, where `R =
//! ⌊(S′·b·P′ − pos) / (b·P′)⌋` full steps remain in the epoch, and those steps read the
//! permutation from position `pos` on ([`crate::data::TrainData::shift_epoch`]). Later
//! epochs are the usual ones of P′ workers. As at any epoch's end, the fewer than `b·P′`
//! samples left over are not used. Language-model data is cut into BPTT rows per rank, and
//! the model carries state along them: a different worker count resumes it only from an
//! epoch-boundary checkpoint (the carried state then starts afresh).

use std::collections::BTreeMap;
use std::path::Path;

use super::checkpointing::Meta;
use crate::checkpoint::Checkpoint;
use crate::exchange::ExchangerState;
use crate::sync::SERVER_SECTION;

/// Why a checkpoint cannot resume on the new worker count, or what went wrong reading it.
pub(super) type Refusal = String;

/// Rank 0's checkpoint `ck0` (of `dir`, with metadata `meta0`) with every per-rank state
/// replaced by its mean over the `meta0.world` ranks' files of `dir` (see the module
/// table): error-feedback memories, DLCP residuals, BatchNorm buffers; and with the server
/// residuals of rank `to.0` of `to.1` workers. Refuses compressor states that differ
/// between ranks, naming `method`.
pub(super) fn combine(
    dir: &Path,
    meta0: &Meta,
    ck0: &Checkpoint,
    method: &str,
    to: (usize, usize),
) -> Result<Checkpoint, Refusal> {
    let p = meta0.world;
    let mut servers: BTreeMap<String, Vec<Vec<f32>>> = BTreeMap::new();
    let ex0: Option<ExchangerState> = ck0.json("exchanger").ok();
    let mut memories: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    let mut lossy: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    let mut buffers: Vec<f64> = Vec::new();
    for rank in 0..p {
        let loaded;
        let ck = if rank == 0 {
            ck0
        } else {
            let path = dir.join(format!("rank-{rank}.ckpt"));
            loaded = Checkpoint::load(&path).map_err(|e| {
                format!("its per-rank state is redistributed from every rank's file: {e}")
            })?;
            let meta: Meta = loaded.json("meta").map_err(|e| e.to_string())?;
            if (meta.step, meta.world, meta.rank) != (meta0.step, p, rank)
                || meta.memory_keys != meta0.memory_keys
            {
                return Err(format!(
                    "{} does not belong with rank 0's file (rank {} of {} at step {})",
                    path.display(),
                    meta.rank,
                    meta.world,
                    meta.step
                ));
            }
            &loaded
        };
        for key in &meta0.memory_keys {
            add(
                memories.entry(*key).or_default(),
                &ck.f32(&format!("mem/{key}")).map_err(|e| e.to_string())?,
            )?;
        }
        add(&mut buffers, &ck.f32("buffers").map_err(|e| e.to_string())?)?;
        for name in ck.names().filter(|n| n.starts_with(SERVER_SECTION)) {
            let part = ck.f32(name).map_err(|e| e.to_string())?;
            servers.entry(name.to_string()).or_default().push(part);
        }
        if let Some(ex0) = &ex0 {
            let ex: ExchangerState = ck.json("exchanger").map_err(|e| e.to_string())?;
            if ex.compressors != ex0.compressors || ex.theta_scale != ex0.theta_scale {
                return Err(format!(
                    "compress.kind = {method:?} keeps compressor state that differs between \
                     the ranks, and no rule redistributes it to another worker count"
                ));
            }
            for (id, r) in &ex.lossy_residual {
                add(lossy.entry(*id).or_default(), r)?;
            }
        }
    }
    let mean = |sum: &[f64]| -> Vec<f32> { sum.iter().map(|x| (x / p as f64) as f32).collect() };
    let mut out = ck0.clone();
    for (key, sum) in &memories {
        out.put_f32(&format!("mem/{key}"), &mean(sum));
    }
    out.put_f32("buffers", &mean(&buffers));
    let (rank, world) = to;
    for (name, parts) in &servers {
        let whole: Vec<f32> = parts.concat();
        let tiles = parts.len() == p
            && parts.iter().enumerate().all(|(r, part)| {
                part.len() == dtrain_comms::segment_range(whole.len(), p, r).len()
            });
        if !tiles {
            return Err(format!(
                "the ranks' {name} sections do not tile a bucket of {} values in rank order",
                whole.len()
            ));
        }
        let range = dtrain_comms::segment_range(whole.len(), world, rank);
        let scale = world as f64 / p as f64;
        let mine: Vec<f32> = whole[range]
            .iter()
            .map(|&x| (x as f64 * scale) as f32)
            .collect();
        out.put_f32(name, &mine);
    }
    if let Some(mut ex) = ex0 {
        ex.lossy_residual = lossy.iter().map(|(id, s)| (*id, mean(s))).collect();
        out.put_json("exchanger", &ex);
    }
    Ok(out)
}

/// Adds `v` into the running sum `sum` (empty: the first), element by element.
fn add(sum: &mut Vec<f64>, v: &[f32]) -> Result<(), Refusal> {
    if sum.is_empty() {
        sum.extend(v.iter().map(|&x| x as f64));
        return Ok(());
    }
    if sum.len() != v.len() {
        return Err(format!(
            "the ranks' per-rank states differ in length ({} and {} values)",
            sum.len(),
            v.len()
        ));
    }
    for (s, &x) in sum.iter_mut().zip(v) {
        *s += x as f64;
    }
    Ok(())
}

/// Where a run of `world` workers, `steps_per_epoch` steps an epoch and per-worker batch
/// `batch`, continues from the checkpoint of `meta` (see the module docs): the step, and
/// the epoch to shift with its shift (`None` at an epoch boundary).
pub(super) fn position(
    meta: &Meta,
    batch: u64,
    world: u64,
    steps_per_epoch: u64,
) -> (u64, Option<(u64, i64)>) {
    let (epoch, j) = (
        meta.step / meta.steps_per_epoch,
        meta.step % meta.steps_per_epoch,
    );
    if j == 0 {
        return (epoch * steps_per_epoch, None);
    }
    let pos = j * batch * meta.world as u64;
    let per = batch * world;
    let remaining = (steps_per_epoch * per).saturating_sub(pos) / per;
    if remaining == 0 {
        // Less than one step of this worker count is left in the epoch.
        return ((epoch + 1) * steps_per_epoch, None);
    }
    let first = steps_per_epoch - remaining;
    let delta = pos as i64 - (first * per) as i64;
    (epoch * steps_per_epoch + first, Some((epoch, delta)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(step: u64, world: usize, steps_per_epoch: u64) -> Meta {
        Meta {
            step,
            world,
            rank: 0,
            seed: 1,
            params: 0,
            buffers: 0,
            method: "topk".into(),
            optimizer_steps: BTreeMap::new(),
            memory_keys: Vec::new(),
            skipped: 0,
            recoveries: 0,
            best_loss_bits: None,
            steps_per_epoch,
            replicas_checked_at: 0,
        }
    }

    #[test]
    fn the_data_position_carries_over_in_samples() {
        // 512 samples, batch 8. Two workers (32 steps an epoch), 5 steps into epoch 1:
        // 80 samples used. Four workers (16 steps, 32 samples a step): 13 full steps are
        // left (432 samples), from step 16 + 3, shifted by 80 − 3·32 = −16.
        assert_eq!(position(&meta(37, 2, 32), 8, 4, 16), (19, Some((1, -16))));
        // Four to two, 3 steps in (96 samples): step 32 + 6, no shift needed.
        assert_eq!(position(&meta(19, 4, 16), 8, 2, 32), (38, Some((1, 0))));
        // At an epoch boundary: the first step of the epoch.
        assert_eq!(position(&meta(32, 2, 32), 8, 4, 16), (16, None));
        // Less than one step left at the new count: the next epoch.
        assert_eq!(position(&meta(63, 2, 32), 8, 4, 16), (32, None));
    }

    fn write(dir: &Path, rank: usize, mem: &[f32], lossy: &[f32], q: f64) {
        let mut m = meta(5, 2, 32);
        m.rank = rank;
        m.memory_keys = vec![3];
        let mut ck = Checkpoint::new();
        ck.put_json("meta", &m);
        ck.put_f32("mem/3", mem);
        ck.put_f32("buffers", &[rank as f32]);
        let ex = ExchangerState {
            version: ExchangerState::VERSION,
            method: "topk".into(),
            memory_kind: "residual".into(),
            plan: Vec::new(),
            theta_scale: 1.0,
            memory: BTreeMap::new(),
            server_memory: BTreeMap::new(),
            routes: Vec::new(),
            compressors: BTreeMap::from([(3, BTreeMap::from([("q/0/0".to_string(), q)]))]),
            lossy_residual: BTreeMap::from([(4, lossy.to_vec())]),
        };
        ck.put_json("exchanger", &ex);
        ck.save(&dir.join(format!("rank-{rank}.ckpt"))).unwrap();
    }

    #[test]
    fn per_rank_state_becomes_the_mean_of_the_ranks() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 0, &[1.0, -2.0, 0.5], &[4.0], 0.25);
        write(dir.path(), 1, &[3.0, 2.0, 0.0], &[-1.0], 0.25);
        let ck0 = Checkpoint::load(&dir.path().join("rank-0.ckpt")).unwrap();
        let m0: Meta = ck0.json("meta").unwrap();
        let out = combine(dir.path(), &m0, &ck0, "topk", (0, 3)).unwrap();
        assert_eq!(out.f32("mem/3").unwrap(), [2.0, 0.0, 0.25]);
        assert_eq!(out.f32("buffers").unwrap(), [0.5]);
        let ex: ExchangerState = out.json("exchanger").unwrap();
        assert_eq!(ex.lossy_residual[&4], [1.5]);
        // The pending update is preserved: P' ranks holding the mean owe what P did.
        let owed = |mems: &[&[f32]]| -> Vec<f64> {
            (0..3)
                .map(|i| mems.iter().map(|m| m[i] as f64).sum::<f64>() / mems.len() as f64)
                .collect()
        };
        let mean = out.f32("mem/3").unwrap();
        assert_eq!(
            owed(&[&[1.0, -2.0, 0.5], &[3.0, 2.0, 0.0]]),
            owed(&[&mean, &mean, &mean])
        );

        // Compressor state that differs between ranks has no rule: refused, naming it.
        write(dir.path(), 1, &[3.0, 2.0, 0.0], &[-1.0], 0.5);
        let e = combine(dir.path(), &m0, &ck0, "powersgd", (0, 3)).unwrap_err();
        assert!(e.contains("\"powersgd\"") && e.contains("differs"), "{e}");
        // Server residuals: rank order, scaled by P'/P, cut into the new ranges.
        let srv = |dir: &Path, rank: usize, part: &[f32]| {
            let path = dir.join(format!("rank-{rank}.ckpt"));
            let mut ck = Checkpoint::load(&path).unwrap();
            ck.put_f32("srv/3", part);
            ck.save(&path).unwrap();
        };
        write(dir.path(), 1, &[3.0, 2.0, 0.0], &[-1.0], 0.25);
        // 5 values on 2 ranks: 3 + 2.
        srv(dir.path(), 0, &[1.0, 2.0, 3.0]);
        srv(dir.path(), 1, &[4.0, 5.0]);
        let ck0 = Checkpoint::load(&dir.path().join("rank-0.ckpt")).unwrap();
        let on = |rank, world| {
            combine(dir.path(), &m0, &ck0, "onebit", (rank, world))
                .unwrap()
                .f32("srv/3")
                .unwrap()
        };
        // Three ranks: 2 + 2 + 1 values, times 3/2.
        assert_eq!(on(0, 3), [1.5, 3.0]);
        assert_eq!(on(1, 3), [4.5, 6.0]);
        assert_eq!(on(2, 3), [7.5]);
        // One rank: all of it, halved; what the replicas owe (s/P) is unchanged.
        assert_eq!(on(0, 1), [0.5, 1.0, 1.5, 2.0, 2.5]);
        // Ranges that do not tile the bucket are refused.
        srv(dir.path(), 1, &[4.0]);
        let e = combine(dir.path(), &m0, &ck0, "onebit", (0, 3)).unwrap_err();
        assert!(e.contains("srv/3") && e.contains("tile"), "{e}");

        // A missing rank file is named.
        std::fs::remove_file(dir.path().join("rank-1.ckpt")).unwrap();
        let e = combine(dir.path(), &m0, &ck0, "topk", (0, 3)).unwrap_err();
        assert!(e.contains("rank-1.ckpt"), "{e}");
    }
}
