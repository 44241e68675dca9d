//! Several GPUs: which rank owns which channels or rows, and how the ranks' results
//! combine. Backend-agnostic: the GPU path (`gpu::parallel`, over NCCL) and the CPU
//! path ([`cpu`], ranks run one after another in one process) share it.
//!
//! Tensor parallel splits the Linear layer's output channels into equal, contiguous
//! shards, one per rank (a column-parallel Linear). The fused epilogue then needs no
//! communication as long as every GroupNorm group and every AvgPool window lies on one
//! rank; [`TensorSplit`] finds the smallest shard that guarantees it and refuses the
//! counts of ranks that would cut one. A chain ending in a row `max` finishes with one
//! all-reduce of a [`RowMaxKey`] per row; otherwise each rank holds a column slice of
//! the output. In the backward every rank's `dX` is a partial sum over its channels:
//! the input gradient is their all-reduced sum.
//!
//! Data parallel splits the batch's rows ([`BatchSplit`]); each rank's gradients are
//! averaged over the ranks.

pub mod cpu;

use crate::block::{BlockSpec, Params};
use crate::chain::{Chain, Op};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::ops::Range;

/// The most ranks [`TensorSplit::valid_counts`] lists.
const MAX_LISTED_RANKS: usize = 1024;

/// How a block's output channels split over `ranks` ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSplit {
    ranks: usize,
    full: BlockSpec,
    /// The block each rank runs: `Linear(in, out / ranks)` and the chain with each
    /// GroupNorm's groups divided by `ranks`.
    shard: BlockSpec,
    /// Whether the chain ends in a row max, reduced across ranks.
    row_max: bool,
}

impl TensorSplit {
    /// The split of `spec` over `ranks` ranks, or an error naming what it would cut
    /// and the counts that work.
    pub fn new(spec: &BlockSpec, ranks: usize) -> Result<TensorSplit> {
        if ranks == 0 {
            return Err(Error::Argument("tensor parallel over 0 ranks".into()));
        }
        let quantum = Self::quantum(spec)?;
        let out = spec.out_features;
        if ranks > 1 && !out.is_multiple_of(ranks * quantum.channels) {
            return Err(Error::Argument(format!(
                "tensor parallel over {ranks} GPUs would cut {}: each GPU needs a multiple of {} of the \
                 {out} output channels; {}",
                quantum.why,
                quantum.channels,
                counts_hint(&Self::counts(out, quantum.channels))
            )));
        }
        let mut chain = spec.chain.clone();
        for op in &mut chain.0 {
            if let Op::GroupNorm { groups, .. } = op {
                *groups /= ranks;
            }
        }
        let shard = BlockSpec::new(spec.in_features, out / ranks, chain)?;
        let row_max = spec.chain.0.last() == Some(&Op::RowMax);
        Ok(TensorSplit { ranks, full: spec.clone(), shard, row_max })
    }

    /// The counts of ranks `spec` splits over (1 always; the rest need the shard of
    /// [`TensorSplit::new`]), up to 1024.
    pub fn valid_counts(spec: &BlockSpec) -> Result<Vec<usize>> {
        Ok(Self::counts(spec.out_features, Self::quantum(spec)?.channels))
    }

    fn counts(out: usize, quantum: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (2..=MAX_LISTED_RANKS).filter(|&n| out.is_multiple_of(n * quantum)).collect();
        v.insert(0, 1);
        v
    }

    /// The smallest run of Linear channels a rank may own, and what it keeps whole.
    fn quantum(spec: &BlockSpec) -> Result<Quantum> {
        let chain: &Chain = &spec.chain;
        // Linear channels per feature entering op i (the product of earlier AvgPools).
        let mut per_feature = 1usize;
        let mut q = Quantum { channels: 1, why: "nothing".into() };
        for (i, op) in chain.0.iter().enumerate() {
            let f = spec.features_at(i);
            match *op {
                Op::GroupNorm { groups, .. } => {
                    q.keep(f / groups * per_feature, format!("a group of groupnorm({groups})"));
                }
                // A pool's window on one rank: `k` must divide the features it pools.
                Op::AvgPool(k) | Op::MaxPool(k) => {
                    if !f.is_multiple_of(k) {
                        return Err(Error::Chain(format!(
                            "{op} drops the last {} of its {f} features; tensor parallel needs it to divide them",
                            f % k
                        )));
                    }
                    q.keep(k * per_feature, format!("a window of {op}"));
                    per_feature *= k;
                }
                Op::RowMax if i + 1 != chain.0.len() => {
                    return Err(Error::Chain(format!(
                        "`max` is op {} of {}: tensor parallel reduces a row max across GPUs only as the \
                         chain's last op (the ops after it would need the whole row)",
                        i + 1,
                        chain.0.len()
                    )));
                }
                // Across the whole row: a rank would need every channel.
                Op::Reduce(_) | Op::Softmax | Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                    q.keep(f * per_feature, format!("the row `{op}` works across"));
                }
                Op::BatchNorm { .. } => {
                    return Err(Error::Chain(format!(
                        "`{op}`: the parallel blocks do not run a BatchNorm (its statistics span the batch)"
                    )));
                }
                // `residual` adds each channel's own `z` back.
                Op::RowMax | Op::Pointwise(..) | Op::Residual => {}
            }
        }
        Ok(q)
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The unsplit block.
    pub fn full(&self) -> &BlockSpec {
        &self.full
    }

