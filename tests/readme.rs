//! The README is a contract: its commands, run in the order it shows them, as written,
//! by a shell (pipes, globs and quotes as a user's shell does them), each must succeed.
//! They run in a sandbox that stands for a user's folder: the repository's configs made
//! tiny (a few steps of a small model, so the whole README runs in a minute), a small
//! corpus as data/shakespeare.txt, and the files the README names as the user's own
//! (scene.txt, stories.jsonl, fineweb/).
//!
//! Commands that install (`cargo install`, `apt`), build for hardware this build lacks
//! (`--device cuda` without a GPU) or run the test suite itself are listed as skipped;
//! `mpirun` runs in builds with the `mpi` feature. A command the README shows that
//! fails makes this test fail, naming it.
//!
//! Why not trycmd: its markdown cases compare each command's output with the text below
//! it; ours are training logs whose figures change with the machine, so every output
//! would be a wildcard, and a sandbox of tiny configs is needed either way. What the
//! contract asks is that each command works as written: its exit status, here.
//!
//! Unix only: the README's commands are a POSIX shell's (bash runs them).
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tinygpt");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The commands of the README's code blocks (indented by four spaces), in order; a
/// line is a command when it starts with one of the programs a user types, the rest of
/// a block being output shown as an example.
fn commands(readme: &str) -> Vec<String> {
    const PROGRAMS: [&str; 10] = [
        "mkdir ",
        "tinygpt ",
        "./data/prepare.sh",
        "echo ",
        "mpirun ",
        "cargo ",
        "sudo ",
        "eval ",
        "tools/",
        "srun ",
    ];
    let mut out: Vec<String> = Vec::new();
    let mut continued = false;
    for line in readme.lines() {
        let Some(code) = line.strip_prefix("    ") else {
            continued = false;
            continue;
        };
        // A trailing comment is the README's, not the shell's business.
        let code = match code.find("  #") {
            Some(at) => code[..at].trim_end(),
            None => code.trim_end(),
        };
        if continued {
            let last = out.last_mut().expect("a command to continue");
            last.push(' ');
            last.push_str(code.trim_start());
        } else if !code.starts_with(' ') && PROGRAMS.iter().any(|p| code.starts_with(p)) {
            out.push(code.to_string());
        } else {
            continue;
        }
        continued = code.ends_with('\\');
        if continued {
            let last = out.last_mut().expect("just pushed");
            last.pop();
            last.truncate(last.trim_end().len());
        }
    }
    out
}

/// Why a command is not run here, if it is not.
fn skipped(command: &str) -> Option<&'static str> {
    if ["cargo ", "sudo ", "eval ", "tools/"]
        .iter()
        .any(|p| command.starts_with(p))
    {
        return Some("installs, builds or tests: the suite is that already");
    }
    if command.contains("--device cuda") && !has_gpu() {
        return Some("CUDA: this build or machine has none");
    }
    if command.starts_with("mpirun ") && !cfg!(feature = "mpi") {
        return Some("mpirun: this build has no MPI (feature mpi)");
    }
    None
}

fn has_gpu() -> bool {
    cfg!(feature = "cuda") && candle_core::Device::new_cuda(0).is_ok()
}

/// A config of the repository made tiny: the same file, with a small model trained a
/// few steps (what the README's commands set on the command line still wins).
fn tiny(config: &str) -> String {
    let mut table: toml::Table = toml::from_str(config).unwrap();
    let mut set = |section: &str, key: &str, value: toml::Value| {
        let section = table
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        section.as_table_mut().unwrap().insert(key.into(), value);
    };
    for (key, value) in [
        ("n_layer", 1),
        ("n_head", 2),
        ("n_embd", 16),
        ("block_size", 32),
    ] {
        set("model", key, toml::Value::Integer(value));
    }
    for (key, value) in [
        ("batch_size", 4),
        ("max_iters", 6),
        ("warmup_iters", 1),
        ("eval_interval", 3),
        ("eval_iters", 1),
        ("checkpoint_interval", 3),
    ] {
        set("train", key, toml::Value::Integer(value));
    }
    set("tokenizer", "vocab_size", toml::Value::Integer(300));
    toml::to_string(&table).unwrap()
}

