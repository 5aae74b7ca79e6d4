//! Where a training step's time goes (`tinygpt bench --profile`).
//!
//! While a profile is on, every piece of work an engine does (a kernel launch, a
//! matrix product, a CPU op) is recorded with the phase of the step it ran in, its
//! group (products by the layer they serve, attention, norms, ...), the floating-point
//! operations it does and the bytes it must read and write at least, and its time
//! where the time can be known: a CPU op by a timer around it, CUDA work by events
//! around it, read once the step has run (`end_step`). The emulator's times say
//! nothing of a GPU, so there the FLOPs and bytes are what counts, and the floor they
//! imply on a GPU: max(FLOPs / peak, bytes / bandwidth), group by group.
//!
//! Off, which is always but in `bench --profile`, recording costs one relaxed load of
//! an atomic. The records are process-wide (a CPU engine's ops run on its worker
//! threads), so one profile runs at a time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::config::Math;
use crate::model::spec::Projection;

/// The part of a training step a piece of work belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Forward,
    Backward,
    /// Gradient norm, clipping and AdamW.
    Optimizer,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// What a piece of work is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    /// A linear layer's matrix products (its bias is `Elementwise`).
    Product(Projection),
    /// Attention's scores, softmax and weighted values (flash tiles, or the products
    /// and softmax kernels of the products path).
    Attention,
    /// Moving heads between row and head layouts, rounding copies, clearing buffers.
    Copy,
    Norm,
    Activation,
    /// Residual adds, dropout, biases and their gradients, RoPE.
    Elementwise,
    Embedding,
    /// Softmax over the vocabulary, the loss and the logits' gradient.
    Classifier,
    /// The gradient norm, clipping and AdamW.
    Optimizer,
}

impl Group {
    pub fn name(self) -> &'static str {
        match self {
            Group::Product(p) => match p {
                Projection::Qkv => "products: qkv",
                Projection::AttentionOut => "products: attention out",
                Projection::MlpUp => "products: mlp up",
                Projection::MlpDown => "products: mlp down",
                Projection::Output => "products: output (tied)",
            },
            Group::Attention => "attention",
            Group::Copy => "copies",
            Group::Norm => "norms",
            Group::Activation => "activation",
            Group::Elementwise => "residual, dropout, bias, rope",
            Group::Embedding => "embedding",
            Group::Classifier => "classifier (softmax, loss)",
            Group::Optimizer => "optimizer",
        }
    }

    /// Whether its FLOPs run on the matrix units (tensor cores, the GEMM kernels), so
    /// its floor is taken at the products' peak, not the vector one.
    pub fn on_matrix_units(self) -> bool {
        matches!(self, Group::Product(_) | Group::Attention)
    }
}

/// The floating-point operations a piece of work does and the bytes it must read and
/// write at least (each operand once: what an ideal kernel of its design moves).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    pub flops: f64,
    pub bytes: f64,
}

impl Cost {
    pub fn new(flops: f64, bytes: f64) -> Self {
        Self { flops, bytes }
    }

    /// Work that reads and writes `values` f32 values in all, with no arithmetic to
    /// speak of.
    pub fn f32s(values: usize) -> Self {
        Self::new(0.0, 4.0 * values as f64)
    }

    /// `flops` besides moving `values` f32 values.
    pub fn f32s_and_flops(values: usize, flops: usize) -> Self {
        Self::new(flops as f64, 4.0 * values as f64)
    }
}

/// A time read once the work has run (a GPU's pair of events).
pub trait Elapsed: Send {
    fn seconds(&self) -> Result<f64>;
}

#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    calls: u64,
    /// Seconds of the calls that were timed.
    seconds: f64,
    timed: bool,
    flops: f64,
    bytes: f64,
}

impl Totals {
    fn add(&mut self, cost: Cost, seconds: Option<f64>) {
        self.calls += 1;
        self.flops += cost.flops;
        self.bytes += cost.bytes;
        if let Some(s) = seconds {
            self.seconds += s;
            self.timed = true;
        }
    }
}

type Key = (Phase, Group);

struct State {
    phase: Phase,
    steps: usize,
    totals: BTreeMap<Key, Totals>,
    pending: Vec<(Key, Cost, Box<dyn Elapsed>)>,
}