    /// The block every rank runs on its channels.
    pub fn shard(&self) -> &BlockSpec {
        &self.shard
    }

    /// Whether the ranks' outputs are row maxima that an all-reduce combines (the
    /// output is then `(batch,)` on every rank), rather than column slices.
    pub fn reduces_row_max(&self) -> bool {
        self.row_max
    }

    /// The Linear output channels rank `rank` owns.
    pub fn channels(&self, rank: usize) -> Range<usize> {
        let w = self.shard.out_features;
        rank * w..(rank + 1) * w
    }

    /// Rank `rank`'s slice of every parameter: the Linear weight's rows and bias, and
    /// each op's per-channel parameters at that op's features.
    pub fn shard_params<T: Copy>(&self, p: &Params<T>, rank: usize) -> Result<Params<T>> {
        let mut flat = Vec::new();
        for (t, (full, part)) in p.flat().into_iter().zip(self.full.param_specs().iter().zip(self.shard.param_specs()))
        {
            if t.shape() != full.shape.as_slice() {
                return Err(Error::tensor(&full.name, format!("expected shape {:?}, got {:?}", full.shape, t.shape())));
            }
            let n: usize = part.shape.iter().product();
            flat.push(Tensor::new(&part.shape, t.data()[rank * n..(rank + 1) * n].to_vec())?);
        }
        Params::from_flat(&self.shard, flat)
    }

    /// The ranks' parameter slices (or their gradients) put back together.
    pub fn gather_params<T: Copy>(&self, shards: &[Params<T>]) -> Result<Params<T>> {
        self.check_ranks("parameter shards", shards.len())?;
        let specs = self.full.param_specs();
        let flat = (0..specs.len())
            .map(|i| {
                let data: Vec<T> = shards.iter().flat_map(|s| s.flat()[i].data().to_vec()).collect();
                Tensor::new(&specs[i].shape, data)
            })
            .collect::<Result<_>>()?;
        Params::from_flat(&self.full, flat)
    }

    /// The block's output from the ranks' column slices `(batch, F / ranks)`.
    pub fn gather_columns<T: Copy>(&self, shards: &[Tensor<T>]) -> Result<Tensor<T>> {
        self.check_ranks("output shards", shards.len())?;
        let batch = shards[0].rows();
        let w = shards[0].len() / batch.max(1);
        if shards.iter().any(|s| s.shape() != [batch, w]) {
            return Err(Error::Shape("the output shards differ in shape".into()));
        }
        let mut data = Vec::with_capacity(batch * w * self.ranks);
        for r in 0..batch {
            for s in shards {
                data.extend_from_slice(s.row(r));
            }
        }
        Tensor::new(&[batch, w * self.ranks], data)
    }

    /// Rank `rank`'s columns of an output gradient `(batch, F)`.
    pub fn shard_columns<T: Copy>(&self, dy: &Tensor<T>, rank: usize) -> Result<Tensor<T>> {
        let [batch, f] = dy.shape() else {
            return Err(Error::tensor("dy", format!("expected (batch, features), got {:?}", dy.shape())));
        };
        if !f.is_multiple_of(self.ranks) {
            return Err(Error::tensor("dy", format!("{f} columns do not split over {} ranks", self.ranks)));
        }
        let w = f / self.ranks;
        let data = (0..*batch).flat_map(|r| dy.row(r)[rank * w..(rank + 1) * w].to_vec()).collect();
        Tensor::new(&[*batch, w], data)
    }

