//! Who started this process, read from the environment the launchers set: Open MPI's
//! `mpirun` (OMPI_COMM_WORLD_*), MPICH's Hydra and other PMI launchers (PMI_*), Slurm's
//! `srun` (SLURM_STEP_NUM_TASKS, SLURM_PROCID), PMIx (PMIX_RANK) and torchrun
//! (WORLD_SIZE, RANK). Nothing here talks to a launcher: a build without MPI reads this
//! to refuse instead of starting N independent runs in one run folder.

/// What the environment says about the ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launcher {
    /// The launcher, as users know it ("Open MPI's mpirun", "Slurm's srun", ...).
    pub name: &'static str,
    /// Ranks in the job, where the launcher says.
    pub size: Option<usize>,
    /// This process's rank.
    pub rank: usize,
}

impl Launcher {
    /// The launcher that started this process, if any.
    pub fn detect() -> Option<Self> {
        Self::from_env(|key| std::env::var(key).ok())
    }

    /// [`Launcher::detect`] over any environment (tests).
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let number = |key: &str| var(key).and_then(|v| v.trim().parse::<usize>().ok());
        // (name, size variable, rank variable), most specific first: Open MPI under
        // Slurm sets both its own and Slurm's.
        let known: [(&'static str, &str, &str); 5] = [
            (
                "Open MPI's mpirun",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_RANK",
            ),
            ("an MPI launcher (PMI)", "PMI_SIZE", "PMI_RANK"),
            ("Slurm's srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
            ("a PMIx launcher", "PMIX_SIZE", "PMIX_RANK"),
            ("torchrun", "WORLD_SIZE", "RANK"),
        ];
        for (name, size, rank) in known {
            if let Some(size) = number(size) {
                let rank = number(rank).unwrap_or(0);
                let size = Some(size);
                return Some(Self { name, size, rank });
            }
        }
        // PMIx launchers (srun --mpi=pmix, prterun) set the rank but not always a size.
        number("PMIX_RANK").map(|rank| Self {
            name: "a PMIx launcher",
            size: None,
            rank,
        })
    }

    /// Whether it started (or may have started) more than this one process.
    pub fn several(&self) -> bool {
        self.size.is_none_or(|n| n > 1)
    }

    /// "4", or "several" where the launcher does not say.
    pub fn size_name(&self) -> String {
        self.size.map_or("several".into(), |n| n.to_string())
    }

    /// The one line a build without MPI prints when launched as one of several ranks.
    pub fn refusal(&self) -> String {
        format!(
            "started by {} as rank {} of {}, but this tinygpt was built without MPI, so each rank would train alone into the same run folder; rebuild with `cargo install --path . --features mpi` (needs an MPI library: apt install libopenmpi-dev libclang-dev), or run one process",
            self.name,
            self.rank,
            self.size_name()
        )
    }
}

/// Under Open MPI's `mpirun`, where a checkpoint of `bytes` may take longer to write
/// than the time mpirun gives ranks to stop: on Ctrl-C or SIGTERM it sends them SIGCONT
/// at once, SIGTERM `odls_base_sigkill_timeout` seconds later (1 by default) and
/// SIGKILL as long after that (measured with Open MPI 4.1.4: a script's traps under
/// mpirun saw SIGTERM 1.0 s after the Ctrl-C, 3.0 s with the setting at 3, and mpirun
/// ended twice that after it). The note says how to give a stop time to save. Writes
/// are taken at 50 MB/s, a slow disk's or a network filesystem's pace.
pub fn open_mpi_stop_note(bytes: usize) -> Option<String> {
    stop_note_in(bytes, |key| std::env::var(key).ok())
}

/// [`open_mpi_stop_note`] in any environment (tests).
fn stop_note_in(bytes: usize, var: impl Fn(&str) -> Option<String>) -> Option<String> {
    var("OMPI_COMM_WORLD_SIZE")?;
    let given = var("OMPI_MCA_odls_base_sigkill_timeout");
    let delay = given
        .as_deref()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(1.0);
    let seconds = bytes as f64 / 50e6;
    (seconds > delay).then(|| {
        format!(
            "note: Open MPI's mpirun passes Ctrl-C or SIGTERM on to the ranks {delay} s late and kills them {delay} s after that, and this run's checkpoint ({:.0} MB) may take longer to write, so a stop through mpirun could lose the steps since the last one: stop the ranks themselves (kill -INT their pids, scancel), which saves, or start mpirun with --mca odls_base_sigkill_timeout {} (a stop then takes that long to reach the ranks; a second Ctrl-C ends mpirun and leaves them to be killed)",
            bytes as f64 / 1e6,
            (4.0 * seconds).ceil().max(10.0)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_slower_to_write_than_open_mpis_kill_is_told() {
        let open_mpi = [("OMPI_COMM_WORLD_SIZE", "2")];
        // 150 MB (12.6M parameters with AdamW's moments): 3 s at 50 MB/s, past 1 s.
        let note = stop_note_in(150_000_000, env(&open_mpi)).unwrap();
        assert!(
            note.contains("--mca odls_base_sigkill_timeout 12"),
            "{note}"
        );
        // 19 MB: written within the second.
        assert_eq!(stop_note_in(19_000_000, env(&open_mpi)), None);
        // Given time already; or not Open MPI.
        let given = [
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_MCA_odls_base_sigkill_timeout", "10"),
        ];
        assert_eq!(stop_note_in(150_000_000, env(&given)), None);
        assert_eq!(stop_note_in(150_000_000, env(&[("PMI_SIZE", "2")])), None);
    }

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |key| {
            pairs
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn each_launcher_is_recognised() {
        assert_eq!(Launcher::from_env(env(&[])), None);
        let ompi = Launcher::from_env(env(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("SLURM_STEP_NUM_TASKS", "8"),
        ]))
        .unwrap();
        assert_eq!(
            (ompi.name, ompi.size, ompi.rank),
            ("Open MPI's mpirun", Some(4), 3)
        );
        let hydra = Launcher::from_env(env(&[("PMI_SIZE", "2"), ("PMI_RANK", "1")])).unwrap();
        assert_eq!((hydra.size, hydra.rank), (Some(2), 1));
        let srun = Launcher::from_env(env(&[
            ("SLURM_STEP_NUM_TASKS", "16"),
            ("SLURM_PROCID", "5"),
        ]))
        .unwrap();
        assert_eq!(
            (srun.name, srun.size, srun.rank),
            ("Slurm's srun", Some(16), 5)
        );
        let pmix = Launcher::from_env(env(&[("PMIX_RANK", "0")])).unwrap();
        assert!(pmix.several());
        assert!(pmix.refusal().contains("rank 0 of several"));
    }

    #[test]
    fn a_batch_script_alone_is_not_a_launch() {
        // sbatch sets SLURM_NTASKS for the whole allocation; only srun's steps set
        // SLURM_STEP_NUM_TASKS.
        let batch = env(&[("SLURM_NTASKS", "4"), ("SLURM_PROCID", "0")]);
        assert_eq!(Launcher::from_env(batch), None);
    }

    #[test]
    fn the_refusal_names_the_rebuild() {
        let l = Launcher::from_env(env(&[
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
        ]))
        .unwrap();
        let line = l.refusal();
        assert!(line.contains("rank 1 of 2") && line.contains("--features mpi"));
        assert!(!line.contains('\n'));
    }
}