static ON: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    // A panic while recording leaves nothing half-written that matters here.
    STATE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether work is being recorded.
pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Starts recording, from nothing, in the forward phase.
pub fn start() {
    *state() = Some(State {
        phase: Phase::Forward,
        steps: 0,
        totals: BTreeMap::new(),
        pending: Vec::new(),
    });
    ON.store(true, Ordering::Relaxed);
}

/// Work recorded from now on belongs to `phase`.
pub fn set_phase(phase: Phase) {
    if !is_on() {
        return;
    }
    if let Some(s) = state().as_mut() {
        s.phase = phase;
    }
}

/// One piece of work in `group`, timed (`seconds`) or not (the emulator).
pub fn record(group: Group, cost: Cost, seconds: Option<f64>) {
    if !is_on() {
        return;
    }
    if let Some(s) = state().as_mut() {
        s.totals
            .entry((s.phase, group))
            .or_default()
            .add(cost, seconds);
    }
}

/// One piece of work whose time is read after the step (`end_step`).
pub fn record_later(group: Group, cost: Cost, elapsed: Box<dyn Elapsed>) {
    if !is_on() {
        return;
    }
    if let Some(s) = state().as_mut() {
        s.pending.push(((s.phase, group), cost, elapsed));
    }
}

/// Ends a step once the device has finished it: the times read after the work are
/// read now.
pub fn end_step() -> Result<()> {
    let mut guard = state();
    let Some(s) = guard.as_mut() else {
        return Ok(());
    };
    for (key, cost, elapsed) in std::mem::take(&mut s.pending) {
        let seconds = elapsed.seconds()?;
        s.totals.entry(key).or_default().add(cost, Some(seconds));
    }
    s.steps += 1;
    Ok(())
}

/// A profile being recorded: `start` on creation, and recording stops when it is
/// finished or dropped (an error between steps leaves nothing recording).
pub struct Recording(());

impl Recording {
    pub fn start() -> Self {
        start();
        Self(())
    }

    /// What each phase's groups did per step.
    pub fn finish(self) -> Vec<Recorded> {
        finish()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        ON.store(false, Ordering::Relaxed);
    }
}

/// Stops recording and gives what each phase's groups did per step.
pub fn finish() -> Vec<Recorded> {
    ON.store(false, Ordering::Relaxed);
    let Some(s) = state().take() else {
        return Vec::new();
    };
    let steps = s.steps.max(1) as f64;
    s.totals
        .into_iter()
        .map(|((phase, group), t)| Recorded {
            phase,
            group,
            calls: t.calls as f64 / steps,
            seconds: t.timed.then_some(t.seconds / steps),
            flops: t.flops / steps,
            bytes: t.bytes / steps,
        })
        .collect()
}

/// What one phase's group did in a step (the mean over the profiled steps).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recorded {
    pub phase: Phase,
    pub group: Group,
    pub calls: f64,
    /// None where the work was not timed (the emulator).
    pub seconds: Option<f64>,
    pub flops: f64,
    pub bytes: f64,
}

/// A CPU op's timer: records its group when dropped.
pub struct Span {
    group: Group,
    cost: Cost,
    started: Instant,
}

impl Drop for Span {
    fn drop(&mut self) {
        record(
            self.group,
            self.cost,
            Some(self.started.elapsed().as_secs_f64()),
        );
    }
}

/// Times the work until the returned span is dropped, when a profile is on (`cost` is
/// only computed then).
pub fn span(group: Group, cost: impl FnOnce() -> Cost) -> Option<Span> {
    is_on().then(|| Span {
        group,
        cost: cost(),
        started: Instant::now(),
    })
}

/// What a device does at best: the products' arithmetic in the run's precision, other
/// arithmetic, and memory bandwidth.
#[derive(Debug, Clone, Serialize)]
pub struct Peak {
    /// The device, as the figures name it.
    pub device: String,
    pub matrix_tflops: f64,
    pub vector_tflops: f64,
    pub bandwidth_gbs: f64,
    /// Where the figures come from (measured here, or a published table).
    pub source: String,
    /// One large product and one large streaming kernel timed here, where they were.
    pub measured: Option<Measured>,
}

