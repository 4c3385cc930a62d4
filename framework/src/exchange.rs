//! The gradient exchange of one data-parallel step: bucket → compensate → compress → the
//! collective the method's aggregation needs → decompress / sum → average.
//!
//! | aggregation | collective | receive side |
//! |---|---|---|
//! | uncompressed bucket | all-reduce sum (f32) | — |
//! | `Dense` | decode own payload, all-reduce sum | — |
//! | `Summable` | all-reduce sum of the payload's f32 value lanes | decode the summed payload once |
//! | `Gather` | all-gather(v) of payload bytes | decode and add every rank's payload |
//!
//! Every rank ends with bit-identical averaged gradients: all-reduce sums are bit-identical
//! by construction in dtrain-comms, and gathered payloads are decoded in rank order.
//!
//! Buckets are processed one after another; overlapping the communication of bucket `i`
//! with the compression of bucket `i + 1` is not done yet (the collectives are blocking).

use std::collections::BTreeMap;
use std::time::Instant;

use dtrain_comms::{CommError, Communicator, Transport};
use dtrain_compress::{
    summable_lanes, Aggregation, CompressError, CompressorConfig, ConfigError, Ctx, MemoryConfig,
    Payload, Pipeline, Rng, WireError,
};
use thiserror::Error;

use crate::bucket::{self, Bucket, BucketPolicy, ParamInfo};

/// Why an exchange failed.
#[derive(Debug, Error)]
pub enum ExchangeError {
    /// The collective failed (names the peer where one is to blame).
    #[error("communication failed in bucket {bucket}: {source}")]
    Comm {
        /// Bucket id.
        bucket: u64,
        /// The collective's error.
        source: CommError,
    },
    /// The local gradient could not be compressed (e.g. non-finite values).
    #[error("compression failed in bucket {bucket}: {source}")]
    Compress {
        /// Bucket id.
        bucket: u64,
        /// The compressor's error.
        source: CompressError,
    },
    /// A payload received from a peer did not decode.
    #[error("payload from rank {rank} in bucket {bucket} did not decode: {source}")]
    Decode {
        /// Sending rank.
        rank: usize,
        /// Bucket id.
        bucket: u64,
        /// The decoder's error.
        source: WireError,
    },
    /// The flat gradient does not match the parameter listing.
    #[error("gradient has {got} elements, the model lists {want}")]
    Length {
        /// Elements the model's parameters add up to.
        want: usize,
        /// Elements given.
        got: usize,
    },
}

/// Time and bytes of one exchange.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExchangeStats {
    /// Seconds in compensate + compress (including the own-payload decode for EF).
    pub compress_s: f64,
    /// Seconds inside collectives.
    pub communicate_s: f64,
    /// Seconds decoding and summing received payloads, averaging and scattering.
    pub decompress_s: f64,
    /// Bytes this rank sent (framing included).
    pub bytes_sent: u64,
    /// Bytes this rank received (framing included).
    pub bytes_received: u64,
    /// Bytes of this rank's encoded payloads (what a perfect transport would send).
    pub payload_bytes: u64,
    /// Elements exchanged (the model size).
    pub elements: u64,
}

struct Slot {
    bucket: Bucket,
    pipe: Option<Pipeline>,
}

/// Compresses and exchanges flat gradients, bucket by bucket. One per worker.
pub struct Exchanger {
    slots: Vec<Slot>,
    total: usize,
    buf: Vec<f32>,
    lane: Vec<f32>,
    payload: Payload,
    seed: u64,
}

impl Exchanger {
    /// Plans buckets for `params` and builds one compressor + memory per compressed bucket.
    pub fn new(
        params: &[ParamInfo],
        policy: &BucketPolicy,
        method: &CompressorConfig,
        memory: &MemoryConfig,
        seed: u64,
    ) -> Result<Self, ConfigError> {
        let uncompressed = matches!(method, CompressorConfig::None(_));
        let mut slots = Vec::new();
        for b in bucket::plan(params, policy) {
            let pipe = if b.compressed && !uncompressed {
                Some(Pipeline::new(method.build()?, memory.build()?))
            } else {
                None
            };
            slots.push(Slot { bucket: b, pipe });
        }
        Ok(Exchanger {
            slots,
            total: params.iter().map(|p| p.numel()).sum(),
            buf: Vec::new(),
            lane: Vec::new(),
            payload: Payload::new(),
            seed,
        })
    }

    /// The bucket plan.
    pub fn buckets(&self) -> impl Iterator<Item = &Bucket> {
        self.slots.iter().map(|s| &s.bucket)
    }