    fn check_ranks(&self, what: &str, n: usize) -> Result<()> {
        if n != self.ranks {
            return Err(Error::Argument(format!("{n} {what} for a split over {} ranks", self.ranks)));
        }
        Ok(())
    }
}

struct Quantum {
    channels: usize,
    why: String,
}

impl Quantum {
    /// Also keeps whole runs of `channels` (aligned): the least common multiple.
    fn keep(&mut self, channels: usize, why: String) {
        let l = lcm(self.channels, channels);
        if l != self.channels {
            self.why = why;
        }
        self.channels = l;
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

fn counts_hint(counts: &[usize]) -> String {
    let list: Vec<String> = counts.iter().map(usize::to_string).collect();
    format!("these counts of GPUs work: {}", list.join(", "))
}

/// A row maximum and the rank that holds it, as one 64-bit word whose unsigned order
/// is the order the ranks' maxima combine in: the larger value wins, and among equal
/// values the lower rank (the lower channel, as `torch.max` picks the first), so an
/// all-reduce `max` of the words gives every rank the row's maximum and its owner at
/// once. NaN (any payload) sorts above everything: as `torch.max`, a row holding NaN
/// has max NaN, at its first NaN. The GPU kernels `row_max_keys` and `row_max_unkey`
/// write and read the same words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RowMaxKey(pub u64);

impl RowMaxKey {
    pub fn new(value: f32, rank: usize, ranks: usize) -> RowMaxKey {
        let bits = if value.is_nan() { 0x7fc0_0000 } else { value.to_bits() };
        // Negative floats reversed below the positives: unsigned order = numeric order.
        let ordered = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
        RowMaxKey((u64::from(ordered) << 32) | (ranks - 1 - rank) as u64)
    }

    pub fn value(self) -> f32 {
        let ordered = (self.0 >> 32) as u32;
        f32::from_bits(if ordered >> 31 == 1 { ordered & 0x7fff_ffff } else { !ordered })
    }

    /// The rank whose channels hold the maximum.
    pub fn owner(self, ranks: usize) -> usize {
        ranks - 1 - (self.0 & 0xffff_ffff) as usize
    }
}

/// How a global batch's rows split over data-parallel ranks: equal, contiguous runs,
/// so that averaging the ranks' mean-loss gradients gives the global batch's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSplit {
    pub batch: usize,
    pub ranks: usize,
}

impl BatchSplit {
    pub fn new(batch: usize, ranks: usize) -> Result<BatchSplit> {
        if ranks == 0 {
            return Err(Error::Argument("data parallel over 0 ranks".into()));
        }
        if batch == 0 || !batch.is_multiple_of(ranks) {
            return Err(Error::Argument(format!(
                "a batch of {batch} rows does not split evenly over {ranks} GPUs: the ranks' gradients are \
                 averaged, so each needs the same number of rows (use a multiple of {ranks})"
            )));
        }
        Ok(BatchSplit { batch, ranks })
    }

    /// The rows rank `rank` trains on.
    pub fn rows(&self, rank: usize) -> Range<usize> {
        let n = self.batch / self.ranks;
        rank * n..(rank + 1) * n
    }

