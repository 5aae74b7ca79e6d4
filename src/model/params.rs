//! The reference model's trainable tensors: the spec's table as candle variables.
//!
//! candle's own initialisers draw from an unseeded RNG on CPU, so runs could not be
//! reproduced. The values come from [`ModelSpec::initial_values`] (one seeded stream,
//! drawn on the host) or from a checkpoint, and are then moved to the device: the same
//! seed gives the same weights on every device and in every engine.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};

use super::spec::{ModelSpec, Param, ParamId};
use crate::user_bail;

/// One variable per entry of the spec's table, in table order.
pub struct Params {
    table: Vec<Param>,
    vars: Vec<Var>,
}

impl Params {
    /// The spec's tensors from `values` (a flat buffer in table order), as `dtype` on
    /// `device`.
    pub fn from_flat(
        spec: &ModelSpec,
        values: &[f32],
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        assert_eq!(values.len(), spec.len(), "a flat buffer of the whole table");
        let vars = spec
            .params()
            .iter()
            .map(|p| {
                let t = Tensor::from_slice(&values[p.range()], p.shape.as_slice(), device)?;
                Ok(Var::from_tensor(&t.to_dtype(dtype)?)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            table: spec.params().to_vec(),
            vars,
        })
    }

    /// The tensor of `id` (it tracks gradients).
    pub fn tensor(&self, id: ParamId) -> &Tensor {
        self.var(id).as_tensor()
    }

    pub fn var(&self, id: ParamId) -> &Var {
        &self.vars[id.index()]
    }

    /// Each table entry with its variable, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (&Param, &Var)> {
        self.table.iter().zip(&self.vars)
    }

    pub fn get(&self, name: &str) -> Option<&Var> {
        self.iter().find(|(p, _)| p.name == name).map(|(_, v)| v)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// Total number of scalars.
    pub fn count(&self) -> usize {
        self.table.iter().map(Param::len).sum()
    }

    /// The tensors by name, for saving.
    pub fn to_map(&self) -> NamedTensors {
        self.iter()
            .map(|(p, v)| (p.name.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// Every value as f32 on the host, in one buffer in table order (what the fused
    /// engines and the CPU decoder work on).
    pub fn to_flat(&self) -> Result<Vec<f32>> {
        let mut flat = Vec::with_capacity(self.count());
        for v in &self.vars {
            let t = v.as_tensor().to_dtype(DType::F32)?.flatten_all()?;
            flat.extend(t.to_vec1::<f32>()?);
        }
        Ok(flat)
    }

    /// Overwrites every variable from a flat buffer in table order.
    pub fn set_flat(&self, values: &[f32]) -> Result<()> {
        assert_eq!(
            values.len(),
            self.count(),
            "a flat buffer of the whole table"
        );
        for (p, var) in self.iter() {
            let t = Tensor::from_slice(&values[p.range()], p.shape.as_slice(), var.device())?;
            var.set(&t.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }

    /// Overwrites every variable from `tensors`, which must hold exactly these names
    /// with these shapes. `source` names the file in errors.
    pub fn load(&self, tensors: &NamedTensors, source: &str) -> Result<()> {
        self.set_flat(&weights_from_file(&self.table, tensors, source)?)
    }
}

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
