//! Corpora of any size and format: the streamed, chunked, parallel encoding gives the ids
//! of encoding each document whole; every format gives the ids its documents should;
//! the cache is reused and rebuilt when it should be.

use std::path::Path;

use indicatif::ProgressBar;
use tinygpt::config::FingerprintKind;
use tinygpt::corpus::cache::CorpusCache;
use tinygpt::corpus::encode::encode_in_chunks;
use tinygpt::corpus::{token_files, Corpus};
use tinygpt::tokenizer::Tokenizer;
use tinygpt::util::Stop;

mod common;
use common::random_words;

/// Documents with everything that could go wrong at a cut: runs of spaces and newlines,
/// tabs, non-ASCII letters and spaces, digits, contractions, emoji, the end-of-text
/// text inside a document, long lines, and an empty document.
fn documents() -> Vec<String> {
    let mut docs = Vec::new();
    for i in 0..40 {
        let mut doc = String::new();
        for j in 0..(i % 7 + 1) * 20 {
            match (i + j) % 9 {
                0 => doc.push_str("Now is the winter of our discontent\n"),
                1 => doc.push_str("Made glorious summer  by this sun of York;\n\n"),
                2 => doc.push_str("  indented\tline\t\twith tabs \n"),
                3 => {
                    doc.push_str("Ünïcödé wörds — “quotes” naïve café 日本語の文章。\u{3000}全角 ")
                }
                4 => doc.push_str("we've 3.14 apples; don't panic 'S 12345 🎉🎉 "),
                5 => doc.push_str("a<|endoftext|>b "),
                6 => doc.push_str(&"word ".repeat(60)),
                7 => doc.push_str("trailing spaces   \n \nand one \nor \ttwo\t\nthen\n\n\nthree\n"),
                _ => doc.push_str(&format!("line {i}-{j}\r\n")),
            }
        }
        docs.push(doc);
    }
    docs.insert(5, String::new());
    docs
}

/// Encodes each document whole with `tokenizers` itself, joined by end-of-text: what the
/// streamed path must equal.
fn one_shot(docs: &[String], tk: &Tokenizer) -> Vec<u32> {
    let eot = tk.end_of_text().expect("BPE has end-of-text");
    let mut ids = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        if i > 0 {
            ids.push(eot);
        }
        ids.extend(tk.encode_with_tokenizers(doc).unwrap());
    }
    ids
}

/// `assert_eq!` for long id lists: reports where they part, not the lists.
#[track_caller]
fn assert_same(got: &[u32], want: &[u32], what: &str) {
    if let Some(i) = (0..got.len().min(want.len())).find(|&i| got[i] != want[i]) {
        let (a, b) = (i.saturating_sub(3), (i + 4).min(got.len()).min(want.len()));
        panic!(
            "{what}: ids differ at {i}: {:?} vs {:?}",
            &got[a..b],
            &want[a..b]
        );
    }
    assert_eq!(got.len(), want.len(), "{what}: lengths");
}

fn streamed(corpus: &Corpus, tk: &Tokenizer, chunk_bytes: usize) -> Vec<u32> {
    let mut ids = Vec::new();
    encode_in_chunks(
        corpus,
        tk,
        chunk_bytes,
        &ProgressBar::hidden(),
        &Stop::new(),
        |chunk, _| {
            ids.extend_from_slice(chunk);
            Ok(())
        },
    )
    .unwrap();
    ids
}

fn write_text_folder(dir: &Path, docs: &[String]) {
    std::fs::create_dir_all(dir).unwrap();
    for (i, doc) in docs.iter().enumerate() {
        std::fs::write(dir.join(format!("{i:03}.txt")), doc).unwrap();
    }
}

/// BPE trained line by line: each line's end is the end of a text, so words that
/// only a wrong cut would make (" \n", "  \n") are learned as merges, and a wrong cut
/// changes the ids.
fn bpe_for(docs: &[String]) -> Tokenizer {
    let lines = docs.iter().flat_map(|d| d.split_inclusive('\n'));
    Tokenizer::train_bpe_on(lines, 600).unwrap()
}

