use cubek_quant::scheme::{QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype};
use cubek_test_utils::CatalogEntry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    RowMajor,
    ColMajor,
}

impl Layout {
    pub fn short(self) -> &'static str {
        match self {
            Layout::RowMajor => "r",
            Layout::ColMajor => "c",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantSide {
    LhsOnly,
    RhsOnly,
    Both,
}

impl QuantSide {
    fn short(self) -> &'static str {
        match self {
            QuantSide::LhsOnly => "lhs",
            QuantSide::RhsOnly => "rhs",
            QuantSide::Both => "both",
        }
    }
}

#[derive(Clone, Copy)]
pub enum Mode {
    Float,
    Quant {
        scheme: QuantScheme,
        side: QuantSide,
    },
}

#[derive(Clone)]
pub struct QuantizedMatmulProblem {
    pub b: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lhs_layout: Layout,
    pub rhs_layout: Layout,
    pub mode: Mode,
    pub mode_label: String,
}

fn scheme_tensor(value: QuantValue) -> QuantScheme {
    QuantScheme::default()
        .with_mode(QuantMode::Symmetric)
        .per_tensor(ScaleDtype::F32)
        .with_value(value)
        .with_store(QuantStore::PackedU32(0))
}

fn scheme_block(value: QuantValue, block: u8) -> QuantScheme {
    QuantScheme::default()
        .with_mode(QuantMode::Symmetric)
        .per_block([block], ScaleDtype::F32)
        .with_value(value)
        .with_store(QuantStore::PackedU32(0))
}

fn quant_schemes() -> Vec<(&'static str, QuantScheme)> {
    vec![
        ("q8s-tensor", scheme_tensor(QuantValue::Q8S)),
        ("q4s-tensor", scheme_tensor(QuantValue::Q4S)),
        ("q8s-block32", scheme_block(QuantValue::Q8S, 32)),
        ("q4s-block32", scheme_block(QuantValue::Q4S, 32)),
    ]
}

fn quant_sides() -> Vec<QuantSide> {
    vec![QuantSide::LhsOnly, QuantSide::RhsOnly, QuantSide::Both]
}

fn layouts() -> Vec<(Layout, Layout)> {
    use Layout::*;
    vec![
        (RowMajor, RowMajor),
        (RowMajor, ColMajor),
        (ColMajor, RowMajor),
        (ColMajor, ColMajor),
    ]
}

fn gemm_shapes() -> Vec<(usize, usize, usize, usize)> {
    vec![
        (1, 1024, 1024, 1024),
        (1, 4096, 4096, 4096),
        (2, 1024, 1024, 1024),
    ]
}

fn gemv_shapes() -> Vec<(usize, usize, usize, usize)> {
    vec![(1, 4096, 1, 4096)]
}

fn shape_kind(b: usize, m: usize, n: usize, k: usize) -> &'static str {
    if m == 1 || n == 1 {
        "gemv"
    } else {
        let _ = (b, k);
        "gemm"
    }
}

fn build_id(p: &QuantizedMatmulProblem) -> String {
    format!(
        "{}_b{}_m{}_n{}_k{}_{}{}_{}",
        shape_kind(p.b, p.m, p.n, p.k),
        p.b,
        p.m,
        p.n,
        p.k,
        p.lhs_layout.short(),
        p.rhs_layout.short(),
        p.mode_label,
    )
}

fn build_label(p: &QuantizedMatmulProblem) -> String {
    format!(
        "{} (b={} m={} n={} k={}) {}{} {}",
        shape_kind(p.b, p.m, p.n, p.k).to_uppercase(),
        p.b,
        p.m,
        p.n,
        p.k,
        p.lhs_layout.short(),
        p.rhs_layout.short(),
        p.mode_label,
    )
}

fn modes() -> Vec<(String, Mode)> {
    let mut out = vec![("float".to_string(), Mode::Float)];
    for (name, scheme) in quant_schemes() {
        for side in quant_sides() {
            out.push((
                format!("{}-{}", name, side.short()),
                Mode::Quant { scheme, side },
            ));
        }
    }
    out
}

pub fn problems() -> Vec<CatalogEntry<QuantizedMatmulProblem>> {
    let mut out = Vec::new();
    for shapes in [gemm_shapes(), gemv_shapes()] {
        for (b, m, n, k) in shapes {
            for (lhs_layout, rhs_layout) in layouts() {
                for (mode_label, mode) in modes() {
                    let problem = QuantizedMatmulProblem {
                        b,
                        m,
                        n,
                        k,
                        lhs_layout,
                        rhs_layout,
                        mode,
                        mode_label,
                    };
                    let id = build_id(&problem);
                    let label = build_label(&problem);
                    out.push(CatalogEntry::new(id, label, problem));
                }
            }
        }
    }
    out
}
