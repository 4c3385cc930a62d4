//! What the registry needs of a model family: the [`ModelFamily`] trait each family's spec
//! implements, the [`ModelInfo`] listing entry, and the device helper the specs' `build`
//! share.
//!
//! This file imports no model file. The families import it, and [`crate::registry`] imports
//! the families (its `registry!` line per spec), so the dependency runs one way; the trait
//! and the listing entry are re-exported from `registry` and from the crate root.

use burn::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::flat::ParamTable;
use crate::model::{Model, ModelError};
use crate::torch_names::TorchLayout;

/// A family's registry spec: the options a TOML `[model]` table may set (besides `kind`).
pub trait ModelFamily: Serialize + DeserializeOwned {
    /// The `variant` names the family accepts.
    const VARIANTS: &'static [&'static str];
    /// One line for `dtrain list models`.
    const SUMMARY: &'static str;

    /// Whether the family is a language model: it takes token batches from a text dataset,
    /// whose vocabulary is its `vocab` unless one is given.
    const LANGUAGE_MODEL: bool = false;

    /// Builds the model on `device` (made an autodiff device if it is not one).
    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError>;

    /// Checks the options without building anything (configuration validation); `vocab`
    /// may still be unset. What this passes, `build` accepts once `vocab` is set.
    fn check(&self) -> Result<(), ModelError> {
        Ok(())
    }

    /// The explicit vocabulary size of a language model (`None`: unset, or not a language
    /// model).
    fn vocab(&self) -> Option<usize> {
        None
    }

    /// Sets the vocabulary size (a language model's default: the corpus's). No-op for other
    /// families.
    fn set_vocab(&mut self, _vocab: usize) {}

    /// The longest token sequence the model takes (a transformer's `context`); `None`: any.
    fn context(&self) -> Option<usize> {
        None
    }

    /// PyTorch's names and layouts for the tensors of the model this spec builds, whose
    /// table is `table` (see [`crate::torch_names`]). The default keeps dtrain's module
    /// paths ([`TorchLayout::generic`]); a family whose PyTorch twin names its modules
    /// otherwise overrides it.
    fn torch_layout(&self, table: &ParamTable) -> Result<TorchLayout, ModelError> {
        Ok(TorchLayout::generic(table, |path| path.to_string()))
    }
}

/// One registered family, for listings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelInfo {
    /// The `kind` tag.
    pub kind: &'static str,
    /// Accepted `variant` names.
    pub variants: &'static [&'static str],
    /// One-line description.
    pub summary: &'static str,
}

/// Resolves `device` to its autodiff form.
pub(crate) fn autodiff(device: &Device) -> Device {
    if device.is_autodiff() {
        device.clone()
    } else {
        device.clone().autodiff()
    }
}