#[test]
fn chunked_encoding_equals_encoding_each_document_whole() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents();
    write_text_folder(&dir.path().join("docs"), &docs);
    let tk = bpe_for(&docs);
    let corpus = Corpus::open(&dir.path().join("docs"), "text").unwrap();
    let expected = one_shot(&docs, &tk);
    // Chunks far smaller than a document force cuts everywhere; the default size none.
    for chunk_bytes in [1, 64, 1000, 1 << 20] {
        assert_same(
            &streamed(&corpus, &tk, chunk_bytes),
            &expected,
            &format!("chunks of {chunk_bytes} bytes"),
        );
    }
}

#[test]
fn parallel_encoding_equals_serial() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents();
    write_text_folder(&dir.path().join("docs"), &docs);
    let tk = bpe_for(&docs);
    let corpus = Corpus::open(&dir.path().join("docs"), "text").unwrap();
    let run = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| streamed(&corpus, &tk, 200))
    };
    let serial = run(1);
    assert_same(&run(4), &serial, "4 threads");
    assert_same(&run(3), &serial, "3 threads");
}

#[test]
fn documents_are_separated_only_at_their_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    // Documents without the end-of-text text in them, cut into many chunks each.
    let docs: Vec<String> = documents()
        .into_iter()
        .map(|d| d.replace("<|endoftext|>", "|"))
        .collect();
    write_text_folder(&dir.path().join("docs"), &docs);
    let tk = bpe_for(&docs);
    let corpus = Corpus::open(&dir.path().join("docs"), "text").unwrap();
    let ids = streamed(&corpus, &tk, 100);
    let eot = tk.end_of_text().unwrap();
    let pieces: Vec<&[u32]> = ids.split(|&id| id == eot).collect();
    assert_eq!(pieces.len(), docs.len());
    for (piece, doc) in pieces.iter().zip(&docs) {
        assert_eq!(&tk.decode(piece).unwrap(), doc);
    }
}

#[test]
fn jsonl_gives_its_documents() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents();
    let mut jsonl = String::new();
    for (i, doc) in docs.iter().enumerate() {
        jsonl.push_str(&serde_json::json!({"id": i, "content": doc, "meta": {"x": 1}}).to_string());
        jsonl.push('\n');
        if i == 3 {
            // Blank lines are skipped, and records without text (as parquet's nulls):
            // a null, or the field left out (as writers leave out a null) once
            // records before have had it.
            jsonl.push('\n');
            jsonl.push_str("{\"id\": 99, \"content\": null}\n");
            jsonl.push_str("{\"id\": 100}\n");
        }
    }
    let path = dir.path().join("docs.jsonl");
    std::fs::write(&path, &jsonl).unwrap();
    let tk = bpe_for(&docs);
    let corpus = Corpus::open(&path, "content").unwrap();
    assert_same(&streamed(&corpus, &tk, 300), &one_shot(&docs, &tk), "jsonl");

    // The text one level down, named with a dot as parquet names a nested column.
    let nested: String = docs
        .iter()
        .map(|doc| format!("{}\n", serde_json::json!({"data": {"text": doc}})))
        .collect();
    std::fs::write(&path, nested).unwrap();
    let corpus = Corpus::open(&path, "data.text").unwrap();
    assert_same(
        &streamed(&corpus, &tk, 300),
        &one_shot(&docs, &tk),
        "nested",
    );
}

#[test]
fn parquet_from_pyarrow_gives_its_rows() {
    // tests/data/make_parquet.py wrote these: snappy with dictionary pages, zstd with
    // data pages v2, two rows per row group.
    let docs: Vec<String> = [
        "Once upon a time, there was a fox.\nThe end.",
        "A second story: über naïve café ☕.",
        "",
        "Third\n\nparagraphs  with  spaces ",
        "Last one<|endoftext|>inside",
    ]
    .map(String::from)
    .to_vec();
    let tk = bpe_for(&documents());
    for name in ["stories.parquet", "stories-zstd.parquet"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name);
        let corpus = Corpus::open(&path, "text").unwrap();
        assert_same(
            &streamed(&corpus, &tk, 1 << 20),
            &one_shot(&docs, &tk),
            name,
        );
        let err = Corpus::open(&path, "body")
            .and_then(|c| c.chunks().collect::<anyhow::Result<Vec<_>>>())
            .expect_err("no such column");
        assert!(format!("{err}").contains("it has: id, text, url"), "{err}");
    }
}

