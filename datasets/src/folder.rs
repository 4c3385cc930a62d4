//! Image folders: `root/<class>/<file>.{jpg,jpeg,png}`, decoded lazily.
//!
//! Classes are the sub-directory names in byte order; files within a class are in byte
//! order of their names, so the index → file mapping is the same on every machine.
//! JPEG (baseline and progressive) and PNG are decoded by the `image` crate; each image
//! is converted to RGB or grey and brought to the target size by [`Resize`].

use std::path::{Path, PathBuf};

use burn_dataset::{Dataset, DatasetError};
use image::imageops::FilterType;
use image::{DynamicImage, ImageReader};

use crate::error::{DataError, Result};
use crate::sample::{ImageSet, Sample};

/// How an image is brought to the target size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Resize {
    /// Scale so the image covers the target, then crop the centre (keeps aspect ratio).
    #[default]
    CenterCrop,
    /// Scale each axis independently to the target (distorts aspect ratio).
    Stretch,
}

/// Settings of an [`ImageFolder`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFolderConfig {
    /// Target height in pixels.
    pub height: u32,
    /// Target width in pixels.
    pub width: u32,
    /// 3 for RGB, 1 for grey.
    pub channels: usize,
    /// How images are brought to `height × width`.
    pub resize: Resize,
}

impl ImageFolderConfig {
    /// RGB images of `size × size`, centre-cropped.
    pub fn rgb(size: u32) -> Self {
        Self {
            height: size,
            width: size,
            channels: 3,
            resize: Resize::CenterCrop,
        }
    }
}

/// A dataset over `root/<class>/<image>` files. Items are CHW [`Sample`]s in `[0, 1]`.
#[derive(Debug, Clone)]
pub struct ImageFolder {
    classes: Vec<String>,
    files: Vec<(PathBuf, usize)>,
    config: ImageFolderConfig,
}

const EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

impl ImageFolder {
    /// Lists `root`'s classes and image files. Nothing is decoded yet.
    ///
    /// Errors: `root` unreadable, no class directory, or no image file at all; a
    /// `channels` other than 1 or 3, or a zero target size.
    pub fn open(root: impl AsRef<Path>, config: ImageFolderConfig) -> Result<Self> {
        let root = root.as_ref();
        if !(config.channels == 1 || config.channels == 3)
            || config.height == 0
            || config.width == 0
        {
            return Err(DataError::Invalid(format!(
                "image folder {}: need 1 or 3 channels and a non-zero size, got {config:?}",
                root.display()
            )));
        }
        let mut classes = Vec::new();
        for entry in read_dir_sorted(root)? {
            if entry.is_dir() {
                classes.push(entry);
            }
        }
        let mut files = Vec::new();
        let mut names = Vec::new();
        for (label, dir) in classes.iter().enumerate() {
            for f in read_dir_sorted(dir)? {
                let ext = f
                    .extension()
                    .and_then(|e| e.to_str())
                    .map(|e| e.to_ascii_lowercase());
                if f.is_file() && ext.is_some_and(|e| EXTENSIONS.contains(&e.as_str())) {
                    files.push((f, label));
                }
            }
            names.push(
                dir.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            );
        }
        if files.is_empty() {
            return Err(DataError::format(
                root,
                "no images found (expected root/<class>/<name>.jpg|jpeg|png)",
            ));
        }
        Ok(Self {
            classes: names,
            files,
            config,
        })
    }

    /// Class names; a label is an index into this list.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// The image files and their labels, in index order.
    pub fn files(&self) -> &[(PathBuf, usize)] {
        &self.files
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// True when there are no images (never, for a successfully opened folder).
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Decodes image `index` into raw CHW bytes of the target size.
    ///
    /// # Panics
    /// Panics if `index >= len()`.
    pub fn load_bytes(&self, index: usize) -> Result<Vec<u8>> {
        let (path, _) = &self.files[index];
        let img = decode_image(path)?;
        Ok(to_chw(&fit(img, &self.config), self.config.channels))
    }

    /// Decodes image `index` as a [`Sample`].
    ///
    /// # Panics
    /// Panics if `index >= len()`.
    pub fn load(&self, index: usize) -> Result<Sample> {
        let bytes = self.load_bytes(index)?;
        Ok(Sample {
            data: bytes.iter().map(|&b| b as f32 * (1.0 / 255.0)).collect(),
            shape: self.shape().to_vec(),
            label: self.files[index].1,
        })
    }

    /// `[channels, height, width]` of every item.
    pub fn shape(&self) -> [usize; 3] {
        [
            self.config.channels,
            self.config.height as usize,
            self.config.width as usize,
        ]
    }

    /// Decodes every image into an in-memory [`ImageSet`]; the first undecodable file
    /// is an error naming it.
    pub fn load_all(&self) -> Result<ImageSet> {
        let mut pixels = Vec::with_capacity(self.len() * self.shape().iter().product::<usize>());
        let mut labels = Vec::with_capacity(self.len());
        for i in 0..self.len() {
            pixels.extend(self.load_bytes(i)?);
            labels.push(self.files[i].1 as u16);
        }
        ImageSet::new(self.shape(), pixels, labels, self.classes.len())
    }
}

impl Dataset<Sample> for ImageFolder {
    /// Decodes the image; an undecodable file is an `Err` whose source is
    /// [`DataError::Image`] naming the file.
    ///
    /// # Panics
    /// Panics if `index >= len()`.
    fn get(&self, index: usize) -> Result<Sample, DatasetError> {
        self.load(index).map_err(DatasetError::new)
    }

    fn len(&self) -> usize {
        self.files.len()
    }
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| DataError::io(dir, "read directory", e))? {
        v.push(
            e.map_err(|e| DataError::io(dir, "read directory", e))?
                .path(),
        );
    }
    v.sort();
    Ok(v)
}

/// Decodes a PNG or JPEG file (format from its content, not its name).
pub fn decode_image(path: &Path) -> Result<DynamicImage> {
    let img_err = |source| DataError::Image {
        path: path.to_path_buf(),
        source,
    };
    ImageReader::open(path)
        .map_err(|e| DataError::io(path, "open", e))?
        .with_guessed_format()
        .map_err(|e| DataError::io(path, "read", e))?
        .decode()
        .map_err(img_err)
}

fn fit(img: DynamicImage, c: &ImageFolderConfig) -> DynamicImage {
    if img.width() == c.width && img.height() == c.height {
        return img;
    }
    match c.resize {
        Resize::CenterCrop => img.resize_to_fill(c.width, c.height, FilterType::Triangle),
        Resize::Stretch => img.resize_exact(c.width, c.height, FilterType::Triangle),
    }
}

/// Converts to CHW bytes with 1 (grey) or 3 (RGB) channels.
fn to_chw(img: &DynamicImage, channels: usize) -> Vec<u8> {
    let (w, h) = (img.width() as usize, img.height() as usize);
    if channels == 1 {
        return img.to_luma8().into_raw();
    }
    let rgb = img.to_rgb8();
    let raw = rgb.as_raw();
    let mut out = vec![0u8; 3 * w * h];
    for (p, px) in raw.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * w * h + p] = px[c];
        }
    }
    out
}
