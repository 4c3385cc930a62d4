//! Live membership: survivors of a failure agree on a smaller group on the same
//! connections and go on (`Communicator::regroup`).

use std::thread;
use std::time::Duration;

use dtrain_comms::{
    channel_mesh, ChannelTransport, CommConfig, CommError, Communicator, Membership,
};

fn quick() -> CommConfig {
    CommConfig {
        timeout: Duration::from_millis(800),
        abort_grace: Duration::from_millis(200),
        // Small chunks: a ring all-reduce of the vectors below takes many messages, so a
        // peer lost in the middle leaves some of them in flight.
        chunk_bytes: 256,
        ..CommConfig::default()
    }
}

/// Runs `body` on each of `n` ranks (threads over channels) with its communicator; their
/// results in rank order.
fn each<R: Send + 'static>(n: usize, body: fn(Communicator<ChannelTransport>) -> R) -> Vec<R> {
    let handles: Vec<_> = channel_mesh(n)
        .into_iter()
        .map(|t| thread::spawn(move || body(Communicator::new(t, quick()))))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// All-reduces `len` values of (this rank's transport rank + 1); returns the sum, checked equal
/// in every element.
fn sums(c: &mut Communicator<impl dtrain_comms::Transport>, len: usize) -> Result<f32, CommError> {
    let mut v = vec![c.members()[c.rank()] as f32 + 1.0; len];
    c.all_reduce_sum(&mut v)?;
    assert!(v.iter().all(|&x| x == v[0]), "every element alike");
    Ok(v[0])
}

#[test]
fn survivors_of_a_killed_rank_agree_and_go_on() {
    let out = each(4, |mut c| {
        // Everyone: one collective of the full group.
        assert_eq!(sums(&mut c, 4096).unwrap(), 10.0);
        if c.rank() == 3 {
            // Dies (its transport is dropped) while the others start the next one.
            return None;
        }
        let e = sums(&mut c, 4096).expect_err("rank 3 is gone");
        assert_eq!(e.failed_ranks(), vec![3], "{e}");
        let m = c.regroup(&e.failed_ranks()).unwrap();
        // The group goes on over the same connections, the relayed aborts and any
        // chunk of the failed collective dropped: several collectives in a row.
        let mut after = Vec::new();
        for len in [4096, 3, 10_000] {
            after.push(sums(&mut c, len).unwrap());
        }
        Some((m, after, c.world_size(), c.epoch()))
    });
    for (p, o) in out.iter().enumerate().take(3) {
        let (m, after, world, epoch) = o.clone().unwrap();
        assert_eq!(
            m,
            Membership {
                epoch: 1,
                members: vec![0, 1, 2],
                removed: vec![3],
                added: vec![],
                rank: p,
            }
        );
        assert_eq!(after, vec![6.0; 3]);
        assert_eq!((world, epoch), (3, 1));
    }
}

#[test]
fn a_second_failure_forms_a_second_epoch_with_shifted_ranks() {
    let out = each(5, |mut c| {
        let me = c.rank();
        if me == 1 {
            return None;
        }
        let e = sums(&mut c, 2000).unwrap_err();
        let m1 = c.regroup(&e.failed_ranks()).unwrap();
        assert_eq!(m1.members, vec![0, 2, 3, 4]);
        assert_eq!(sums(&mut c, 2000).unwrap(), 1.0 + 3.0 + 4.0 + 5.0);
        if me == 4 {
            return None;
        }
        // Transport rank 4 is group rank 3 now: the error names the group rank.
        let e = sums(&mut c, 2000).unwrap_err();
        assert_eq!(e.failed_ranks(), vec![3], "{e}");
        let m2 = c.regroup(&e.failed_ranks()).unwrap();
        Some((m2, sums(&mut c, 2000).unwrap(), c.rank()))
    });
    for (p, o) in [(0, &out[0]), (2, &out[2]), (3, &out[3])] {
        let (m, sum, rank) = o.clone().unwrap();
        assert_eq!(m.epoch, 2);
        assert_eq!(m.members, vec![0, 2, 3]);
        assert_eq!(m.removed, vec![4]);
        assert_eq!(sum, 1.0 + 3.0 + 4.0);
        assert_eq!(rank, [0, 2, 3].iter().position(|&q| q == p).unwrap());
    }
}