/// What one large product and one large streaming pass achieved on the device.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Measured {
    pub matrix_tflops: f64,
    /// The same product on one thread (CPUs): how the threads scale.
    pub one_thread_tflops: Option<f64>,
    pub bandwidth_gbs: f64,
}

impl Peak {
    /// A device known only by what was measured on it.
    pub fn measured(device: String, m: Measured) -> Self {
        Self {
            device,
            matrix_tflops: m.matrix_tflops,
            vector_tflops: m.matrix_tflops,
            bandwidth_gbs: m.bandwidth_gbs,
            source: "measured here".into(),
            measured: Some(m),
        }
    }
}

/// How an engine's work is profiled: how it is timed, and against what peak.
#[derive(Debug, Clone)]
pub struct Profiled {
    pub timing: Timing,
    pub peak: Peak,
}

impl Peak {
    /// The least time `r`'s work can take on this device: its arithmetic at the peak
    /// of the units it runs on, or its bytes at full bandwidth, whichever is longer.
    pub fn floor_seconds(&self, r: &Recorded) -> f64 {
        let tflops = match r.group.on_matrix_units() {
            true => self.matrix_tflops,
            false => self.vector_tflops,
        };
        (r.flops / (tflops * 1e12)).max(r.bytes / (self.bandwidth_gbs * 1e9))
    }
}

/// Published dense peaks of common GPUs: bf16 tensor-core, f32 (CUDA cores), and memory
/// bandwidth. Matched on the device's name, longest names first.
const GPUS: &[(&str, f64, f64, f64)] = &[
    // name, bf16 TFLOP/s (dense, f32 sums), f32 TFLOP/s, GB/s
    ("H100 PCIe", 756.0, 51.2, 2_000.0),
    ("H100 NVL", 835.0, 60.0, 3_900.0),
    ("H100", 989.4, 66.9, 3_350.0),
    ("H200", 989.4, 66.9, 4_800.0),
    ("GH200", 989.4, 66.9, 4_000.0),
    ("B200", 2_250.0, 80.0, 8_000.0),
    ("A100-SXM4-80GB", 312.0, 19.5, 2_039.0),
    ("A100 80GB PCIe", 312.0, 19.5, 1_935.0),
    ("A100", 312.0, 19.5, 1_555.0),
    ("L40S", 362.1, 91.6, 864.0),
    ("L40", 181.0, 90.5, 864.0),
    ("L4", 121.0, 30.3, 300.0),
    ("A10G", 70.0, 31.2, 600.0),
    ("A10", 125.0, 31.2, 600.0),
    ("RTX 4090", 165.2, 82.6, 1_008.0),
    ("RTX 3090", 71.0, 35.6, 936.0),
];

/// The published peaks of the GPU named `name` for products multiplying as `math`
/// (f32 on the CUDA cores; TF32 on the tensor cores at half their bf16 rate, as on
/// every generation since Ampere), if the table knows it.
pub fn published_gpu_peak(name: &str, math: Math) -> Option<Peak> {
    let mut known: Vec<_> = GPUS.iter().filter(|g| name.contains(g.0)).collect();
    known.sort_by_key(|g| std::cmp::Reverse(g.0.len()));
    let &&(known_as, bf16_tflops, f32_tflops, gbs) = known.first()?;
    Some(Peak {
        device: name.to_string(),
        matrix_tflops: match math {
            Math::F32 => f32_tflops,
            Math::Tf32 => bf16_tflops / 2.0,
            Math::Bf16 => bf16_tflops,
        },
        vector_tflops: f32_tflops,
        bandwidth_gbs: gbs,
        source: format!("published dense peak of the {known_as}"),
        measured: None,
    })
}

/// How the profile was timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Timing {
    /// A timer around each CPU op.
    CpuTimers,
    /// A pair of CUDA events around each launch and product.
    CudaEvents,
    /// Not timed: the CUDA kernels ran in the emulator, so only FLOPs, bytes and the
    /// floor on `Peak`'s GPU count.
    Untimed,
}

