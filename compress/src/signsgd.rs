//! `signsgd` and `signum`: signSGD with majority vote (Bernstein, Wang, Azizzadenesheli &
//! Anandkumar, "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018, and
//! Bernstein, Zhao, Azizzadenesheli & Anandkumar, "signSGD with Majority Vote is
//! Communication Efficient and Fault Tolerant", ICLR 2019).
//!
//! Each worker sends the sign of its (compensated) gradient, one bit per element, with no
//! scale; the update is the **majority vote**, the sign of the sum of the workers' signs
//! ([`Combine::MajorityVote`]): every coordinate moves by exactly the learning rate, in the
//! direction most workers agree on, and a tie (an even split) does not move it.
//! ```text
//! worker:     bit_j = 1 iff p_j ≥ 0        (sign(p_j) = +1 for p_j ≥ 0, −0.0 included)
//! aggregate:  u_j = sign(Σ_w sign_w(p_j))  ∈ {−1, 0, +1}
//! ```
//! `signum` is the same with the worker's momentum (the paper's Algorithm 3, "Signum"):
//! the memory [`MemoryConfig::Momentum`] (β = 0.9 by default) makes `p = β·m + (1 − β)·g`
//! the buffer whose sign is sent. `signsgd` uses no memory by default; with
//! `error_feedback = true` it gets the residual (the scaled, error-feedback variant is the
//! separate method `ef-signsgd`).
//!
//! As in the papers the step is `lr · u`: the learning rate is the whole step size (1e-4 to
//! 1e-3 for SGD-tuned models; the authors pair Signum with weight decay and no optimizer
//! momentum). Semantics checked against GRACE's `signsgd` / `signum` compressors (which
//! map a tie to +1; the authors' `torch.sign` maps it to 0, as here) and the authors'
//! majority-vote code.
//!
//! Payloads are all-gathered (every receiver needs each worker's signs to count the vote).
//!
//! ## Body, per segment of `n` elements
//! ```text
//! ⌈n/8⌉ bytes     bit j = 1 iff p_j ≥ 0, LSB-first; unused bits of the last byte 0
//! ```
//! Bits: `8⌈n/8⌉`, one bit per element.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Combine, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::memory::MemoryConfig;
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{Reader, Writer};

/// Configuration of `signsgd` (no parameters; memory none by default).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignSgdConfig {}

impl Method for SignSgdConfig {
    const NAME: &'static str = "signsgd";
    const ABOUT: &'static str =
        "signSGD with majority vote: sign(g), 1 bit/element; update = sign of the summed signs";
    const ID: MethodId = MethodId(19);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(SignSgd { id: Self::ID }))
    }
}

/// Configuration of `signum`: signSGD with the worker's momentum (the memory, β = 0.9 by
/// default: `memory = { kind = "momentum", beta = … }`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignumConfig {}

impl Method for SignumConfig {
    const NAME: &'static str = "signum";
    const ABOUT: &'static str =
        "Signum: sign of the worker momentum (β 0.9), 1 bit/element; majority vote";
    const ID: MethodId = MethodId(20);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(SignSgd { id: Self::ID }))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::Momentum { beta: 0.9 }
    }
}

/// The sign compressor of `signsgd` and `signum` (stateless and deterministic: it ignores
/// the [`Rng`]); `id` is the method's.
#[derive(Debug, Clone, Copy)]
pub struct SignSgd {
    id: MethodId,
}

impl Compressor for SignSgd {
    fn method(&self) -> MethodId {
        self.id
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }

    fn combine(&self) -> Combine {
        Combine::MajorityVote
    }

    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        // 1 for p_j ≥ 0 (−0.0 included; the framing has checked x is finite).
        w.sign_bits(x);
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let bits = r.sign_bits(out.len(), "signsgd sign bits (unused bits must be 0)")?;
        for (chunk, &b) in out.chunks_mut(8).zip(bits) {
            for (k, o) in chunk.iter_mut().enumerate() {
                *o += if b >> k & 1 == 1 { 1.0 } else { -1.0 };
            }
        }
        Ok(())
    }

    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(8 * n.div_ceil(8) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress_sum_add, Ctx};
    use crate::{CompressorConfig, Pipeline};

    fn payload(c: &mut SignSgd, g: &[f32]) -> Vec<u8> {
        compress_new(c, g, &Ctx::default(), &mut Rng::seed_from_u64(0))
            .unwrap()
            .into_bytes()
    }

    #[test]
    fn the_majority_vote_is_the_sign_of_the_summed_signs() {
        let mut c = SignSgd {
            id: SignSgdConfig::ID,
        };
        // Three workers; −0.0 and 0 vote +.
        let w = [
            [1.0f32, -2.0, 0.5, -0.0, 3.0],
            [-1.0, -0.1, 0.2, -1.0, 0.0],
            [-5.0, 4.0, -0.3, -2.0, 7.0],
        ];
        let ps: Vec<Vec<u8>> = w.iter().map(|g| payload(&mut c, g)).collect();
        let refs: Vec<&[u8]> = ps.iter().map(Vec::as_slice).collect();
        let mut sum = [0f32; 5];
        decompress_sum_add(&c, &refs, &mut sum).unwrap();
        assert_eq!(sum, [-1.0, -1.0, 1.0, -1.0, 3.0]);
        let mut mean = sum.map(|v| v / 3.0);
        c.combine().finish(&mut mean);
        assert_eq!(mean, [-1.0, -1.0, 1.0, -1.0, 1.0]);
        // Two workers that disagree: a tie does not move the coordinate.
        let refs: Vec<&[u8]> = ps[..2].iter().map(Vec::as_slice).collect();
        let mut sum = [0f32; 5];
        decompress_sum_add(&c, &refs, &mut sum).unwrap();
        let mut mean = sum.map(|v| v / 2.0);
        c.combine().finish(&mut mean);
        assert_eq!(mean, [0.0, -1.0, 1.0, 0.0, 1.0]);
    }

    #[test]
    fn one_bit_per_element_and_malformed_bodies_are_refused() {
        let c = SignSgd {
            id: SignumConfig::ID,
        };
        assert_eq!(c.segment_bits(8), Some(8));
        assert_eq!(c.segment_bits(9), Some(16));
        let mut out = [0f32; 3];
        // Stray bits past n, a short body.
        for body in [vec![0b1101u8], vec![]] {
            let mut r = Reader::new(&body);
            assert!(c.decode_segment_add(&mut r, &mut out).is_err(), "{body:?}");
        }
        c.decode_segment_add(&mut Reader::new(&[0b101]), &mut out)
            .unwrap();
        assert_eq!(out, [1.0, -1.0, 1.0]);
    }

    #[test]
    fn signum_sends_the_sign_of_the_worker_momentum() {
        let cfg = CompressorConfig::default_for(SignumConfig::NAME).unwrap();
        assert_eq!(cfg.default_memory(), MemoryConfig::Momentum { beta: 0.9 });
        let mut pipe = Pipeline::new(cfg.build().unwrap(), cfg.default_memory().build().unwrap());
        // The gradient flips sign at step 1, but the momentum 0.9·0.1 − 0.1·0.05 > 0 does
        // not: the sent sign stays +.
        let mut out = Vec::new();
        for g in [[1.0f32], [-0.05]] {
            let mut p = crate::Payload::new();
            pipe.compress(&g, &Ctx::default(), &mut Rng::seed_from_u64(0), &mut p)
                .unwrap();
            let mut d = [0f32];
            pipe.decompress_add(p.as_bytes(), &mut d).unwrap();
            out.push(d[0]);
        }
        assert_eq!(out, [1.0, 1.0]);
    }
}