#[test]
fn a_rank_frozen_past_the_timeout_is_dropped_and_told_so_when_it_wakes() {
    let out = each(3, |mut c| {
        if c.rank() == 2 {
            // Alive but stalled past the others' timeout.
            thread::sleep(Duration::from_millis(2500));
            // It finds its collective failed, and in trying to regroup learns that
            // the others went on without it: it does not go on alone.
            let e = sums(&mut c, 100).unwrap_err();
            let e = c.regroup(&e.failed_ranks()).unwrap_err();
            assert!(matches!(e, CommError::Excluded { .. }), "{e}");
            assert!(sums(&mut c, 100).is_err(), "unusable afterwards");
            return Err(e.to_string());
        }
        let e = sums(&mut c, 100).unwrap_err();
        assert_eq!(e.failed_ranks(), vec![2], "{e}");
        let m = c.regroup(&e.failed_ranks()).unwrap();
        // Two of three are a majority: they go on although rank 2 may be alive.
        let s = sums(&mut c, 100).unwrap();
        // Keep the connections open until rank 2 has read the notice.
        thread::sleep(Duration::from_millis(2500));
        Ok((m.members, s))
    });
    assert_eq!(out[0], Ok((vec![0, 1], 3.0)));
    assert_eq!(out[1], Ok((vec![0, 1], 3.0)));
    let woke = out[2].as_ref().unwrap_err();
    assert!(woke.contains("dropped from the group"), "{woke}");
}

#[test]
fn a_minority_cut_off_from_live_peers_stops() {
    let out = each(4, |mut c| {
        if c.rank() >= 2 {
            // Silent but connected: from ranks 0 and 1, a partition looks alike.
            thread::sleep(Duration::from_millis(3000));
            return None;
        }
        let e = sums(&mut c, 100).unwrap_err();
        let mut blamed = e.failed_ranks();
        blamed.sort();
        assert_eq!(blamed, vec![2, 3], "{e}");
        Some(c.regroup(&blamed).unwrap_err())
    });
    for e in out[..2].iter() {
        match e {
            Some(CommError::NoMajority {
                epoch: 1,
                members,
                previous: 4,
            }) => assert_eq!(members, &vec![0, 1]),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn half_the_group_goes_on_when_the_other_half_is_gone_for_certain() {
    let out = each(4, |mut c| {
        if c.rank() >= 2 {
            return None; // exited: connections closed
        }
        let e = sums(&mut c, 100).unwrap_err();
        let m = c.regroup(&e.failed_ranks()).unwrap();
        Some((m.members, m.removed, sums(&mut c, 100).unwrap()))
    });
    for o in &out[..2] {
        assert_eq!(o, &Some((vec![0, 1], vec![2, 3], 3.0)));
    }
}

/// A newcomer in a lost rank's place: the survivors regroup without it, admit the newcomer
/// at a point they all reach, and the three run collectives again. Messages the members
/// send it before the welcome arrives are kept for it.
#[test]
fn a_newcomer_takes_a_lost_ranks_place() {
    let mut mesh = channel_mesh(3);
    let slots = mesh[0].slots();
    let lost = mesh.pop().unwrap();
    let members: Vec<_> = mesh
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let mut c = Communicator::new(t, quick());
                let e = sums(&mut c, 1000).expect_err("rank 2 is gone");
                c.regroup(&e.failed_ranks()).unwrap();
                assert_eq!(sums(&mut c, 1000).unwrap(), 3.0);
                // Nobody waits yet: nothing to admit, and the group is unchanged.
                assert_eq!(c.admit().unwrap(), None);
                assert_eq!(c.epoch(), 1);
                let m = loop {
                    if let Some(m) = c.admit().unwrap() {
                        break m;
                    }
                    thread::sleep(Duration::from_millis(5));
                };
                let after: Vec<f32> = (0..3).map(|_| sums(&mut c, 5000).unwrap()).collect();
                (m, after)
            })
        })
        .collect();
    drop(lost);
    thread::sleep(Duration::from_millis(300));
    let newcomer = slots.join(2);
    let joiner = thread::spawn(move || {
        let mut c = Communicator::new(newcomer, quick());
        let m = c.join(Duration::from_secs(10)).unwrap();
        let after: Vec<f32> = (0..3).map(|_| sums(&mut c, 5000).unwrap()).collect();
        (m, after)
    });
    let (jm, jafter) = joiner.join().unwrap();
    assert_eq!(jafter, vec![6.0; 3]);
    assert_eq!(
        jm,
        Membership {
            epoch: 2,
            members: vec![0, 1, 2],
            removed: vec![],
            added: vec![2],
            rank: 2,
        }
    );
    for (p, h) in members.into_iter().enumerate() {
        let (m, after) = h.join().unwrap();
        assert_eq!(after, vec![6.0; 3]);
        assert_eq!(
            m,
            Membership {
                epoch: 2,
                members: vec![0, 1, 2],
                removed: vec![],
                added: vec![2],
                rank: p,
            }
        );
    }
}

