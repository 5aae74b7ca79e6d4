//! Tensors by name, as safetensors files hold them, and the flat buffer in table order
//! that the engines and the decoder work on: the two ways round, every tensor checked
//! against the spec's table.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use super::spec::Param;
use crate::user_bail;

/// The weights of `table` from a file's `tensors`, which must hold exactly these names
/// with these shapes, as one flat buffer; `source` names the file in errors.
pub fn weights_from_file(
    table: &[Param],
    tensors: &NamedTensors,
    source: &str,
) -> Result<Vec<f32>> {
    let flat = flat_from_named(table, tensors, "", source)?;
    if let Some(extra) = tensors
        .keys()
        .find(|k| !table.iter().any(|p| &p.name == *k))
    {
        user_bail!(
            "{source}: unexpected tensor {extra}; the file does not match this model's config"
        );
    }
    Ok(flat)
}

/// Tensors by name, as safetensors files hold them.
pub type NamedTensors = HashMap<String, Tensor>;

/// The tensors of `table`, found in `tensors` as `<name><suffix>`, as one flat f32
/// buffer in table order. A missing or mis-shaped tensor is an error naming it and
/// `source` (the file).
pub fn flat_from_named(
    table: &[Param],
    tensors: &NamedTensors,
    suffix: &str,
    source: &str,
) -> Result<Vec<f32>> {
    let mut flat = Vec::with_capacity(table.iter().map(Param::len).sum());
    for p in table {
        let name = format!("{}{suffix}", p.name);
        let Some(t) = tensors.get(&name) else {
            user_bail!(
                "{source}: tensor {name} is missing; the file does not match this model's config"
            );
        };
        if t.dims() != p.shape.as_slice() {
            user_bail!(
                "{source}: tensor {name} has shape {:?}, but the config needs {:?}",
                t.dims(),
                p.shape
            );
        }
        flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(flat)
}

/// The reverse of [`flat_from_named`]: `flat`'s tensors on the host, named
/// `<name><suffix>`.
pub fn named_from_flat(table: &[Param], flat: &[f32], suffix: &str) -> Result<NamedTensors> {
    table
        .iter()
        .map(|p| {
            let t = Tensor::from_slice(&flat[p.range()], p.shape.as_slice(), &Device::Cpu)?;
            Ok((format!("{}{suffix}", p.name), t))
        })
        .collect()
}