fn u16_bytes(ids: &[u16]) -> Vec<u8> {
    ids.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn llmc_shard(ids: &[u16]) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[20240520, 1, ids.len() as i32]);
    let mut bytes: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
    bytes.extend(u16_bytes(ids));
    bytes
}

/// A byte-order mark before a text file's first character, or a jsonl file's first
/// object, is not text; a .json file is refused, not trained on as text.
#[test]
fn a_byte_order_mark_is_not_text_and_json_is_not_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("a.txt"), "\u{feff}First Citizen:").unwrap();
    std::fs::write(
        d.join("b.jsonl"),
        "\u{feff}{\"text\": \"Before we proceed\"}\n",
    )
    .unwrap();
    let corpus = Corpus::open(d, "text").unwrap();
    let text: String = corpus
        .chunks_of(7)
        .collect::<anyhow::Result<Vec<_>>>()
        .unwrap()
        .into_iter()
        .flatten()
        .map(|piece| piece.text)
        .collect();
    assert_eq!(text, "First Citizen:Before we proceed");
    std::fs::write(d.join("c.json"), "[{\"text\": \"x\"}]").unwrap();
    let err = Corpus::open(&d.join("c.json"), "text").err().unwrap();
    assert!(format!("{err}").contains("rename it"), "{err}");
}

#[test]
fn nanogpt_bins_are_used_as_they_are_with_val_bin_held_out() {
    let dir = tempfile::tempdir().unwrap();
    let train: Vec<u16> = (0..1000).map(|i| (i * 7 % 50257) as u16).collect();
    let val: Vec<u16> = (0..300).map(|i| (i * 13 % 50257) as u16).collect();
    std::fs::write(dir.path().join("train.bin"), u16_bytes(&train)).unwrap();
    std::fs::write(dir.path().join("val.bin"), u16_bytes(&val)).unwrap();
    // nanoGPT's prepare.py leaves the text beside the ids: the ids are the corpus.
    std::fs::write(dir.path().join("input.txt"), "First Citizen:").unwrap();
    let corpus = Corpus::open(dir.path(), "text").unwrap();
    assert!(corpus.is_tokenized());
    // Not read, and named so (training's note).
    assert_eq!(corpus.skipped, [dir.path().join("input.txt")]);
    let (t, v) = token_files::load(&corpus, 50257).unwrap();
    let as_u32 = |ids: &[u16]| ids.iter().map(|&i| i as u32).collect::<Vec<_>>();
    assert_eq!(t.to_vec(), as_u32(&train));
    assert_eq!(v.expect("val.bin is validation").to_vec(), as_u32(&val));
    // An empty val.bin is named, not taken for a corpus too short.
    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("train.bin"), u16_bytes(&train)).unwrap();
    std::fs::write(empty.path().join("val.bin"), b"").unwrap();
    let with_empty_val = Corpus::open(empty.path(), "text").unwrap();
    let err = token_files::load(&with_empty_val, 50257).err().unwrap();
    assert!(
        format!("{err}").contains("(validation) holds no ids"),
        "{err}"
    );
    let err = token_files::load(&corpus, 1000).err().unwrap();
    assert!(
        format!("{err}").contains("outside the vocabulary of 1000"),
        "{err}"
    );
}

/// A raw file of u32 ids (a vocabulary over 65,536, written with `np.uint32`) is read
/// as u32, not as twice as many u16 ids with every second one 0.
#[test]
fn raw_u32_bins_are_read_as_u32() {
    let dir = tempfile::tempdir().unwrap();
    let train: Vec<u32> = (0..2000u32).map(|i| i * 7919 % 100_000).collect();
    let bytes: Vec<u8> = train.iter().flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(dir.path().join("train.bin"), bytes).unwrap();
    let corpus = Corpus::open(dir.path(), "text").unwrap();
    let (t, v) = token_files::load(&corpus, 100_000).unwrap();
    assert_eq!(t.to_vec(), train);
    assert!(v.is_none());
    // Its ids are checked against the vocabulary as u32.
    let err = token_files::load(&corpus, 50_257).err().unwrap();
    assert!(
        format!("{err}").contains("outside the vocabulary of 50257"),
        "{err}"
    );
}

