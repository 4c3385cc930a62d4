//! The whole chain a trainer uses: IDX files → cifar10-like set → rank shard →
//! augmentation + normalisation → batches. Fixtures are written here; with
//! `DTRAIN_DATA_DIR` set (e.g. to `data` after `dtrain data fetch`), the same chain also
//! runs on the real Fashion-MNIST.

use std::path::Path;

use dtrain_datasets::cifar_like::load_cifar_like;
use dtrain_datasets::idx::encode_idx;
use dtrain_datasets::{
    Batcher, CifarAugment, Dataset, Normalize, ShardSpec, ShardedDataset, Split, Transformed,
};

fn write_fixture(dir: &Path, n: usize) {
    let pixels: Vec<u8> = (0..n * 784)
        .map(|i| ((i / 784) * 20 + i % 7) as u8)
        .collect();
    let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
    std::fs::write(
        dir.join("train-images-idx3-ubyte"),
        encode_idx(&[n, 28, 28], &pixels),
    )
    .unwrap();
    std::fs::write(
        dir.join("train-labels-idx1-ubyte"),
        encode_idx(&[n], &labels),
    )
    .unwrap();
}

fn run_chain(dir: &Path, world: usize, batch: usize) -> Vec<Vec<usize>> {
    let set = load_cifar_like(dir, Split::Train).unwrap();
    assert_eq!(set.shape(), [3, 32, 32]);
    let norm = Normalize::fit(&set);
    assert_eq!(norm.mean.len(), 3);
    let mut seen = Vec::new();
    for rank in 0..world {
        let shard = ShardedDataset::new(set.clone(), ShardSpec::new(rank, world, 11));
        let mut data = Transformed::new(shard, Some(CifarAugment::new(3)), Some(norm.clone()));
        data.set_epoch(1);
        data.inner_mut().set_epoch(1);
        let mut labels = Vec::new();
        let b = Batcher::new(&data, batch, true);
        let expected = b.num_batches();
        let mut n = 0;
        for x in b {
            let x = x.unwrap();
            assert_eq!(x.shape, vec![batch, 3, 32, 32]);
            assert!(x.data.iter().all(|v| v.is_finite()));
            labels.extend(x.labels);
            n += 1;
        }
        assert_eq!(n, expected);
        // Labels follow the shard's indices.
        let idx = data.inner().indices();
        for (k, l) in labels.iter().enumerate() {
            assert_eq!(*l, set.label(idx[k]));
        }
        // Same epoch, same items: fetching again gives identical augmented values.
        assert_eq!(data.get(0).unwrap(), data.get(0).unwrap());
        seen.push(idx.to_vec());
    }
    seen
}

#[test]
fn fixture_chain_gives_disjoint_equal_shards_of_cifar_shaped_batches() {
    let t = tempfile::tempdir().unwrap();
    write_fixture(t.path(), 50);
    let shards = run_chain(t.path(), 3, 4);
    let mut all: Vec<usize> = shards.concat();
    assert!(shards.iter().all(|s| s.len() == 16));
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 48);
}

#[test]
fn real_fashion_mnist_chain_when_available() {
    let Ok(dir) = std::env::var("DTRAIN_DATA_DIR") else {
        eprintln!("skipped: set DTRAIN_DATA_DIR to a directory filled by `dtrain data fetch`");
        return;
    };
    let dir = Path::new(&dir).join("fashion-mnist");
    let shards = run_chain(&dir, 2, 256);
    assert_eq!(shards[0].len(), 30_000);
}
