//! The model's trainable tensors, by name, with GPT-2's initialisation.
//!
//! candle's own initialisers draw from an unseeded RNG on CPU, so runs could not be
//! reproduced. Here every tensor is drawn on the host from a seeded ChaCha stream, in
//! construction order, and then moved to the device: the same seed gives the same
//! initial weights on every device.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::config::Precision;
use crate::user_bail;

/// Named variables in construction order. Names are the tensor names in
/// `model.safetensors` (documented in the README).
#[derive(Default)]
pub struct Params {
    vars: Vec<(String, Var)>,
}

impl Params {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.vars.iter().map(|(n, v)| (n.as_str(), v))
    }

    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.vars.len()
    }

    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// Total number of scalars.
    pub fn count(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// The tensors by name, for saving.
    pub fn to_map(&self) -> HashMap<String, Tensor> {
        self.vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// Overwrites every variable from `tensors`, which must hold exactly these names
    /// with these shapes. `source` names the file in errors.
    pub fn load(&self, tensors: &HashMap<String, Tensor>, source: &str) -> Result<()> {
        for (name, var) in &self.vars {
            let Some(t) = tensors.get(name) else {
                user_bail!(
                    "{source}: tensor {name} is missing; the file does not match this model's config"
                );
            };
            if t.dims() != var.dims() {
                user_bail!(
                    "{source}: tensor {name} has shape {:?}, but the config needs {:?}",
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
        if let Some(extra) = tensors.keys().find(|k| self.get(k).is_none()) {
            user_bail!(
                "{source}: unexpected tensor {extra}; the file does not match this model's config"
            );
        }
        Ok(())
    }
}

/// How a new tensor starts.
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// Creates named variables from a seeded stream.
pub struct ParamBuilder {
    params: Params,
    rng: ChaCha8Rng,
    device: Device,
    dtype: DType,
    products: Precision,
}

impl ParamBuilder {
    pub fn new(seed: u64, device: &Device, dtype: DType) -> Self {
        Self {
            params: Params::default(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            device: device.clone(),
            dtype,
            products: Precision::F32,
        }
    }

    /// Layers built from here on multiply in `products` (see [`super::linear::product`]).
    pub fn set_products(&mut self, products: Precision) {
        self.products = products;
    }

    /// The precision of the matrix products of the layers being built.
    pub fn products(&self) -> Precision {
        self.products
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Makes the variable `name` and returns its tensor (which tracks gradients).
    pub fn var(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        assert!(
            self.params.get(name).is_none(),
            "parameter {name} created twice"
        );
        let n: usize = shape.iter().product();
        let values: Vec<f32> = match init {
            Init::Normal { std } => (0..n)
                .map(|_| {
                    let z: f64 = StandardNormal.sample(&mut self.rng);
                    (z * std) as f32
                })
                .collect(),
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
        };
        let t = Tensor::from_vec(values, shape, &self.device)?.to_dtype(self.dtype)?;
        let var = Var::from_tensor(&t)?;
        let tensor = var.as_tensor().clone();
        self.params.vars.push((name.to_string(), var));
        Ok(tensor)
    }

    pub fn finish(self) -> Params {
        self.params
    }
}
