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
use serde::{Deserialize, Serialize};

use super::checkpointing::Meta;
use crate::checkpoint::{checksum, Checkpoint};
use crate::exchange::ExchangerState;
use crate::sync::SERVER_SECTION;

/// One section as a member announces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
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
    CommError::Poisoned(format!("handing the state over to a newcomer: {detail}"))
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
    let manifest: Vec<Entry> = state.map_or_else(Vec::new, |ck| {
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
    });
    let mine = serde_json::to_vec(&manifest).expect("a manifest serialises");
    let all = comm.all_gather(&mine)?;
    let mut manifests = Vec::with_capacity(donors);
    for (r, b) in all.iter().take(donors).enumerate() {
        let m: Vec<Entry> = serde_json::from_slice(b)
            .map_err(|e| protocol(format!("member {r}'s manifest: {e}")))?;
        manifests.push(m);
    }
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
    let cut = |j: usize| (total as u128 * j as u128 / donors as u128) as usize;
    // 2: the slices.
    let payload = match state {
        Some(ck) if me < donors => {
            // This member's range of the replicated sections laid end to end, copied
            // from the sections it overlaps (not the whole state laid out first).
            let (lo, hi) = (cut(me), cut(me + 1));
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
            if me == 0 {
                for (e, _) in leader.iter().zip(&replicated).filter(|(_, &r)| !r) {
                    p.extend_from_slice(ck.bytes(&e.name).expect("a listed section"));
                }
            }
            p
        }
        Some(_) | None if me < donors => {
            return Err(protocol(format!("member {me} has no state to hand over")))
        }
        _ => Vec::new(),
    };
    let newcomers: Vec<usize> = (donors..comm.world_size()).collect();
    let all = comm.gather_to(&payload, &newcomers)?;
    if me < donors {
        return Ok(None);
    }
    let mut blob = Vec::with_capacity(total as usize);
    for (j, p) in all.iter().take(donors).enumerate() {
        let want = cut(j + 1) - cut(j);
        if p.len() < want {
            return Err(protocol(format!(
                "member {j} sent {} bytes of its slice of {want}",
                p.len()
            )));
        }
        blob.extend_from_slice(&p[..want]);
    }
    let own_only: &[u8] = &all[0][cut(1) - cut(0)..];
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
    use dtrain_comms::{channel_mesh, CommConfig};

    /// Three members hand their state to a newcomer: the replicated sections arrive split
    /// three ways, the one that differs between them (BatchNorm statistics, say) is the
    /// leader's, and each member sends about a third of the replicated bytes.
    #[test]
    fn a_newcomer_gets_the_members_state_in_slices() {
        let handles: Vec<_> = channel_mesh(4)
            .into_iter()
            .map(|t| {
                std::thread::spawn(move || {
                    let mut c = Communicator::new(t, CommConfig::default());
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
                })
            })
            .collect();
        let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
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