/// Text with the variety of a real corpus: sentences of words drawn at random.
fn prose(words: usize, seed: u64) -> String {
    const WORDS: [&str; 24] = [
        "the", "king", "and", "queen", "of", "rome", "said", "to", "his", "her", "lord", "good",
        "night", "sweet", "prince", "what", "is", "done", "cannot", "be", "undone", "ROMEO.",
        "JULIET.", "soft",
    ];
    let mut state = seed;
    (0..words)
        .map(|i| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let word = WORDS[(state >> 33) as usize % WORDS.len()];
            if i % 10 == 9 {
                format!("{word}.\n")
            } else {
                format!("{word} ")
            }
        })
        .collect()
}

/// The user's folder: the repository's tools and tiny configs, and their data.
fn sandbox(dir: &Path) {
    std::fs::create_dir_all(dir.join("configs")).unwrap();
    for entry in std::fs::read_dir(repo().join("configs")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(
            dir.join("configs").join(path.file_name().unwrap()),
            tiny(&text),
        )
        .unwrap();
    }
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::copy(repo().join("data/prepare.sh"), dir.join("data/prepare.sh")).unwrap();
    // Already there, as after a first ./data/prepare.sh: no download in tests.
    // Every letter, digit and common mark, as a real text has (a char vocabulary
    // refuses a prompt character it never saw).
    let alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'-\n";
    let corpus = prose(40_000, 1) + &alphabet.repeat(20);
    std::fs::write(dir.join("data/shakespeare.txt"), corpus).unwrap();
    std::fs::write(dir.join("scene.txt"), prose(60, 2)).unwrap();
    let stories: String = (0..400)
        .map(|i| format!("{}\n", serde_json::json!({ "text": prose(30, 100 + i) })))
        .collect();
    std::fs::write(dir.join("stories.jsonl"), stories).unwrap();
    std::fs::create_dir_all(dir.join("fineweb")).unwrap();
    for part in 0..2 {
        let rows: Vec<String> = (0..200).map(|i| prose(30, 1000 * part + i)).collect();
        write_parquet(&dir.join(format!("fineweb/part-{part}.parquet")), &rows);
    }
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::os::unix::fs::symlink(BIN, dir.join("bin/tinygpt")).unwrap();
}

/// A parquet file as the Hugging Face hub serves datasets: one `text` column of strings.
fn write_parquet(path: &Path, rows: &[String]) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let schema = parse_message_type("message schema { REQUIRED BYTE_ARRAY text (UTF8); }");
    let file = std::fs::File::create(path).unwrap();
    let props = Default::default();
    let mut writer = SerializedFileWriter::new(file, schema.unwrap().into(), props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let mut column = group.next_column().unwrap().expect("the text column");
    let values: Vec<ByteArray> = rows.iter().map(|r| ByteArray::from(r.as_str())).collect();
    column
        .typed::<ByteArrayType>()
        .write_batch(&values, None, None)
        .unwrap();
    column.close().unwrap();
    group.close().unwrap();
    writer.close().unwrap();
}

/// Runs `command` as a user's shell would in `dir`, with `tinygpt` on the PATH.
fn run(dir: &Path, command: &str) -> std::process::Output {
    let path = format!(
        "{}:{}",
        dir.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let start = Instant::now();
    let out = Command::new("sh")
        .args(["-c", command])
        .current_dir(dir)
        .env("PATH", path)
        // The sandbox is the user's home too (completions and man pages go there).
        .env("HOME", dir)
        // mpirun refuses root (CI runs as root) unless told, and two cores may be fewer
        // than a command's ranks: neither changes the command.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(300),
        "`{command}` took {:?}",
        start.elapsed()
    );
    out
}