/// Two newcomers admitted together (a node's workers coming back): the later one's view of
/// the mesh holds the earlier one, the earlier one's only its lost predecessor's place, and
/// on their welcome the earlier one takes the later one's link
/// (`Transport::link_member`): the four run collectives again.
#[test]
fn two_newcomers_admitted_together_link_to_each_other() {
    let mut mesh = channel_mesh(4);
    let slots = mesh[0].slots();
    let lost = (mesh.pop(), mesh.pop());
    let members: Vec<_> = mesh
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let mut c = Communicator::new(t, quick());
                let e = sums(&mut c, 1000).expect_err("ranks 2 and 3 are gone");
                c.regroup(&e.failed_ranks()).unwrap();
                while c.waiting_joiners().len() < 2 {
                    thread::sleep(Duration::from_millis(5));
                }
                let m = loop {
                    if let Some(m) = c.admit().unwrap() {
                        break m;
                    }
                    thread::sleep(Duration::from_millis(5));
                };
                let after: Vec<f32> = (0..3).map(|_| sums(&mut c, 5000).unwrap()).collect();
                (m.added, after)
            })
        })
        .collect();
    drop(lost);
    thread::sleep(Duration::from_millis(300));
    let joiners: Vec<_> = [2, 3]
        .into_iter()
        .map(|r| {
            let mut c = Communicator::new(slots.join(r), quick());
            thread::spawn(move || {
                let m = c.join(Duration::from_secs(10)).unwrap();
                let after: Vec<f32> = (0..3).map(|_| sums(&mut c, 5000).unwrap()).collect();
                (m.added, after)
            })
        })
        .collect();
    for h in members.into_iter().chain(joiners) {
        assert_eq!(h.join().unwrap(), (vec![2, 3], vec![10.0; 3]));
    }
}

/// A newcomer no member expected (its rank's member is alive) is never admitted, and the
/// group goes on; the newcomer's wait ends at its deadline.
#[test]
fn a_newcomer_for_a_live_rank_waits_and_times_out() {
    let mesh = channel_mesh(2);
    let slots = mesh[0].slots();
    let handles: Vec<_> = mesh
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let mut c = Communicator::new(t, quick());
                // Past the newcomer's deadline (which it would not reach if the group
                // ended first: see the next test).
                for _ in 0..25 {
                    assert_eq!(c.admit().unwrap(), None);
                    thread::sleep(Duration::from_millis(20));
                }
                sums(&mut c, 10).unwrap()
            })
        })
        .collect();
    let mut c = Communicator::new(slots.join(1), quick());
    let e = c.join(Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    drop(c);
    for h in handles {
        assert_eq!(h.join().unwrap(), 3.0);
    }
}

/// A newcomer whose would-be group is gone (the run ended) stops waiting at once, saying
/// so, instead of waiting out its deadline.
#[test]
fn a_newcomer_stops_waiting_when_every_other_rank_is_gone() {
    let mut mesh = channel_mesh(3);
    let slots = mesh[0].slots();
    drop(mesh.pop());
    let mut c = Communicator::new(slots.join(2), quick());
    drop(mesh);
    let t = std::time::Instant::now();
    let e = c.join(Duration::from_secs(30)).unwrap_err();
    assert!(e.to_string().contains("every other rank is gone"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A newcomer that is gone by the time the members admit it (it never read its welcome)
/// does not break the admission: the members go on with it as a member, their next
/// collective names it lost, and they regroup without it, as after any loss.
#[test]
fn a_newcomer_gone_before_its_welcome_is_dropped_like_any_lost_member() {
    let mut mesh = channel_mesh(3);
    let slots = mesh[0].slots();
    drop(mesh.pop());
    // It arrives and leaves at once.
    drop(slots.join(2));
    let members: Vec<_> = mesh
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let mut c = Communicator::new(t, quick());
                let e = sums(&mut c, 100).expect_err("rank 2 is gone");
                c.regroup(&e.failed_ranks()).unwrap();
                let m = c.admit().unwrap().expect("the newcomer was waiting");
                assert_eq!(m.added, vec![2]);
                let e = sums(&mut c, 100).expect_err("the newcomer is gone");
                assert_eq!(e.failed_ranks(), vec![2], "{e}");
                let m = c.regroup(&e.failed_ranks()).unwrap();
                (m.removed, sums(&mut c, 100).unwrap())
            })
        })
        .collect();
    for h in members {
        assert_eq!(h.join().unwrap(), (vec![2], 3.0));
    }
}
