//! The automatic choice of route per bucket (`compress.collective = "auto"`) and the
//! hierarchical all-reduce of the dense buckets, through the exchanger.

use super::*;

fn link(bandwidth: &str, latency: &str) -> Option<LinkSpec> {
    Some(LinkSpec::parse(Some(bandwidth), Some(latency)).unwrap())
}

/// A link over which 12 kB take a tenth of a second: compressing always pays.
fn slow() -> Option<LinkSpec> {
    link("1Mbit", "100us")
}

/// A link over which a bucket takes less than reading it once: compressing never pays.
fn fast() -> Option<LinkSpec> {
    link("4000Gbit", "1ns")
}

fn auto(method: &str, link: Option<LinkSpec>) -> Setup {
    let mut s = Setup::new(parse_method(method).unwrap());
    s.gather = GatherCollective::Auto;
    s.link = link;
    s
}

/// Every rank's routes after the choice (checked to agree), and rank 0's report.
fn choose(setup: &Setup, world: usize) -> (Vec<Route>, AutoReport) {
    let out = on_ranks(world, |_, comm| {
        let mut ex = setup.exchanger();
        let report = ex.choose_collectives(comm).unwrap();
        (ex.routes(), report)
    });
    for (r, (routes, _)) in out.iter().enumerate() {
        assert_eq!(routes, &out[0].0, "rank {r} chose differently");
    }
    out.into_iter().next().unwrap()
}

use crate::exchange::auto::AutoReport;

#[test]
fn a_slow_link_compresses_every_bucket_and_a_fast_one_sends_them_dense() {
    for method in ["qsgd:levels=7", "topk:ratio=0.05", "onebit", "terngrad"] {
        let (routes, report) = choose(&auto(method, slow()), 4);
        let compressed = report.buckets.len();
        assert_eq!(compressed, 4, "{method}: {report}");
        assert!(
            routes
                .iter()
                .filter(|r| matches!(r, Route::Compressed(_)))
                .count()
                == compressed,
            "{method} on a slow link: {routes:?}\n{report}"
        );
        assert_eq!(report.link_source, "[network] (emulated)");
        let (routes, report) = choose(&auto(method, fast()), 4);
        assert!(
            routes.iter().all(|r| *r == Route::Dense),
            "{method} on a fast link: {routes:?}\n{report}"
        );
        // The report names every candidate, the chosen one first and cheapest.
        for b in &report.buckets {
            assert!(b.candidates.len() >= 2, "{method}: {b:?}");
            assert!(b.candidates[1..]
                .iter()
                .all(|c| c.seconds >= b.chosen().seconds));
        }
    }
}

#[test]
fn at_eight_workers_the_quantizers_leave_the_all_gather_on_a_slow_link() {
    // P = 8 on 1 Mbit/s: the all-gather's 7 payloads against the compressed all-reduce's
    // 2·7/8 of one (the acceptance's bytes bound, by auto's own choice).
    for method in ["qsgd:levels=7", "terngrad", "onebit", "natural"] {
        let (routes, report) = choose(&auto(method, slow()), 8);
        for r in routes.iter().filter(|r| **r != Route::Dense) {
            assert_eq!(
                *r,
                Route::Compressed(GatherCollective::CompressedAllReduce),
                "{method}:\n{report}"
            );
        }
    }
}

#[test]
fn sent_dense_a_compressed_run_trains_as_the_uncompressed_one() {
    let none = Setup::new(parse_method("none").unwrap()).run(3, 2);
    let dense = auto("qsgd:levels=7", fast()).run(3, 2);
    for (r, (a, b)) in dense.iter().zip(&none).enumerate() {
        for s in 0..2 {
            assert_same(&a.0[s], &b.0[s], format!("rank {r} step {s}"));
        }
        assert_eq!(a.1[0].bytes_sent, b.1[0].bytes_sent, "rank {r}");
    }
}

/// All sent dense, a run whose 1-D bypasses sit between its compressed buckets (so that
/// those are not ranges of the gradient) averages the ranges of the uncompressed plan: bit
/// for bit the uncompressed run without bypasses (at P = 3 a ring's sum order depends on
/// where an element falls in the buffer), and nothing copied out and back (no codec time).
#[test]
fn sent_dense_a_run_with_bypasses_averages_as_the_plain_uncompressed_one() {
    let mut plain = Setup::new(parse_method("none").unwrap());
    plain.policy.dense_1d = false;
    let plain = plain.run(3, 2);
    let dense = auto("qsgd:levels=7", fast());
    assert!(dense.policy.dense_1d);
    let dense = dense.run(3, 2);
    for (r, (a, b)) in dense.iter().zip(&plain).enumerate() {
        for s in 0..2 {
            assert_same(&a.0[s], &b.0[s], format!("rank {r} step {s}"));
            let st = &a.1[s];
            assert_eq!((st.compress_s, st.decompress_s), (0.0, 0.0), "rank {r}");
        }
        assert_eq!(a.1[0].bytes_sent, b.1[0].bytes_sent, "rank {r}");
    }
}

