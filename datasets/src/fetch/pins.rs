//! Pinned sha256 of every file `dtrain data fetch` keeps, measured once from the pinned
//! package versions. A registry that served different bytes would fail these checks.

use super::Pin;

pub(super) const MNIST_PINS: &[Pin] = &[
    Pin {
        member: "package/data/t10k-images-idx3-ubyte",
        file: "t10k-images-idx3-ubyte",
        sha256: "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    },
    Pin {
        member: "package/data/t10k-labels-idx1-ubyte",
        file: "t10k-labels-idx1-ubyte",
        sha256: "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
    Pin {
        member: "package/data/train-images-idx3-ubyte",
        file: "train-images-idx3-ubyte",
        sha256: "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    },
    Pin {
        member: "package/data/train-labels-idx1-ubyte",
        file: "train-labels-idx1-ubyte",
        sha256: "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    },
];

pub(super) const FASHION_PINS: &[Pin] = &[
    Pin {
        member: "usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz",
        file: "t10k-images-idx3-ubyte.gz",
        sha256: "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    },
    Pin {
        member: "usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz",
        file: "t10k-labels-idx1-ubyte.gz",
        sha256: "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
    },
    Pin {
        member: "usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz",
        file: "train-images-idx3-ubyte.gz",
        sha256: "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    },
    Pin {
        member: "usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz",
        file: "train-labels-idx1-ubyte.gz",
        sha256: "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    },
];

pub(super) const MOBY_PINS: &[Pin] = &[Pin {
    member: "package/data/data.txt",
    file: "moby-dick.txt",
    sha256: "fe282a57094ed62e7144fb7c804a9748fc1c909bf3b49d06e7276015f9f67240",
}];

pub(super) const SAMPLES_PINS: &[Pin] = &[
    Pin {
        member: "foolbox/data/cifar100_00_49.png",
        file: "cifar100_00_49.png",
        sha256: "950650b1201b16c7b9bab15d07d0d35957ce6b2fb049dbac3993b59c1d5f71f6",
    },
    Pin {
        member: "foolbox/data/cifar100_01_33.png",
        file: "cifar100_01_33.png",
        sha256: "d393db77699ce0474c199a5dcc35aa5d0796df8c7a5ae3ddf10c07f31ab7d0b8",
    },
    Pin {
        member: "foolbox/data/cifar100_02_72.png",
        file: "cifar100_02_72.png",
        sha256: "f5b2b9ae70d58b546555ffa3a76e2ac96f30475c4fd6283f4fbf826aea7a0d27",
    },
    Pin {
        member: "foolbox/data/cifar100_03_51.png",
        file: "cifar100_03_51.png",
        sha256: "d1d96246dbcc8443d816e0d4283ce27c623dfb462c51d33ef4addec420f90905",
    },
    Pin {
        member: "foolbox/data/cifar100_04_71.png",
        file: "cifar100_04_71.png",
        sha256: "94038d0fa599e2eac2845555fc1419cbeade5da393f2b1a953747353b7e8fd6a",
    },
    Pin {
        member: "foolbox/data/cifar100_05_92.png",
        file: "cifar100_05_92.png",
        sha256: "feb279be28de4d3a1f9d339ca5ed6e14a4959113788a68b623dcd24dcd5c0279",
    },
    Pin {
        member: "foolbox/data/cifar100_06_15.png",
        file: "cifar100_06_15.png",
        sha256: "2a97893fc573f17d851bffe7cc295e19e3fdab77acf92bdc67a2eb08cfbc71f0",
    },
    Pin {
        member: "foolbox/data/cifar100_07_14.png",
        file: "cifar100_07_14.png",
        sha256: "e5932f2977a32d268fbfc2f4a3367970ec323b0f8a6b61b5e967783bac52e2e6",
    },
    Pin {
        member: "foolbox/data/cifar100_08_23.png",
        file: "cifar100_08_23.png",
        sha256: "7b972708656be532cdcf061e797480b18037fc98280216759e5aa68324ebbb92",
    },
    Pin {
        member: "foolbox/data/cifar100_09_0.png",
        file: "cifar100_09_0.png",
        sha256: "f88aaa22ad2ca6b1f2a37cb03cf308537a65d8a705feb08d16de456f732c144b",
    },
    Pin {
        member: "foolbox/data/cifar100_10_71.png",
        file: "cifar100_10_71.png",
        sha256: "6855dcb338d49eaaf249f42d62285b3ff9cf971ed478faf7bd7015f173781e59",
    },
    Pin {
        member: "foolbox/data/cifar100_11_75.png",
        file: "cifar100_11_75.png",
        sha256: "baa3402ffe23b613f11a6d2d61a52a909b223dc7f4658a436acc83345cec2308",
    },
    Pin {
        member: "foolbox/data/cifar100_12_81.png",
        file: "cifar100_12_81.png",
        sha256: "c846a02bfb3f4f90e860c37e221df64c32b4773a884c3fbbad1c20ed821bc5e5",
    },
    Pin {
        member: "foolbox/data/cifar100_13_69.png",
        file: "cifar100_13_69.png",
        sha256: "ae243464d016116024dfd32f1096d67f6caf68ed883d935bace30d640b4d2531",
    },
    Pin {
        member: "foolbox/data/cifar100_14_40.png",
        file: "cifar100_14_40.png",
        sha256: "98b1c1f5425ee96fc14a33eab46ed2ab2bef02534c01d9fc2904a1c7cf5582c4",
    },
    Pin {
        member: "foolbox/data/cifar100_15_43.png",
        file: "cifar100_15_43.png",
        sha256: "876aca1ee3e230d3ae392d535aeed73ac22228c91b3a04ac49af88f96668c6ba",
    },
    Pin {
        member: "foolbox/data/cifar100_16_92.png",
        file: "cifar100_16_92.png",
        sha256: "eed65401664dfb4718542a69d89b230b91ba7374247b5b105d179be95ab2623b",
    },
    Pin {
        member: "foolbox/data/cifar100_17_97.png",
        file: "cifar100_17_97.png",
        sha256: "977faf0c3b8f927516827080c1408cf51d9c9c4dfc26cd43b27307997f5087de",
    },
    Pin {
        member: "foolbox/data/cifar100_18_70.png",
        file: "cifar100_18_70.png",
        sha256: "da6f0ffba1bf5c66bc6f9d2b733ecb42b50e5e733d37ca714572de59e2acc09a",
    },
    Pin {
        member: "foolbox/data/cifar100_19_53.png",
        file: "cifar100_19_53.png",
        sha256: "1efc8b5f1eaa5dbc180e700370f3fa803cf6e026569a8895a2105656efc67d64",
    },
    Pin {
        member: "foolbox/data/cifar10_00_3.png",
        file: "cifar10_00_3.png",
        sha256: "0d4964922e2463ad0e2b1cd298e03d5627ff7dad1ab1cdd173ce35e9974e204f",
    },
    Pin {
        member: "foolbox/data/cifar10_01_8.png",
        file: "cifar10_01_8.png",
        sha256: "eaec54ee1aed958f9548d01aff16c41aeba408885da42759890a538888be879e",
    },
    Pin {
        member: "foolbox/data/cifar10_02_8.png",
        file: "cifar10_02_8.png",
        sha256: "3873d7fb73cd351df3244c6a16cd52eef264700093746e9ac7f8831b3ce6d2e3",
    },
    Pin {
        member: "foolbox/data/cifar10_03_0.png",
        file: "cifar10_03_0.png",
        sha256: "fce5a6515e44e57d6b4349822f25e2cf941c580c5cc2f5fc637d5743a9057338",
    },
    Pin {
        member: "foolbox/data/cifar10_04_6.png",
        file: "cifar10_04_6.png",
        sha256: "6cfbe4ca868b7da43a30545c2011658082ebf2c63680b221d9adbc9228f31192",
    },
    Pin {
        member: "foolbox/data/cifar10_05_6.png",
        file: "cifar10_05_6.png",
        sha256: "d31b1901b24199172f2f652d0b5d6661a4e346a8c1d6b436e77784e93a1d9ad7",
    },
    Pin {
        member: "foolbox/data/cifar10_06_1.png",
        file: "cifar10_06_1.png",
        sha256: "2362c09b8f26a398daac5f4edc5d04739c8b95b7adddad4e49dd6012d9e8fa1d",
    },
    Pin {
        member: "foolbox/data/cifar10_07_6.png",
        file: "cifar10_07_6.png",
        sha256: "84f9dc0df9d001f30ef3c0268a4250e13bc84c680494f2abf4ac10307253ffad",
    },
    Pin {
        member: "foolbox/data/cifar10_08_3.png",
        file: "cifar10_08_3.png",
        sha256: "d77efc76eaf52c5f4f9b76e1e313f462e7426bfebb212e431b5e10fdf7e91128",
    },
    Pin {
        member: "foolbox/data/cifar10_09_1.png",
        file: "cifar10_09_1.png",
        sha256: "5da75a70e31bfb9e28e6e5d82a4f1045227da16a82e359e27bd5a53f74a49d8d",
    },
    Pin {
        member: "foolbox/data/cifar10_10_0.png",
        file: "cifar10_10_0.png",
        sha256: "c50e97f0b6841005b23a108d01b6fe18ab1e59a0c84c9ed0d989fa854b0c9a87",
    },
    Pin {
        member: "foolbox/data/cifar10_11_9.png",
        file: "cifar10_11_9.png",
        sha256: "a7e6dca0f8fb57a9371015ee5ec609411bcf9f96c85177b5ef280c0d80b3bfe8",
    },
    Pin {
        member: "foolbox/data/cifar10_12_5.png",
        file: "cifar10_12_5.png",
        sha256: "b80d290cd1eb025112ea752b9877272fedeb7287f7d492e47bd7b31b94637aae",
    },
    Pin {
        member: "foolbox/data/cifar10_13_7.png",
        file: "cifar10_13_7.png",
        sha256: "3fe4359cdb1453db950f44a70289d4c4f75a4f92e5d822ff88a771769a085f65",
    },
    Pin {
        member: "foolbox/data/cifar10_14_9.png",
        file: "cifar10_14_9.png",
        sha256: "bdae32f37b5de6a6924aa5af401898bfd6c696f9572749a156e4cc6316c30a4e",
    },
    Pin {
        member: "foolbox/data/cifar10_15_8.png",
        file: "cifar10_15_8.png",
        sha256: "576c3d2292dd9f4effa0caa321a9da7cf774b0502ef50940443d797ff77be3ca",
    },
    Pin {
        member: "foolbox/data/cifar10_16_5.png",
        file: "cifar10_16_5.png",
        sha256: "c588d7a98d8a73cbc23a9cac274894bdb432b1394bce6647664ea8188dc1bc85",
    },
    Pin {
        member: "foolbox/data/cifar10_17_7.png",
        file: "cifar10_17_7.png",
        sha256: "9ac91edf5ca7fb19669943ce81f690dc155f245eb014ecf217b5ae16478ace05",
    },
    Pin {
        member: "foolbox/data/cifar10_18_8.png",
        file: "cifar10_18_8.png",
        sha256: "06ef95c8900cc444bf45ee23e86f9c7470eed6fba2c5290a1ae970ec708ea00e",
    },
    Pin {
        member: "foolbox/data/cifar10_19_6.png",
        file: "cifar10_19_6.png",
        sha256: "c7dfa89248f0c00066429fbc80a741d02e4a4328822280ef2c41f9c0b2c41f94",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_00_9.png",
        file: "fashionMNIST_00_9.png",
        sha256: "cc22f44180c393601df7c2b9e5946b59e431ea747aff0d7bc223f8896a71548e",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_01_2.png",
        file: "fashionMNIST_01_2.png",
        sha256: "2df1817f8cd941cdcf918412bf7c7daa1b494a8473aad9f42f17244a903f7208",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_02_1.png",
        file: "fashionMNIST_02_1.png",
        sha256: "d66e39bd3a44f2c0e1fe825a089334f54862de9a29aa14feadd12069d4b49810",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_03_1.png",
        file: "fashionMNIST_03_1.png",
        sha256: "1f3bfa2ca4a9f5a0a8c9fa1bf7ebb0a1b232e352621ad788d136c54b9b61a92b",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_04_6.png",
        file: "fashionMNIST_04_6.png",
        sha256: "44b99883d220542fab7aafddcbfb67482c4830bd6e496bcb615eb69d71e3d6ed",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_05_1.png",
        file: "fashionMNIST_05_1.png",
        sha256: "2f105d0ce045dea06236f37e6e136a6765c92f9d8f493316dad592a612c9a085",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_06_4.png",
        file: "fashionMNIST_06_4.png",
        sha256: "49d207a3c89c50aba8081df46c9079e3c0456695f95f08aeb9900c9923451a6e",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_07_6.png",
        file: "fashionMNIST_07_6.png",
        sha256: "10809ad80b4a81f841eb83539b8701f2f4bf75cfe4fdfcfbf61b4ad83a2db566",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_08_5.png",
        file: "fashionMNIST_08_5.png",
        sha256: "e8d2fe3c6ec5e7f0c74b0f84b3c6f041f65037ce1320e64a56135cb4e73c4e18",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_09_7.png",
        file: "fashionMNIST_09_7.png",
        sha256: "7748b55e5aba8c73f8345d676b536da8690196b727283344c2506cf9109e2a55",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_10_4.png",
        file: "fashionMNIST_10_4.png",
        sha256: "6f343fca2bd148e95517354fb2b9e2ef178d8c3ebec304a6310201010e4ca482",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_11_5.png",
        file: "fashionMNIST_11_5.png",
        sha256: "5dd0c0481b59b252b916ad723930f5d4a89af2d047ff8a563b40454927782707",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_12_7.png",
        file: "fashionMNIST_12_7.png",
        sha256: "e25759b48514bbee532cc2c96e2b282f4ecf33f28309d6c6b3ccc224c6118af1",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_13_3.png",
        file: "fashionMNIST_13_3.png",
        sha256: "8cef78fd3b0477894ffc1b3a289a2d681a73c1a2407a89fafabef92d1fae129b",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_14_4.png",
        file: "fashionMNIST_14_4.png",
        sha256: "2a763364dd60edbb84b7eceb5ad547c669c24de5bb8cd72a078b9059818f6098",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_15_1.png",
        file: "fashionMNIST_15_1.png",
        sha256: "8046761a7875670b30188ed0868662ee946fe85462d3e212ca31b9ddb3c6cfff",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_16_2.png",
        file: "fashionMNIST_16_2.png",
        sha256: "de8771bb20ad56beb12c123574741bea5591afa669160a68c00734483f2d5592",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_17_4.png",
        file: "fashionMNIST_17_4.png",
        sha256: "cab3096ab9ff2ea2087a01eca68d09bd6a3c64d419b983cf36199ffebbab07a8",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_18_8.png",
        file: "fashionMNIST_18_8.png",
        sha256: "d1cb535c544652bb98b8d01d25300a6de6750821d6c60601be0f3633ad7cdf20",
    },
    Pin {
        member: "foolbox/data/fashionMNIST_19_0.png",
        file: "fashionMNIST_19_0.png",
        sha256: "1add0501d1c3763f63baec809778e1c67142418118dac382328e6f99dc39fa30",
    },
    Pin {
        member: "foolbox/data/imagenet_00_243.jpg",
        file: "imagenet_00_243.jpg",
        sha256: "28b7b933c8028c6e20bf74a86a709eda42ce99f14c8742cb657cb386f08a4c9d",
    },
    Pin {
        member: "foolbox/data/imagenet_01_559.jpg",
        file: "imagenet_01_559.jpg",
        sha256: "5f03b0c74dff01b5b4195d0beabcae2a625a406e6917957ab9c455b5b7dea6d6",
    },
    Pin {
        member: "foolbox/data/imagenet_02_438.jpg",
        file: "imagenet_02_438.jpg",
        sha256: "ccef0734c1a65549c6cb5adb0f5d9b1c0b2e2104aba50a9e5f9202dc6d4532ed",
    },
    Pin {
        member: "foolbox/data/imagenet_03_990.jpg",
        file: "imagenet_03_990.jpg",
        sha256: "c7f0b2f1e9ee39d8f900759e8983afa2e4a2d7de090060e8bb947f6e90cace5f",
    },
    Pin {
        member: "foolbox/data/imagenet_04_949.jpg",
        file: "imagenet_04_949.jpg",
        sha256: "a7f62f3c1d214de4718c7253871ab38209283249e131faf65b8f2b7fdc970669",
    },
    Pin {
        member: "foolbox/data/imagenet_05_853.jpg",
        file: "imagenet_05_853.jpg",
        sha256: "8a449436c61da867528b1f4efaf8ae832ab9c9201705eae0d3af1353fbdac131",
    },
    Pin {
        member: "foolbox/data/imagenet_06_609.jpg",
        file: "imagenet_06_609.jpg",
        sha256: "fb061102a4e58b3ed942bb2a4f9542e1e1acdc8f225ef95498e93889290e192f",
    },
    Pin {
        member: "foolbox/data/imagenet_07_609.jpg",
        file: "imagenet_07_609.jpg",
        sha256: "2c297ad1e5c4804a647e9b34bc02ee2fc348b05a4d49050d170fb61c948efa5c",
    },
    Pin {
        member: "foolbox/data/imagenet_08_915.jpg",
        file: "imagenet_08_915.jpg",
        sha256: "c6a3411a3987799f0de45adc142f00ca412c3e14073c635e2adfae1f3913180c",
    },
    Pin {
        member: "foolbox/data/imagenet_09_455.jpg",
        file: "imagenet_09_455.jpg",
        sha256: "ace3716b60ac5843269b270e17020e4f8138440cd30ef3487f7d6e54da9745a4",
    },
    Pin {
        member: "foolbox/data/imagenet_10_541.jpg",
        file: "imagenet_10_541.jpg",
        sha256: "f325c71d9f4290ee45e99bd7ad42f4bffe513b1450ad21e7bd61c7cb137395d9",
    },
    Pin {
        member: "foolbox/data/imagenet_11_630.jpg",
        file: "imagenet_11_630.jpg",
        sha256: "892dff58fc528fe63d2df0c783aa3eca2342637798578ce01763fbc0553eda01",
    },
    Pin {
        member: "foolbox/data/imagenet_12_741.jpg",
        file: "imagenet_12_741.jpg",
        sha256: "6c256e17545b25bbf2e06cf6513ff48d049583569515ac4d4c3a52aea804a529",
    },
    Pin {
        member: "foolbox/data/imagenet_13_471.jpg",
        file: "imagenet_13_471.jpg",
        sha256: "52ed0e738b90d27afcabc3e92c81ae637f160c2d9f75b93a65211005ab5dcd81",
    },
    Pin {
        member: "foolbox/data/imagenet_14_129.jpg",
        file: "imagenet_14_129.jpg",
        sha256: "ad9371d813bf24b0365ee2f78f28c08718ee7c5975f060caa16c3f264e828139",
    },
    Pin {
        member: "foolbox/data/imagenet_15_99.jpg",
        file: "imagenet_15_99.jpg",
        sha256: "4b588649cd835d4c65521727ebee03d9621baff1f54d3e8a53a26b53d983ec2e",
    },
    Pin {
        member: "foolbox/data/imagenet_16_251.jpg",
        file: "imagenet_16_251.jpg",
        sha256: "ce3440a3b7beb6ca3009817504c44d39fa789e7c2f70a2eef7e2f9cc9a87b129",
    },
    Pin {
        member: "foolbox/data/imagenet_17_22.jpg",
        file: "imagenet_17_22.jpg",
        sha256: "b432341845620e9cfd67d848c4783c32dd6eaddad45513866b17180d2b09fcf5",
    },
    Pin {
        member: "foolbox/data/imagenet_18_317.jpg",
        file: "imagenet_18_317.jpg",
        sha256: "b9412f92f0b1c3faede45b55a44940977daa744f2040118d0538cf597fca785d",
    },
    Pin {
        member: "foolbox/data/imagenet_19_305.jpg",
        file: "imagenet_19_305.jpg",
        sha256: "e1f58f00e2e47ce930d7ecab0e46a78316054f68c10d0742e87c1cc092324556",
    },
    Pin {
        member: "foolbox/data/mnist_00_7.png",
        file: "mnist_00_7.png",
        sha256: "4765a6a3323bab81763ab13ad5f0370ddc653ba00dc3f817f1e7f7a0ae8f2d9d",
    },
    Pin {
        member: "foolbox/data/mnist_01_2.png",
        file: "mnist_01_2.png",
        sha256: "72363b408e0f318c0d2db8c663a49efff6358d2e770eb3201e298d9f7b5b0d48",
    },
    Pin {
        member: "foolbox/data/mnist_02_1.png",
        file: "mnist_02_1.png",
        sha256: "33bf13128fd13c23190fa297e80abc6e5bc3e4c7bb291fa1fd31894aeea185ae",
    },
    Pin {
        member: "foolbox/data/mnist_03_0.png",
        file: "mnist_03_0.png",
        sha256: "d7e589381b51c3aee74517724f3d8e40cec0b5c810567703736f5ddb7ea2ca3d",
    },
    Pin {
        member: "foolbox/data/mnist_04_4.png",
        file: "mnist_04_4.png",
        sha256: "9c4ef669be5ea4172faca47eb7352f6da4dc750635a477bb4dec8c42b8e74a24",
    },
    Pin {
        member: "foolbox/data/mnist_05_1.png",
        file: "mnist_05_1.png",
        sha256: "1bc798f3d591d142dc454460f1d88020ac97f8278267e17da91a99da194aa330",
    },
    Pin {
        member: "foolbox/data/mnist_06_4.png",
        file: "mnist_06_4.png",
        sha256: "69e11b8a1e79ae9a112c3df407b75429d160f20b2a3db659aa9cc701e18b8b8b",
    },
    Pin {
        member: "foolbox/data/mnist_07_9.png",
        file: "mnist_07_9.png",
        sha256: "958ece5dc38620a377090eb5a57fbae68b1cd2beee5e9eea3995cbfed694566c",
    },
    Pin {
        member: "foolbox/data/mnist_08_5.png",
        file: "mnist_08_5.png",
        sha256: "1ee6fbc49ce07d63fa8830574c3505c456ee000168708a66b65020a83b32a0f9",
    },
    Pin {
        member: "foolbox/data/mnist_09_9.png",
        file: "mnist_09_9.png",
        sha256: "a573740fba4eeae1cae2bfd92dfc81bba8a0cbf28c4c6ded4de86b66aa9a032d",
    },
    Pin {
        member: "foolbox/data/mnist_10_0.png",
        file: "mnist_10_0.png",
        sha256: "24ae4056b797e805c6ad6fa04502664f6529f9f6c15f8fa4e674c23ee9cf94cb",
    },
    Pin {
        member: "foolbox/data/mnist_11_6.png",
        file: "mnist_11_6.png",
        sha256: "de821203aac9ecd8f9c551ae1999dd08b206828dc2a432838faafeae346bb1b0",
    },
    Pin {
        member: "foolbox/data/mnist_12_9.png",
        file: "mnist_12_9.png",
        sha256: "f6124535db9080cc271c87820ec32ee08a79cd133818304e1e05019b6e367f19",
    },
    Pin {
        member: "foolbox/data/mnist_13_0.png",
        file: "mnist_13_0.png",
        sha256: "00eae173a7bc2e7c8907f72b98962a81c7c86ab03fd58d22be06dc9adb2a0072",
    },
    Pin {
        member: "foolbox/data/mnist_14_1.png",
        file: "mnist_14_1.png",
        sha256: "32f3333eedfaa391c301e82a2c79d7fce0f1dedcde63ba1c50aa80980f8b89f1",
    },
    Pin {
        member: "foolbox/data/mnist_15_5.png",
        file: "mnist_15_5.png",
        sha256: "0a3e6179730690269a6ad1262a1c0c696def8cf3d23ddd62020f752f523e3953",
    },
    Pin {
        member: "foolbox/data/mnist_16_9.png",
        file: "mnist_16_9.png",
        sha256: "c6f064e150351eb3bd2ca06479e7ca9013b9a03072a8b43b75cbf1d8b1287c14",
    },
    Pin {
        member: "foolbox/data/mnist_17_7.png",
        file: "mnist_17_7.png",
        sha256: "216b1ffeabad94955a44688d9ab16d48fda90da65c5a4dd8ebf58ced101292be",
    },
    Pin {
        member: "foolbox/data/mnist_18_3.png",
        file: "mnist_18_3.png",
        sha256: "b64608b54865acecbe635c4ebf8e7efb60c83ff611d5a889fdd9ebe42b24eb30",
    },
    Pin {
        member: "foolbox/data/mnist_19_4.png",
        file: "mnist_19_4.png",
        sha256: "0d95e3eb12c55a84768e832f0bc3273a444b6b4aba5c02db66839ca8e64ea2f5",
    },
];

/// Built by `build_sotu` from the 233 speeches (deterministic: sorted order, whitespace
/// and control characters collapsed to single spaces).
pub(super) const SOTU_PINS: &[Pin] = &[
    Pin {
        member: "",
        file: "sotu.txt",
        sha256: "54a9be79df9cd300bcfa74f4bb376c202feffa4808899f330176494db208d946",
    },
    Pin {
        member: "",
        file: "speeches.tsv",
        sha256: "090d4307b230baf9fff8de29946ac19d04442aa2b7b084ac62e576b4b34e22c7",
    },
];
