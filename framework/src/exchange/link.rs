//! Where the collectives run: inline on the calling thread or on the communication thread,
//! in submission order either way.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use dtrain_comms::dlcp::{DlcpConfig, DlcpReport, DlcpTensor};
use dtrain_comms::topology::Topology;
use dtrain_comms::{CommError, Communicator, SparseSlice, Transport};
use dtrain_compress::{LaneFormat, Payload};

use super::schedule::OwnerReduce;

/// A collective, with the buffers it works on.
pub(super) enum Op {
    Sum(Vec<f32>),
    /// The sum in bfloat16 ([`all_reduce_sum_bf16`]).
    SumBf16(Vec<f32>),
    /// A dense bucket's sum, hierarchically over the hosts.
    HierarchicalSum(Vec<f32>, Arc<Topology>),
    Gather(Vec<u8>),
    Broadcast(Vec<u8>, usize),
    /// Sparse all-reduce of (indices, values) into the dense output buffer.
    Sparse(Vec<u32>, Vec<f32>, Vec<f32>),
    /// Sparse all-reduce of (indices, values) of a bucket of this many elements, the sum
    /// kept sparse: for a bucket whose average is made on the device, where only the sum's
    /// entries need to cross.
    SparseKept(Vec<u32>, Vec<f32>, usize),
    /// DLCP bounded-loss all-reduce of a dense bucket with its tensors.
    Lossy(Vec<f32>, Arc<[DlcpTensor]>, Arc<DlcpConfig>),
    /// Compressed all-reduce: this rank's payload of each owner's range, the bucket's
    /// length (the layout key every rank must agree on) and the owner's side.
    Compressed(Vec<Payload>, u32, Box<OwnerReduce>),
}

/// A collective's result: the buffers, back.
pub(super) enum Reply {
    Sum(Vec<f32>),
    /// The dense sum, and the index / value buffers back for reuse.
    Sparse(Vec<f32>, Vec<u32>, Vec<f32>),
    /// The sum's entries that are not `+0.0`, in index order: (indices, values).
    SparseKept(Vec<u32>, Vec<f32>),
    Gather(Vec<Vec<u8>>),
    Broadcast(Vec<u8>),
    /// The (lossy) sum and the round's report.
    Lossy(Vec<f32>, Box<DlcpReport>),
    /// The owners' encoded sums in owner order, the shares back for reuse, and the owner's
    /// side (back to its slot).
    Compressed(Vec<Vec<u8>>, Vec<Payload>, Box<OwnerReduce>),
}

pub(super) struct Done {
    pub(super) result: Result<Reply, CommError>,
    /// Seconds the collective took where it ran.
    pub(super) secs: f64,
}

/// The sum of `v` over the ranks in bfloat16 (a summable method's lanes of
/// [`LaneFormat::Bf16`]): each rank's values rounded to bfloat16 travel to the owner of
/// their segment, the owner adds them in `f32` in rank order and rounds the sum to
/// bfloat16, and the sums travel to every rank — the compressed all-reduce with a bfloat16
/// codec, so a rank sends `2·(P−1)/P` of the bfloat16 buffer, a bfloat16 ring's bytes, and
/// every rank ends with the same bits.
pub(super) fn all_reduce_sum_bf16<T: Transport>(
    comm: &mut Communicator<T>,
    v: &mut [f32],
) -> Result<(), CommError> {
    const BF16: LaneFormat = LaneFormat::Bf16;
    let (world, rank) = (comm.world_size(), comm.rank());
    let ranges: Vec<_> = (0..world)
        .map(|q| dtrain_comms::segment_range(v.len(), world, q))
        .collect();
    let encode = |x: &[f32]| {
        let mut b = vec![0u8; x.len() * BF16.bytes()];
        BF16.write(&mut x.iter().copied(), &mut b);
        b
    };
    let shares: Vec<Vec<u8>> = ranges.iter().map(|r| encode(&v[r.clone()])).collect();
    let views: Vec<&[u8]> = shares.iter().map(Vec::as_slice).collect();
    let mine = ranges[rank].len();
    let (mut sum, mut vals) = (Vec::with_capacity(mine), Vec::with_capacity(mine));
    let mut reduce = |shares: &[&[u8]]| -> Result<Vec<u8>, (usize, String)> {
        sum.clear();
        sum.resize(mine, 0.0);
        for (q, s) in shares.iter().enumerate() {
            if s.len() != mine * BF16.bytes() {
                return Err((
                    q,
                    format!(
                        "a bfloat16 share of {} bytes, expected {}",
                        s.len(),
                        2 * mine
                    ),
                ));
            }
            vals.clear();
            BF16.read(s, &mut vals);
            sum.iter_mut().zip(&vals).for_each(|(a, b)| *a += b);
        }
        Ok(encode(&sum))
    };
    let key = u32::try_from(v.len()).unwrap_or(u32::MAX);
    let blocks = comm.compressed_all_reduce(&views, key, &mut reduce)?;
    let mut out = Vec::new();
    for (q, (block, range)) in blocks.iter().zip(&ranges).enumerate() {
        if block.len() != range.len() * BF16.bytes() {
            return Err(CommError::InvalidArgument(format!(
                "rank {q}'s bfloat16 sum has {} bytes, its segment {} values",
                block.len(),
                range.len()
            )));
        }
        out.clear();
        BF16.read(block, &mut out);
        v[range.clone()].copy_from_slice(&out);
    }
    Ok(())
}

