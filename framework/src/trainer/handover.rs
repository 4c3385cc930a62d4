//! Handing the state over to a newcomer (live membership): what a worker that takes a lost
//! worker's place receives from the members, split across them, and checked.
//!
//! ```text
//! every member: its state at the step the newcomer enters (the checkpoint's contents),
//!   less what is its own: error-feedback memories (zeros), the compressed all-reduce's
//!   server residuals and a recurrent model's carried state (dropped), DLCP residuals (zeros)
//! all-gather 1: each member's manifest — every section's name, length and checksum
//! a section whose length and checksum agree on every member is *replicated*: the
//!   replicated sections laid end to end are cut into one slice per member; any other
//!   (BatchNorm statistics, a periodic [sync]'s inner optimizer) comes from the leader
//! gather to the newcomers: member j's slice, sent straight to each newcomer (the leader's
//!   also carries the sections only it sends)
//! the newcomer: every section's checksum against the manifests, then restores the state
//! ```
//!
//! **Split across the members.** The newcomer's link carries the whole state once, in P′
//! slices from P′ senders, each sent directly ([`Communicator::gather_to`]; an all-gather's
//! ring would have the newcomer's neighbour relay it everything): no member sends more
//! than its share, so a newcomer does not choke one donor. **Checked.** The replicated sections are compared by checksum
//! on every member before anything is sent (a member whose replica differs would show up
//! as a section that is not replicated), and every section is checked on arrival against
//! the checksum its sender announced: a newcomer never trains from a state that silently
//! differs. **What starts afresh.** The newcomer's own error-feedback memory starts at zero
//! (what the gradients it has yet to send owe the model: nothing yet), like the elastic
//! rule's new ranks, but without the mean, which would count the members' pending updates
//! twice; its server residuals (for its own range of the compressed all-reduce) start
//! empty; a recurrent model's carried state starts afresh, as on an elastic resume.

use dtrain_comms::{CommError, Communicator, Transport};
use dtrain_records::StepRecord;
use serde::{Deserialize, Serialize};

use super::checkpointing::Meta;
use crate::checkpoint::{checksum, Checkpoint};
use crate::exchange::ExchangerState;
use crate::sync::SERVER_SECTION;

/// One section as a member announces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Entry {
    name: String,
    len: u64,
    sum: u64,
}

/// Whether section `name` is an error-feedback memory (`mem/<id>`, under any prefix).
fn is_memory(name: &str) -> bool {
    name.rsplit_once("mem/").is_some_and(|(head, id)| {
        (head.is_empty() || head.ends_with('/')) && id.parse::<u64>().is_ok()
    })
}

/// Whether section `name` is an exchanger's state (`exchanger`, under any prefix).
fn is_exchanger(name: &str) -> bool {
    name == "exchanger" || name.ends_with("/exchanger")
}

/// Member state `ck` as the newcomers of a group of `world` take it (see the [module
/// docs](self)): identical on every member wherever their replicas are. Its metadata names
/// `rank`, the first newcomer's group rank.
pub(super) fn for_newcomer(
    ck: &Checkpoint,
    rank: usize,
    world: usize,
) -> Result<Checkpoint, String> {
    let mut out = Checkpoint::new();
    for name in ck.names() {
        let bytes = ck.bytes(name).map_err(|e| e.to_string())?;
        if name == "model_state" || name.contains(SERVER_SECTION) {
            continue;
        }
        if is_memory(name) {
            out.put_bytes(name, vec![0; bytes.len()]);
        } else if name == "meta" {
            let mut meta: Meta = ck.json(name).map_err(|e| e.to_string())?;
            meta.rank = rank;
            meta.world = world;
            out.put_json(name, &meta);
        } else if is_exchanger(name) {
            let mut ex: ExchangerState = ck.json(name).map_err(|e| e.to_string())?;
            for r in ex.lossy_residual.values_mut() {
                r.fill(0.0);
            }
            ex.server_memory.clear();
            out.put_json(name, &ex);
        } else {
            out.put_bytes(name, bytes.to_vec());
        }
    }
    Ok(out)
}