#[test]
fn every_readme_command_works_as_written_in_order() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let commands = commands(&readme);
    assert!(commands.len() >= 25, "{} commands found", commands.len());
    let dir = tempfile::tempdir().unwrap();
    sandbox(dir.path());
    let mut ran = 0;
    // `tinygpt serve` runs as the user leaves it: in the background, for the commands
    // (and the Python) that talk to it.
    let mut server: Option<Background> = None;
    for command in &commands {
        if let Some(why) = skipped(command) {
            eprintln!("SKIPPED `{command}`: {why}");
            continue;
        }
        if command.starts_with("tinygpt serve ") {
            server = Some(Background::serve(dir.path(), command));
            ran += 1;
            continue;
        }
        let out = run(dir.path(), command);
        assert!(
            out.status.success(),
            "the README's `{command}` failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        ran += 1;
    }
    assert!(ran >= 20, "{ran} commands ran");
    // The README's Python (the openai client) against the server it started.
    let snippets = python_snippets(&readme);
    assert!(!snippets.is_empty(), "the README shows the openai client");
    match python_with_openai() {
        None => eprintln!(
            "SKIPPED the README's Python: no Python with the openai package (tools/serve-clients.sh --install makes target/clients-venv)"
        ),
        Some(python) => {
            assert!(server.is_some(), "the Python needs the README's `tinygpt serve`");
            for snippet in &snippets {
                let out = Command::new(&python)
                    .args(["-c", snippet])
                    .current_dir(dir.path())
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "the README's Python failed:\n{snippet}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(!out.stdout.is_empty(), "the README's Python printed nothing");
            }
        }
    }
    drop(server);
    // What they left: the quick start's run, the sweep's picture beside its runs.
    let checkpoints = dir.path().join("checkpoints");
    assert!(checkpoints
        .join("shakespeare-char/model.safetensors")
        .is_file());
    assert!(checkpoints.join("sweep-shakespeare-char.png").is_file());
    // The README's glob of the sweep's runs takes runs only (the picture is named apart).
    let compared = run(dir.path(), "tinygpt compare checkpoints/shakespeare-char-*");
    let said = String::from_utf8_lossy(&compared.stderr);
    assert!(
        compared.status.success() && !said.contains("skipped"),
        "{said}"
    );
    assert!(checkpoints.join("compare.png").is_file());
    let home = dir.path().join(".local/share");
    assert!(home.join("bash-completion/completions/tinygpt").is_file());
    // Beside ~/.cargo/bin, where man finds them (it looks in ../share/man of each
    // folder of PATH).
    let man = dir.path().join(".cargo/share/man/man1");
    assert!(man.join("tinygpt-train.1").is_file());
}

/// A command left running (the README's `tinygpt serve`), stopped when dropped.
struct Background(std::process::Child);

impl Background {
    /// Starts the command and waits until the server says where it listens.
    fn serve(dir: &Path, command: &str) -> Self {
        use std::io::BufRead;
        let path = format!(
            "{}:{}",
            dir.join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut child = Command::new("sh")
            .args(["-c", &format!("exec {command}")])
            .current_dir(dir)
            .env("PATH", path)
            .env("HOME", dir)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let mut said = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            said.push_str(&line);
            said.push('\n');
            if line.contains("at http://") {
                return Self(child);
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the README's `{command}` did not start serving:\n{said}");
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The README's Python: indented blocks that begin with `from openai import`.
fn python_snippets(readme: &str) -> Vec<String> {
    let mut snippets: Vec<String> = Vec::new();
    let mut inside = false;
    for line in readme.lines() {
        match line.strip_prefix("    ") {
            Some(code) if inside => {
                let last = snippets.last_mut().expect("a snippet");
                last.push_str(code);
                last.push('\n');
            }
            Some(code) if code.starts_with("from openai import") => {
                inside = true;
                snippets.push(format!("{code}\n"));
            }
            _ => inside = false,
        }
    }
    snippets
}

/// A Python that has the openai package: the clients' venv, else the system's.
fn python_with_openai() -> Option<PathBuf> {
    let venv = repo().join("target/clients-venv/bin/python");
    [venv, PathBuf::from("python3")].into_iter().find(|python| {
        Command::new(python)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn commands_are_told_from_their_output() {
    let readme = "text\n\n    tinygpt train --config x.toml  # a comment\n    ROMEO.\n    echo hi | tinygpt generate\n\n    mpirun -np 2 tinygpt train \\\n        --set a=b\n";
    assert_eq!(
        commands(readme),
        vec![
            "tinygpt train --config x.toml",
            "echo hi | tinygpt generate",
            "mpirun -np 2 tinygpt train --set a=b"
        ]
    );
}