pub(super) fn run_op<T: Transport>(comm: &mut Communicator<T>, op: Op) -> Done {
    let t = Instant::now();
    let result = match op {
        Op::Sum(mut v) => comm.all_reduce_sum(&mut v).map(|()| Reply::Sum(v)),
        Op::SumBf16(mut v) => all_reduce_sum_bf16(comm, &mut v).map(|()| Reply::Sum(v)),
        Op::HierarchicalSum(mut v, hosts) => comm
            .hierarchical_all_reduce_sum(&mut v, &hosts)
            .map(|()| Reply::Sum(v)),
        Op::Gather(b) => comm.all_gather(&b).map(Reply::Gather),
        Op::Broadcast(mut b, root) => comm.broadcast(&mut b, root).map(|()| Reply::Broadcast(b)),
        Op::Lossy(mut v, tensors, cfg) => comm
            .dlcp_all_reduce(&mut v, &tensors, &cfg)
            .map(|r| Reply::Lossy(v, Box::new(r))),
        Op::Compressed(shares, key, mut owner) => {
            let views: Vec<&[u8]> = shares.iter().map(Payload::as_bytes).collect();
            let sums = comm.compressed_all_reduce(&views, key, owner.as_mut());
            drop(views);
            sums.map(|s| Reply::Compressed(s, shares, owner))
        }
        Op::Sparse(idx, vals, mut out) => match SparseSlice::new(out.len(), &idx, &vals) {
            Ok(input) => comm
                .sparse_all_reduce_dense(input, &mut out)
                .map(|()| Reply::Sparse(out, idx, vals)),
            Err(e) => Err(CommError::InvalidArgument(format!(
                "sparse all-reduce input: {e}"
            ))),
        },
        Op::SparseKept(idx, vals, dim) => match SparseSlice::new(dim, &idx, &vals) {
            Ok(input) => comm.sparse_all_reduce(input).map(|sum| {
                let (_, idx, vals) = sum.into_parts();
                Reply::SparseKept(idx, vals)
            }),
            Err(e) => Err(CommError::InvalidArgument(format!(
                "sparse all-reduce input: {e}"
            ))),
        },
    };
    Done {
        result,
        secs: t.elapsed().as_secs_f64(),
    }
}

/// Where the collectives run: inline on the calling thread, or on the communication
/// thread (in submission order either way, which is what keeps the ranks in step).
pub(super) enum Link<'a, T: Transport> {
    Inline {
        comm: &'a mut Communicator<T>,
        done: VecDeque<Done>,
    },
    Thread {
        jobs: mpsc::Sender<Op>,
        done: mpsc::Receiver<Done>,
    },
}

/// The link plus the calling thread's blocked time, so (de)compression timings can leave
/// it out.
pub(super) struct Comms<'a, T: Transport> {
    pub(super) link: Link<'a, T>,
    /// Seconds blocked on communication so far (→ `wait_s`).
    pub(super) blocked: f64,
    /// Seconds inside collectives so far (→ `communicate_s`).
    pub(super) busy: f64,
}

impl<T: Transport> Comms<'_, T> {
    pub(super) fn submit(&mut self, op: Op) {
        match &mut self.link {
            Link::Inline { comm, done } => {
                let d = run_op(comm, op);
                self.blocked += d.secs;
                done.push_back(d);
            }
            Link::Thread { jobs, .. } => {
                // A closed channel means the thread stopped after a failed collective; the
                // failure is the next result `wait` returns.
                let _ = jobs.send(op);
            }
        }
    }

    pub(super) fn wait(&mut self) -> Result<Reply, CommError> {
        let d = match &mut self.link {
            Link::Inline { done, .. } => done.pop_front().expect("a collective was submitted"),
            Link::Thread { done, .. } => {
                let t = Instant::now();
                let d = done
                    .recv()
                    .expect("the communication thread answers every submitted collective");
                self.blocked += t.elapsed().as_secs_f64();
                d
            }
        };
        self.busy += d.secs;
        d.result
    }
}

/// The communication thread: runs collectives in submission order until the channel
/// closes or one fails (later ones would only fail or hang; the caller stops at the first
/// error it receives).
pub(super) fn comm_thread<T: Transport>(
    comm: &mut Communicator<T>,
    jobs: mpsc::Receiver<Op>,
    done: mpsc::Sender<Done>,
) {
    for op in jobs {
        let d = run_op(comm, op);
        let failed = d.result.is_err();
        if done.send(d).is_err() || failed {
            break;
        }
    }
}