#[test]
fn votes_and_momentum_owning_memories_never_go_dense_and_two_phase_methods_keep_theirs() {
    for method in [
        "signsgd",
        "signum",
        "dgc:ratio=0.05",
        "scalecom:ratio=0.05",
        "powersgd",
    ] {
        let (routes, report) = choose(&auto(method, fast()), 3);
        for b in &report.buckets {
            assert!(
                b.candidates.iter().all(|c| c.route != Route::Dense),
                "{method}: {b:?}"
            );
        }
        assert!(
            routes.iter().any(|r| matches!(r, Route::Compressed(_))),
            "{method}: {routes:?}"
        );
    }
    // Two-phase: the method's own collective is the only candidate.
    let (_, report) = choose(&auto("scalecom:ratio=0.05", slow()), 3);
    for b in &report.buckets {
        assert_eq!(b.candidates.len(), 1, "{b:?}");
        assert_eq!(b.chosen().collective, Collective::BroadcastAllReduce);
    }
}

#[test]
fn without_an_emulated_link_the_probe_is_agreed_by_every_rank() {
    let (_, report) = choose(&auto("qsgd:levels=7", None), 3);
    assert!(
        report.link_source.starts_with("measured"),
        "{}",
        report.link_source
    );
    // With one worker there is nothing to exchange: the method's own collective, unprobed.
    let (routes, report) = choose(&auto("qsgd:levels=7", None), 1);
    assert!(routes.iter().all(|r| matches!(
        r,
        Route::Dense | Route::Compressed(GatherCollective::AllGather)
    )));
    assert_eq!(report.link_source, "none (one worker)");
}

#[test]
fn the_choice_travels_in_the_state_and_a_restore_takes_it_instead_of_choosing() {
    let setup = auto("qsgd:levels=7", slow());
    let n = setup.n();
    let states = on_ranks(2, |rank, comm| {
        let mut ex = setup.exchanger();
        ex.exchange(comm, &mut grad(rank, n, 0), 0).unwrap();
        ex.export_state().unwrap()
    });
    let recorded = &states[0].routes;
    assert_eq!(recorded.len(), 5);
    assert!(recorded.iter().any(|r| r != "dense"), "{recorded:?}");
    // A fast link would choose dense everywhere; the restored routes win, and no choice
    // (no probe, no collective) is made at the next exchange.
    let fast_setup = auto("qsgd:levels=7", fast());
    let restored = on_ranks(2, |rank, comm| {
        let mut ex = fast_setup.exchanger();
        ex.import_state(states[rank].clone()).unwrap();
        let names: Vec<String> = ex.routes().iter().map(|r| r.name().to_string()).collect();
        ex.exchange(comm, &mut grad(rank, n, 1), 1).unwrap();
        (names, ex.auto_report().is_none())
    });
    for (names, unchosen) in restored {
        assert_eq!(&names, recorded);
        assert!(unchosen);
    }
    // Refused, changing nothing: routes for a fixed collective, a bad name, a wrong count.
    let mut fixed = Setup::new(parse_method("qsgd:levels=7").unwrap()).exchanger();
    let e = fixed.import_state(states[0].clone()).unwrap_err();
    assert!(e.contains("\"auto\""), "{e}");
    let mut ex = fast_setup.exchanger();
    let mut bad = states[0].clone();
    bad.routes[0] = "ring".into();
    let e = ex.import_state(bad).unwrap_err();
    assert!(e.contains("route of bucket") && e.contains("ring"), "{e}");
    let mut short = states[0].clone();
    short.routes.pop();
    let e = ex.import_state(short).unwrap_err();
    assert!(e.contains("4 routes for 5 buckets"), "{e}");
    let mut misplaced = states[0].clone();
    let dense_bucket = setup
        .exchanger()
        .collectives()
        .iter()
        .position(|c| *c == Collective::AllReduce)
        .expect("an uncompressed bucket");
    misplaced.routes[dense_bucket] = "allgather".into();
    let e = ex.import_state(misplaced).unwrap_err();
    assert!(e.contains("not compressed"), "{e}");
    assert_eq!(
        ex.routes(),
        fast_setup.exchanger().routes(),
        "a refusal changed routes"
    );
}

