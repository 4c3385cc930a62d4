#!/usr/bin/env python3
"""Self-check of the PyTorch twins in models.py: each has exactly dtrain's parameter count,
and one training step runs on a batch of 2.

    python experiments/vs_pytorch/test_models.py
    python -m unittest experiments/vs_pytorch/test_models.py     (from the repository root)
    python -m unittest                                            (from experiments/vs_pytorch)

Skipped when torch is not installed (CI has none).
"""

import importlib.util
import math
import os
import sys
import unittest

try:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
except ImportError:
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))

# dtrain's `model.table().num_params()` of each registry default, as its own docs and tests
# state them (models/src/mlp.rs, lenet.rs, alexnet.rs, vgg.rs, resnet.rs, lstm.rs; the LSTM
# at dtrain's bench vocabulary of 10,000). Kept here as literals, independent of models.py.
DTRAIN_PARAMS = {
    "mlp/mnist": 535_818,
    "lenet/lenet5": 61_706,
    "alexnet/cifar": 2_472_266,
    "vgg/vgg11": 9_225_610,
    "resnet/resnet20": 269_722,
    "lstm/word": 2_653_200,
}

# The field names of dtrain's `--json` rows (framework/src/bench/models.rs `Row`, `Timing`).
ROW_FIELDS = {"model", "params", "batch", "dropout_off", "timing", "reference", "check"}
TIMING_FIELDS = {"device", "first_ms", "step_ms", "forward_ms", "backward_ms"}


def load_twins():
    """Imports models.py by path, under a name of its own: the repository root has a `models/`
    directory (dtrain's Rust crate) that a plain `import models` could find first."""
    name = "dtrain_vs_pytorch_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "models.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@unittest.skipIf(torch is None, "torch is not installed (pip install torch==2.1.2)")
class TwinTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.twins = load_twins()

    def test_every_dtrain_bench_default_has_a_twin(self):
        self.assertEqual(list(self.twins.TWINS), list(DTRAIN_PARAMS))

    def test_parameter_counts_equal_dtrains(self):
        for name, want in DTRAIN_PARAMS.items():
            with self.subTest(model=name):
                torch.manual_seed(0)
                model = self.twins.TWINS[name].build()
                self.assertEqual(self.twins.count_params(model), want)
                self.assertEqual(self.twins.TWINS[name].dtrain_params, want)

    def test_the_gpt_twin_has_dtrains_parameter_count_and_steps(self):
        # dtrain: `dtrain bench models --models gpt/mini` prints 5785088 params.
        twin = self.twins.EXTRA_TWINS["gpt/mini"]
        torch.manual_seed(0)
        self.assertEqual(self.twins.count_params(twin.build()), 5_785_088)
        stepper, _ = self.twins.make_stepper("gpt/mini", batch=2, seq_len=5)
        loss, _, _ = stepper.step()
        self.assertTrue(math.isfinite(loss) and loss > 0, loss)

    def test_one_step_on_a_batch_of_two(self):
        for name in DTRAIN_PARAMS:
            with self.subTest(model=name):
                stepper, described = self.twins.make_stepper(name, batch=2, seq_len=5)
                loss, fwd_ms, bwd_ms = stepper.step()
                self.assertTrue(math.isfinite(loss) and loss > 0, loss)
                self.assertGreaterEqual(fwd_ms, 0)
                self.assertGreaterEqual(bwd_ms, 0)
                grads = stepper.flat_grads
                self.assertEqual(grads.numel(), DTRAIN_PARAMS[name])
                self.assertTrue(bool(torch.isfinite(grads).all()))
                self.assertGreater(float(grads.abs().sum()), 0.0)
                self.assertTrue(described.startswith("2x"), described)
                # A second step runs too (the LSTM from its carried state).
                loss2, _, _ = stepper.step()
                self.assertTrue(math.isfinite(loss2))

    def test_mlp_options_mirror_dtrains(self):
        # The MLP: 1024-2048-1024-10 (dtrain: `mlp/mnist:image_size=32;hidden=[2048,1024]`).
        name = "mlp/mnist:image_size=32;hidden=[2048,1024]"
        twin = self.twins.resolve(name)
        self.assertEqual(twin.input, ("images", 1, 32, 32, 10))
        widths = [1024, 2048, 1024, 10]
        want = sum(a * b + b for a, b in zip(widths, widths[1:]))
        self.assertEqual(self.twins.count_params(twin.build()), want)
        row = self.twins.measure(name, batch=2, warmup=1, steps=1)
        self.assertEqual((row["params"], row["batch"]), (want, "2x1x32x32"))
        with self.assertRaisesRegex(ValueError, "not mirrored"):
            self.twins.resolve("resnet/resnet20:depth=32")
        with self.assertRaisesRegex(ValueError, "unknown model"):
            self.twins.resolve("mlp/huge")
        self.assertEqual(self.twins.split_top_level("a,b:h=[1,2];c=3 d", ", "),
                         ["a", "b:h=[1,2];c=3", "d"])

    def test_option_a_shortcut_subsamples_and_zero_pads(self):
        block = self.twins.BasicBlock(16, 32, 2)
        x = torch.randn(2, 16, 8, 8)
        y = block.shortcut(x)
        self.assertEqual(tuple(y.shape), (2, 32, 4, 4))
        self.assertTrue(bool((y[:, :8] == 0).all()) and bool((y[:, 24:] == 0).all()))
        self.assertTrue(torch.equal(y[:, 8:24], x[:, :, ::2, ::2]))
        # Option A has no parameters: two convolutions (no bias) and two BatchNorms only.
        convs = 32 * 16 * 9 + 32 * 32 * 9
        norms = 2 * (32 + 32)
        self.assertEqual(self.twins.count_params(block), convs + norms)

    def test_dtrains_batch_and_json_fields(self):
        # dtrain's generator: pixels in [-1, 1), labels below the class count, deterministic.
        twin = self.twins.TWINS["lenet/lenet5"]
        a = self.twins.synthetic_batch(twin, 4, 0, 7, "dtrain")
        b = self.twins.synthetic_batch(twin, 4, 0, 7, "dtrain")
        self.assertTrue(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
        self.assertTrue(bool((a[0] >= -1).all()) and bool((a[0] < 1).all()))
        self.assertTrue(bool((a[1] >= 0).all()) and bool((a[1] < 10).all()))
        row = self.twins.measure("mlp/mnist", batch=2, warmup=1, steps=1)
        self.assertEqual(set(row), ROW_FIELDS)
        self.assertEqual(set(row["timing"]), TIMING_FIELDS)
        self.assertEqual(row["batch"], "2x1x28x28")
        self.assertEqual(row["params"], DTRAIN_PARAMS["mlp/mnist"])
        self.assertIn("fwd ms", self.twins.table_header())


if __name__ == "__main__":
    unittest.main()