/// The section of a newcomer's state holding the group's membership changes so far (the
/// members' `summary.json` history, so that a newcomer that comes to lead writes all of
/// it); not part of a worker's own state.
pub(super) const HISTORY: &str = "live/changes";

fn protocol(detail: String) -> CommError {
    CommError::Poisoned(format!("live membership, handing the state over: {detail}"))
}

/// The transfer (see the [module docs](self)) over `comm`'s group, whose first `donors`
/// ranks are the members and the others the newcomers. A member passes its state for the
/// newcomer ([`for_newcomer`]) and gets `None`; a newcomer passes `None` and gets the state.
pub(super) fn hand_over<T: Transport>(
    comm: &mut Communicator<T>,
    donors: usize,
    state: Option<&Checkpoint>,
) -> Result<Option<(Checkpoint, Vec<String>)>, CommError> {
    let me = comm.rank();
    if donors == 0 || donors >= comm.world_size() {
        return Err(protocol(format!(
            "{donors} members in a group of {}",
            comm.world_size()
        )));
    }
    // 1: the manifests.
    let manifest = state.map_or_else(Vec::new, manifest_of);
    let mine = serde_json::to_vec(&manifest).expect("a manifest serialises");
    let all = comm.all_gather(&mine)?;
    let mut manifests = Vec::with_capacity(donors);
    for (r, b) in all.iter().take(donors).enumerate() {
        let m: Vec<Entry> = serde_json::from_slice(b)
            .map_err(|e| protocol(format!("member {r}'s manifest: {e}")))?;
        manifests.push(m);
    }
    if me < donors && state.is_none() {
        return Err(protocol(format!("member {me} has no state to hand over")));
    }
    let givers: Vec<usize> = (0..donors).collect();
    let takers: Vec<usize> = (donors..comm.world_size()).collect();
    transfer(comm, &givers, &takers, &manifests, state)
}

/// Every section of `ck` as its owner announces it.
pub(super) fn manifest_of(ck: &Checkpoint) -> Vec<Entry> {
    ck.names()
        .map(|n| {
            let b = ck.bytes(n).expect("a listed section");
            Entry {
                name: n.to_string(),
                len: b.len() as u64,
                sum: checksum(b),
            }
        })
        .collect()
}

