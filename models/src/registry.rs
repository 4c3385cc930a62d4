//! The model registry: a serde enum tagged `kind` that a TOML `[model]` table deserializes
//! into, and that builds a boxed [`Model`].
//!
//! ```toml
//! [model]
//! kind = "resnet"
//! variant = "resnet20"
//! num_classes = 10
//! ```
//!
//! Each family owns its spec type (next to its module, in its own file) and implements
//! [`ModelFamily`] for it; the registry is one line per family in the `registry!` invocation
//! below, which generates [`ModelSpec`], [`ModelSpec::build`] and the static list [`MODELS`]
//! that `dtrain list models` prints. Unknown keys are rejected.

use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::alexnet::AlexNetSpec;
use crate::gpt::GptSpec;
use crate::lenet::LeNet5Spec;
use crate::lstm::LstmLmSpec;
use crate::mlp::MlpSpec;
use crate::model::{Model, ModelError};
use crate::resnet::ResNetSpec;
use crate::vgg::VggSpec;

// Defined in `family.rs`, which imports no model file, so that the families depend on it
// and this file depends on the families, never the reverse; kept here at their old paths.
pub use crate::family::{ModelFamily, ModelInfo};

macro_rules! registry {
    ($($(#[$doc:meta])* $variant:ident($spec:ty) = $kind:literal,)*) => {
        /// A model configuration from TOML/JSON: `kind` selects the family, the other keys
        /// are the family's spec.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum ModelSpec {
            $($(#[$doc])* #[serde(rename = $kind)] $variant($spec),)*
        }

        impl ModelSpec {
            /// Builds the model on `device` (made an autodiff device if it is not one).
            pub fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
                match self {
                    $(ModelSpec::$variant(spec) => spec.build(device),)*
                }
            }

            /// The `kind` tag.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(ModelSpec::$variant(_) => $kind,)*
                }
            }

            /// Whether the family is a language model ([`ModelFamily::LANGUAGE_MODEL`]).
            pub fn is_language_model(&self) -> bool {
                match self {
                    $(ModelSpec::$variant(_) => <$spec as ModelFamily>::LANGUAGE_MODEL,)*
                }
            }

            /// Checks the options without building ([`ModelFamily::check`]).
            pub fn check(&self) -> Result<(), ModelError> {
                match self {
                    $(ModelSpec::$variant(spec) => spec.check(),)*
                }
            }

            /// The explicit vocabulary size ([`ModelFamily::vocab`]).
            pub fn vocab(&self) -> Option<usize> {
                match self {
                    $(ModelSpec::$variant(spec) => spec.vocab(),)*
                }
            }

            /// Sets the vocabulary size ([`ModelFamily::set_vocab`]).
            pub fn set_vocab(&mut self, vocab: usize) {
                match self {
                    $(ModelSpec::$variant(spec) => spec.set_vocab(vocab),)*
                }
            }

            /// PyTorch's names and layouts for the tensors of the model this spec builds
            /// ([`ModelFamily::torch_layout`]); `table` is that model's table.
            pub fn torch_layout(
                &self,
                table: &crate::flat::ParamTable,
            ) -> Result<crate::torch_names::TorchLayout, ModelError> {
                match self {
                    $(ModelSpec::$variant(spec) => spec.torch_layout(table),)*
                }
            }

            /// The longest sequence the model takes ([`ModelFamily::context`]).
            pub fn context(&self) -> Option<usize> {
                match self {
                    $(ModelSpec::$variant(spec) => spec.context(),)*
                }
            }
        }

        /// Every registered family, in registry order.
        pub const MODELS: &[ModelInfo] = &[
            $(ModelInfo {
                kind: $kind,
                variants: <$spec as ModelFamily>::VARIANTS,
                summary: <$spec as ModelFamily>::SUMMARY,
            },)*
        ];
    };
}

