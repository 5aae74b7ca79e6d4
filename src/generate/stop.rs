//! Stop strings: text is shown as it is generated, except what might be the start of a
//! stop string, and the output ends at the first one.

/// Holds back text that might be the start of a stop string, and cuts the output at the
/// first stop string.
pub struct StopFilter {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    stopped: bool,
    /// Bytes of text cut at the stop: the stop string and anything after it.
    cut: usize,
}

impl StopFilter {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            emitted: 0,
            stopped: false,
            cut: 0,
        }
    }

    /// Bytes of generated text cut at the stop string (it and what followed it).
    pub fn cut_bytes(&self) -> usize {
        self.cut
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds decoded text; returns what can be shown now.
    pub fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(piece);
        // A stop string cannot begin in text already shown: its start would have been
        // held back.
        let from = self.emitted;
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match first_stop {
            Some(at) => {
                self.stopped = true;
                self.cut = self.text.len() - at;
                self.text.truncate(at);
                at
            }
            None => self.text.len() - self.held_back(),
        };
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    /// Whatever is still held back, at the end of generation.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    /// The final text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Length of the longest suffix of the unshown text that begins a stop string.
    fn held_back(&self) -> usize {
        let pending = &self.text[self.emitted..];
        let mut longest = 0;
        for stop in &self.stops {
            for (i, _) in pending.char_indices() {
                let tail = &pending[i..];
                if tail.len() > longest && stop.starts_with(tail) {
                    longest = tail.len();
                }
            }
        }
        longest
    }
}

/// Turns `\n`, `\t`, `\\` written on a command line into the characters.
pub fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, String, bool) {
        let mut f = StopFilter::new(stops.iter().map(|s| s.to_string()).collect());
        let mut shown = String::new();
        for p in pieces {
            shown.push_str(&f.push(p));
        }
        shown.push_str(&f.finish());
        (shown, f.text().to_string(), f.stopped())
    }

    #[test]
    fn stop_strings_cut_and_are_never_shown() {
        let (shown, text, stopped) = run(&["\n\n"], &["Hello", "\n", "\nworld"]);
        assert_eq!(
            (shown.as_str(), text.as_str(), stopped),
            ("Hello", "Hello", true)
        );
        // A partial match that does not complete is shown in the end.
        let (shown, _, stopped) = run(&["END"], &["the E", "N", "d"]);
        assert_eq!((shown.as_str(), stopped), ("the ENd", false));
        // Earliest of several stops wins.
        let (shown, _, _) = run(&["b", "cd"], &["a", "cdb"]);
        assert_eq!(shown, "a");
        let (shown, _, _) = run(&[], &["x", "y"]);
        assert_eq!(shown, "xy");
    }

    #[test]
    fn unescaping() {
        assert_eq!(unescape("a\\n\\nb\\t\\\\"), "a\n\nb\t\\");
        assert_eq!(unescape("\\q"), "\\q");
    }
}
