//! The reference engine: the candle model of `crate::model`, differentiated by candle's
//! autograd, with AdamW over candle tensors. It runs wherever candle runs, and it is
//! the definition the fused engines are tested against.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use super::interface::{check_batch, Engine, EngineOptions, Readings, MOMENT_SUFFIXES};
use crate::config::Precision;
use crate::data::Batch;
use crate::model::named::{flat_from_named, named_from_flat, NamedTensors};
use crate::model::Params;
use crate::model::{position_losses, Dropout, Gpt, ModelSpec};
use crate::optim::{clip_scale, AdamWStep};

pub struct ReferenceEngine {
    model: Gpt,
    sequences: usize,
    precision: Precision,
    /// Why this engine runs rather than a fused one.
    why: &'static str,
    /// The last forward's mean loss, until `backward` differentiates it.
    loss: Option<Tensor>,
    /// The last forward's loss at each position.
    positions: Option<Tensor>,
    /// Gradients summed since `zero_grads`, per parameter in table order (`None`: no
    /// gradient reached it yet).
    grads: Vec<Option<Tensor>>,
    /// AdamW's moments (m, v) per parameter, made at the first update or load.
    moments: Option<(Vec<Tensor>, Vec<Tensor>)>,
    /// Losses and the gradient norm for the trainer (read from the device as they
    /// are made: the reference is the definition, not the fast path).
    readings: Readings,
}

impl ReferenceEngine {
    /// The model `spec` with `weights` (flat, table order) on `device`.
    pub fn new(
        spec: &ModelSpec,
        weights: &[f32],
        device: &Device,
        options: EngineOptions,
        why: &'static str,
    ) -> Result<Self> {
        // candle's f32 products on CUDA take TF32 from one process-wide switch: set to
        // what this engine asks for each time one is built.
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            candle_core::cuda::set_gemm_reduced_precision_f32(options.tf32);
        }
        let model = Gpt::from_flat(spec, weights, device, DType::F32, options.precision)?;
        Ok(Self {
            grads: vec![None; model.params().tensor_count()],
            model,
            sequences: options.batch,
            precision: options.precision,
            why,
            loss: None,
            positions: None,
            moments: None,
            readings: Readings::default(),
        })
    }

    pub fn model(&self) -> &Gpt {
        &self.model
    }

    fn params(&self) -> &Params {
        self.model.params()
    }

    /// Every parameter's gradient, zeros where none arrived.
    fn dense_grads(&mut self) -> Result<Vec<Tensor>> {
        let params = self.model.params();
        let grads = self
            .grads
            .iter_mut()
            .zip(params.iter())
            .map(|(g, (_, var))| Ok(g.get_or_insert(var.zeros_like()?).clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(grads)
    }

    fn zero_moments(&self) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let zeros = || -> Result<Vec<Tensor>> {
            self.params()
                .iter()
                .map(|(_, v)| Ok(v.zeros_like()?))
                .collect()
        };
        Ok((zeros()?, zeros()?))
    }
}

impl Engine for ReferenceEngine {
    fn describe(&self) -> String {
        let path = format!("reference ({})", self.why);
        match self.precision {
            Precision::F32 => path,
            Precision::Bf16 => format!("{path}, bf16 matrix products"),
        }
    }

