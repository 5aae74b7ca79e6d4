//! Every mistake a user can make that we know of, run through the real binary: one
//! line on stderr that names the thing and the fix, exit code 2, no panic, no
//! backtrace, and no existing file changed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use tinygpt::util::sha256_hex;

struct Case {
    /// What the user did wrong.
    what: &'static str,
    args: Vec<String>,
    /// Something the message must say (the field, file or fix).
    needle: &'static str,
    /// Prepares the mistake in the scratch folder (e.g. corrupts a checkpoint copy).
    setup: Option<fn(&Path)>,
}

fn case(what: &'static str, args: &str, needle: &'static str) -> Case {
    Case {
        what,
        args: args.split_whitespace().map(str::to_string).collect(),
        needle,
        setup: None,
    }
}

fn with(what: &'static str, args: &str, needle: &'static str, setup: fn(&Path)) -> Case {
    Case {
        setup: Some(setup),
        ..case(what, args, needle)
    }
}

const CK: &str = "checkpoints/good";

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// A copy of the good checkpoint at checkpoints/bad, to damage.
fn bad_copy(dir: &Path) -> PathBuf {
    let bad = dir.join("checkpoints/bad");
    let _ = std::fs::remove_dir_all(&bad);
    copy_dir(&dir.join(CK), &bad);
    bad
}

/// Rewrites a checkpoint file and records its new hash, so only the content is wrong.
fn replace_consistently(run: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(run.join(name), bytes).unwrap();
    let path = run.join("state.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    state["files"][name] = serde_json::json!({"size": bytes.len(), "sha256": sha256_hex(bytes)});
    std::fs::write(path, serde_json::to_string(&state).unwrap()).unwrap();
}

fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.clone(), sha256_hex(&std::fs::read(&p).unwrap()));
            }
        }
    }
    out
}