#[test]
fn llmc_shards_are_read_past_their_headers_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let shards: Vec<Vec<u16>> = (0..3)
        .map(|s| (0..500).map(|i| (s * 1000 + i) as u16).collect())
        .collect();
    for (i, shard) in shards.iter().enumerate() {
        let name = format!("fineweb_train_{i:06}.bin");
        std::fs::write(dir.path().join(name), llmc_shard(shard)).unwrap();
    }
    std::fs::write(
        dir.path().join("fineweb_val_000000.bin"),
        llmc_shard(&[7; 400]),
    )
    .unwrap();
    let corpus = Corpus::open(dir.path(), "text").unwrap();
    let (train, val) = token_files::load(&corpus, 50257).unwrap();
    let expected: Vec<u32> = shards.concat().iter().map(|&i| i as u32).collect();
    assert_eq!(train.to_vec(), expected);
    // Windows across shard boundaries read both shards.
    let mut window = vec![0; 10];
    train.copy_range(495, &mut window);
    assert_eq!(
        window,
        [495, 496, 497, 498, 499, 1000, 1001, 1002, 1003, 1004]
    );
    assert_eq!(train.slice(498..1400).to_vec()[..3], [498, 499, 1000]);
    assert_eq!(val.unwrap().to_vec(), vec![7; 400]);
}

#[test]
fn the_cache_is_reused_until_the_corpus_or_tokenizer_changes() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents();
    let path = dir.path().join("corpus.txt");
    std::fs::write(&path, docs.concat()).unwrap();
    let cache_dir = dir.path().join("cache");
    let tk = bpe_for(&docs);

    let corpus = Corpus::open(&path, "text").unwrap();
    let cache = CorpusCache::new(&cache_dir, &corpus, FingerprintKind::Sampled).unwrap();
    // Ids copied out: the maps are dropped before the files are damaged below.
    let first = cache.tokens(&corpus, &tk, &Stop::new()).unwrap().0.to_vec();
    assert_same(
        &first,
        &tk.encode_with_tokenizers(&docs.concat()).unwrap(),
        "cache",
    );
    let bin = std::fs::read_dir(cache.dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "bin"))
        .unwrap();
    let written = std::fs::metadata(&bin).unwrap().modified().unwrap();

    // Same corpus, same tokenizer: mapped, not written again.
    let again = CorpusCache::new(
        &cache_dir,
        &Corpus::open(&path, "text").unwrap(),
        FingerprintKind::Sampled,
    )
    .unwrap();
    assert_eq!(again.dir(), cache.dir());
    assert_eq!(
        again.tokens(&corpus, &tk, &Stop::new()).unwrap().0.to_vec(),
        first
    );
    assert_eq!(
        std::fs::metadata(&bin).unwrap().modified().unwrap(),
        written
    );

    // A header whose ids file was cut short is not trusted: encoded again.
    std::fs::write(&bin, b"\x01\x00").unwrap();
    assert!(bin.with_extension("json").exists());
    assert_eq!(
        cache.tokens(&corpus, &tk, &Stop::new()).unwrap().0.to_vec(),
        first
    );

    // Another tokenizer: its own ids beside the first.
    let char_tk = Tokenizer::train_char(&docs.concat()).unwrap();
    let chars = cache.tokens(&corpus, &char_tk, &Stop::new()).unwrap().0;
    assert_eq!(chars.to_vec(), char_tk.encode(&docs.concat()).unwrap());

    // The corpus rewritten: another folder.
    std::fs::write(&path, docs[..10].concat()).unwrap();
    let changed = Corpus::open(&path, "text").unwrap();
    let cache2 = CorpusCache::new(&cache_dir, &changed, FingerprintKind::Sampled).unwrap();
    assert_ne!(cache2.dir(), cache.dir());
    assert_eq!(
        cache2
            .tokens(&changed, &tk, &Stop::new())
            .unwrap()
            .0
            .to_vec(),
        tk.encode_with_tokenizers(&docs[..10].concat()).unwrap()
    );
}