/// What `bench --profile` reports: per phase and group, each step's time, share,
/// achieved rates and floor; the step's whole and the gaps between the work.
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    pub timing: Timing,
    pub peak: Peak,
    /// The bench's median step, measured without the profile's timers (MFU's).
    pub step_ms: f64,
    /// The median profiled step (its timers included): what the groups' shares and
    /// the gaps are of.
    pub profiled_step_ms: f64,
    /// The groups' times added up (None untimed).
    pub work_ms: Option<f64>,
    /// The profiled step less its work: the device waiting for the host, the host's own
    /// work.
    pub gaps_ms: Option<f64>,
    /// The least time the step's work could take on the peak device, group by group.
    pub floor_ms: f64,
    /// The model's FLOPs a step (matrix products, 3x the forward's, as bench counts
    /// them) over the step's time, against the products' peak (None untimed).
    pub mfu: Option<f64>,
    /// The linear layers' products' share of the work's time, and their rate together
    /// (None untimed): what is left outside them is the rest of the step's work.
    pub products_share: Option<f64>,
    pub products_tflops: Option<f64>,
    pub groups: Vec<GroupRow>,
}

/// One line of the profile.
#[derive(Debug, Clone, Serialize)]
pub struct GroupRow {
    pub phase: Phase,
    pub group: &'static str,
    pub calls: f64,
    pub ms: Option<f64>,
    /// Of the profiled step's time.
    pub share: Option<f64>,
    pub gflop: f64,
    pub mbytes: f64,
    pub tflops: Option<f64>,
    pub gbs: Option<f64>,
    pub floor_ms: f64,
}

impl Profile {
    /// The report of `recorded`, for a step that took `step_ms` unprofiled and
    /// `profiled_step_ms` profiled, and does `model_flops` as bench counts them.
    pub fn new(
        recorded: &[Recorded],
        timing: Timing,
        peak: Peak,
        (step_ms, profiled_step_ms): (f64, f64),
        model_flops: f64,
    ) -> Self {
        let timed = timing != Timing::Untimed;
        let groups: Vec<GroupRow> = recorded
            .iter()
            .map(|r| {
                let seconds = r.seconds.filter(|_| timed);
                GroupRow {
                    phase: r.phase,
                    group: r.group.name(),
                    calls: r.calls,
                    ms: seconds.map(|s| s * 1e3),
                    share: seconds.map(|s| s * 1e3 / profiled_step_ms),
                    gflop: r.flops / 1e9,
                    mbytes: r.bytes / 1e6,
                    tflops: seconds.filter(|&s| s > 0.0).map(|s| r.flops / s / 1e12),
                    gbs: seconds.filter(|&s| s > 0.0).map(|s| r.bytes / s / 1e9),
                    floor_ms: peak.floor_seconds(r) * 1e3,
                }
            })
            .collect();
        let work_ms = timed.then(|| groups.iter().filter_map(|g| g.ms).sum::<f64>());
        let products = recorded
            .iter()
            .filter(|r| matches!(r.group, Group::Product(_)));
        let (products_s, products_flops) = products
            .filter_map(|r| r.seconds.map(|s| (s, r.flops)))
            .fold((0.0, 0.0), |(s, f), (rs, rf)| (s + rs, f + rf));
        let products_share = work_ms.filter(|&w| w > 0.0).map(|w| products_s * 1e3 / w);
        let products_tflops =
            (timed && products_s > 0.0).then(|| products_flops / products_s / 1e12);
        Self {
            products_share,
            products_tflops,
            timing,
            step_ms,
            profiled_step_ms,
            work_ms,
            gaps_ms: work_ms.map(|w| profiled_step_ms - w),
            floor_ms: groups.iter().map(|g| g.floor_ms).sum(),
            mfu: timed.then(|| model_flops / (step_ms / 1e3) / (peak.matrix_tflops * 1e12)),
            peak,
            groups,
        }
    }
}