/// Step 2 of the transfer: the group ranks `donors` (whose manifests, in their order, are
/// `manifests`; a donor passes its `state`) send their slices straight to the group ranks
/// `receivers`, which check every section against the manifests and get the state and the
/// names of the sections that only the first donor sent (those that differ between the
/// donors); a donor gets `None`. Every rank of the group passes the same lists.
fn transfer<T: Transport>(
    comm: &mut Communicator<T>,
    donors: &[usize],
    receivers: &[usize],
    manifests: &[Vec<Entry>],
    state: Option<&Checkpoint>,
) -> Result<Option<(Checkpoint, Vec<String>)>, CommError> {
    let me = comm.rank();
    let leader = &manifests[0];
    if manifests
        .iter()
        .any(|m| m.iter().map(|e| &e.name).ne(leader.iter().map(|e| &e.name)))
    {
        return Err(protocol(
            "the members' states hold different sections".into(),
        ));
    }
    let replicated: Vec<bool> = (0..leader.len())
        .map(|i| manifests.iter().all(|m| m[i] == leader[i]))
        .collect();
    let total: u64 = leader
        .iter()
        .zip(&replicated)
        .filter(|(_, &r)| r)
        .map(|(e, _)| e.len)
        .sum();
    let share = donors.len();
    let cut = |j: usize| (total as u128 * j as u128 / share as u128) as usize;
    let payload = match (donors.iter().position(|&d| d == me), state) {
        (Some(j), Some(ck)) => {
            // This donor's range of the replicated sections laid end to end, copied from
            // the sections it overlaps (not the whole state laid out first).
            let (lo, hi) = (cut(j), cut(j + 1));
            let mut p = Vec::with_capacity(hi - lo);
            let mut at = 0usize;
            for (e, _) in leader.iter().zip(&replicated).filter(|(_, &r)| r) {
                let b = ck.bytes(&e.name).expect("a listed section");
                let (from, to) = (lo.max(at), hi.min(at + b.len()));
                if from < to {
                    p.extend_from_slice(&b[from - at..to - at]);
                }
                at += b.len();
            }
            if j == 0 {
                for (e, _) in leader.iter().zip(&replicated).filter(|(_, &r)| !r) {
                    p.extend_from_slice(ck.bytes(&e.name).expect("a listed section"));
                }
            }
            p
        }
        (Some(j), None) => {
            return Err(protocol(format!(
                "member {} has no state to hand over",
                donors[j]
            )))
        }
        (None, _) => Vec::new(),
    };
    let all = comm.gather_to(&payload, receivers)?;
    if !receivers.contains(&me) {
        return Ok(None);
    }
    let mut blob = Vec::with_capacity(total as usize);
    for (j, &d) in donors.iter().enumerate() {
        let want = cut(j + 1) - cut(j);
        let p = &all[d];
        if p.len() < want {
            return Err(protocol(format!(
                "member {d} sent {} bytes of its slice of {want}",
                p.len()
            )));
        }
        blob.extend_from_slice(&p[..want]);
    }
    let own_only: &[u8] = &all[donors[0]][cut(1) - cut(0)..];
    let mut ck = Checkpoint::new();
    let mut from_leader = Vec::new();
    let (mut at, mut at_own) = (0usize, 0usize);
    for (e, &rep) in leader.iter().zip(&replicated) {
        let len = e.len as usize;
        let (src, pos): (&[u8], &mut usize) = if rep {
            (&blob, &mut at)
        } else {
            from_leader.push(e.name.clone());
            (own_only, &mut at_own)
        };
        let bytes = src
            .get(*pos..*pos + len)
            .ok_or_else(|| protocol(format!("section {:?} is cut short", e.name)))?;
        if checksum(bytes) != e.sum {
            return Err(protocol(format!(
                "section {:?} ({} bytes) does not match its checksum{}",
                e.name,
                len,
                if rep { "" } else { " (from the leader)" }
            )));
        }
        ck.put_bytes(&e.name, bytes.to_vec());
        *pos += len;
    }
    if at_own != own_only.len() {
        return Err(protocol(format!(
            "the leader sent {} bytes past its sections",
            own_only.len() - at_own
        )));
    }
    Ok(Some((ck, from_leader)))
}

/// Whether section `name` is a survivor's own, never taken from another survivor: its
/// error-feedback memories, its server residuals, its BatchNorm statistics (each rank's
/// batches make them) and a recurrent model's carried state (its own batch rows).
fn is_own(name: &str) -> bool {
    is_memory(name) || name.contains(SERVER_SECTION) || name == "model_state" || name == "buffers"
}

/// Survivor state `ck` without what is the survivor's own ([`is_own`]; the exchanger's
/// memories and residuals; the metadata's rank, worker count and memories' ids): what the survivors of
/// a regroup compare, and what one that lags takes from those that do not.
pub(super) fn shared_view(ck: &Checkpoint) -> Result<Checkpoint, String> {
    let mut out = Checkpoint::new();
    for name in ck.names() {
        if is_own(name) {
            continue;
        }
        if name == "meta" {
            let mut meta: Meta = ck.json(name).map_err(|e| e.to_string())?;
            (meta.rank, meta.world) = (0, 0);
            meta.memory_keys.clear();
            out.put_json(name, &meta);
        } else if is_exchanger(name) {
            out.put_json(name, &shared_exchanger(ck, name)?);
        } else {
            out.put_bytes(name, ck.bytes(name).map_err(|e| e.to_string())?.to_vec());
        }
    }
    Ok(out)
}

