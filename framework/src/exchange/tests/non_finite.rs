//! What the exchange reports of a non-finite average ([`ExchangeStats::non_finite`]): the
//! trainer relies on it instead of scanning the averaged gradient again.

use super::*;

/// A sum can overflow although every rank's gradient is finite: the exchange must say so —
/// the uncompressed one in its averaging pass, a compressed one (a sum of kept top-k
/// values) as the bucket pipeline writes each average back; a finite average says
/// `Some(false)`.
#[test]
fn an_overflowing_average_is_reported_uncompressed_and_compressed() {
    for method in ["none", "topk:ratio=0.1"] {
        let setup = Setup::new(parse_method(method).unwrap());
        let n = setup.n();
        let res = on_ranks(2, |rank, comm| {
            let mut ex = setup.exchanger();
            let mut g = grad(rank, n, 0);
            let ok = ex.exchange(comm, &mut g, 0).unwrap().non_finite;
            let mut g = grad(rank, n, 1);
            g[n - 1] = 3e38;
            let st = ex.exchange(comm, &mut g, 1).unwrap();
            (ok, st.non_finite, g[n - 1])
        });
        for (ok, overflow, last) in res {
            assert_eq!(ok, Some(false), "{method}");
            assert_eq!(overflow, Some(true), "{method}");
            assert!(last.is_infinite(), "{method}");
        }
    }
}

#[test]
fn a_non_finite_gradient_on_one_rank_makes_every_ranks_dense_average_non_finite() {
    // What lets the trainer skip its scan before a dense exchange.
    let setup = Setup::new(parse_method("none").unwrap());
    let n = setup.n();
    assert!(setup.exchanger().is_dense());
    assert!(!Setup::new(parse_method("topk:ratio=0.1").unwrap())
        .exchanger()
        .is_dense());
    for world in [2, 3] {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, n / 2, n - 1] {
                let res = on_ranks(world, |rank, comm| {
                    let mut ex = setup.exchanger();
                    let mut g = grad(rank, n, 0);
                    if rank == world - 1 {
                        g[at] = bad;
                    }
                    ex.exchange(comm, &mut g, 0).unwrap().non_finite
                });
                assert!(
                    res.iter().all(|&r| r == Some(true)),
                    "world {world}, {bad} at {at}: {res:?}"
                );
            }
        }
    }
}