impl std::fmt::Display for Profile {
    /// A table: a line per phase and group, then the totals.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.peak;
        writeln!(
            f,
            "profile {} (products {} TFLOP/s, other {} TFLOP/s, {:.0} GB/s: {}), {}",
            p.device,
            significant(p.matrix_tflops),
            significant(p.vector_tflops),
            p.bandwidth_gbs,
            p.source,
            match self.timing {
                Timing::CpuTimers => "timed by CPU timers",
                Timing::CudaEvents => "timed by CUDA events",
                Timing::Untimed => "untimed (emulator): FLOPs, bytes and the floor only",
            }
        )?;
        if let Some(m) = &p.measured {
            let one_thread = m
                .one_thread_tflops
                .map(|t| format!(" ({} on one thread)", significant(t)))
                .unwrap_or_default();
            writeln!(
                f,
                "  measured here: a large product at {} TFLOP/s{one_thread}, a streaming pass at {:.0} GB/s",
                significant(m.matrix_tflops),
                m.bandwidth_gbs
            )?;
        }
        writeln!(
            f,
            "  {:<9} {:<30} {:>6} {:>9} {:>6} {:>9} {:>9} {:>8} {:>8} {:>9}",
            "phase", "group", "calls", "ms", "share", "GFLOP", "MB", "TFLOP/s", "GB/s", "floor ms"
        )?;
        let opt =
            |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
        for g in &self.groups {
            writeln!(
                f,
                "  {:<9} {:<30} {:>6.0} {:>9} {:>6} {:>9.2} {:>9.1} {:>8} {:>8} {:>9.3}",
                g.phase.name(),
                g.group,
                g.calls,
                opt(g.ms, 3),
                g.share
                    .map_or("-".to_string(), |s| format!("{:.1}%", s * 100.0)),
                g.gflop,
                g.mbytes,
                g.tflops.map_or("-".to_string(), significant),
                opt(g.gbs, 0),
                g.floor_ms,
            )?;
        }
        let work = match (self.work_ms, self.gaps_ms) {
            (Some(w), Some(gaps)) => format!(
                "profiled {:.2} ms: work {w:.2} ms, gaps {gaps:.2} ms; ",
                self.profiled_step_ms
            ),
            _ => String::new(),
        };
        if let (Some(share), Some(tflops)) = (self.products_share, self.products_tflops) {
            writeln!(
                f,
                "  the layers' products: {:.1}% of the work at {} TFLOP/s ({:.0}% of the peak); the rest {:.1}%",
                share * 100.0,
                significant(tflops),
                100.0 * tflops / p.matrix_tflops,
                100.0 - share * 100.0
            )?;
        }
        let mfu = self
            .mfu
            .map_or(String::new(), |m| format!(", MFU {:.1}%", m * 100.0));
        write!(
            f,
            "  step {:.2} ms: {work}floor {:.2} ms on {} ({:.0}% of the step){mfu}",
            self.step_ms,
            self.floor_ms,
            p.device,
            100.0 * self.floor_ms / self.step_ms
        )
    }
}