#[test]
fn tokenizers_train_once_per_corpus_and_settings_on_a_sample() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents();
    let path = dir.path().join("corpus.txt");
    std::fs::write(&path, docs.concat()).unwrap();
    let corpus = Corpus::open(&path, "text").unwrap();
    let cache =
        CorpusCache::new(&dir.path().join("cache"), &corpus, FingerprintKind::Sampled).unwrap();
    let mut config = tinygpt::config::TokenizerConfig {
        vocab_size: 500,
        ..Default::default()
    };
    let whole = cache.tokenizer(&corpus, &config, &Stop::new()).unwrap();
    assert_eq!(whole.vocab_size(), 500);
    // Trained on the whole (smaller than the sample): as training on the text at once.
    let direct = Tokenizer::train_bpe(&docs.concat(), 500).unwrap();
    assert_eq!(whole.to_json().unwrap(), direct.to_json().unwrap());
    // Kept: the same file again.
    assert_eq!(
        cache
            .tokenizer(&corpus, &config, &Stop::new())
            .unwrap()
            .to_json()
            .unwrap(),
        whole.to_json().unwrap()
    );
    config.vocab_size = 400;
    cache.tokenizer(&corpus, &config, &Stop::new()).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(cache.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let tokenizers = files
        .iter()
        .filter(|f| f.starts_with("tokenizer-bpe-"))
        .count();
    assert_eq!(tokenizers, 2, "two tokenizers: {files:?}");
    assert_eq!(
        files.len(),
        4,
        "and corpus.json, and the lock this process holds: {files:?}"
    );
    assert!(files.contains(&"in-use.lock".to_string()), "{files:?}");
}

#[test]
fn bpe_trains_on_a_sample_of_the_configured_size() {
    let dir = tempfile::tempdir().unwrap();
    // 3 MiB: the first half one vocabulary, the second another.
    let first = "alpha beta alphabet betamax\n".repeat(1 << 16);
    let second = "gamma delta gammadelta deltoid\n".repeat(1 << 16);
    let path = dir.path().join("corpus.txt");
    std::fs::write(&path, [first, second].concat()).unwrap();
    let corpus = Corpus::open(&path, "text").unwrap();
    let cache =
        CorpusCache::new(&dir.path().join("cache"), &corpus, FingerprintKind::Sampled).unwrap();
    let config = |train_bytes| tinygpt::config::TokenizerConfig {
        vocab_size: 270,
        train_bytes,
        ..Default::default()
    };
    let whole = cache
        .tokenizer(&corpus, &config(1 << 30), &Stop::new())
        .unwrap();
    // More tokens than the sample's pairs allow is refused, naming the sample's size.
    let refused = cache
        .tokenizer(
            &corpus,
            &tinygpt::config::TokenizerConfig {
                vocab_size: 300,
                ..config(1)
            },
            &Stop::new(),
        )
        .err()
        .expect("refused")
        .to_string();
    assert!(refused.contains("raise tokenizer.train_bytes"), "{refused}");
    // The smallest sample is one chunk (1 MiB), from the start.
    let sampled = cache.tokenizer(&corpus, &config(1), &Stop::new()).unwrap();
    let gamma = "gamma delta gammadelta deltoid\n";
    let (by_whole, by_sample) = (whole.encode(gamma).unwrap(), sampled.encode(gamma).unwrap());
    assert!(
        by_sample.len() > by_whole.len() + 5,
        "the sample saw only the first half: {} vs {} tokens",
        by_sample.len(),
        by_whole.len()
    );
}

