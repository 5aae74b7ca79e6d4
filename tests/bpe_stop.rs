//! A stop during BPE's merges ends them, in the library as on the command line: the
//! call returns `Stopped` at once and no thread of ours runs on. (Alone in its test
//! binary: the threads of the process are counted, from Linux's /proc.)
#![cfg(target_os = "linux")]

use indicatif::ProgressBar;
use tinygpt::corpus::Corpus;
use tinygpt::util::{Stop, Stopped};

mod common;
use common::random_words;

/// A stop during BPE's merges ends them: the call returns Stopped at once, and leaves
/// no thread behind (the last trainer left tokenizers' merge loop running to its end).
#[test]
fn a_stop_during_bpe_merges_leaves_no_thread_running() {
    use tinygpt::config::{TokenizerConfig, TokenizerKind};
    use tinygpt::corpus::train::train_tokenizer;
    let threads = || std::fs::read_dir("/proc/self/task").unwrap().count();
    let dir = tempfile::tempdir().unwrap();
    // Words of random letters: pairs enough for many thousands of merges.
    let text = random_words(5, 400_000, 26);
    std::fs::write(dir.path().join("corpus.txt"), text).unwrap();
    let corpus = Corpus::open(&dir.path().join("corpus.txt"), "text").unwrap();
    let config = TokenizerConfig {
        kind: TokenizerKind::Bpe,
        vocab_size: 60_000,
        ..TokenizerConfig::default()
    };
    let bar = ProgressBar::hidden();
    let stop = Stop::new();
    // The pool every call shares is there before we count.
    rayon::scope(|_| {});
    let before = threads();
    let trained = std::thread::scope(|s| {
        let worker = s.spawn(|| train_tokenizer(&corpus, &config, &bar, &stop));
        let start = std::time::Instant::now();
        while !(bar.message().starts_with("merging") && bar.position() > 400) {
            assert!(
                !worker.is_finished(),
                "finished before its merges could be stopped"
            );
            assert!(start.elapsed().as_secs() < 120, "the merges never began");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let asked = std::time::Instant::now();
        stop.request(2);
        let result = worker.join().unwrap();
        (result, asked.elapsed())
    });
    let (result, took) = trained;
    let err = result.err().expect("stopped");
    assert!(err.downcast_ref::<Stopped>().is_some(), "{err:#}");
    assert!(took.as_millis() < 1000, "stopped after {took:?}");
    assert!(bar.position() < 60_000, "the merges did not run on");
    assert_eq!(threads(), before, "no thread left behind");
}
