//! The forward and inverse real FFTs of AlexNet-CIFAR's six weight tensors (the lengths the
//! main job, `experiments/alexnet_fft.toml`, transforms every step), with realfft/rustfft
//! as dtrain plans them, one thread, best of 10: the floor under the FFT codec's cost on
//! this CPU. See run.sh.

use realfft::RealFftPlanner;
use std::time::Instant;

/// conv1..conv5 and the classifier: 64·3·11·11, 192·64·5·5, 384·192·3·3, 256·384·3·3,
/// 256·256·3·3, 10·256.
const LENGTHS: [usize; 6] = [23_232, 307_200, 663_552, 884_736, 589_824, 2_560];

fn main() {
    let mut planner = RealFftPlanner::<f32>::new();
    let (mut fwd_total, mut inv_total) = (0.0, 0.0);
    for &n in &LENGTHS {
        let fwd = planner.plan_fft_forward(n);
        let inv = planner.plan_fft_inverse(n);
        let mut x: Vec<f32> = (0..n)
            .map(|k| ((k * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let mut spec = fwd.make_output_vec();
        let mut fwd_scratch = fwd.make_scratch_vec();
        let mut inv_scratch = inv.make_scratch_vec();
        let (mut best_fwd, mut best_inv) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..10 {
            let t = Instant::now();
            fwd.process_with_scratch(&mut x, &mut spec, &mut fwd_scratch)
                .expect("lengths match the plan");
            best_fwd = best_fwd.min(t.elapsed().as_secs_f64());
            // A real signal's DC and Nyquist bins have no imaginary part.
            spec[0].im = 0.0;
            let last = spec.len() - 1;
            spec[last].im = 0.0;
            let t = Instant::now();
            inv.process_with_scratch(&mut spec, &mut x, &mut inv_scratch)
                .expect("lengths match the plan");
            best_inv = best_inv.min(t.elapsed().as_secs_f64());
            x.iter_mut().for_each(|v| *v /= n as f32);
        }
        println!(
            "rustfft n={n} forward {:.3} ms inverse {:.3} ms",
            best_fwd * 1e3,
            best_inv * 1e3
        );
        fwd_total += best_fwd;
        inv_total += best_inv;
    }
    println!(
        "rustfft total forward {:.3} ms inverse {:.3} ms",
        fwd_total * 1e3,
        inv_total * 1e3
    );
}