/// Exchanger section `name` of `ck` without its memories and residuals (each rank's own).
fn shared_exchanger(ck: &Checkpoint, name: &str) -> Result<ExchangerState, String> {
    let mut ex: ExchangerState = ck.json(name).map_err(|e| e.to_string())?;
    ex.memory.clear();
    ex.lossy_residual.clear();
    ex.server_memory.clear();
    Ok(ex)
}

/// Exchanger section `name` of `taken` (another survivor's) with the memories and residuals
/// of `own`'s: the inverse of [`shared_exchanger`].
fn with_own_exchanger(
    own: &Checkpoint,
    taken: &Checkpoint,
    name: &str,
) -> Result<ExchangerState, String> {
    let mine: ExchangerState = own.json(name).map_err(|e| e.to_string())?;
    let mut ex: ExchangerState = taken.json(name).map_err(|e| e.to_string())?;
    ex.memory = mine.memory;
    ex.lossy_residual = mine.lossy_residual;
    ex.server_memory = mine.server_memory;
    Ok(ex)
}

/// The survivors of a round exchange that a lost worker cut, and that runs again (see
/// [`super::recovery`]), make what their exchangers share between ranks — a compressor's
/// state, such as PowerSGD's Q, which the cut may have left updated on some and not on
/// others — the first survivor's on all: those whose differs take it, in slices from all
/// that match it, and keep their memories and residuals. Returns `own` with it.
pub(super) fn agree_exchangers<T: Transport>(
    comm: &mut Communicator<T>,
    mut own: Checkpoint,
) -> Result<Checkpoint, CommError> {
    let mut view = Checkpoint::new();
    let names: Vec<String> = own
        .names()
        .filter(|n| is_exchanger(n))
        .map(str::to_string)
        .collect();
    for name in &names {
        view.put_json(name, &shared_exchanger(&own, name).map_err(protocol)?);
    }
    let manifests: Vec<Vec<Entry>> = gather_standings(comm, &manifest_of(&view))?;
    let donors: Vec<usize> = (0..manifests.len())
        .filter(|&r| manifests[r] == manifests[0])
        .collect();
    let receivers: Vec<usize> = (0..manifests.len())
        .filter(|&r| manifests[r] != manifests[0])
        .collect();
    if receivers.is_empty() {
        return Ok(own);
    }
    let given = vec![manifests[0].clone(); donors.len()];
    let mine = donors.contains(&comm.rank()).then_some(&view);
    if let Some((taken, _)) = transfer(comm, &donors, &receivers, &given, mine)? {
        for name in &names {
            let ex = with_own_exchanger(&own, &taken, name).map_err(protocol)?;
            own.put_json(name, &ex);
        }
    }
    Ok(own)
}

/// `shared` (another survivor's [`shared_view`]) with what is survivor state `own`'s own
/// put back: the state a lagging survivor goes on from.
pub(super) fn merge(own: &Checkpoint, mut shared: Checkpoint) -> Result<Checkpoint, String> {
    for name in own.names() {
        let bytes = own.bytes(name).map_err(|e| e.to_string())?;
        if is_own(name) {
            shared.put_bytes(name, bytes.to_vec());
        } else if name == "meta" {
            let mine: Meta = own.json(name).map_err(|e| e.to_string())?;
            let mut meta: Meta = shared.json(name).map_err(|e| e.to_string())?;
            (meta.rank, meta.world) = (mine.rank, mine.world);
            // The memories it holds: one the others made in the step it lags (a bucket's
            // first compressed exchange) it has not made yet.
            meta.memory_keys = mine.memory_keys;
            shared.put_json(name, &meta);
        } else if is_exchanger(name) {
            let ex = with_own_exchanger(own, &shared, name)?;
            shared.put_json(name, &ex);
        }
    }
    Ok(shared)
}

