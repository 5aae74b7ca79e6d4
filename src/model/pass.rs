//! What the reference model's layers share: the parts each is built from, and the
//! pass each forward runs in.

use super::dropout::Dropout;
use super::params::Params;
use super::position::Rope;
use super::spec::ModelSpec;
use crate::config::Precision;

/// What every layer is built from: the variables, the spec that names them, the rotary
/// tables (RoPE models), and the precision of the matrix products.
#[derive(Clone, Copy)]
pub struct Parts<'a> {
    pub params: &'a Params,
    pub spec: &'a ModelSpec,
    pub rope: Option<&'a Rope>,
    pub products: Precision,
}

/// One forward pass: where its first token sits, and dropout when training.
#[derive(Clone, Copy)]
pub struct Pass<'a> {
    pub pos0: usize,
    pub dropout: Option<&'a Dropout>,
}