#[test]
fn each_user_mistake_gives_one_clear_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
        .repeat(40);
    std::fs::write(d.join("corpus.txt"), &text).unwrap();
    std::fs::write(d.join("crlf.txt"), text.replace('\n', "\r\n")).unwrap();
    std::fs::write(d.join("empty.txt"), "").unwrap();
    std::fs::write(d.join("latin1.txt"), b"caf\xe9 au lait\n".repeat(50)).unwrap();
    // `printf hello | gzip`: a corpus still compressed.
    std::fs::write(
        d.join("corpus.txt.gz"),
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xcb\x48\xcd\xc9\xc9\x07\x00\x86\xa6\x10\x36\x05\x00\x00\x00",
    )
    .unwrap();
    std::fs::write(d.join("short.txt"), "too short").unwrap();
    std::fs::write(d.join("one.txt"), "N").unwrap();
    std::fs::write(d.join("long-prompt.txt"), "Now is the ".repeat(10)).unwrap();
    std::fs::create_dir(d.join("notxt")).unwrap();
    std::fs::write(d.join("notxt/readme.md"), "no text here").unwrap();
    std::fs::write(d.join("bad-tokenizer.json"), "{ nope").unwrap();
    std::fs::write(d.join("bad.jsonl"), "{\"text\": \"fine\"}\n{oops\n").unwrap();
    std::fs::write(d.join("nofield.jsonl"), "{\"id\": 1, \"body\": \"x\"}\n").unwrap();
    std::fs::write(d.join("arrays.jsonl"), "[1, 2]\n").unwrap();
    std::fs::write(d.join("latin1.jsonl"), b"{\"text\": \"caf\xe9\"}\n").unwrap();
    std::fs::write(
        d.join("array.json"),
        "[{\"text\": \"a\"}, {\"text\": \"b\"}]",
    )
    .unwrap();
    // Notepad's "Unicode": UTF-16 little-endian with its byte-order mark.
    let utf16: Vec<u8> = [0xFF, 0xFE]
        .into_iter()
        .chain(text.encode_utf16().flat_map(u16::to_le_bytes))
        .collect();
    std::fs::write(d.join("utf16.txt"), utf16).unwrap();
    std::fs::write(d.join("image.txt"), b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR").unwrap();
    std::fs::create_dir(d.join("stray")).unwrap();
    std::fs::write(d.join("stray/a.txt"), &text).unwrap();
    std::fs::write(d.join("stray/model.bin"), [1u8, 0, 2, 0]).unwrap();
    let bpe = tinygpt::tokenizer::Tokenizer::train_bpe(&text, 300).unwrap();
    std::fs::write(d.join("bpe.json"), bpe.to_json().unwrap()).unwrap();
    let tokens: Vec<u8> = [1u16, 2, 5000, 3]
        .repeat(50)
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(d.join("tokens.bin"), &tokens).unwrap();
    std::fs::write(d.join("odd.bin"), [1u8, 0, 2]).unwrap();
    let mut header = vec![0i32; 256];
    header[..3].copy_from_slice(&[1234, 1, 4]);
    let mut shard: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
    shard.extend([1u16, 2, 3, 4].iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(d.join("badmagic.bin"), &shard).unwrap();
    std::fs::create_dir(d.join("mixed")).unwrap();
    std::fs::write(d.join("mixed/a.txt"), "some text").unwrap();
    std::fs::write(d.join("mixed/b.bin"), [1u8, 0]).unwrap();
    let parquet = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/stories.parquet");
    let whole = std::fs::read(parquet.as_path()).unwrap();
    std::fs::write(d.join("cut.parquet"), &whole[..whole.len() * 3 / 5]).unwrap();
    std::fs::write(
        d.join("lines.parquet"),
        "{\"text\": \"a jsonl file misnamed\"}\n",
    )
    .unwrap();
    let parquet = parquet.display();
    std::fs::write(d.join("syntax.toml"), "[model]\nn_layer = = 2\n").unwrap();
    std::fs::write(d.join("unknown.toml"), "[model]\nlayers = 2\n").unwrap();
    std::fs::write(d.join("section.toml"), "[modle]\nn_layer = 2\n").unwrap();
    std::fs::write(d.join("type.toml"), "[train]\nlr = \"fast\"\n").unwrap();
    std::fs::write(
        d.join("exp.toml"),
        "[run]\nname = \"good\"\n[data]\ncorpus = \"corpus.txt\"\n[tokenizer]\nkind = \"char\"\n\
         [model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n\
         [train]\nbatch_size = 4\nmax_iters = 3\nwarmup_iters = 1\neval_interval = 3\neval_iters = 1\n",
    )
    .unwrap();
    let ok = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(["train", "--config", "exp.toml"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    let t = "train --config exp.toml --set run.name=other";
    let g = "generate --checkpoint checkpoints/good --max-new-tokens 5";
    let gb = "generate --checkpoint checkpoints/bad --max-new-tokens 5 --prompt Now";
    let cases = vec![
        // Config files and overrides.
        case(
            "config file missing",
            "train --config nope.toml",
            "nope.toml",
        ),
        case("TOML syntax error", "train --config syntax.toml", "line 2"),
        case("unknown key", "train --config unknown.toml", "layers"),
        case("unknown section", "train --config section.toml", "modle"),
        case("wrong type in file", "train --config type.toml", "lr"),
        case(
            "unknown key in --set",
            &format!("{t} --set model.n_layers=2"),
            "n_layers",
        ),
        case(
            "--set without =",
            &format!("{t} --set model.n_layer"),
            "section.key=value",
        ),
        case(
            "--set without section",
            &format!("{t} --set n_layer=2"),
            "section.key",
        ),
        case(
            "--set wrong type",
            &format!("{t} --set model.n_layer=two"),
            "model.n_layer",
        ),
        case(
            "--set wrong type, in words",
            &format!("{t} --set model.n_layer=two"),
            "expected a whole number",
        ),
        case(
            "wrong type in file, in words",
            "train --config type.toml",
            "expected a number",
        ),
        case(
            "--set negative count",
            &format!("{t} --set train.batch_size=-4"),
            "train.batch_size",
        ),
        case(
            "unknown enum value",
            &format!("{t} --set tokenizer.kind=wordpiece"),
            "tokenizer.kind",
        ),
        case(
            "unknown dtype",
            &format!("{t} --set train.dtype=fp8"),
            "train.dtype",
        ),
        case(
            "unknown position kind",
            &format!("{t} --set model.positions=alibi"),
            "model.positions",
        ),
        case(
            "n_embd not divisible by n_head",
            &format!("{t} --set model.n_head=3"),
            "n_head",
        ),
        case(
            "n_head not divisible by n_kv_head",
            &format!("{t} --set model.n_kv_head=3 --set model.n_head=2"),
            "n_kv_head",
        ),
        case(
            "zero K/V heads",
            &format!("{t} --set model.n_kv_head=0"),
            "n_kv_head",
        ),
        case(
            "odd head size with RoPE",
            &format!("{t} --set model.positions=rope --set model.n_embd=18"),
            "even head size",
        ),
        case(
            "odd width with sinusoids",
            &format!(
                "{t} --set model.positions=sinusoidal --set model.n_embd=15 --set model.n_head=1"
            ),
            "n_embd",
        ),
        case(
            "block_size below 2",
            &format!("{t} --set model.block_size=1"),
            "block_size",
        ),
        case(
            "zero layers",
            &format!("{t} --set model.n_layer=0"),
            "n_layer",
        ),
        case(
            "dropout of 1",
            &format!("{t} --set model.dropout=1.0"),
            "dropout",
        ),
        case(
            "rope_theta below 1",
            &format!("{t} --set model.rope_theta=0.5"),
            "rope_theta",
        ),
        case(
            "BPE vocabulary below 257",
            &format!("{t} --set tokenizer.kind=bpe --set tokenizer.vocab_size=100"),
            "vocab_size",
        ),
        case(
            "val_fraction 0",
            &format!("{t} --set data.val_fraction=0"),
            "val_fraction",
        ),
        case(
            "min_lr above lr",
            &format!("{t} --set train.min_lr=0.1"),
            "min_lr",
        ),
        case("beta2 of 1", &format!("{t} --set train.beta2=1"), "beta2"),
        case("eps of 0", &format!("{t} --set train.eps=0"), "eps"),
        case(
            "negative clip",
            &format!("{t} --set train.grad_clip=-1"),
            "grad_clip",
        ),
        case(
            "zero batch",
            &format!("{t} --set train.batch_size=0"),
            "batch_size",
        ),
        case(
            "decay shorter than warmup",
            &format!("{t} --set train.lr_decay_iters=2 --set train.warmup_iters=5"),
            "lr_decay_iters",
        ),
        case(
            "run name with a slash",
            "train --config exp.toml --set run.name=a/b",
            "run.name",
        ),
        case(
            "model that cannot fit in memory",
            &format!("{t} --set model.n_embd=65536 --set model.n_head=64 --set model.n_layer=64"),
            "GiB",
        ),
        case(
            "bench of a model that cannot fit in memory",
            "bench --config exp.toml --steps 1 --set model.n_embd=65536 --set model.n_head=64 --set model.n_layer=64",
            "GiB",
        ),
        case(
            "import into the folder it reads",
            "import --from checkpoints --out checkpoints",
            "is not empty",
        ),
        case(
            "import onto a file",
            "import --from checkpoints --out exp.toml",
            "is a file",
        ),
        case(
            "import of a checkpoint that is one already",
            &format!("import --from {CK} --out checkpoints/again"),
            "a tinygpt checkpoint already",
        ),
        case(
            "eval with a window longer than the model's context",
            &format!("eval --checkpoint {CK} --text corpus.txt --context 100000"),
            "--context 100000 is longer than the model's context",
        ),
        case(
            "model vocab smaller than tokenizer",
            &format!("{t} --set model.vocab_size=3"),
            "model.vocab_size",
        ),
        // Corpus.
        case(
            "corpus missing",
            &format!("{t} --set data.corpus=nope.txt"),
            "(os error 2) (read from the current folder, ",
        ),
        with(
            "corpus a .json file",
            &format!("{t} --set data.corpus=c.json"),
            "c.json is a .json file; tinygpt reads JSON Lines (one object per line) as .jsonl",
            |d| std::fs::write(d.join("c.json"), "[{\"text\": \"To be\"}]").unwrap(),
        ),
        case(
            "out_dir a file, found before the corpus is read",
            &format!("{t} --set run.out_dir=exp.toml --set data.corpus=nope.txt"),
            "run.out_dir exp.toml: exp.toml is a file, not a folder; set run.out_dir to a folder",
        ),
        case(
            "corpus empty",
            &format!("{t} --set data.corpus=empty.txt"),
            "empty",
        ),
        case(
            "a device as the corpus (a pipe reads once)",
            &format!("{t} --set data.corpus=/dev/null"),
            "is not a regular file (a pipe or a device); save it to a file first",
        ),
        case(
            "corpus still gzip-compressed",
            &format!("{t} --set data.corpus=corpus.txt.gz"),
            "is gzip-compressed; decompress it first (gzip -dc corpus.txt.gz > corpus.txt) and name the result in data.corpus",
        ),
        with(
            "corpus gzip-compressed under a .txt name",
            &format!("{t} --set data.corpus=packed.txt"),
            "is gzip-compressed; decompress it first (gzip -dc packed.txt > packed.decompressed.txt)",
            |d| {
                std::fs::copy(d.join("corpus.txt.gz"), d.join("packed.txt")).unwrap();
            },
        ),
        case(
            "corpus in latin-1",
            &format!("{t} --set data.corpus=latin1.txt"),
            "is not UTF-8 (byte 0xE9 at offset 3); convert it from the encoding it was written in (e.g. iconv -f LATIN1 -t UTF-8 latin1.txt > latin1.utf8.txt",
        ),
        case(
            "corpus in UTF-16",
            &format!("{t} --set data.corpus=utf16.txt"),
            "is UTF-16 text (it starts with UTF-16's byte-order mark); convert it first (iconv -f UTF-16 -t UTF-8 utf16.txt > utf16.utf8.txt)",
        ),
        case(
            "an image named .txt as the corpus",
            &format!("{t} --set data.corpus=image.txt"),
            "is not text (a PNG image); name a text file in data.corpus",
        ),
        case(
            "a .jsonl in latin-1",
            &format!("{t} --set data.corpus=latin1.jsonl"),
            "latin1.jsonl (line 1) is not UTF-8 (byte 0xE9 at offset 13)",
        ),
        case(
            "a stray .bin beside the text in a corpus folder",
            &format!("{t} --set data.corpus=stray"),
            "(the a.txt beside them is then not read: move the .bin files out to train on the text)",
        ),
        case(
            "eval of a JSON array",
            "eval --checkpoint checkpoints/good --text array.json",
            "convert a JSON array with jq -c '.[]' array.json > array.jsonl",
        ),
        case(
            "eval of an empty file",
            "eval --checkpoint checkpoints/good --text empty.txt",
            "--text empty.txt is empty; name a text to score",
        ),
        case(
            "eval of one character",
            "eval --checkpoint checkpoints/good --text one.txt",
            "--text one.txt is 1 token; evaluation needs at least 2",
        ),
        case(
            "eval of a PNG",
            "eval --checkpoint checkpoints/good --text image.txt",
            "--text image.txt is not text (a PNG image); name a text file in --text",
        ),
        case(
            "corpus shorter than a block",
            &format!("{t} --set data.corpus=short.txt"),
            "block_size",
        ),
        case(
            "corpus folder without .txt",
            &format!("{t} --set data.corpus=notxt"),
            "has no .txt, .jsonl, .parquet or .bin files (it holds readme.md); put the files to train on there",
        ),
        with(
            "corpus folder of compressed shards",
            &format!("{t} --set data.corpus=shards"),
            "only compressed ones (a.jsonl.gz and 1 more); decompress them there first (e.g. gunzip -k shards/*.gz)",
            |d| {
                std::fs::create_dir(d.join("shards")).unwrap();
                for name in ["a.jsonl.gz", "b.jsonl.gz"] {
                    std::fs::write(d.join("shards").join(name), b"\x1f\x8b\x08\x00").unwrap();
                }
            },
        ),
        case(
            "jsonl line that is not JSON",
            &format!("{t} --set data.corpus=bad.jsonl"),
            "bad.jsonl:2",
        ),
        case(
            "jsonl without the text field",
            &format!("{t} --set data.corpus=nofield.jsonl"),
            "it has: body, id",
        ),
        case(
            "jsonl text field not a string",
            &format!("{t} --set data.corpus=nofield.jsonl --set data.text_field=id"),
            "a number",
        ),
        case(
            "parquet without the text column",
            &format!("{t} --set data.corpus={parquet} --set data.text_field=body"),
            "it has: id, text, url",
        ),
        case(
            "parquet file cut short",
            &format!("{t} --set data.corpus=cut.parquet"),
            "download it again",
        ),
        case(
            "jsonl named .parquet",
            &format!("{t} --set data.corpus=lines.parquet"),
            "give it the extension of what it holds",
        ),
        case(
            "jsonl lines that are not objects",
            &format!("{t} --set data.corpus=arrays.jsonl"),
            "arrays.jsonl:1 is an array, not a JSON object",
        ),
        case(
            "a char tokenizer asked for beside a BPE tokenizer.path",
            &format!("{t} --set tokenizer.kind=char --set tokenizer.path=bpe.json"),
            "is not a char vocabulary",
        ),
        case(
            "token file without tokenizer.path",
            &format!("{t} --set data.corpus=tokens.bin"),
            "tokenizer.path",
        ),
        case(
            "llm.c shard with a wrong magic",
            &format!("{t} --set data.corpus=badmagic.bin --set tokenizer.path={CK}/tokenizer.json"),
            "magic 1234",
        ),
        case(
            "token id beyond the vocabulary",
            &format!("{t} --set data.corpus=tokens.bin --set tokenizer.path={CK}/tokenizer.json"),
            "holds id 5000",
        ),
        case(
            "token file of an odd size",
            &format!("{t} --set data.corpus=odd.bin --set tokenizer.path={CK}/tokenizer.json"),
            "truncated",
        ),
        case(
            "folder of token files (text beside them left out) without tokenizer.path",
            &format!("{t} --set data.corpus=mixed"),
            "tokenizer.path",
        ),
        // Tokenizer.
        case(
            "BPE vocabulary larger than the corpus allows (and no short tokenizer cached under its name)",
            &format!("{t} --set tokenizer.kind=bpe --set tokenizer.vocab_size=5000"),
            "tokenizer.vocab_size",
        ),
        case(
            "corrupt tokenizer.json",
            &format!("{t} --set tokenizer.path=bad-tokenizer.json"),
            "bad-tokenizer.json",
        ),
        case(
            "tokenizer.json missing",
            &format!("{t} --set tokenizer.path=nope.json"),
            "nope.json",
        ),
        with(
            "tokenizer.json that makes the tokenizers library panic",
            &format!("{t} --set tokenizer.path=crash.json"),
            "crash.json",
            |d| {
                let data = Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/data/tokenizer-decoder-panic.json");
                std::fs::copy(data, d.join("crash.json")).unwrap();
            },
        ),
        // Runs and checkpoints.
        case(
            "new run into a folder with a checkpoint",
            "train --config exp.toml",
            "--resume",
        ),
        case(
            "--resume without a checkpoint",
            &format!("{t} --resume"),
            "no checkpoint",
        ),
        case(
            "--resume with another model",
            "train --config exp.toml --resume --set model.n_layer=2",
            "model.n_layer = 2 (the checkpoint has 1)",
        ),
        case(
            "a file passed as the run folder",
            "info --checkpoint checkpoints/good/model.safetensors",
            "pass the run folder that holds it: checkpoints/good",
        ),
        case(
            "a folder of runs passed as the run folder",
            "generate --checkpoint checkpoints --prompt Now",
            "pass one of them: checkpoints/good",
        ),
        case(
            "a config key given as a flag",
            "train --config exp.toml --max-iters 10",
            "--set train.max_iters=10",
        ),
        case(
            "a config key given as a flag with =",
            "train --config exp.toml --warmup-iters=5",
            "--set train.warmup_iters=5",
        ),
        with(
            "train while another trainer holds the lock",
            "train --config exp.toml --resume --set train.max_iters=6",
            "pid 1",
            |d| {
                // Held as a trainer holds it: locked, its pid written. The handle is
                // left open (locked) for the rest of this test process.
                let mut lock = std::fs::File::create(d.join(CK).join("train.lock")).unwrap();
                lock.try_lock().unwrap();
                std::io::Write::write_all(&mut lock, b"1\n").unwrap();
                std::mem::forget(lock);
            },
        ),
        case(
            "cache prune with a mistyped runs folder",
            "cache prune --runs checkpoint",
            "--runs checkpoint: no such folder",
        ),
        case(
            "cache list with a mistyped cache folder",
            "cache --cache data/cahce",
            "--cache data/cahce: no such folder",
        ),
        case(
            "serve with an empty API key",
            "serve --checkpoint checkpoints/good --port 0 --api-key=",
            "--api-key (or TINYGPT_API_KEY) is empty",
        ),
        case(
            "serve allowing no tokens",
            "serve --checkpoint checkpoints/good --port 0 --max-tokens 0",
            "--max-tokens 0",
        ),
        case(
            "plot --out inside a file",
            "plot --checkpoint checkpoints/good --out checkpoints/good/config.toml/x.png",
            "config.toml is a file, not a folder",
        ),
        case(
            "plot --out where nothing can be written",
            "plot --checkpoint checkpoints/good --out /proc/tinygpt-plot.png",
            "cannot write there",
        ),
        case(
            "serve allowing no connections",
            "serve --checkpoint checkpoints/good --port 0 --max-connections 0",
            "--max-connections 0 would close every connection",
        ),
        case(
            "serve allowing no request body",
            "serve --checkpoint checkpoints/good --port 0 --max-body-bytes 0",
            "--max-body-bytes 0 leaves no room",
        ),
        case(
            "serve --cors given something that is no origin",
            "serve --checkpoint checkpoints/good --port 0 --cors localhost:3000/app",
            "is not an origin",
        ),
        case(
            "generate int8 weights with the reference decoder",
            "generate --checkpoint checkpoints/good --prompt To --reference --dtype int8",
            "--dtype int8 decodes with the fused CPU decoder only",
        ),
        case(
            "generate int4 weights without a KV cache",
            "generate --checkpoint checkpoints/good --prompt To --no-kv-cache --dtype int4",
            "--dtype int4 decodes with the fused CPU decoder only",
        ),
        case(
            "plot into a folder that does not exist",
            "plot --checkpoint checkpoints/good --out nodir/loss.png",
            "the folder nodir does not exist",
        ),
        case(
            "plot as a picture type it cannot write",
            "plot --checkpoint checkpoints/good --out loss.svg",
            "end the name with .png",
        ),
        case(
            "attention map without a picture extension",
            "attention --checkpoint checkpoints/good --prompt To --out attention",
            "end the name with .png",
        ),
        case(
            "compare into a folder that does not exist",
            "compare checkpoints/good --out nodir/compare.png",
            "the folder nodir does not exist",
        ),
        case(
            "export GGUF to a folder path",
            "export --checkpoint checkpoints/good --format gguf --out newdir/",
            "is a folder; --format gguf writes one file",
        ),
        case(
            "resume with another tokenizer",
            "train --config exp.toml --resume --set train.max_iters=6 --set tokenizer.kind=bpe",
            "--resume keeps the run's tokenizer, and --set asks for another: tokenizer.kind = bpe (the checkpoint has char)",
        ),
        case(
            "resume on a corpus with Windows line endings",
            "train --config exp.toml --resume --set train.max_iters=6 --set data.corpus=crlf.txt",
            "corpus crlf.txt holds the character '\\r', which this run's char-level vocabulary lacks; it has Windows line endings (\\r\\n): convert them to \\n (dos2unix)",
        ),
        case(
            "no K/V heads",
            "train --config exp.toml --set model.n_kv_head=0 --set run.name=kv",
            "model.n_kv_head = 0 must be at least 1",
        ),
        case(
            "a number past what a setting can hold",
            "train --config exp.toml --set model.n_embd=18446744073709551615 --set run.name=big",
            "is too large a number",
        ),
        case(
            "checkpoint folder missing",
            "info --checkpoint checkpoints/nope",
            "does not exist",
        ),
        with(
            "checkpoint file missing",
            "info --checkpoint checkpoints/bad",
            "model.safetensors",
            |d| {
                std::fs::remove_file(bad_copy(d).join("model.safetensors")).unwrap();
            },
        ),
        with(
            "config.toml edited by hand",
            "info --checkpoint checkpoints/bad",
            "config.toml was edited since the checkpoint was written (it no longer matches state.json): undo the edit, and give changed settings on the command line instead (train --resume --set train.lr=...)",
            |d| {
                let p = bad_copy(d).join("config.toml");
                let text = std::fs::read_to_string(&p).unwrap();
                std::fs::write(&p, text.replacen("lr = ", "lr = 1", 1)).unwrap();
            },
        ),
        with(
            "optimizer.safetensors missing on resume",
            &format!("{t} --set run.name=bad --set train.max_iters=6 --resume"),
            "the checkpoint cannot resume without it: restore it, or start a new run from its weights (train --init-from ",
            |d| {
                std::fs::remove_file(bad_copy(d).join("optimizer.safetensors")).unwrap();
            },
        ),
        with(
            "truncated safetensors",
            "info --checkpoint checkpoints/bad",
            "sha256",
            |d| {
                let p = bad_copy(d).join("model.safetensors");
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() / 2]).unwrap();
            },
        ),
        with(
            "corrupt safetensors (hash updated)",
            "info --checkpoint checkpoints/bad",
            "not a valid safetensors",
            |d| {
                replace_consistently(&bad_copy(d), "model.safetensors", b"garbage, not tensors");
            },
        ),
        // The same through generate, which maps the weights and hashes them beside
        // the loading (src/mapped.rs): refused before any text, in every precision.
        with(
            "truncated safetensors, mapped by generate",
            "generate --checkpoint checkpoints/bad --prompt Now --device cpu",
            "truncated or was changed",
            |d| {
                let p = bad_copy(d).join("model.safetensors");
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() - 4]).unwrap();
            },
        ),
        with(
            "one changed weight, same size, mapped by generate in int8",
            "generate --checkpoint checkpoints/bad --prompt Now --dtype int8",
            "truncated or was changed",
            |d| {
                let p = bad_copy(d).join("model.safetensors");
                let mut b = std::fs::read(&p).unwrap();
                let last = b.len() - 1;
                b[last] ^= 0x40;
                std::fs::write(&p, &b).unwrap();
            },
        ),
        with(
            "a weight changed after a good run was noted in .verified",
            "generate --checkpoint checkpoints/bad --prompt Now --dtype bf16",
            "truncated or was changed",
            |d| {
                let bad = bad_copy(d);
                let ok = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
                    .args(["generate", "--checkpoint"])
                    .arg(&bad)
                    .args(["--prompt", "Now", "--max-new-tokens", "1"])
                    .output()
                    .unwrap();
                assert!(ok.status.success(), "the good copy decodes");
                assert!(bad.join(".verified").is_file(), "a passed check is noted");
                let p = bad.join("model.safetensors");
                let mut b = std::fs::read(&p).unwrap();
                let middle = b.len() / 2;
                b[middle] ^= 0x01;
                std::fs::write(&p, &b).unwrap();
            },
        ),
        with(
            "corrupt safetensors (hash updated), mapped by generate",
            "generate --checkpoint checkpoints/bad --prompt Now",
            "not a valid safetensors",
            |d| {
                replace_consistently(&bad_copy(d), "model.safetensors", b"garbage, not tensors");
            },
        ),
        with(
            "weights of the wrong shape",
            "info --checkpoint checkpoints/bad",
            "shape",
            |d| {
                let bad = bad_copy(d);
                let config = std::fs::read_to_string(bad.join("config.toml")).unwrap();
                replace_consistently(
                    &bad,
                    "config.toml",
                    config.replace("n_embd = 16", "n_embd = 32").as_bytes(),
                );
            },
        ),
        with(
            "tokenizer of another model",
            "info --checkpoint checkpoints/bad",
            "tokenizer",
            |d| {
                let bad = bad_copy(d);
                let big = tinygpt::tokenizer::Tokenizer::train_char(
                    &"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789".repeat(2),
                )
                .unwrap();
                replace_consistently(&bad, "tokenizer.json", big.to_json().unwrap().as_bytes());
            },
        ),
        with(
            "config.toml edited after saving",
            "info --checkpoint checkpoints/bad",
            "config.toml",
            |d| {
                let p = bad_copy(d).join("config.toml");
                let mut s = std::fs::read_to_string(&p).unwrap();
                s.push('\n');
                std::fs::write(p, s).unwrap();
            },
        ),
        with(
            "state.json corrupt",
            "info --checkpoint checkpoints/bad",
            "state.json",
            |d| {
                std::fs::write(bad_copy(d).join("state.json"), "{\"step\": ").unwrap();
            },
        ),
        with(
            "resume from a damaged checkpoint",
            "train --config exp.toml --set run.name=bad --resume --set train.max_iters=6",
            "sha256",
            |d| {
                let p = bad_copy(d).join("optimizer.safetensors");
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..10]).unwrap();
            },
        ),
        with("generate from a damaged checkpoint", gb, "sha256", |d| {
            let p = bad_copy(d).join("model.safetensors");
            std::fs::write(&p, b"x").unwrap();
        }),
        // Generation.
        case(
            "prompt with a character the vocabulary lacks",
            &format!("{g} --prompt Zebra"),
            "'Z'",
        ),
        case(
            "prompt longer than the context",
            &format!("{g} --prompt-file long-prompt.txt"),
            "pass --crop to keep its last 16 tokens",
        ),
        case(
            "prompt file missing",
            &format!("{g} --prompt-file nope.txt"),
            "nope.txt",
        ),
        case(
            "top-p above 1",
            &format!("{g} --prompt Now --top-p 1.5"),
            "--top-p",
        ),
        case(
            "top-p of 0",
            &format!("{g} --prompt Now --top-p 0"),
            "--top-p",
        ),
        case(
            "negative temperature",
            &format!("{g} --prompt Now --temperature -1"),
            "--temperature",
        ),
        case(
            "repetition penalty of 0",
            &format!("{g} --prompt Now --repetition-penalty 0"),
            "--repetition-penalty",
        ),
        case(
            "zero samples",
            &format!("{g} --prompt Now --num-samples 0"),
            "--num-samples",
        ),
        case(
            "unknown decoding precision",
            &format!("{g} --prompt Now --dtype f16"),
            "invalid value 'f16' for '--dtype <DTYPE>'; possible values: f32, bf16, int8, int4",
        ),
        case(
            "unknown precision of the keys and values",
            &format!("{g} --prompt Now --kv-dtype f16"),
            "invalid value 'f16' for '--kv-dtype <KV_DTYPE>'; possible values: f32, bf16, int8",
        ),
        case(
            "keys and values set where candle decodes",
            &format!("{g} --prompt Now --reference --kv-dtype bf16"),
            "--kv-dtype sets the fused CPU decoder's keys and values",
        ),
        case(
            "attention layer out of range",
            "attention --checkpoint checkpoints/good --prompt Now --layer 9",
            "--layer 9",
        ),
        case(
            "plot of a folder without metrics",
            "plot --checkpoint notxt",
            "metrics.jsonl",
        ),
        // Sweeps and comparisons.
        case(
            "sweep grid without values",
            "sweep --config exp.toml --grid model.n_layer",
            "section.key=value1,value2",
        ),
        case(
            "sweep grid of a wrong type",
            "sweep --config exp.toml --grid model.n_layer=1,two",
            "model.n_layer",
        ),
        case(
            "sweep grid of an unknown key",
            "sweep --config exp.toml --grid model.n_lyer=1,2",
            "--grid model.n_lyer=1,2",
        ),
        case(
            "cache prune with an age in no unit",
            "cache prune --older-than soon",
            "--older-than \"soon\"",
        ),
        case(
            "compare of a folder without runs",
            "compare notxt",
            "neither a run folder",
        ),
        case(
            "compare of a glob matching nothing",
            "compare nope-*",
            "matches no run folder",
        ),
        // Evaluation.
        case(
            "eval text missing",
            "eval --checkpoint checkpoints/good --text nope.txt",
            "nope.txt",
        ),
        case(
            "eval text of one token",
            "eval --checkpoint checkpoints/good --text one.txt",
            "at least 2",
        ),
        case(
            "eval text not UTF-8",
            "eval --checkpoint checkpoints/good --text latin1.txt",
            "UTF-8",
        ),
        // Devices.
        case(
            "unknown device",
            &format!("{t} --device tpu"),
            "unknown device",
        ),
        case(
            "bad CUDA ordinal",
            &format!("{t} --device cuda:x"),
            "ordinal",
        ),
        case(
            "CUDA in a CPU-only build (the README's install line)",
            &format!("{t} --device cuda"),
            "cargo install --path . --features cuda",
        ),
        case(
            "Metal in a CPU-only build",
            "info --checkpoint checkpoints/good --device metal",
            "--features metal",
        ),
        // Issue 41: what passed silently, or was answered with the wrong fix.
        case(
            "resume of a run already at train.max_iters",
            "train --config exp.toml --resume",
            "finished at step 3 (train.max_iters = 3); to train on, raise it: --set train.max_iters=6",
        ),
        case(
            "resume of a run past train.max_iters",
            "train --config exp.toml --resume --set train.max_iters=2",
            "--set train.max_iters=6",
        ),
        case(
            "serve --runs given a run folder",
            "serve --checkpoint checkpoints/good --runs checkpoints/good --port 0",
            "pass the folder that holds run folders: --runs checkpoints",
        ),
        with(
            "export into a folder of the user's files",
            "export --checkpoint checkpoints/good --out mine",
            "--out mine holds files that are not an earlier export (config.json)",
            |d| {
                std::fs::create_dir_all(d.join("mine")).unwrap();
                std::fs::write(d.join("mine/config.json"), "{\"mine\": true}").unwrap();
            },
        ),
        case(
            "bench of a checkpoint on a GPU",
            "bench --checkpoint checkpoints/good --device cuda",
            "--device cuda: bench --checkpoint measures the CPU decoder",
        ),
        case(
            "bench decoding no tokens",
            "bench --checkpoint checkpoints/good --decode-tokens 0",
            "--decode-tokens 0: pass at least 1",
        ),
        with(
            "import into a folder below a file",
            "import --from exp.toml --out notes.txt/model",
            "--out notes.txt/model: notes.txt is a file, not a folder; pick another place",
            |d| std::fs::write(d.join("notes.txt"), "mine").unwrap(),
        ),
        case(
            "an experiment file passed as the run folder",
            "generate --checkpoint exp.toml --prompt Now",
            "pass the run folder it trains: checkpoints/good",
        ),
        case(
            "a mistyped run folder to compare",
            "compare checkpoints/good checkpoints/nosuch",
            "run folder checkpoints/nosuch does not exist; check the path",
        ),
        case(
            "a mistyped run folder to plot",
            "plot --checkpoint checkpoints/nosuch",
            "run folder checkpoints/nosuch does not exist; check the path",
        ),
        case(
            "a file that is no checkpoint's passed as the run folder",
            "info --checkpoint corpus.txt",
            "is a file, not a run folder",
        ),
        with(
            "an exported Hugging Face folder passed as the run folder",
            "generate --checkpoint hf/good --prompt Now",
            "import it first: tinygpt import --from hf/good --out checkpoints/good",
            |d| {
                if !d.join("hf/good").exists() {
                    let out = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
                        .args(["export", "--checkpoint", CK, "--out", "hf/good"])
                        .current_dir(d)
                        .output()
                        .unwrap();
                    assert!(out.status.success(), "the export for the case");
                }
            },
        ),
        case(
            "a file of a Hugging Face folder passed to serve",
            "serve --checkpoint hf/good/model.safetensors --port 0",
            "not a run folder; import it first",
        ),
        case(
            "a checkpoint file passed to serve",
            "serve --checkpoint checkpoints/good/model.safetensors --port 0",
            "pass the run folder that holds it: checkpoints/good",
        ),
        case(
            "a negative collective timeout",
            &format!("{t} --collective-timeout=-1"),
            "\"-1\" is not a number of seconds (0 or more, e.g. 1800 or 2.5)",
        ),
        case(
            "several values given to --set",
            &format!("{t} --set train.lr=3e-4,1e-3"),
            "use `tinygpt sweep --grid train.lr=3e-4,1e-3`",
        ),
        case(
            "a negative count",
            &format!("{g} --prompt Now --max-new-tokens -5"),
            "--max-new-tokens -5: a negative number is not taken here (`tinygpt generate --help` says what --max-new-tokens takes)",
        ),
        case(
            "a mistyped flag",
            &format!("{g} --prompt Now --tempreature 1"),
            "a similar argument exists: '--temperature'",
        ),
        case(
            "a mistyped subcommand",
            "genrate --checkpoint checkpoints/good",
            "a similar subcommand exists: 'generate'",
        ),
        case(
            "a required flag left out",
            "train",
            "--config <CONFIG>; `tinygpt train --help`",
        ),
    ];
    assert!(cases.len() >= 40, "{} cases", cases.len());

    for c in &cases {
        if (c.needle.contains("--features cuda") && cfg!(feature = "cuda"))
            || (c.needle.contains("features metal") && cfg!(feature = "metal"))
        {
            continue;
        }
        if let Some(setup) = c.setup {
            setup(d);
        }
        let before = snapshot(d);
        let out = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
            .args(&c.args)
            .current_dir(d)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let what = c.what;
        assert_eq!(
            out.status.code(),
            Some(2),
            "{what}: exit code; stderr: {err}"
        );
        assert!(err.starts_with("error: "), "{what}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{what}: one line, got: {err}"
        );
        assert!(
            err.contains(c.needle),
            "{what}: expected {:?} in: {err}",
            c.needle
        );
        assert!(
            !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
            "{what}: {err}"
        );
        assert!(
            out.stdout.is_empty(),
            "{what}: printed before its error: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let after = snapshot(d);
        let added: Vec<&PathBuf> = after.keys().filter(|p| !before.contains_key(*p)).collect();
        // Nothing new either, but for a corpus found too short once tokenized: its
        // cache (tokenizer and ids) is what any run on it makes, and is kept; and the
        // note that a checkpoint's hashes were checked (.verified), which they were.
        let added: Vec<&&PathBuf> = added
            .iter()
            .filter(|p| !(what == "corpus shorter than a block" && p.starts_with(d.join("cache"))))
            .filter(|p| !p.ends_with(".verified"))
            .collect();
        assert!(added.is_empty(), "{what}: wrote {added:?}");
        for (path, hash) in &before {
            assert_eq!(
                after.get(path),
                Some(hash),
                "{what}: {} was changed or removed",
                path.display()
            );
        }
        let _ = std::fs::remove_file(d.join(CK).join("train.lock"));
    }
}