/// Drops the compressed all-reduce's server residuals from `ck` (its `srv/` sections and
/// the exchanger's record of them): each covers this rank's range of a bucket in the
/// group the state was taken in, and the ranges change with the group. They start afresh
/// over the new ranges, as a newcomer's do; what they owed the model is lost, as a lost
/// worker's memory is.
pub(super) fn drop_server_residuals(ck: &mut Checkpoint) -> Result<(), String> {
    let names: Vec<String> = ck.names().map(str::to_string).collect();
    for name in names {
        if name.contains(SERVER_SECTION) {
            ck.remove(&name);
        } else if is_exchanger(&name) {
            let mut ex: ExchangerState = ck.json(&name).map_err(|e| e.to_string())?;
            if !ex.server_memory.is_empty() {
                ex.server_memory.clear();
                ck.put_json(&name, &ex);
            }
        }
    }
    Ok(())
}

/// The survivors of a regroup roll forward to step `top` (live membership, see
/// [`super::recovery`]): survivor `r` (group rank) finished `done[r]` steps and its
/// [`shared_view`]'s manifest is `manifests[r]`; this one's shared view is `shared` and its
/// state `own`. Those whose shared view differs from the first that finished `top` steps
/// (they lag a step, or their exchange was cut with a compressor state half updated) take
/// it, in slices from all that match it, and keep their own sections ([`merge`]). Returns
/// this survivor's state to go on from when it took one, and the group ranks that did.
pub(super) fn take_shared<T: Transport>(
    comm: &mut Communicator<T>,
    top: u64,
    done: &[u64],
    manifests: &[Vec<Entry>],
    shared: &Checkpoint,
    own: &Checkpoint,
) -> Result<(Option<Checkpoint>, Vec<usize>), CommError> {
    let reference = done
        .iter()
        .position(|&d| d == top)
        .ok_or_else(|| protocol(format!("no survivor finished {top} steps")))?;
    let matches = |r: usize| done[r] == top && manifests[r] == manifests[reference];
    let donors: Vec<usize> = (0..done.len()).filter(|&r| matches(r)).collect();
    let receivers: Vec<usize> = (0..done.len()).filter(|&r| !matches(r)).collect();
    if receivers.is_empty() {
        return Ok((None, receivers));
    }
    let given = vec![manifests[reference].clone(); donors.len()];
    let mine = donors.contains(&comm.rank()).then_some(shared);
    let state = match transfer(comm, &donors, &receivers, &given, mine)? {
        Some((ck, _)) => Some(merge(own, ck).map_err(protocol)?),
        None => None,
    };
    Ok((state, receivers))
}

/// Step records from several survivors: one a step (the first given), in step order.
pub(super) fn by_step(records: impl IntoIterator<Item = StepRecord>) -> Vec<StepRecord> {
    let mut out = std::collections::BTreeMap::new();
    for r in records {
        out.entry(r.step).or_insert(r);
    }
    out.into_values().collect()
}

/// What each survivor says of itself after a regroup (`mine` here), all-gathered: element
/// `r` is group rank `r`'s.
pub(super) fn gather_standings<T: Transport, S: Serialize + serde::de::DeserializeOwned>(
    comm: &mut Communicator<T>,
    mine: &S,
) -> Result<Vec<S>, CommError> {
    let all = comm.all_gather(&serde_json::to_vec(mine).expect("a standing serialises"))?;
    all.iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice(b).map_err(|e| protocol(format!("survivor {r}'s standing: {e}")))
        })
        .collect()
}