    /// Replaces `grad` (this rank's flat gradient) by the average over all ranks of the
    /// (compressed) gradients, identically on every rank.
    pub fn exchange<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        step: u64,
    ) -> Result<ExchangeStats, ExchangeError> {
        if grad.len() != self.total {
            return Err(ExchangeError::Length {
                want: self.total,
                got: grad.len(),
            });
        }
        let world = comm.world_size();
        let rank = comm.rank();
        let inv = 1.0 / world as f32;
        let mut st = ExchangeStats {
            elements: self.total as u64,
            ..ExchangeStats::default()
        };
        let before = comm.total_bytes();
        for slot in &mut self.slots {
            let b = &slot.bucket;
            let id = b.id;
            let comm_err = |source| ExchangeError::Comm { bucket: id, source };
            let t0 = Instant::now();
            bucket::gather(b, grad, &mut self.buf);
            match &mut slot.pipe {
                None => {
                    st.payload_bytes += 4 * self.buf.len() as u64;
                    let t1 = Instant::now();
                    comm.all_reduce_sum(&mut self.buf).map_err(comm_err)?;
                    st.communicate_s += t1.elapsed().as_secs_f64();
                    st.compress_s += (t1 - t0).as_secs_f64();
                }
                Some(pipe) => {
                    let ctx = Ctx {
                        step,
                        rank: rank as u32,
                        bucket: id,
                        segments: &b.segments,
                    };
                    let mut rng = Rng::for_step(self.seed, step, rank as u64, id);
                    pipe.compress(&self.buf, &ctx, &mut rng, &mut self.payload)
                        .map_err(|source| ExchangeError::Compress { bucket: id, source })?;
                    st.payload_bytes += self.payload.encoded_len() as u64;
                    let t1 = Instant::now();
                    st.compress_s += (t1 - t0).as_secs_f64();
                    let decode_err = |r: usize| {
                        move |source| ExchangeError::Decode {
                            rank: r,
                            bucket: id,
                            source,
                        }
                    };
                    match pipe.compressor().aggregation() {
                        Aggregation::Dense => {
                            self.buf.fill(0.0);
                            pipe.decompress_add(self.payload.as_bytes(), &mut self.buf)
                                .map_err(decode_err(rank))?;
                            let t2 = Instant::now();
                            comm.all_reduce_sum(&mut self.buf).map_err(comm_err)?;
                            st.communicate_s += t2.elapsed().as_secs_f64();
                            st.decompress_s += (t2 - t1).as_secs_f64();
                        }
                        Aggregation::Summable => {
                            let lanes = summable_lanes(pipe.compressor(), self.payload.as_bytes())
                                .map_err(decode_err(rank))?;
                            self.lane.clear();
                            let bytes = self.payload.as_bytes();
                            for l in &lanes {
                                self.lane.extend(
                                    bytes[l.clone()]
                                        .chunks_exact(4)
                                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                                );
                            }
                            let t2 = Instant::now();
                            comm.all_reduce_sum(&mut self.lane).map_err(comm_err)?;
                            let t3 = Instant::now();
                            st.communicate_s += (t3 - t2).as_secs_f64();
                            let bytes = self.payload.bytes_mut();
                            let mut vals = self.lane.iter();
                            for l in &lanes {
                                for c in bytes[l.clone()].chunks_exact_mut(4) {
                                    c.copy_from_slice(
                                        &vals.next().expect("lane length").to_le_bytes(),
                                    );
                                }
                            }
                            self.buf.fill(0.0);
                            pipe.decompress_add(self.payload.as_bytes(), &mut self.buf)
                                .map_err(decode_err(rank))?;
                            st.decompress_s += t3.elapsed().as_secs_f64();
                        }
                        Aggregation::Gather => {
                            let all = comm.all_gather(self.payload.as_bytes()).map_err(comm_err)?;
                            let t2 = Instant::now();
                            st.communicate_s += (t2 - t1).as_secs_f64();
                            self.buf.fill(0.0);
                            for (r, p) in all.iter().enumerate() {
                                pipe.decompress_add(p, &mut self.buf)
                                    .map_err(decode_err(r))?;
                            }
                            st.decompress_s += t2.elapsed().as_secs_f64();
                        }
                    }
                }
            }
            let t4 = Instant::now();
            for v in self.buf.iter_mut() {
                *v *= inv;
            }
            bucket::scatter(b, &self.buf, grad);
            st.decompress_s += t4.elapsed().as_secs_f64();
        }
        let d = comm.total_bytes() - before;
        st.bytes_sent = d.sent;
        st.bytes_received = d.received;
        Ok(st)
    }

    /// Error-feedback state of every compressed bucket, for checkpoints.
    pub fn export_memory(&self) -> BTreeMap<u64, Vec<f32>> {
        let mut all = BTreeMap::new();
        for s in &self.slots {
            if let Some(p) = &s.pipe {
                all.extend(p.memory().export());
            }
        }
        all
    }

    /// Restores state written by [`Exchanger::export_memory`].
    pub fn import_memory(&mut self, mut state: BTreeMap<u64, Vec<f32>>) {
        for s in &mut self.slots {
            if let Some(p) = &mut s.pipe {
                let mine: BTreeMap<u64, Vec<f32>> = state
                    .remove(&s.bucket.id)
                    .map(|v| BTreeMap::from([(s.bucket.id, v)]))
                    .unwrap_or_default();
                p.memory_mut().import(mine);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtrain_comms::{channel_mesh, CommConfig};

    fn params() -> Vec<ParamInfo> {
        [vec![64, 3, 3, 3], vec![64], vec![128, 64], vec![10]]
            .into_iter()
            .enumerate()
            .map(|(i, shape)| ParamInfo {
                name: format!("p{i}"),
                shape,
            })
            .collect()
    }

    fn grad(rank: usize, n: usize, step: u64) -> Vec<f32> {
        let mut r = Rng::for_step(99, step, rank as u64, 0);
        (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect()
    }

    /// Runs `steps` exchanges on `world` in-process ranks; returns every rank's results.
    fn run(world: usize, method: &str, steps: u64) -> Vec<Vec<Vec<f32>>> {
        let cfg = crate::bench::compress::parse_method(method).unwrap();
        let mem = cfg.default_memory();
        let ps = params();
        let n: usize = ps.iter().map(|p| p.numel()).sum();
        let policy = BucketPolicy {
            bucket_bytes: 4 * 4000,
            dense_1d: true,
            ..BucketPolicy::default()
        };
        let handles: Vec<_> = channel_mesh(world)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let (ps, cfg, policy) = (ps.clone(), cfg.clone(), policy.clone());
                std::thread::spawn(move || {
                    let mut comm = Communicator::new(t, CommConfig::default());
                    let mut ex = Exchanger::new(&ps, &policy, &cfg, &mem, 7).unwrap();
                    (0..steps)
                        .map(|s| {
                            let mut g = grad(rank, n, s);
                            let st = ex.exchange(&mut comm, &mut g, s).unwrap();
                            assert_eq!(st.elements as usize, n);
                            g
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn uncompressed_exchange_is_the_mean_and_identical_on_all_ranks() {
        for world in [1usize, 2, 3, 4] {
            let res = run(world, "none", 2);
            let n = res[0][0].len();
            for step in 0..2u64 {
                let s = step as usize;
                for other in &res[1..] {
                    assert_eq!(other[s], res[0][s], "bit-identical");
                }
                let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, n, step)).collect();
                for (i, got) in res[0][s].iter().enumerate() {
                    let mean: f64 = grads.iter().map(|g| g[i] as f64).sum::<f64>() / world as f64;
                    assert!((*got as f64 - mean).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn compressed_exchanges_agree_across_ranks_for_every_aggregation_kind() {
        // topk: gather; randomk: summable; fp16: dense.
        for method in ["topk:ratio=0.05", "randomk:ratio=0.2", "fp16"] {
            let res = run(3, method, 3);
            for (step, mine) in res[0].iter().enumerate() {
                assert_eq!(&res[1][step], mine, "{method}");
                assert_eq!(&res[2][step], mine, "{method}");
                assert!(mine.iter().any(|&v| v != 0.0), "{method}");
            }
        }
        // fp16 is close to the true mean.
        let res = run(2, "fp16", 1);
        let n = res[0][0].len();
        let (g0, g1) = (grad(0, n, 0), grad(1, n, 0));
        for (i, got) in res[0][0].iter().enumerate() {
            let mean = (g0[i] + g1[i]) / 2.0;
            assert!((got - mean).abs() < 1e-3);
        }
    }

    #[test]
    fn wrong_length_is_an_error() {
        let mut comm = Communicator::new(channel_mesh(1).pop().unwrap(), CommConfig::default());
        let cfg = CompressorConfig::default_for("topk").unwrap();
        let mut ex = Exchanger::new(
            &params(),
            &BucketPolicy::default(),
            &cfg,
            &MemoryConfig::None,
            0,
        )
        .unwrap();
        let mut g = vec![0f32; 3];
        assert!(matches!(
            ex.exchange(&mut comm, &mut g, 0),
            Err(ExchangeError::Length { .. })
        ));
    }
}
