//! How much a fixed amount of compute varies from one repetition to the next on this host,
//! without burn, the allocator or any communication: the floor under the time lock-step
//! workers wait for each other at every step (`sync_s` in `metrics.jsonl`).
//!
//! ```text
//! cargo run --release -p dtrain-framework --example host_jitter -- [copies] [reps]
//! ```
//!
//! Each of `copies` threads (default 1; use the worker count to load the host as a run
//! does) repeats the same allocation-free multiply-accumulate over a 64×784 by 784×500
//! problem (the MLP's first layer at batch 64; a few milliseconds) `reps` times (default
//! 600) and prints the mean, standard deviation and p10/p50/p90 of a repetition after 50
//! warm-up repetitions. With two lock-step workers whose repetitions vary independently with
//! standard deviation σ, the expected wait per step is E|X − Y| = 2σ/√π ≈ 1.13 σ.

use std::time::Instant;

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|s| s.parse().expect("copies and reps are whole numbers"))
        .unwrap_or(default)
}

/// Times `reps` repetitions of the fixed workload, in milliseconds.
fn run(reps: usize) -> Vec<f64> {
    let (m, k, n) = (64usize, 784usize, 500usize);
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut c = vec![0f32; m * n];
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        for (ci, ai) in c.chunks_exact_mut(n).zip(a.chunks_exact(k)) {
            for (av, bp) in ai.iter().zip(b.chunks_exact(n)) {
                for (x, y) in ci.iter_mut().zip(bp) {
                    *x += av * y;
                }
            }
        }
        std::hint::black_box(&mut c);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times
}

fn main() {
    let (copies, reps) = (arg(1, 1).max(1), arg(2, 600).max(60));
    let handles: Vec<_> = (0..copies)
        .map(|_| std::thread::spawn(move || run(reps)))
        .collect();
    println!(
        "# fixed workload, {copies} cop(ies) at once, {reps} repetitions each (first 50 dropped)"
    );
    for (i, h) in handles.into_iter().enumerate() {
        let mut t = h.join().expect("workload thread");
        let t = t.split_off(50);
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        let var = t.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (t.len() - 1) as f64;
        let mut s = t.clone();
        s.sort_by(f64::total_cmp);
        let q = |p: usize| s[(s.len() - 1) * p / 100];
        println!(
            "copy {i}: mean {mean:.2} ms, sd {:.2} ms ({:.0} % of the mean), p10 {:.2}, p50 {:.2}, p90 {:.2}",
            var.sqrt(),
            100.0 * var.sqrt() / mean,
            q(10),
            q(50),
            q(90)
        );
    }
}
