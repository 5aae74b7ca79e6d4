//! The reference model's trainable tensors: the spec's table as candle variables.
//!
//! candle's own initialisers draw from an unseeded RNG on CPU, so runs could not be
//! reproduced. The values come from [`ModelSpec::initial_values`] (one seeded stream,
//! drawn on the host) or from a checkpoint, and are then moved to the device: the same
//! seed gives the same weights on every device and in every engine.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};

use super::named::{weights_from_file, NamedTensors};
use super::spec::{ModelSpec, Param, ParamId};

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
        let vars = tensors_from_flat(spec.params(), values, device, dtype)?
            .iter()
            .map(|t| Ok(Var::from_tensor(t)?))
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

    /// Number of tensors (not of scalars: that is the spec's `len`).
    pub fn tensor_count(&self) -> usize {
        self.vars.len()
    }

    /// Total number of scalars: the length of the flat buffer.
    pub fn scalar_count(&self) -> usize {
        self.table.last().map_or(0, |p| p.offset + p.len())
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
        let mut flat = Vec::with_capacity(self.scalar_count());
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
            self.scalar_count(),
            "a flat buffer of the whole table"
        );
        for (var, t) in self.vars.iter().zip(self.tensors_from_flat(values)?) {
            var.set(&t)?;
        }
        Ok(())
    }

    /// A flat buffer in table order (weights, gradients or moments) as one tensor per
    /// parameter, on the variables' device in their type.
    pub fn tensors_from_flat(&self, flat: &[f32]) -> Result<Vec<Tensor>> {
        let Some(first) = self.vars.first() else {
            return Ok(Vec::new());
        };
        tensors_from_flat(&self.table, flat, first.device(), first.dtype())
    }

    /// Overwrites every variable from `tensors`, which must hold exactly these names
    /// with these shapes. `source` names the file in errors.
    pub fn load(&self, tensors: &NamedTensors, source: &str) -> Result<()> {
        self.set_flat(&weights_from_file(&self.table, tensors, source)?)
    }
}

/// `flat`'s tensors of `table`, as `dtype` on `device`.
fn tensors_from_flat(
    table: &[Param],
    flat: &[f32],
    device: &Device,
    dtype: DType,
) -> Result<Vec<Tensor>> {
    table
        .iter()
        .map(|p| {
            let t = Tensor::from_slice(&flat[p.range()], p.shape.as_slice(), device)?;
            Ok(t.to_dtype(dtype)?)
        })
        .collect()
}