registry! {
    /// Multi-layer perceptron.
    Mlp(MlpSpec) = "mlp",
    /// LeNet-5.
    LeNet(LeNet5Spec) = "lenet",
    /// AlexNet.
    AlexNet(AlexNetSpec) = "alexnet",
    /// VGG.
    Vgg(VggSpec) = "vgg",
    /// ResNet.
    ResNet(ResNetSpec) = "resnet",
    /// LSTM language model.
    Lstm(LstmLmSpec) = "lstm",
    /// GPT (decoder-only transformer) language model.
    Gpt(GptSpec) = "gpt",
}

/// Every `kind/variant` name, e.g. `resnet/resnet20`, in registry order.
pub fn model_names() -> Vec<String> {
    MODELS
        .iter()
        .flat_map(|m| m.variants.iter().map(move |v| format!("{}/{v}", m.kind)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_toml(text: &str) -> Result<ModelSpec, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn every_family_is_listed_with_variants() {
        let kinds: Vec<_> = MODELS.iter().map(|m| m.kind).collect();
        assert_eq!(
            kinds,
            ["mlp", "lenet", "alexnet", "vgg", "resnet", "lstm", "gpt"]
        );
        assert!(MODELS.iter().all(|m| !m.variants.is_empty()));
        assert!(model_names().contains(&"resnet/resnet20".to_string()));
        assert!(model_names().contains(&"vgg/vgg16".to_string()));
    }

    #[test]
    fn parses_a_toml_table() {
        let spec = from_toml(
            "kind = \"resnet\"\nvariant = \"resnet56\"\nnum_classes = 100\nshortcut = \"b\"\n",
        )
        .unwrap();
        let ModelSpec::ResNet(r) = &spec else {
            panic!("wrong family: {spec:?}")
        };
        assert_eq!(r.num_classes, Some(100));
        assert_eq!(spec.kind(), "resnet");
    }

    #[test]
    fn rejects_unknown_keys_kinds_and_variants() {
        for bad in [
            "kind = \"resnet\"\nvariant = \"resnet20\"\nnum_clases = 10\n",
            "kind = \"resnet\"\nvariant = \"resnet21\"\n",
            "kind = \"transformer\"\n",
            "kind = \"gpt\"\nvariant = \"gpt3\"\n",
            "kind = \"gpt\"\nwidth = 64\n",
            "variant = \"resnet20\"\n",
            "kind = \"vgg\"\nvariant = \"vgg16\"\nlrn = true\n",
        ] {
            assert!(from_toml(bad).is_err(), "accepted: {bad}");
        }
    }

    #[test]
    fn round_trips_through_json() {
        let spec = from_toml(
            "kind = \"lstm\"\nvariant = \"word\"\nvocab = 100\nhidden = 32\nembed = 32\n",
        )
        .unwrap();
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<ModelSpec>(&json).unwrap(), spec);
    }

    #[test]
    fn invalid_combinations_are_errors_not_panics() {
        let device = Device::flex();
        for bad in [
            "kind = \"lstm\"\nvariant = \"word\"\nvocab = 100\nhidden = 32\nembed = 16\ntied = true\n",
            "kind = \"resnet\"\nvariant = \"resnet50\"\nshortcut = \"a\"\n",
            "kind = \"vgg\"\nvariant = \"vgg11\"\nimage_size = 40\n",
            "kind = \"lenet\"\nimage_size = 8\n",
            "kind = \"mlp\"\ndropout = 1.5\n",
            "kind = \"alexnet\"\nvariant = \"imagenet\"\nimage_size = 32\n",
            "kind = \"gpt\"\nvocab = 10\nd_model = 30\nheads = 4\n",
            "kind = \"gpt\"\nvocab = 10\ndropout = 1.0\n",
            "kind = \"gpt\"\nd_model = 32\n",
            "kind = \"lstm\"\nvariant = \"char\"\n",
        ] {
            let spec = from_toml(bad).unwrap();
            assert!(
                matches!(spec.build(&device), Err(ModelError::Config(_))),
                "built: {bad}"
            );
        }
    }
}
