//! Byte-level BPE training that a stop can interrupt.
//!
//! The algorithm is `tokenizers`' `BpeTrainer` (special tokens first, then the byte
//! alphabet in code point order, then merges, most frequent pair first, ties to the
//! smaller pair of ids), written out here for one reason: its merge loop cannot be
//! stopped, so a Ctrl-C during a long training left a thread merging on after the
//! command or the library call had given up. This one checks `stop` before every merge
//! and every chunk of text. Tested to give the same vocabulary and merges as
//! `tokenizers` on the same texts, whose words are shorter than [`MAX_WORD_BYTES`]
//! (longer ones are counted in pieces here, see there).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet};

use anyhow::Result;
use rayon::prelude::*;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::util::Stop;

/// Pairs merge only when seen at least this often (`tokenizers`' `min_frequency`).
const MIN_FREQUENCY: i64 = 2;

/// Words longer than this many bytes are counted as pieces of it. Text with no spaces
/// or punctuation (a line of DNA, base64, letters run together) is one word to GPT-2's
/// pre-tokenizer, and every merge walks each word it touches: a 2 MB word kept the
/// merges busy for minutes. Only merges longer than this are lost.
const MAX_WORD_BYTES: usize = 256;

/// How each word of the texts occurs, as byte-level symbols.
#[derive(Debug, Default)]
pub struct WordCounts(HashMap<String, u64>);

impl WordCounts {
    /// Adds the words of `texts` (split as GPT-2's byte-level pre-tokenizer splits
    /// them, on every core).
    pub fn add(&mut self, texts: &[String]) -> Result<()> {
        let splitter = ByteLevel::new(false, true, true);
        let counted: Vec<HashMap<String, u64>> = texts
            .par_iter()
            .map(|text| {
                let mut words = PreTokenizedString::from(text.as_str());
                splitter
                    .pre_tokenize(&mut words)
                    .map_err(|e| anyhow::anyhow!("splitting a text into words: {e}"))?;
                let mut counts = HashMap::new();
                for (word, _, _) in words.get_splits(OffsetReferential::Original, OffsetType::Byte)
                {
                    for piece in pieces_of(word, MAX_WORD_BYTES) {
                        *counts.entry(piece.to_string()).or_default() += 1;
                    }
                }
                Ok(counts)
            })
            .collect::<Result<_>>()?;
        for counts in counted {
            for (word, n) in counts {
                *self.0.entry(word).or_default() += n;
            }
        }
        Ok(())
    }
}

/// `word` (byte-level symbols, one char per byte) in pieces of at most `max` symbols.
fn pieces_of(word: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = word;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.char_indices().nth(max).map_or(rest.len(), |(i, _)| i);
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

/// A vocabulary in id order and its merges in the order learned.
pub struct Learned {
    pub tokens: Vec<String>,
    pub merges: Vec<(String, String)>,
}

/// A candidate merge: a pair of ids, how often it occurs, and the words it occurs in
/// (those that changed since it was last queued).
#[derive(Debug)]
struct Candidate {
    pair: (u32, u32),
    count: i64,
    words: HashSet<usize>,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.count == other.count && self.pair == other.pair
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    /// The most frequent first; among equals, the smaller pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.count
            .cmp(&other.count)
            .then_with(|| other.pair.cmp(&self.pair))
    }
}