/// `v` to three significant digits (a CPU's 0.0412 TFLOP/s, a GPU's 412).
fn significant(v: f64) -> String {
    let digits = if v == 0.0 || !v.is_finite() {
        1
    } else {
        (2 - v.abs().log10().floor() as i32).clamp(0, 6) as usize
    };
    format!("{v:.digits$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peak() -> Peak {
        Peak {
            device: "test".into(),
            matrix_tflops: 100.0,
            vector_tflops: 10.0,
            bandwidth_gbs: 1_000.0,
            source: "test".into(),
            measured: None,
        }
    }

    /// The floor is the longer of arithmetic at the units' peak and bytes at full
    /// bandwidth: worked by hand.
    #[test]
    fn the_floor_is_the_slower_of_arithmetic_and_memory() {
        let product = Recorded {
            phase: Phase::Forward,
            group: Group::Product(Projection::MlpUp),
            calls: 1.0,
            seconds: Some(2e-3),
            flops: 1e12, // 10 ms at 100 TFLOP/s
            bytes: 1e9,  // 1 ms at 1,000 GB/s
        };
        assert!((peak().floor_seconds(&product) - 1e-2).abs() < 1e-12);
        // The same FLOPs outside the matrix units: 100 ms at 10 TFLOP/s.
        let norm = Recorded {
            group: Group::Norm,
            ..product
        };
        assert!((peak().floor_seconds(&norm) - 1e-1).abs() < 1e-12);
        // Memory-bound: 4 GB at 1,000 GB/s is 4 ms, its 1 GFLOP 0.1 ms.
        let copy = Recorded {
            group: Group::Copy,
            flops: 1e9,
            bytes: 4e9,
            ..product
        };
        assert!((peak().floor_seconds(&copy) - 4e-3).abs() < 1e-12);
    }

    #[test]
    fn the_report_adds_shares_rates_gaps_and_mfu() {
        let recorded = [
            Recorded {
                phase: Phase::Forward,
                group: Group::Product(Projection::Qkv),
                calls: 2.0,
                seconds: Some(0.004),
                flops: 2e11,
                bytes: 4e8,
            },
            Recorded {
                phase: Phase::Backward,
                group: Group::Norm,
                calls: 4.0,
                seconds: Some(0.001),
                flops: 0.0,
                bytes: 5e8,
            },
        ];
        let p = Profile::new(&recorded, Timing::CudaEvents, peak(), (10.0, 10.0), 5e11);
        assert_eq!(p.work_ms, Some(5.0));
        assert_eq!(p.gaps_ms, Some(5.0));
        let qkv = &p.groups[0];
        assert_eq!(qkv.share, Some(0.4));
        assert!((qkv.tflops.unwrap() - 50.0).abs() < 1e-9); // 2e11 / 4 ms
        assert!((p.groups[1].gbs.unwrap() - 500.0).abs() < 1e-9); // 5e8 / 1 ms
                                                                  // Floors: 2 ms (arithmetic) + 0.5 ms (memory).
        assert!((p.floor_ms - 2.5).abs() < 1e-9);
        // 5e11 in 10 ms is 50 TFLOP/s of 100.
        assert!((p.mfu.unwrap() - 0.5).abs() < 1e-12);
        // The qkv products: 4 of the 5 ms of work, 2e11 in 4 ms = 50 TFLOP/s.
        assert!((p.products_share.unwrap() - 0.8).abs() < 1e-12);
        assert!((p.products_tflops.unwrap() - 50.0).abs() < 1e-9);
        // Untimed (the emulator): no times, shares, rates or MFU; the floor stays.
        let untimed = Profile::new(&recorded, Timing::Untimed, peak(), (10.0, 20.0), 5e11);
        assert!(untimed
            .groups
            .iter()
            .all(|g| g.ms.is_none() && g.tflops.is_none()));
        assert_eq!((untimed.work_ms, untimed.mfu), (None, None));
        assert_eq!(
            (untimed.products_share, untimed.products_tflops),
            (None, None)
        );
        assert!((untimed.floor_ms - 2.5).abs() < 1e-9);
        let table = untimed.to_string();
        assert!(table.contains("products: qkv") && table.contains("floor 2.50 ms"));
    }

    #[test]
    fn rates_show_three_significant_digits() {
        assert_eq!(significant(0.04123), "0.0412");
        assert_eq!(significant(989.4), "989");
        assert_eq!(significant(66.9), "66.9");
        assert_eq!(significant(0.0), "0.0");
    }

    #[test]
    fn gpus_are_known_by_their_longest_matching_name() {
        let h100 = published_gpu_peak("NVIDIA H100 80GB HBM3", Math::Bf16).unwrap();
        assert_eq!((h100.matrix_tflops, h100.bandwidth_gbs), (989.4, 3_350.0));
        let tf32 = published_gpu_peak("NVIDIA H100 80GB HBM3", Math::Tf32).unwrap();
        assert_eq!(tf32.matrix_tflops, 494.7);
        let pcie = published_gpu_peak("NVIDIA H100 PCIe", Math::F32).unwrap();
        assert_eq!((pcie.matrix_tflops, pcie.bandwidth_gbs), (51.2, 2_000.0));
        let a100 = published_gpu_peak("NVIDIA A100-SXM4-80GB", Math::Bf16).unwrap();
        assert_eq!(a100.bandwidth_gbs, 2_039.0);
        let l40s = published_gpu_peak("NVIDIA L40S", Math::Bf16).unwrap();
        assert_eq!(l40s.matrix_tflops, 362.1);
        assert!(published_gpu_peak("Some Other GPU", Math::Bf16).is_none());
    }
}