#[test]
fn a_failure_midway_leaves_no_cache_behind() {
    let dir = tempfile::tempdir().unwrap();
    let docs = dir.path().join("docs");
    std::fs::create_dir(&docs).unwrap();
    // Good text for more than a wave of chunks (4 per thread), then a broken line.
    let good = (0..10_000)
        .map(|i| serde_json::json!({ "text": format!("{} {i}", "story ".repeat(200)) }).to_string())
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(docs.join("a.jsonl"), good).unwrap();
    std::fs::write(docs.join("b.jsonl"), "{\"text\": \"fine\"}\n{broken\n").unwrap();
    let corpus = Corpus::open(&docs, "text").unwrap();
    let tk = Tokenizer::train_bpe("story 0123456789 fine", 280).unwrap();
    let cache =
        CorpusCache::new(&dir.path().join("cache"), &corpus, FingerprintKind::Sampled).unwrap();
    let err = cache
        .tokens(&corpus, &tk, &Stop::new())
        .err()
        .expect("line 2 is broken");
    assert!(format!("{err:#}").contains("b.jsonl:2"), "{err}");
    // No ids, no header, no temporary file: the folder this encoding made is gone.
    assert!(
        !cache.dir().exists(),
        "left {:?}",
        std::fs::read_dir(cache.dir())
    );
    // A folder that held something before (a tokenizer trained there) keeps it, and
    // nothing of the failed encoding.
    std::fs::create_dir_all(cache.dir()).unwrap();
    std::fs::write(cache.dir().join("tokenizer-kept.json"), "{}").unwrap();
    cache
        .tokens(&corpus, &tk, &Stop::new())
        .err()
        .expect("still broken");
    let mut left: Vec<String> = std::fs::read_dir(cache.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    left.sort();
    // (in-use.lock: this process's hold on the folder, not the encoding's.)
    assert_eq!(left, ["corpus.json", "in-use.lock", "tokenizer-kept.json"]);
}

/// Runs the binary in `dir`; returns stderr, asserting success.
fn tinygpt(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{args:?}: {err}");
    err
}

#[test]
fn training_runs_on_jsonl_and_on_nanogpt_bins_sharing_one_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let docs = documents();
    let jsonl: String = docs
        .iter()
        .map(|doc| serde_json::json!({ "text": doc }).to_string() + "\n")
        .collect();
    std::fs::write(d.join("docs.jsonl"), jsonl).unwrap();
    std::fs::write(
        d.join("exp.toml"),
        "[data]\ncorpus = \"docs.jsonl\"\n[tokenizer]\nvocab_size = 400\n\
         [model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n\
         [train]\nbatch_size = 4\nmax_iters = 2\nwarmup_iters = 1\neval_interval = 2\neval_iters = 1\n",
    )
    .unwrap();
    tinygpt(d, &["train", "--config", "exp.toml", "--set", "run.name=a"]);
    let cache = std::fs::read_dir(d.join("cache"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let ids_file = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "bin"))
        .expect("the ids are cached");
    let written = std::fs::metadata(&ids_file).unwrap().modified().unwrap();
    // A second run on the same corpus reuses tokenizer and ids.
    tinygpt(d, &["train", "--config", "exp.toml", "--set", "run.name=b"]);
    assert_eq!(
        std::fs::metadata(&ids_file).unwrap().modified().unwrap(),
        written
    );
    assert_eq!(
        std::fs::read(d.join("checkpoints/a/tokenizer.json")).unwrap(),
        std::fs::read(d.join("checkpoints/b/tokenizer.json")).unwrap()
    );

    // The same ids written as nanoGPT's train.bin / val.bin train with that tokenizer.
    let tk = Tokenizer::from_file(&d.join("checkpoints/a/tokenizer.json")).unwrap();
    let ids: Vec<u16> = docs
        .iter()
        .flat_map(|doc| tk.encode(doc).unwrap())
        .map(|id| id as u16)
        .collect();
    let (train, val) = ids.split_at(ids.len() * 9 / 10);
    std::fs::create_dir(d.join("owt")).unwrap();
    std::fs::write(d.join("owt/train.bin"), u16_bytes(train)).unwrap();
    std::fs::write(d.join("owt/val.bin"), u16_bytes(val)).unwrap();
    let err = tinygpt(
        d,
        &[
            "train",
            "--config",
            "exp.toml",
            "--set",
            "run.name=c",
            "--set",
            "data.corpus=owt",
            "--set",
            "tokenizer.path=checkpoints/a/tokenizer.json",
            "--set",
            "tokenizer.vocab_size=999",
        ],
    );
    let counts = format!("{} train / {} val tokens", train.len(), val.len());
    assert!(err.contains(&counts), "expected {counts:?} in {err}");
    // The size asked for beside the file is named as unused, and the run's config
    // says the size it used.
    let have = tk.vocab_size();
    let note = format!("tokenizer.vocab_size = 999 is not used: tokenizer.path checkpoints/a/tokenizer.json brings its own {have} tokens");
    assert!(err.contains(&note), "expected {note:?} in {err}");
    let saved = std::fs::read_to_string(d.join("checkpoints/c/config.toml")).unwrap();
    let section = saved.split("[tokenizer]").nth(1).unwrap();
    let section = section.split("\n[").next().unwrap();
    assert!(
        section.contains(&format!("vocab_size = {have}\n")),
        "{saved}"
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("checkpoints/c/state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 2);
}

/// A corpus rewritten with the same size and its old modification time (`cp -p`,
/// `rsync -t`) gets a cache of its own: the sampled fingerprint sees the bytes changed
/// (in every block of the file here, and in a single byte within a sampled block; any
/// byte of a file up to 16 MiB, hashed whole), the full one any byte.
#[test]
fn a_same_size_rewrite_with_the_old_time_is_noticed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corpus.txt");
    let doc = documents().concat();
    let text: String = doc.repeat((17 << 20) / doc.len() + 1);
    assert!(
        text.len() > 16 << 20,
        "large enough to be sampled: {}",
        text.len()
    );
    std::fs::write(&path, &text).unwrap();
    let when = std::fs::metadata(&path).unwrap().modified().unwrap();
    let dir_of = |how| {
        let corpus = Corpus::open(&path, "text").unwrap();
        CorpusCache::new(&dir.path().join("cache"), &corpus, how)
            .unwrap()
            .dir()
            .to_path_buf()
    };
    let rewrite = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        let file = std::fs::File::options().write(true).open(&path).unwrap();
        file.set_modified(when).unwrap();
    };
    let (sampled, full) = (
        dir_of(FingerprintKind::Sampled),
        dir_of(FingerprintKind::Full),
    );
    assert_ne!(sampled, full, "the two kinds never share a folder");
    assert_eq!(
        dir_of(FingerprintKind::Sampled),
        sampled,
        "the same bytes, the same folder"
    );

    // Every character shifted by one: same size, same time.
    let shifted: Vec<u8> = text
        .bytes()
        .map(|b| if b == b'a' { b'b' } else { b })
        .collect();
    rewrite(&shifted);
    assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), when);
    assert_ne!(dir_of(FingerprintKind::Sampled), sampled);
    assert_ne!(dir_of(FingerprintKind::Full), full);

    // One byte, at the start of the last sampled block.
    rewrite(text.as_bytes());
    assert_eq!(dir_of(FingerprintKind::Sampled), sampled);
    let mut one = text.clone().into_bytes();
    let at = one.len() - 4096;
    one[at] = if one[at] == b'x' { b'y' } else { b'x' };
    rewrite(&one);
    assert_ne!(dir_of(FingerprintKind::Sampled), sampled);
    assert_ne!(dir_of(FingerprintKind::Full), full);

    // A smaller file (300 KB), one byte changed between where blocks would be sampled:
    // after the first (0..4096), before the second (at (300,000 - 4096) / 63 = 4696).
    let small = &text.as_bytes()[..300_000];
    rewrite(small);
    let before = dir_of(FingerprintKind::Sampled);
    let mut one = small.to_vec();
    let at = 4096 + 300;
    one[at] = if one[at] == b'x' { b'y' } else { b'x' };
    rewrite(&one);
    assert_ne!(dir_of(FingerprintKind::Sampled), before);
}