/// The first section (by name) whose bytes differ between `a` and `b`, or that only one
/// of them holds.
pub(super) fn first_difference(a: &Checkpoint, b: &Checkpoint) -> Option<String> {
    let names: std::collections::BTreeSet<&str> = a.names().chain(b.names()).collect();
    names
        .into_iter()
        .find(|n| a.bytes(n).ok() != b.bytes(n).ok())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtrain_comms::{channel_mesh, ChannelTransport, CommConfig};

    /// `f` on every rank of an in-process mesh of `n`, each on a thread of its own: their
    /// results in rank order.
    fn on_mesh<R: Send + 'static>(
        n: usize,
        f: impl Fn(Communicator<ChannelTransport>) -> R + Send + Copy + 'static,
    ) -> Vec<R> {
        let handles: Vec<_> = channel_mesh(n)
            .into_iter()
            .map(|t| std::thread::spawn(move || f(Communicator::new(t, CommConfig::default()))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Three members hand their state to a newcomer: the replicated sections arrive split
    /// three ways, the one that differs between them (BatchNorm statistics, say) is the
    /// leader's, and each member sends about a third of the replicated bytes.
    #[test]
    fn a_newcomer_gets_the_members_state_in_slices() {
        let out = on_mesh(4, |mut c| {
            let r = c.rank();
            let state = (r < 3).then(|| {
                let mut ck = Checkpoint::new();
                ck.put_f32("params", &(0..3000).map(|i| i as f32).collect::<Vec<_>>());
                ck.put_bytes("small", vec![7; 5]);
                ck.put_f32("buffers", &[r as f32; 10]);
                ck
            });
            let before = c.total_bytes().sent;
            let got = hand_over(&mut c, 3, state.as_ref()).unwrap();
            (got, c.total_bytes().sent - before)
        });
        for (got, _) in &out[..3] {
            assert!(got.is_none());
        }
        let (ck, from_leader) = out[3].0.clone().unwrap();
        assert_eq!(from_leader, vec!["buffers".to_string()]);
        assert_eq!(ck.f32("buffers").unwrap(), vec![0.0; 10]);
        assert_eq!(ck.f32("params").unwrap()[2999], 2999.0);
        assert_eq!(ck.bytes("small").unwrap(), &[7; 5]);
        // The members' sends: each about a third of the state (and the manifests).
        let state = 3000 * 4;
        for (_, sent) in &out[..3] {
            assert!(*sent < state / 2, "a member sent {sent} of {state} bytes");
        }
    }

    #[test]
    fn a_newcomers_state_drops_what_is_per_rank() {
        let mut ck = Checkpoint::new();
        ck.put_f32("mem/4", &[1.0, 2.0]);
        ck.put_f32("srv/4", &[1.0]);
        ck.put_f32("model_state", &[1.0]);
        ck.put_f32("params", &[3.0]);
        let n = for_newcomer(&ck, 2, 3).unwrap();
        assert_eq!(n.f32("mem/4").unwrap(), vec![0.0, 0.0]);
        assert_eq!(n.f32("params").unwrap(), vec![3.0]);
        assert!(n.bytes("srv/4").is_err() && n.bytes("model_state").is_err());
    }

    /// A survivor's own sections stay its own: the shared view leaves them out, a merge
    /// puts the survivor's back over another's shared view, and the server residuals go.
    #[test]
    fn a_lagging_survivor_takes_the_shared_state_and_keeps_its_own() {
        let state = |p: f32, own: f32| {
            let mut ck = Checkpoint::new();
            ck.put_f32("params", &[p; 3]);
            ck.put_f32("opt/0/m", &[p; 3]);
            ck.put_f32("mem/2", &[own; 2]);
            ck.put_f32("buffers", &[own]);
            ck.put_f32("model_state", &[own]);
            ck.put_f32("srv/2", &[own]);
            ck
        };
        let (ahead, behind) = (state(1.0, 5.0), state(0.0, 7.0));
        let shared = shared_view(&ahead).unwrap();
        assert_eq!(
            shared.names().collect::<Vec<_>>(),
            ["opt/0/m", "params"],
            "only what every survivor holds alike"
        );
        // Another survivor that differs only in what is its own shares the same view.
        let other = shared_view(&state(1.0, 9.0)).unwrap();
        assert_eq!(first_difference(&shared, &other), None);
        let mut merged = merge(&behind, shared).unwrap();
        assert_eq!(merged.f32("params").unwrap(), [1.0; 3]);
        assert_eq!(merged.f32("opt/0/m").unwrap(), [1.0; 3]);
        assert_eq!(merged.f32("mem/2").unwrap(), [7.0; 2]);
        assert_eq!(merged.f32("buffers").unwrap(), [7.0]);
        assert_eq!(merged.f32("model_state").unwrap(), [7.0]);
        drop_server_residuals(&mut merged).unwrap();
        assert!(merged.bytes("srv/2").is_err());
        assert_eq!(merged.f32("mem/2").unwrap(), [7.0; 2]);
    }

    /// Three survivors: rank 2 finished a step fewer; ranks 0 and 1 agree. Rank 2 takes
    /// their shared state in two slices and keeps its memory.
    #[test]
    fn survivors_roll_forward_from_those_that_finished() {
        let out = on_mesh(3, |mut c| {
            let r = c.rank();
            let done = if r == 2 { 4 } else { 5 };
            let mut ck = Checkpoint::new();
            let p = if r == 2 { 0.0 } else { 3.0 };
            ck.put_f32(
                "params",
                &(0..1000).map(|i| i as f32 + p).collect::<Vec<_>>(),
            );
            ck.put_f32("mem/0", &[r as f32; 4]);
            let shared = shared_view(&ck).unwrap();
            let all = gather_standings(&mut c, &(done, manifest_of(&shared))).unwrap();
            let (done, manifests): (Vec<u64>, Vec<Vec<Entry>>) = all.into_iter().unzip();
            let before = c.total_bytes().sent;
            let got = take_shared(&mut c, 5, &done, &manifests, &shared, &ck).unwrap();
            (got, c.total_bytes().sent - before)
        });
        for ((_, receivers), _) in &out {
            assert_eq!(receivers, &[2]);
        }
        assert!(out[0].0 .0.is_none() && out[1].0 .0.is_none());
        let ck = out[2].0 .0.as_ref().unwrap();
        assert_eq!(ck.f32("params").unwrap()[999], 1002.0);
        assert_eq!(ck.f32("mem/0").unwrap(), [2.0; 4]);
        // Each donor sent about half the state.
        for (_, sent) in &out[..2] {
            assert!(*sent < 3000, "a donor sent {sent} bytes");
        }
    }

    /// Three survivors whose exchangers' compressor state differs (a cut exchange updated
    /// it on some): all end with the first one's, each with its own memory.
    #[test]
    fn survivors_agree_on_their_exchangers_shared_state() {
        let out = on_mesh(3, |mut c| {
            let r = c.rank();
            let mut ex = ExchangerState {
                version: ExchangerState::VERSION,
                method: "powersgd".into(),
                memory_kind: "residual".into(),
                plan: Vec::new(),
                theta_scale: 1.0,
                memory: [(0, vec![r as f32; 3])].into(),
                compressors: [(0, [("q/0/0".to_string(), (r.min(1)) as f64)].into())].into(),
                lossy_residual: Default::default(),
                server_memory: Default::default(),
                routes: Vec::new(),
            };
            let mut ck = Checkpoint::new();
            ck.put_json("exchanger", &ex);
            ck.put_f32("params", &[r as f32; 4]);
            let out = agree_exchangers(&mut c, ck).unwrap();
            ex = out.json("exchanger").unwrap();
            (ex, out.f32("params").unwrap())
        });
        for (r, (ex, params)) in out.into_iter().enumerate() {
            assert_eq!(ex.compressors[&0]["q/0/0"], 0.0, "rank {r} has rank 0's Q");
            assert_eq!(
                ex.memory[&0],
                vec![r as f32; 3],
                "rank {r} keeps its memory"
            );
            assert_eq!(params, vec![r as f32; 4], "only the exchanger is agreed on");
        }
    }

    #[test]
    fn memories_are_told_apart_from_other_sections() {
        assert!(is_memory("mem/3"));
        assert!(is_memory("dense/mem/12"));
        assert!(!is_memory("mem/x"));
        assert!(!is_memory("opt/mem/"));
        assert!(!is_memory("summem/3"));
        assert!(is_exchanger("exchanger"));
        assert!(is_exchanger("dense/exchanger"));
        assert!(!is_exchanger("exchangers"));
    }
}