/// Integer-valued gradients: every sum is exact, so the hierarchical and the flat all-reduce
/// agree bit for bit; random ones agree across ranks (and the collective is recorded).
#[test]
fn dense_buckets_take_the_hierarchical_all_reduce_over_several_hosts() {
    let mut setup = Setup::new(parse_method("none").unwrap());
    setup.params = params();
    setup.policy = policy(4000);
    let n = setup.n();
    let ints = |rank: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 31 + rank * 17) % 201) as f32 - 100.0)
            .collect()
    };
    let run = |hosts: Option<Topology>, integers: bool| {
        let mut s = Setup::new(parse_method("none").unwrap());
        s.params = params();
        s.policy = policy(4000);
        s.hosts = hosts;
        on_ranks(4, |rank, comm| {
            let mut ex = s.exchanger();
            let mut g = if integers {
                ints(rank)
            } else {
                grad(rank, n, 0)
            };
            ex.exchange(comm, &mut g, 0).unwrap();
            (g, ex.collectives())
        })
    };
    let pairs = Topology::from_nodes(4, 2).unwrap();
    let hier = run(Some(pairs.clone()), true);
    let flat = run(None, true);
    for (r, ((h, hc), (f, fc))) in hier.iter().zip(&flat).enumerate() {
        assert_same(h, f, format!("rank {r}"));
        assert!(
            hc.iter().all(|c| *c == Collective::HierarchicalAllReduce),
            "{hc:?}"
        );
        assert!(fc.iter().all(|c| *c == Collective::AllReduce), "{fc:?}");
    }
    let random = run(Some(pairs), false);
    for (r, (g, _)) in random.iter().enumerate() {
        assert_same(g, &random[0].0, format!("rank {r}"));
    }
    // One rank per host, or one host: no hierarchy, the flat all-reduce.
    for t in [Topology::one_per_host(4), Topology::single_host(4)] {
        let out = run(Some(t), false);
        assert!(out[0].1.iter().all(|c| *c == Collective::AllReduce));
    }
    // A topology of another world is refused at the exchange, naming both sizes.
    let mut s = Setup::new(parse_method("none").unwrap());
    s.hosts = Some(Topology::from_nodes(6, 3).unwrap());
    let e = on_ranks(2, |rank, comm| {
        let mut ex = s.exchanger();
        ex.exchange(comm, &mut grad(rank, s.n(), 0), 0)
            .unwrap_err()
            .to_string()
    });
    assert!(e[0].contains("6 ranks") && e[0].contains("2"), "{}", e[0]);
}

/// With a hierarchy, auto's dense route is the hierarchical all-reduce, costed among the
/// leaders; compressed buckets keep their collective over all ranks.
#[test]
fn auto_costs_the_dense_route_among_the_leaders() {
    let mut s = auto("qsgd:levels=7", fast());
    s.hosts = Some(Topology::from_nodes(4, 2).unwrap());
    let (routes, report) = choose(&s, 4);
    assert_eq!(report.hosts, Some(2));
    assert!(routes.iter().all(|r| *r == Route::Dense));
    for b in &report.buckets {
        assert_eq!(b.chosen().collective, Collective::HierarchicalAllReduce);
    }
    let mut s = auto("qsgd:levels=7", slow());
    s.hosts = Some(Topology::from_nodes(4, 2).unwrap());
    let (routes, _) = choose(&s, 4);
    assert!(routes.iter().any(|r| matches!(r, Route::Compressed(_))));
}

/// A state written before `auto` existed (version 1) resumes on the all-gather, the default
/// it was taken under, however fast the link.
#[test]
fn a_state_from_before_auto_keeps_the_all_gather() {
    let setup = auto("qsgd:levels=7", fast());
    let n = setup.n();
    let states = on_ranks(2, |rank, comm| {
        let mut ex = Setup::new(parse_method("qsgd:levels=7").unwrap()).exchanger();
        ex.exchange(comm, &mut grad(rank, n, 0), 0).unwrap();
        let mut st = ex.export_state().unwrap();
        assert!(st.routes.is_empty());
        st.version = 1;
        st
    });
    let routes = on_ranks(2, |rank, comm| {
        let mut ex = setup.exchanger();
        ex.import_state(states[rank].clone()).unwrap();
        ex.exchange(comm, &mut grad(rank, n, 1), 1).unwrap();
        (ex.routes(), ex.auto_report().is_none())
    });
    for (r, unchosen) in routes {
        assert!(unchosen);
        // The four compressed buckets stay on the all-gather (the fast link would send
        // them dense), the uncompressed one dense.
        let gathered = Route::Compressed(GatherCollective::AllGather);
        assert_eq!(r.iter().filter(|x| **x == gathered).count(), 4, "{r:?}");
        assert_eq!(r.iter().filter(|x| **x == Route::Dense).count(), 1, "{r:?}");
    }
    let mut future = states[0].clone();
    future.version = ExchangerState::VERSION + 1;
    let e = setup.exchanger().import_state(future).unwrap_err();
    assert!(e.contains("not supported"), "{e}");
}