/// Our BPE trainer (stoppable) learns what `tokenizers`' BpeTrainer learns from the same
/// texts: the same vocabulary, ids and merges, so the same tokenizer.json.
#[test]
fn bpe_training_learns_what_tokenizers_learns() {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, PreTokenizerWrapper};

    let theirs = |texts: &[String], vocab_size: usize| -> String {
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainerBuilder::new()
                .vocab_size(vocab_size)
                .min_frequency(2)
                .show_progress(false)
                .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
                .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                .build(),
        );
        let mut tk = tokenizers::Tokenizer::new(ModelWrapper::BPE(BPE::default()));
        tk.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, true, true,
        ))));
        tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
        tk.train(&mut trainer, texts.iter()).unwrap();
        tk.to_string(true).unwrap()
    };
    // Shakespeare-like lines, unicode, code-like text, numbers: ties and merges of
    // merges of every kind.
    let mut mixed = documents();
    mixed.push(random_words(11, 3000, 7));
    for vocab_size in [280, 600, 1500] {
        let ours = Tokenizer::train_bpe_on(mixed.iter(), vocab_size).unwrap();
        assert_eq!(
            ours.to_json().unwrap(),
            theirs(&mixed, vocab_size),
            "vocab {vocab_size}"
        );
    }
}
