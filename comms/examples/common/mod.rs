//! Helpers shared by the comms examples (not an example itself: cargo only builds
//! `examples/*.rs` and `examples/*/main.rs`).

#![allow(dead_code)] // each example uses a subset

/// `"64K"`, `"2M"`, `"1G"` or a plain byte count.
///
/// # Panics
/// On a malformed size (these are command-line examples).
pub fn parse_size(s: &str) -> usize {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().expect("size") * mul
}

/// The shortest exact `K` / `M` spelling of `b` bytes.
pub fn fmt_size(b: usize) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}
