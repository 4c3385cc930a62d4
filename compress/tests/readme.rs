//! The worked example of `compress/README.md` ("Adding a compressor"): the method file it
//! shows is `tests/readme/int8.rs`, compiled and exercised here, and the README must show
//! that file verbatim.

#[path = "readme/int8.rs"]
mod int8;

use dtrain_compress::compressor::HEADER_BITS;
use dtrain_compress::{compress_new, decompress, Ctx, Method, Rng, METHODS};
use int8::Int8Config;

#[test]
fn the_readme_shows_the_example_verbatim() {
    let readme = include_str!("../README.md");
    let example = include_str!("readme/int8.rs");
    assert!(
        readme.contains(example),
        "compress/README.md no longer shows tests/readme/int8.rs verbatim"
    );
    // The registration step names the real registry and the form of its lines.
    let lib = include_str!("../src/lib.rs");
    assert!(lib.contains("methods! {") && readme.contains("methods! {"));
    assert!(
        lib.contains("    TopK(topk::TopKConfig),"),
        "registry line format changed"
    );
}

#[test]
fn the_example_method_round_trips_within_half_a_step() {
    let cfg: Int8Config = toml::from_str("").unwrap();
    assert!(toml::from_str::<Int8Config>("bits = 4").is_err());
    assert!(METHODS
        .iter()
        .all(|m| m.id != Int8Config::ID && m.name != Int8Config::NAME));
    let mut c = cfg.build().unwrap();
    let g: Vec<f32> = (0..1000)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let segs = [0..600, 600..1000];
    let ctx = Ctx {
        segments: &segs,
        ..Ctx::default()
    };
    let p = compress_new(c.as_mut(), &g, &ctx, &mut Rng::seed_from_u64(1)).unwrap();
    let bits = HEADER_BITS + 32 * 2 + c.segment_bits(600).unwrap() + c.segment_bits(400).unwrap();
    assert_eq!(8 * p.encoded_len() as u64, bits);
    let mut out = vec![0f32; g.len()];
    decompress(c.as_ref(), p.as_bytes(), &mut out).unwrap();
    for s in segs {
        let step = g[s.clone()].iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        for i in s {
            assert!((out[i] - g[i]).abs() <= step / 2.0 + 1e-6, "{i}");
        }
    }
    // Hostile bytes: an error, never a panic.
    let mut rng = Rng::seed_from_u64(7);
    for len in [0usize, 3, 12, 17, 40] {
        for _ in 0..50 {
            let mut b: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            if len >= 4 {
                b[..4].copy_from_slice(&[0xD7, 1, Int8Config::ID.0, 0]);
            }
            let mut out = vec![0f32; 4];
            let _ = decompress(c.as_ref(), &b, &mut out);
        }
    }
}
