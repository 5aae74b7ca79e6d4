//! The training memory estimate (engine/footprint.rs), against what a training step really
//! allocates: a counting allocator records the heap's peak over building an engine and
//! running one step. (One test in this binary: the allocator counts every thread.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::Device;
use tinygpt::config::{ModelConfig, TrainConfig};
use tinygpt::data::Batch;
use tinygpt::engine::{self, EngineOptions};
use tinygpt::engine::{training_bytes, Footprint};
use tinygpt::model::ModelSpec;
use tinygpt::optim::AdamWStep;

mod common;
use common::model;

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = NOW.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(now, Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        NOW.fetch_sub(layout.size(), Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The heap's peak above where it started, over building the engine `fused` names
/// and one training step.
fn measured_bytes(m: &ModelConfig, t: &TrainConfig, fused: bool) -> f64 {
    let spec = ModelSpec::new(m);
    let start = NOW.load(Ordering::SeqCst);
    PEAK.store(start, Ordering::SeqCst);
    {
        let weights = spec.initial_values(1);
        let options = EngineOptions::f32(t.batch_size, fused);
        let mut engine = engine::build(&spec, &weights, &Device::Cpu, options).unwrap();
        drop(weights);
        let mut batch = Batch::empty(t.batch_size, m.block_size);
        for (i, id) in batch.x.iter_mut().chain(batch.y.iter_mut()).enumerate() {
            *id = (i * 7 % m.vocab_size) as u32;
        }
        engine.zero_grads().unwrap();
        engine.forward(&batch, None).unwrap();
        engine.backward(1.0).unwrap();
        engine.clip_grads(1.0).unwrap();
        engine.adamw(&AdamWStep::new(t, 1, t.lr)).unwrap();
    }
    (PEAK.load(Ordering::SeqCst) - start) as f64
}

#[test]
fn the_estimate_is_within_20_percent_of_each_engines_step() {
    // (layers, heads, width, context, vocabulary, batch)
    let shapes = [
        (4, 4, 128, 64, 65, 12),
        (2, 4, 256, 128, 2048, 8),
        (6, 6, 192, 64, 512, 16),
        (2, 8, 128, 256, 65, 4),
        (3, 2, 384, 32, 4096, 8),
    ];
    for (n_layer, n_head, n_embd, block_size, vocab_size, batch_size) in shapes {
        let m = model(n_layer, n_head, n_embd, block_size, vocab_size);
        let t = TrainConfig {
            batch_size,
            ..TrainConfig::default()
        };
        for (engine, fused) in [(Footprint::Reference, false), (Footprint::FusedCpu, true)] {
            let estimate = training_bytes(&m, &t, engine, 1);
            let measured = measured_bytes(&m, &t, fused);
            let ratio = estimate / measured;
            assert!(
                (0.8..=1.2).contains(&ratio),
                "{engine:?} {n_layer}L/{n_embd} H{n_head} T{block_size} V{vocab_size} B{batch_size}: estimate {:.1} MB, measured {:.1} MB",
                estimate / 1e6,
                measured / 1e6
            );
        }
    }
}
