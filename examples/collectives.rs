//! What a data-parallel step's communication costs here: the ZeRO-1 exchange of
//! tinygpt's trainer (a reduce-scatter of the gradients, then an all-gather of the
//! updated weights) over `--floats` f32 values, through the same `Collective` the
//! trainer uses, timed on rank 0.
//!
//!     cargo build --release --features mpi --example collectives
//!     mpirun -np 2 target/release/examples/collectives --floats 10700000
//!
//! Prints one line per size: the median time of the exchange and its bus bandwidth
//! (nccl-tests' definition: 2 (N - 1) / N x bytes / time, the traffic of a ring).

use std::time::Instant;

use tinygpt::parallel::{join, Shards};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let floats: Vec<usize> = match args.iter().position(|a| a == "--floats") {
        Some(i) => args[i + 1]
            .split(',')
            .map(|s| s.parse::<f64>().map(|f| f as usize))
            .collect::<Result<_, _>>()?,
        None => vec![1 << 16, 1 << 20, 10_700_000, 124_000_000],
    };
    let world = join()?;
    let comm = world.comm.as_ref();
    let (rank, ranks) = (comm.rank(), comm.size());
    if rank == 0 {
        println!("{ranks} ranks over {}", comm.describe());
    }
    for n in floats {
        let shards = Shards::new(n, ranks);
        let counts = shards.counts();
        let mut grads = vec![1.0f32; n];
        let mut shard = vec![0.0f32; counts[rank]];
        let mut times = Vec::new();
        for _ in 0..7 {
            comm.barrier()?;
            let start = Instant::now();
            comm.reduce_scatter_sum(&grads, &counts, &mut shard)?;
            comm.all_gather(&shard, &counts, &mut grads)?;
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let bytes = (n * 4) as f64;
        let bus = 2.0 * (ranks - 1) as f64 / ranks as f64 * bytes / median;
        if rank == 0 {
            println!(
                "{n:>11} f32 ({:>7.1} MB): {:>8.2} ms, bus bandwidth {:.2} GB/s",
                bytes / 1e6,
                median * 1e3,
                bus / 1e9
            );
        }
    }
    Ok(())
}