/// exp.toml in `dir`: a model of one small layer on `corpus`, its [tokenizer] the
/// `tokenizer` lines, two steps: the least a run of the real binary needs.
#[cfg(target_os = "linux")]
fn tiny_experiment(dir: &Path, corpus: &str, tokenizer: &str) {
    let config = format!(
        "[data]\ncorpus = \"{corpus}\"\n[tokenizer]\n{tokenizer}\n[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n[train]\nbatch_size = 2\nmax_iters = 2\neval_iters = 1\n"
    );
    std::fs::write(dir.join("exp.toml"), config).unwrap();
}

/// `program` (the binary, or a launcher of it) training exp.toml in `dir`, asserted to
/// succeed.
#[cfg(target_os = "linux")]
fn train_tiny(mut program: Command, dir: &Path) {
    let out = program
        .args(["train", "--config", "exp.toml"])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One line, exit 2, no panic: what every refusal below must be.
#[cfg(unix)]
fn refused_in_one_line(out: &std::process::Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
}

/// An argument of bytes that are not UTF-8 (a latin-1 file name typed in a latin-1
/// terminal) is named, not a panic of `std::env::args`.
#[cfg(unix)]
#[test]
fn an_argument_that_is_not_utf8_is_named() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let set = std::ffi::OsStr::from_bytes(b"data.corpus=caf\xe9.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(["train", "--config", "none.toml", "--set"])
        .arg(set)
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused_in_one_line(&out, r#"argument "data.corpus=caf\xE9.txt" is not UTF-8"#);
    let out = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(["generate", "--checkpoint", "none", "--prompt"])
        .arg(std::ffi::OsStr::from_bytes(b"\xe9"))
        .current_dir(dir.path())
        .output()
        .unwrap();
    refused_in_one_line(&out, "is not UTF-8 text");
}

/// A corpus folder holding a file named in another encoding trains (the cache's record
/// of its files could not be written: "internal error: path contains invalid UTF-8").
#[cfg(target_os = "linux")]
#[test]
fn a_corpus_file_named_in_latin1_trains() {
    use std::os::unix::ffi::OsStrExt;
    let text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("corpus")).unwrap();
    std::fs::write(d.join("corpus/a.txt"), text.repeat(30)).unwrap();
    let latin1 = d
        .join("corpus")
        .join(std::ffi::OsStr::from_bytes(b"caf\xe9.txt"));
    std::fs::write(latin1, text.repeat(30)).unwrap();
    tiny_experiment(d, "corpus", "kind = \"char\"");
    train_tiny(Command::new(env!("CARGO_BIN_EXE_tinygpt")), d);
}

/// A cache folder that exists and cannot be written (a shared dataset's cache/ made by
/// another user) is refused before the tokenizer is trained, naming data.cache_dir (it
/// was "internal error: ... Permission denied", exit 1, after the training). Root
/// writes anywhere: as root the binary runs as `nobody` through runuser.
#[cfg(target_os = "linux")]
#[test]
fn a_cache_folder_that_cannot_be_written_is_refused_before_the_work() {
    use std::os::unix::fs::PermissionsExt;
    let root = unsafe { libc::geteuid() } == 0;
    let runuser = ["/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    if root && runuser.is_none() {
        eprintln!("SKIPPED: running as root without runuser, so no folder is unwritable");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n";
    std::fs::write(d.join("corpus.txt"), text.repeat(40)).unwrap();
    std::fs::create_dir(d.join("cache")).unwrap();
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    mode(d, 0o777);
    mode(&d.join("cache"), 0o555);
    tiny_experiment(d, "corpus.txt", "kind = \"bpe\"\nvocab_size = 280");
    let mut cmd = match (root, runuser) {
        (true, Some(runuser)) => {
            let mut cmd = Command::new(runuser);
            cmd.args(["-u", "nobody", "--", env!("CARGO_BIN_EXE_tinygpt")]);
            cmd
        }
        _ => Command::new(env!("CARGO_BIN_EXE_tinygpt")),
    };
    let out = cmd
        .args(["train", "--config", "exp.toml"])
        .current_dir(d)
        .output()
        .unwrap();
    refused_in_one_line(&out, "data.cache_dir cache/corpus-");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot create a folder in cache (Permission denied"),
        "{err}"
    );
    mode(&d.join("cache"), 0o755);
}

/// Standard output on a full disk (`generate > file` there): one line saying so, exit 2
/// (its hint was about training's run.out_dir).
#[cfg(target_os = "linux")]
#[test]
fn standard_output_on_a_full_disk_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n";
    std::fs::write(dir.path().join("corpus.txt"), text.repeat(40)).unwrap();
    tiny_experiment(dir.path(), "corpus.txt", "kind = \"char\"");
    train_tiny(Command::new(env!("CARGO_BIN_EXE_tinygpt")), dir.path());
    let full = std::fs::File::create("/dev/full").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args([
            "generate",
            "--checkpoint",
            "checkpoints/exp",
            "--max-new-tokens",
            "5",
        ])
        .current_dir(dir.path())
        .stdout(full)
        .output()
        .unwrap();
    refused_in_one_line(
        &out,
        "the disk standard output goes to is full: free space there or send the output elsewhere",
    );
}
