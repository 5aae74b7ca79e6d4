//! The fixed position tables a model needs on the device, shared by the engine and the
//! decoder: sinusoidal positions (added at the input), or RoPE's cos and sin.

use anyhow::Result;

use super::buffers::Buf;
use super::gpu::Gpu;
use crate::config::PositionKind;
use crate::model::position::{rope_tables, sinusoidal_values};
use crate::model::spec::ModelSpec;

pub struct PositionTables {
    /// (block_size, C): sinusoidal positions.
    sinusoids: Option<Buf<f32>>,
    /// (block_size, d/2) each: RoPE's cos and sin.
    rope: Option<[Buf<f32>; 2]>,
}

impl PositionTables {
    pub fn new(gpu: &Gpu, spec: &ModelSpec) -> Result<Self> {
        let cfg = &spec.config;
        let mut tables = Self {
            sinusoids: None,
            rope: None,
        };
        match cfg.positions {
            PositionKind::Sinusoidal => {
                tables.sinusoids = Some(Buf::from_host(gpu, &sinusoidal_values(spec)?)?);
            }
            PositionKind::Rope => {
                let (cos, sin) = rope_tables(cfg);
                tables.rope = Some([Buf::from_host(gpu, &cos)?, Buf::from_host(gpu, &sin)?]);
            }
            PositionKind::Learned => {}
        }
        Ok(tables)
    }

    /// The address of the table added at the input: the learned one (in the flat
    /// parameter buffer `params`) or the sinusoids; 0 under RoPE.
    pub fn added(&self, spec: &ModelSpec, params: &Buf<f32>) -> u64 {
        match (spec.wpe, &self.sinusoids) {
            (Some(wpe), _) => params.at(spec[wpe].offset),
            (None, Some(table)) => table.ptr(),
            (None, None) => 0,
        }
    }

    /// RoPE's (cos, sin) addresses, under RoPE.
    pub fn rope(&self) -> Option<(u64, u64)> {
        self.rope.as_ref().map(|[cos, sin]| (cos.ptr(), sin.ptr()))
    }

    pub fn bytes(&self) -> u64 {
        let rope = self.rope.iter().flatten();
        self.sinusoids.iter().chain(rope).map(Buf::bytes).sum()
    }
}
