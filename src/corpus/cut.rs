//! Where a long text can be cut into chunks that encode to the same ids as the whole.
//!
//! Byte-level BPE never merges across the words of GPT-2's pre-tokenizer pattern, so a
//! cut where that pattern ends a word anyway changes nothing. Two such places are common
//! in any text and can be recognised from their neighbours alone:
//! - after a newline that ends a line of text and starts one: `x\n|y` (the pattern
//!   makes the lone newline a word, at the end of a text or not);
//! - before a single space between two words: `x| y` (the space begins the next word).
//!
//! Here `x` and `y` are characters that are not whitespace. A run of whitespace is
//! never cut: the pattern gives its last space to the following word, so where such a
//! run is split matters. Char-level vocabularies can be cut anywhere.

/// A piece of text grows this long, at most, looking for a safe place to cut; past it,
/// it is cut where the bound falls (see [`hard_cut`]). Encoding holds some 16 bytes per
/// byte of a word: a 300 MB line with no space in it was once one piece, and no
/// machine's memory. A cut inside a word changes a token or two at the cut.
pub const MAX_PIECE_BYTES: usize = 4 << 20;

/// The last safe cut in `text[..limit]` (`0 < cut <= limit`), if there is one.
pub fn last_safe_cut(text: &str, limit: usize) -> Option<usize> {
    let limit = limit.min(text.len());
    (1..limit).rev().find(|&p| is_safe(text, p))
}

/// The first safe cut after `from` and before `to`, if there is one.
fn next_safe_cut(text: &str, from: usize, to: usize) -> Option<usize> {
    (from.max(1)..text.len().min(to)).find(|&p| is_safe(text, p))
}

/// Where to cut a text held whole in memory into a first piece of about `limit` bytes:
/// the last safe cut before it, else the first after it within [`MAX_PIECE_BYTES`]
/// (or `limit`, if larger), else where that bound falls.
pub fn cut_near(text: &str, limit: usize) -> usize {
    let bound = limit.max(MAX_PIECE_BYTES);
    last_safe_cut(text, limit)
        .or_else(|| next_safe_cut(text, limit, bound))
        .unwrap_or_else(|| hard_cut(text, bound))
}

/// `limit` moved back to a character boundary (but past the first character): the
/// cut of last resort, for a text with no safe place in far more than a chunk.
pub fn hard_cut(text: &str, limit: usize) -> usize {
    let mut cut = limit.min(text.len());
    while cut > 0 && !text.is_char_boundary(cut) {
        cut -= 1;
    }
    if cut == 0 {
        cut = text.chars().next().map_or(0, char::len_utf8);
    }
    cut
}

/// Whether cutting `text` before byte `p` is safe (see the module's comment).
fn is_safe(text: &str, p: usize) -> bool {
    let bytes = text.as_bytes();
    match bytes[p - 1] {
        b'\n' => p >= 2 && is_word_char(text, p) && is_word_char_before(text, p - 1),
        _ if bytes[p] == b' ' => {
            is_word_char_before(text, p) && p + 1 < text.len() && is_word_char(text, p + 1)
        }
        _ => false,
    }
}

/// Whether the character starting at byte `p` is not whitespace.
fn is_word_char(text: &str, p: usize) -> bool {
    text.is_char_boundary(p) && text[p..].chars().next().is_some_and(|c| !c.is_whitespace())
}

/// Whether the character ending at byte `p` is not whitespace.
fn is_word_char_before(text: &str, p: usize) -> bool {
    text.is_char_boundary(p)
        && text[..p]
            .chars()
            .next_back()
            .is_some_and(|c| !c.is_whitespace())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_only_between_words() {
        assert_eq!(last_safe_cut("ab\ncd", 5), Some(3));
        assert_eq!(last_safe_cut("ab cd", 5), Some(2));
        // Whitespace runs are not cut: "a  b" has no safe place, nor has "a \nb".
        assert_eq!(last_safe_cut("a  b", 4), None);
        assert_eq!(last_safe_cut("a \nb", 4), None);
        assert_eq!(last_safe_cut("a\n\nb", 4), None);
        // The last one at or before the limit, or the first after it.
        assert_eq!(last_safe_cut("one two three", 9), Some(7));
        assert_eq!(last_safe_cut("one two three", 7), Some(3));
        assert_eq!(last_safe_cut("one two three", 3), None);
        assert_eq!(cut_near("one two three", 2), 3);
        assert_eq!(cut_near("onetwothree", 2), 11);
        // No safe place within the bound: cut where it falls, at a character boundary.
        let word = "é".repeat(MAX_PIECE_BYTES);
        assert_eq!(cut_near(&word, 10), MAX_PIECE_BYTES);
        let spaced = format!("{} two", "é".repeat(MAX_PIECE_BYTES));
        assert_eq!(
            cut_near(&spaced, 10),
            MAX_PIECE_BYTES,
            "the space is past the bound"
        );
        let near = format!("{} two", "é".repeat(1000));
        assert_eq!(cut_near(&near, 10), 2000);
        // Multi-byte neighbours.
        assert_eq!(last_safe_cut("é\nü", 5), Some(3));
    }

    #[test]
    fn a_hard_cut_is_at_a_character_boundary() {
        assert_eq!(hard_cut("ééé", 3), 2);
        assert_eq!(hard_cut("ééé", 1), 2);
        assert_eq!(hard_cut("abc", 10), 3);
    }
}
