//! Compressed buckets that are one range of the gradient are compressed from it and
//! averaged where they lie (no gather, no scatter), and a gradient the caller checked is
//! not scanned again by the compressors: each bit for bit the gathered path.

use super::compressed_allreduce::chunkable_kinds;
use super::*;

/// Every rank's averaged gradients of `steps` exchanges of `setup` on `world` ranks.
/// `gathered`: every bucket gathered and scattered as if none were contiguous;
/// `prechecked`: told so ([`Exchanger::exchange_checked`]).
fn trace(
    setup: &Setup,
    world: usize,
    steps: u64,
    gathered: bool,
    prechecked: bool,
) -> Vec<Vec<Vec<f32>>> {
    let n = setup.n();
    on_ranks(world, |rank, comm| {
        let mut ex = setup.exchanger();
        if gathered {
            ex.slots.iter_mut().for_each(|s| s.range = None);
        }
        (0..steps)
            .map(|s| {
                let mut g = grad(rank, n, s);
                let st = ex.exchange_checked(comm, &mut g, s, prechecked).unwrap();
                assert_eq!(st.non_finite, Some(false));
                g
            })
            .collect()
    })
}

#[test]
fn in_place_and_prechecked_exchanges_are_the_gathered_path_bit_for_bit() {
    let mut cases: Vec<_> = all_kinds()
        .into_iter()
        .filter(|m| !m.passthrough())
        .map(|m| (m, GatherCollective::AllGather))
        .collect();
    cases.extend(
        chunkable_kinds()
            .into_iter()
            .map(|m| (m, GatherCollective::CompressedAllReduce)),
    );
    for (method, gather) in cases {
        let name = format!("{} over {}", method.name(), gather.name());
        let mut setup = Setup::new(method);
        setup.gather = gather;
        // Every compressed bucket of this plan is one range: the in-place path is taken.
        let ex = setup.exchanger();
        let compressed: Vec<_> = ex.slots.iter().filter(|s| s.pipe.is_some()).collect();
        assert!(compressed.len() >= 4, "{name}");
        assert!(compressed.iter().all(|s| s.range.is_some()), "{name}");
        for world in [2, 3] {
            let want = trace(&setup, world, 3, true, false);
            for prechecked in [false, true] {
                let got = trace(&setup, world, 3, false, prechecked);
                for (r, (got, want)) in got.iter().zip(&want).enumerate() {
                    for (s, (g, w)) in got.iter().zip(want).enumerate() {
                        let what = format!("{name}, P={world}, prechecked {prechecked}");
                        assert_same(g, w, format!("{what}: rank {r} step {s}"));
                    }
                }
            }
        }
    }
}
