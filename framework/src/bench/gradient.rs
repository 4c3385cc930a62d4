//! Synthetic gradient-like inputs for benchmarks, and raw f32 file input.

use std::path::Path;

use dtrain_compress::Rng;

/// Input vectors the compression benchmark can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Shape {
    /// Layer-structured, heavy-tailed: a CNN-like sequence of layers whose scales span three
    /// decades, Laplace-distributed values with a few outliers, and a smooth low-frequency
    /// component inside each layer (the "realistic" default).
    Layered,
    /// Smooth, low-frequency signal plus a little noise (favourable to transform coders).
    Smooth,
    /// Standard Gaussian noise.
    Gaussian,
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "layered" => Ok(Shape::Layered),
            "smooth" => Ok(Shape::Smooth),
            "gaussian" => Ok(Shape::Gaussian),
            _ => Err(format!(
                "unknown input shape {s:?} (layered | smooth | gaussian)"
            )),
        }
    }
}

fn gauss(r: &mut Rng) -> f32 {
    // Box–Muller.
    let u1 = r.next_f64().max(1e-300);
    let u2 = r.next_f64();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// Layer lengths of the layered vector for a total of `n` elements: conv-like blocks that
/// double in size, a big fully connected block, small bias-like tensors in between.
pub fn layer_lengths(n: usize) -> Vec<usize> {
    if n < 64 {
        return vec![n];
    }
    let mut lens = Vec::new();
    let mut left = n;
    let mut block = (n / 64).max(1);
    while left > 0 {
        let l = block.min(left);
        lens.push(l);
        left -= l;
        let bias = (l / 256).clamp(1, 512).min(left);
        if bias > 0 {
            lens.push(bias);
            left -= bias;
        }
        block = (block * 2).min(n / 2).max(1);
    }
    lens
}

/// A deterministic input vector of `n` elements.
pub fn synthesize(shape: Shape, n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::seed_from_u64(seed);
    match shape {
        Shape::Gaussian => (0..n).map(|_| gauss(&mut r)).collect(),
        Shape::Smooth => {
            let mut v = Vec::with_capacity(n);
            let f: Vec<(f64, f64, f64)> = (0..6)
                .map(|k| {
                    (
                        r.next_f64() * 8.0 + k as f64,
                        r.next_f64() * std::f64::consts::TAU,
                        1.0 / (1.0 + k as f64),
                    )
                })
                .collect();
            for i in 0..n {
                let t = i as f64 / n.max(1) as f64;
                let s: f64 = f
                    .iter()
                    .map(|&(fr, ph, a)| a * (std::f64::consts::TAU * fr * t + ph).sin())
                    .sum();
                v.push(s as f32 + 0.01 * gauss(&mut r));
            }
            v
        }
        Shape::Layered => {
            let mut v = Vec::with_capacity(n);
            for (li, len) in layer_lengths(n).into_iter().enumerate() {
                let scale = 10f64.powf(-3.0 * r.next_f64()) as f32;
                let freq = 1.0 + (li % 5) as f64;
                let phase = r.next_f64() * std::f64::consts::TAU;
                for j in 0..len {
                    let u = r.next_f32().max(1e-7);
                    let lap = -u.ln() * if r.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
                    let outlier = if r.next_u64().is_multiple_of(1000) {
                        20.0
                    } else {
                        1.0
                    };
                    let smooth =
                        (std::f64::consts::TAU * freq * j as f64 / len as f64 + phase).sin() as f32;
                    v.push(scale * (0.7 * lap * outlier + 0.5 * smooth));
                }
            }
            v
        }
    }
}

/// Reads a raw little-endian f32 file (e.g. a layer gradient dumped by the trainer).
pub fn read_f32_file(path: &Path) -> Result<Vec<f32>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() % 4 != 0 {
        return Err(format!(
            "{}: {} bytes is not a whole number of little-endian f32 values",
            path.display(),
            bytes.len()
        ));
    }
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "{}: element {i} is not finite ({})",
            path.display(),
            v[i]
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_tile_the_vector() {
        for n in [0usize, 1, 63, 64, 1000, 4 << 20] {
            assert_eq!(layer_lengths(n).iter().sum::<usize>(), n);
            assert!(layer_lengths(n).iter().all(|&l| l > 0) || n == 0);
        }
        let v = synthesize(Shape::Layered, 10_000, 1);
        assert_eq!(v.len(), 10_000);
        assert!(v.iter().all(|x| x.is_finite()));
        assert_eq!(v, synthesize(Shape::Layered, 10_000, 1));
    }

    #[test]
    fn raw_file_errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("dtrain-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("odd.f32");
        std::fs::write(&p, [0u8; 7]).unwrap();
        assert!(read_f32_file(&p).unwrap_err().contains("odd.f32"));
        let q = dir.join("ok.f32");
        std::fs::write(&q, 1.5f32.to_le_bytes()).unwrap();
        assert_eq!(read_f32_file(&q).unwrap(), vec![1.5]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