    fn name(&self) -> &'static str {
        "reference"
    }

    fn spec(&self) -> &ModelSpec {
        self.model.spec()
    }

    fn forward(&mut self, batch: &Batch, dropout: Option<&Dropout>) -> Result<()> {
        check_batch(self.sequences, self.model.spec().shapes.block_size, batch)?;
        let device = self.model.device();
        let shape = (batch.batch, batch.block);
        let x = Tensor::from_slice(&batch.x, shape, device)?;
        let y = Tensor::from_slice(&batch.y, shape, device)?;
        let logits = self.model.forward(&x, 0, None, dropout)?.logits;
        let losses = position_losses(&logits, &y)?;
        let loss = losses.mean_all()?;
        let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        self.loss = Some(loss);
        self.positions = Some(losses);
        self.readings.add_loss(value);
        Ok(())
    }

    fn take_losses(&mut self) -> Result<Vec<f64>> {
        Ok(self.readings.take_losses())
    }

    fn position_losses(&self) -> Result<Vec<f64>> {
        let losses = self
            .positions
            .as_ref()
            .expect("a forward before its losses");
        let losses = losses.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        Ok(losses.into_iter().map(f64::from).collect())
    }

    fn backward(&mut self, scale: f32) -> Result<()> {
        let loss = self.loss.take().expect("a forward before its backward");
        let store = (loss * scale as f64)?.backward()?;
        let params = self.model.params();
        for (sum, (_, var)) in self.grads.iter_mut().zip(params.iter()) {
            if let Some(g) = store.get(var.as_tensor()) {
                *sum = Some(match sum.take() {
                    Some(prev) => (prev + g)?,
                    None => g.clone(),
                });
            }
        }
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        self.grads.iter_mut().for_each(|g| *g = None);
        Ok(())
    }

    /// The reference engine trains in one process (`engine::build_replica` refuses it
    /// ranks): nothing to add.
    fn reduce_grads(&mut self) -> Result<()> {
        Ok(())
    }

    fn clip_grads(&mut self, max_norm: f64) -> Result<()> {
        let grads = self.dense_grads()?;
        let mut sum = 0.0;
        for g in &grads {
            sum += g
                .to_dtype(DType::F32)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f32>()? as f64;
        }
        let norm = sum.sqrt();
        if let Some(scale) = clip_scale(norm, max_norm) {
            for g in self.grads.iter_mut().flatten() {
                *g = (&*g * scale)?;
            }
        }
        self.readings.set_grad_norm(norm);
        Ok(())
    }

    fn grad_norm(&self) -> Result<f64> {
        self.readings.grad_norm()
    }

    fn grads(&self) -> Result<NamedTensors> {
        self.params()
            .iter()
            .zip(&self.grads)
            .map(|((p, var), g)| {
                let g = match g {
                    Some(g) => g.clone(),
                    None => var.zeros_like()?,
                };
                Ok((p.name.clone(), g))
            })
            .collect()
    }

    fn set_grads(&mut self, grads: &NamedTensors, source: &str) -> Result<()> {
        let table = self.model.spec().params();
        let flat = flat_from_named(table, grads, "", source)?;
        self.grads = self
            .params()
            .tensors_from_flat(&flat)?
            .into_iter()
            .map(Some)
            .collect();
        Ok(())
    }

    fn adamw(&mut self, u: &AdamWStep) -> Result<()> {
        let grads = self.dense_grads()?;
        if self.moments.is_none() {
            self.moments = Some(self.zero_moments()?);
        }
        let (ms, vs) = self.moments.as_mut().expect("made above");
        let (bc1, bc2) = u.bias_corrections();
        let params = self.model.params();
        for ((((p, var), g), m), v) in params.iter().zip(&grads).zip(ms).zip(vs) {
            *m = ((&*m * u.beta1)? + (g * (1.0 - u.beta1))?)?;
            *v = ((&*v * u.beta2)? + (g.sqr()? * (1.0 - u.beta2))?)?;
            let m_hat = (&*m / bc1)?;
            let v_hat = (&*v / bc2)?;
            let update = (m_hat / (v_hat.sqrt()? + u.eps)?)?;
            let decayed = (var.as_tensor().detach() * u.shrink(p.decay))?;
            var.set(&(decayed - (update * u.lr)?)?)?;
        }
        Ok(())
    }

    fn weights(&self) -> Result<NamedTensors> {
        // A copy on the host: the variables' own tensors change in place at each update.
        named_from_flat(self.model.spec().params(), &self.params().to_flat()?, "")
    }

    fn load_weights(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        self.params().load(tensors, source)
    }

    fn moments(&self) -> Result<NamedTensors> {
        let zeros;
        let (ms, vs) = match &self.moments {
            Some(moments) => moments,
            None => {
                zeros = self.zero_moments()?;
                &zeros
            }
        };
        let mut out = NamedTensors::new();
        for (suffix, moment) in MOMENT_SUFFIXES.iter().zip([ms, vs]) {
            for ((p, _), t) in self.params().iter().zip(moment) {
                out.insert(format!("{}{suffix}", p.name), t.clone());
            }
        }
        Ok(out)
    }

    fn load_moments(&mut self, tensors: &NamedTensors, source: &str) -> Result<()> {
        let table = self.model.spec().params();
        let on_device = |suffix| -> Result<Vec<Tensor>> {
            let flat = flat_from_named(table, tensors, suffix, source)?;
            self.params().tensors_from_flat(&flat)
        };
        self.moments = Some((
            on_device(MOMENT_SUFFIXES[0])?,
            on_device(MOMENT_SUFFIXES[1])?,
        ));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModelConfig, TrainConfig};

    fn engine() -> ReferenceEngine {
        let cfg = ModelConfig {
            n_layer: 1,
            n_head: 1,
            n_embd: 2,
            block_size: 2,
            vocab_size: 3,
            ..Default::default()
        };
        let options = EngineOptions::f32(1, false);
        let spec = ModelSpec::new(&cfg);
        let weights = spec.initial_values(0);
        ReferenceEngine::new(&spec, &weights, &Device::Cpu, options, "test").unwrap()
    }

    fn first(e: &ReferenceEngine, id: crate::model::spec::ParamId) -> f64 {
        let t = e.params().tensor(id).flatten_all().unwrap();
        t.to_vec1::<f32>().unwrap()[0] as f64
    }

    /// Two updates, checked against the AdamW formula written out by hand on one element
    /// of a matrix (decayed) and of a norm's gain (not decayed).
    #[test]
    fn adamw_matches_the_formula() {
        let mut e = engine();
        let train = TrainConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            ..TrainConfig::default()
        };
        let (lr, spec) = (0.01, e.spec().clone());
        let (wte0, gain0) = (first(&e, spec.wte), first(&e, spec.ln_f.weight));
        for (step, g) in [(1, 0.5f64), (2, -2.0)] {
            e.grads = e
                .params()
                .iter()
                .map(|(_, v)| Some((v.ones_like().unwrap() * g).unwrap()))
                .collect();
            e.adamw(&AdamWStep::new(&train, step, lr)).unwrap();
        }
        let (mut m, mut v, mut pw, mut pg) = (0.0, 0.0, wte0, gain0);
        for (t, g) in [0.5f64, -2.0].iter().enumerate() {
            m = 0.9 * m + 0.1 * g;
            v = 0.99 * v + 0.01 * g * g;
            let step = t as i32 + 1;
            let upd =
                (m / (1.0 - 0.9f64.powi(step))) / ((v / (1.0 - 0.99f64.powi(step))).sqrt() + 1e-8);
            pw = pw * (1.0 - lr * 0.1) - lr * upd;
            pg -= lr * upd; // 1-D: no decay
        }
        let (w, gain) = (first(&e, spec.wte), first(&e, spec.ln_f.weight));
        assert!((w - pw).abs() < 1e-6, "{w} vs {pw}");
        assert!((gain - pg).abs() < 1e-6, "{gain} vs {pg}");
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let mut e = engine();
        // Every gradient element 1: the norm is sqrt(parameter count).
        e.grads = e
            .params()
            .iter()
            .map(|(_, v)| Some(v.ones_like().unwrap()))
            .collect();
        let n = e.spec().len() as f64;
        let mut clip = |max_norm| {
            e.clip_grads(max_norm).unwrap();
            e.grad_norm().unwrap()
        };
        assert!((clip(1.0) - n.sqrt()).abs() < 1e-4);
        assert!((clip(10.0) - 1.0).abs() < 1e-4, "clipped to 1");
        assert!((clip(0.0) - 1.0).abs() < 1e-4, "no clipping under the max");
    }
}