    /// Rank `rank`'s rows of `t` (`(batch, ...)`).
    pub fn slice<T: Copy>(&self, t: &Tensor<T>, rank: usize) -> Result<Tensor<T>> {
        if t.shape().first() != Some(&self.batch) {
            return Err(Error::Shape(format!("{:?} is not a batch of {} rows", t.shape(), self.batch)));
        }
        let per_row = t.len() / self.batch;
        let rows = self.rows(rank);
        let mut shape = t.shape().to_vec();
        shape[0] = rows.len();
        Tensor::new(&shape, t.data()[rows.start * per_row..rows.end * per_row].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Preset;

    #[test]
    fn keys_order_as_the_row_max_combines() {
        let vals = [f32::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(RowMaxKey::new(w[0], 0, 4) <= RowMaxKey::new(w[1], 3, 4), "{w:?}");
        }
        for &v in &vals {
            let k = RowMaxKey::new(v, 2, 4);
            assert_eq!(k.value().to_bits(), v.to_bits());
            assert_eq!(k.owner(4), 2);
        }
        // Ties go to the lower rank; NaN wins over infinity.
        assert!(RowMaxKey::new(1.0, 0, 4) > RowMaxKey::new(1.0, 1, 4));
        assert!(RowMaxKey::new(-f32::NAN, 3, 4) > RowMaxKey::new(f32::INFINITY, 0, 4));
        assert!(RowMaxKey::new(f32::NAN, 3, 4).value().is_nan());
    }

    #[test]
    fn presets_split_in_whole_groups() {
        let m1 = BlockSpec::new(8192, 8192, Preset::M1.chain()).unwrap();
        assert_eq!(TensorSplit::valid_counts(&m1).unwrap(), [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        let s = TensorSplit::new(&m1, 4).unwrap();
        assert_eq!(s.shard().out_features, 2048);
        assert_eq!(s.shard().chain.0[0], Op::GroupNorm { groups: 64, eps: 1e-5 });
        assert_eq!(s.channels(3), 6144..8192);
        let m1 = BlockSpec::new(64, 512, Preset::M1.chain().with_groups(16)).unwrap();
        let err = TensorSplit::new(&m1, 3).unwrap_err().to_string();
        assert!(err.contains("a group of groupnorm(16)") && err.contains("1, 2, 4, 8, 16"), "{err}");
        // M4: avgpool(16) then max; the max is reduced across ranks.
        let m4 = BlockSpec::new(64, 1024, Preset::M4.chain()).unwrap();
        let s = TensorSplit::new(&m4, 8).unwrap();
        assert!(s.reduces_row_max());
        assert_eq!(s.shard().output_shape(5), [5]);
        assert!(TensorSplit::new(&m4, 128).unwrap_err().to_string().contains("avgpool(16)"));
    }

    #[test]
    fn refuses_what_a_split_cannot_run() {
        let after_max = BlockSpec::new(8, 64, "max,scale(2)".parse().unwrap()).unwrap();
        assert!(TensorSplit::new(&after_max, 2).unwrap_err().to_string().contains("last op"));
        let ragged = BlockSpec::new(8, 66, "avgpool(4)".parse().unwrap()).unwrap();
        assert!(TensorSplit::new(&ragged, 2).unwrap_err().to_string().contains("drops the last 2"));
        let spec = BlockSpec::new(8, 64, Chain(vec![])).unwrap();
        assert!(TensorSplit::new(&spec, 0).is_err());
        assert!(TensorSplit::new(&spec, 3).unwrap_err().to_string().contains("1, 2, 4, 8, 16, 32, 64"));
        // Groups after a pool are counted in Linear channels: gn(4) of 16 pooled
        // features is 4 features of 4 channels each = 16 channels per group.
        let pooled = BlockSpec::new(8, 64, "avgpool(4),groupnorm(4)".parse().unwrap()).unwrap();
        assert_eq!(TensorSplit::valid_counts(&pooled).unwrap(), [1, 2, 4]);
    }

    #[test]
    fn params_and_columns_round_trip() {
        use rand::SeedableRng;
        let spec = BlockSpec::new(3, 32, "avgpool(2),bias,groupnorm(4),mul".parse().unwrap()).unwrap();
        let p = Params::random(&spec, &mut rand::rngs::StdRng::seed_from_u64(1));
        let split = TensorSplit::new(&spec, 4).unwrap();
        let shards: Vec<_> = (0..4).map(|r| split.shard_params(&p, r).unwrap()).collect();
        assert_eq!(shards[1].linear_weight.shape(), [8, 3]);
        assert_eq!(shards[1].ops[1][0].data(), &p.ops[1][0].data()[4..8]);
        assert_eq!(split.gather_params(&shards).unwrap(), p);
        let y = Tensor::from_fn(&[2, 16], |i| i as f32).unwrap();
        let cols: Vec<_> = (0..4).map(|r| split.shard_columns(&y, r).unwrap()).collect();
        assert_eq!(cols[2].data(), [8.0, 9.0, 10.0, 11.0, 24.0, 25.0, 26.0, 27.0]);
        assert_eq!(split.gather_columns(&cols).unwrap(), y);
    }

    #[test]
    fn batches_split_evenly() {
        let s = BatchSplit::new(12, 3).unwrap();
        assert_eq!(s.rows(2), 8..12);
        let t = Tensor::from_fn(&[12, 2], |i| i as f32).unwrap();
        assert_eq!(s.slice(&t, 1).unwrap().data(), &t.data()[8..16]);
        assert!(BatchSplit::new(10, 4).unwrap_err().to_string().contains("multiple of 4"));
    }
}