/// Learns merges over `counts` until the vocabulary holds `vocab_size` tokens (or no
/// pair occurs twice): `special` tokens first, then `alphabet` and every character seen,
/// in code point order. Gives up (`Stopped`) between merges once `stop` asks;
/// `progress` hears how many tokens there are.
pub fn learn(
    counts: &WordCounts,
    vocab_size: usize,
    special: &[&str],
    alphabet: &[char],
    stop: &Stop,
    mut progress: impl FnMut(usize),
) -> Result<Learned> {
    let mut vocab = Vocabulary::default();
    for token in special {
        vocab.add(token.to_string());
    }
    let mut chars: Vec<char> = alphabet.to_vec();
    chars.extend(counts.0.keys().flat_map(|w| w.chars()));
    chars.sort_unstable();
    chars.dedup();
    for c in chars {
        vocab.add(c.to_string());
    }

    // Each word as a list of symbol ids, with how often it occurs.
    let (mut words, word_counts): (Vec<Vec<u32>>, Vec<i64>) = counts
        .0
        .iter()
        .map(|(word, n)| {
            let symbols = word.chars().map(|c| vocab.ids[&c.to_string()]).collect();
            (symbols, *n as i64)
        })
        .unzip();
    let mut pair_counts: HashMap<(u32, u32), i64> = HashMap::new();
    let mut changed: HashMap<(u32, u32), HashSet<usize>> = HashMap::new();
    for (i, word) in words.iter().enumerate() {
        for pair in word.windows(2) {
            let pair = (pair[0], pair[1]);
            *pair_counts.entry(pair).or_default() += word_counts[i];
            changed.entry(pair).or_default().insert(i);
        }
    }
    let mut queue = BinaryHeap::with_capacity(pair_counts.len());
    let queue_changed = |changed: &mut HashMap<(u32, u32), HashSet<usize>>,
                         pair_counts: &HashMap<(u32, u32), i64>,
                         queue: &mut BinaryHeap<Candidate>| {
        for (pair, words) in changed.drain() {
            let count = pair_counts[&pair];
            if count > 0 {
                queue.push(Candidate { pair, count, words });
            }
        }
    };
    queue_changed(&mut changed, &pair_counts, &mut queue);

    let mut merges = Vec::new();
    while vocab.tokens.len() < vocab_size {
        stop.check()?;
        let Some(mut top) = queue.pop() else {
            break;
        };
        // Counts change after a candidate is queued: requeue it with the count it has.
        let now = pair_counts[&top.pair];
        if top.count != now {
            top.count = now;
            queue.push(top);
            continue;
        }
        if top.count < MIN_FREQUENCY {
            break;
        }
        let (a, b) = (vocab.token(top.pair.0), vocab.token(top.pair.1));
        let id = vocab.add(format!("{a}{b}"));
        merges.push((a, b));
        progress(vocab.tokens.len());
        for &w in &top.words {
            for (pair, change) in merge_in(&mut words[w], top.pair, id) {
                *pair_counts.entry(pair).or_default() += change * word_counts[w];
                if change > 0 {
                    changed.entry(pair).or_default().insert(w);
                }
            }
        }
        queue_changed(&mut changed, &pair_counts, &mut queue);
    }
    Ok(Learned {
        tokens: vocab.tokens,
        merges,
    })
}

/// Tokens by id and ids by token, growing.
#[derive(Default)]
struct Vocabulary {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
}

impl Vocabulary {
    /// The id of `token`, added at the end if new.
    fn add(&mut self, token: String) -> u32 {
        if let Some(&id) = self.ids.get(&token) {
            return id;
        }
        self.tokens.push(token.clone());
        let id = (self.tokens.len() - 1) as u32;
        self.ids.insert(token, id);
        id
    }

    fn token(&self, id: u32) -> String {
        self.tokens[id as usize].clone()
    }
}

