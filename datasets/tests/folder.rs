//! Image folders with fixtures written here: PNG, baseline JPEG, progressive JPEG, and
//! an undecodable file.

use std::path::Path;

use dtrain_datasets::{DataError, Dataset, ImageFolder, ImageFolderConfig, Resize};
use image::{ImageEncoder, RgbImage};

/// A 40×24 image: red rises left→right, green top→bottom, blue constant.
fn gradient(w: u32, h: u32, blue: u8) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x * 255 / (w - 1)) as u8, (y * 255 / (h - 1)) as u8, blue])
    })
}

fn write_png(path: &Path, img: &RgbImage) {
    let f = std::fs::File::create(path).unwrap();
    image::codecs::png::PngEncoder::new(f)
        .write_image(
            img.as_raw(),
            img.width(),
            img.height(),
            image::ExtendedColorType::Rgb8,
        )
        .unwrap();
}

fn write_jpeg(path: &Path, img: &RgbImage, progressive: bool) {
    let mut enc = jpeg_encoder::Encoder::new_file(path, 95).unwrap();
    enc.set_progressive(progressive);
    enc.encode(
        img.as_raw(),
        img.width() as u16,
        img.height() as u16,
        jpeg_encoder::ColorType::Rgb,
    )
    .unwrap();
}

fn is_progressive(path: &Path) -> bool {
    // SOF2 marker (FF C2) = progressive DCT.
    std::fs::read(path)
        .unwrap()
        .windows(2)
        .any(|w| w == [0xff, 0xc2])
}

#[test]
fn png_baseline_and_progressive_jpeg_decode_and_resize() {
    let t = tempfile::tempdir().unwrap();
    let (cats, dogs) = (t.path().join("cat"), t.path().join("dog"));
    std::fs::create_dir_all(&cats).unwrap();
    std::fs::create_dir_all(&dogs).unwrap();
    let img = gradient(40, 24, 200);
    write_png(&cats.join("a.png"), &img);
    write_jpeg(&cats.join("b.jpg"), &img, false);
    write_jpeg(&dogs.join("c.JPEG"), &img, true);
    std::fs::write(dogs.join("notes.txt"), "ignored").unwrap();
    assert!(is_progressive(&dogs.join("c.JPEG")));
    assert!(!is_progressive(&cats.join("b.jpg")));

    let cfg = ImageFolderConfig::rgb(16);
    let f = ImageFolder::open(t.path(), cfg.clone()).unwrap();
    assert_eq!(f.classes(), ["cat", "dog"]);
    assert_eq!(f.len(), 3);
    let items: Vec<_> = (0..3).map(|i| f.get(i).unwrap()).collect();
    assert_eq!(items.iter().map(|s| s.label).collect::<Vec<_>>(), [0, 0, 1]);
    for s in &items {
        assert_eq!(s.shape, vec![3, 16, 16]);
        assert_eq!(s.data.len(), 3 * 16 * 16);
        // Blue plane stays ≈ 200/255 whatever the codec; red rises along x.
        let blue = &s.data[2 * 256..];
        assert!(blue.iter().all(|&b| (b - 200.0 / 255.0).abs() < 0.04));
        let red_row = &s.data[8 * 16..9 * 16];
        assert!(red_row[15] > red_row[0] + 0.5, "{red_row:?}");
    }
    // The three codecs agree to within JPEG error.
    for k in 0..items[0].data.len() {
        assert!(
            (items[0].data[k] - items[2].data[k]).abs() < 0.06,
            "pixel {k}"
        );
        assert!(
            (items[1].data[k] - items[2].data[k]).abs() < 0.06,
            "pixel {k}"
        );
    }

    let grey = ImageFolder::open(
        t.path(),
        ImageFolderConfig {
            height: 8,
            width: 20,
            channels: 1,
            resize: Resize::Stretch,
        },
    )
    .unwrap();
    let all = grey.load_all().unwrap();
    assert_eq!(all.shape(), [1, 8, 20]);
    assert_eq!(all.len(), 3);
    assert_eq!(all.num_classes(), 2);
}

#[test]
fn undecodable_image_names_the_file() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("x");
    std::fs::create_dir_all(&d).unwrap();
    write_png(&d.join("good.png"), &gradient(8, 8, 0));
    // A PNG signature followed by garbage, and a JPEG cut short.
    let mut bad = b"\x89PNG\r\n\x1a\n".to_vec();
    bad.extend_from_slice(&[7u8; 64]);
    std::fs::write(d.join("broken.png"), bad).unwrap();
    write_jpeg(&d.join("cut.jpg"), &gradient(32, 32, 9), true);
    let bytes = std::fs::read(d.join("cut.jpg")).unwrap();
    std::fs::write(d.join("cut.jpg"), &bytes[..bytes.len() / 3]).unwrap();

    let f = ImageFolder::open(t.path(), ImageFolderConfig::rgb(8)).unwrap();
    let names: Vec<_> = f
        .files()
        .iter()
        .map(|(p, _)| p.file_name().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["broken.png", "cut.jpg", "good.png"]);
    let e = f.load(0).unwrap_err();
    assert!(matches!(e, DataError::Image { .. }), "{e:?}");
    assert!(
        e.to_string().contains("broken.png: cannot decode image"),
        "{e}"
    );
    // Through burn's Dataset::get the DataError is the error's source.
    let e = f.get(0).unwrap_err();
    let src = std::error::Error::source(&e).unwrap();
    assert!(src.to_string().contains("broken.png"), "{src}");
    assert!(f.load_all().unwrap_err().to_string().contains("broken.png"));
    assert!(f.get(2).is_ok());
    // A truncated progressive JPEG either fails naming the file or decodes partially
    // (decoders may fill missing scans): it must never panic.
    if let Err(e) = f.load(1) {
        assert!(e.to_string().contains("cut.jpg"), "{e}");
    }
}

#[test]
fn empty_or_missing_folder_is_an_error() {
    let t = tempfile::tempdir().unwrap();
    let e = ImageFolder::open(t.path(), ImageFolderConfig::rgb(8)).unwrap_err();
    assert!(e.to_string().contains("no images found"), "{e}");
    let e = ImageFolder::open(t.path().join("nope"), ImageFolderConfig::rgb(8)).unwrap_err();
    assert!(e.to_string().contains("nope"), "{e}");
}