/// Replaces each occurrence of `pair` in `word`, left to right, by `id`; the pairs that
/// appeared (+1) and disappeared (-1) around each. One pass, whatever the number of
/// occurrences (a word of length L with k of them once cost O(kL)).
fn merge_in(word: &mut Vec<u32>, pair: (u32, u32), id: u32) -> Vec<((u32, u32), i64)> {
    let mut changes = Vec::new();
    // `word[..write]` is merged; `word[read..]` is not looked at yet (write <= read).
    let (mut read, mut write) = (0, 0);
    while read < word.len() {
        if read + 1 < word.len() && (word[read], word[read + 1]) == pair {
            if write > 0 {
                changes.push(((word[write - 1], pair.0), -1));
                changes.push(((word[write - 1], id), 1));
            }
            if read + 2 < word.len() {
                changes.push(((pair.1, word[read + 2]), -1));
                changes.push(((id, word[read + 2]), 1));
            }
            word[write] = id;
            read += 2;
        } else {
            word[write] = word[read];
            read += 1;
        }
        write += 1;
    }
    word.truncate(write);
    changes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_merge_reports_the_pairs_around_it() {
        // "a b a b" with (a, b) -> x: "x x". Left to right: after the first merge
        // (x, a) appears, and goes with the second; (b, a) is gone, (x, x) appears.
        let (a, b, x) = (1, 2, 9);
        let mut word = vec![a, b, a, b];
        let mut changes = merge_in(&mut word, (a, b), x);
        changes.sort();
        assert_eq!(word, [x, x]);
        assert_eq!(
            changes,
            [((b, a), -1), ((x, a), -1), ((x, a), 1), ((x, x), 1)]
        );
    }

    #[test]
    fn a_pair_of_one_symbol_merges_left_to_right() {
        // "a a a a a" with (a, a) -> x: "x x a"; the pairs around each as it goes.
        let (a, x) = (1, 9);
        let mut word = vec![a; 5];
        let mut changes = merge_in(&mut word, (a, a), x);
        assert_eq!(word, [x, x, a]);
        changes.sort();
        assert_eq!(
            changes,
            [
                ((a, a), -1),
                ((a, a), -1),
                ((x, a), -1),
                ((x, a), 1),
                ((x, a), 1),
                ((x, x), 1)
            ]
        );
    }

    /// The merge as `tokenizers` writes it: a removal per occurrence.
    fn merge_by_removal(word: &mut Vec<u32>, pair: (u32, u32), id: u32) -> Vec<((u32, u32), i64)> {
        let mut changes = Vec::new();
        let mut i = 0;
        while i + 1 < word.len() {
            if (word[i], word[i + 1]) != pair {
                i += 1;
                continue;
            }
            if i > 0 {
                changes.push(((word[i - 1], pair.0), -1));
                changes.push(((word[i - 1], id), 1));
            }
            word[i] = id;
            word.remove(i + 1);
            if i + 1 < word.len() {
                changes.push(((pair.1, word[i + 1]), -1));
                changes.push(((id, word[i + 1]), 1));
            }
            i += 1;
        }
        changes
    }

    #[test]
    fn the_one_pass_merge_does_what_removals_did() {
        // Words over a three-symbol alphabet, every pair of it merged.
        let mut state = 12345u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for _ in 0..500 {
            let len = next() % 12;
            let word: Vec<u32> = (0..len).map(|_| next() % 3).collect();
            for pair in [(0, 0), (0, 1), (1, 0), (2, 2)] {
                let (mut ours, mut theirs) = (word.clone(), word.clone());
                let changes = merge_in(&mut ours, pair, 7);
                assert_eq!(
                    changes,
                    merge_by_removal(&mut theirs, pair, 7),
                    "{word:?} {pair:?}"
                );
                assert_eq!(ours, theirs);
            }
        }
    }

    #[test]
    fn a_word_longer_than_the_bound_is_counted_in_pieces() {
        let mut counts = WordCounts::default();
        // 600 letters with no space: one word to the pre-tokenizer.
        counts.add(&["ab".repeat(300)]).unwrap();
        let mut pieces: Vec<(usize, u64)> = counts.0.iter().map(|(w, n)| (w.len(), *n)).collect();
        pieces.sort();
        assert_eq!(pieces, [(88, 1), (MAX_WORD_BYTES, 2)]);
        // Byte-level symbols of two bytes' UTF-8 (é is two symbols) count as symbols.
        let mut counts = WordCounts::default();
        counts.add(&["é".repeat(200)]).unwrap();
        let symbols: Vec<usize> = counts.0.keys().map(|w| w.chars().count()).collect();
        assert_eq!(symbols.iter().sum::<usize>(), 400);
        assert!(symbols.iter().all(|&n| n <= MAX_WORD_BYTES));
    }

    #[test]
    fn the_most_frequent_pair_merges_first_and_ties_go_to_the_smaller_pair() {
        let mut counts = WordCounts::default();
        counts.0.insert("abab".into(), 3);
        counts.0.insert("cd".into(), 6);
        let learned = learn(&counts, 100, &["<s>"], &[], &Stop::new(), |_| {}).unwrap();
        assert_eq!(learned.tokens[..5], ["<s>", "a", "b", "c", "d"]);
        // (a, b): 6, (c, d): 6, (b, a): 3 -> (a, b) first (smaller ids), then (c, d),
        // then "ab" "ab" (3).
        assert_eq!(
            learned.merges,
            [
                ("a".into(), "b".into()),
                ("c".into(), "d".into()),
                ("ab".into(), "ab".into())
            ]
        );
    }

    #[test]
    fn a_stop_ends_the_merges() {
        let mut counts = WordCounts::default();
        counts.0.insert("abcdefgh".into(), 5);
        let stop = Stop::new();
        let mut seen = 0;
        let result = learn(&counts, 100, &[], &[], &stop, |n| {
            seen = n;
            stop.request(2);
        });
        assert!(result.is_err(), "stopped");
        assert_eq!(seen, 9, "one merge, then the stop");
    }
}
