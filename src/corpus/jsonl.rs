//! JSON Lines: one JSON object per line, the document's text in one of its fields.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::{Piece, Pieces};
use crate::error::user_error;

pub struct JsonlFile {
    path: PathBuf,
    reader: BufReader<File>,
    /// The line being read, as bytes (told from text only once whole).
    buffer: Vec<u8>,
    line: usize,
    field: String,
    /// Whether a record so far had the field: one without it is then a record with no
    /// text (writers leave out a null field), not a wrong data.text_field.
    field_seen: bool,
    bytes_read: u64,
    /// Where the user named the file (`data.corpus`, `--text`).
    setting: &'static str,
}

impl JsonlFile {
    pub fn open(path: &Path, field: &str, setting: &'static str) -> Result<Self> {
        let file = super::open_file(path)?;
        Ok(Self {
            setting,
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(1 << 20, file),
            buffer: Vec::new(),
            line: 0,
            field: field.to_string(),
            field_seen: false,
            bytes_read: 0,
        })
    }
}

impl Pieces for JsonlFile {
    fn next_piece(&mut self) -> Result<Option<Piece>> {
        loop {
            self.buffer.clear();
            let line_start = self.bytes_read;
            let read = self.reader.read_until(b'\n', &mut self.buffer);
            self.line += 1;
            let where_ = || format!("{}:{}", self.path.display(), self.line);
            match read.map_err(|e| user_error(format!("cannot read {}: {e}", where_())))? {
                0 => return Ok(None),
                n => self.bytes_read += n as u64,
            }
            if self.buffer.ends_with(b"\n") {
                self.buffer.pop();
                if self.buffer.ends_with(b"\r") {
                    self.buffer.pop();
                }
            }
            let mut line = match std::str::from_utf8(&self.buffer) {
                Ok(line) => line.to_string(),
                Err(e) => {
                    let bad = e.valid_up_to();
                    let start = if self.line == 1 {
                        &self.buffer[..]
                    } else {
                        &[]
                    };
                    return Err(user_error(format!(
                        "{} {} (line {}) {}",
                        super::text::file_named_by(self.setting),
                        self.path.display(),
                        self.line,
                        super::text::not_text(
                            &self.path,
                            start,
                            (line_start + bad as u64, self.buffer[bad]),
                            self.setting
                        )
                    )));
                }
            };
            // A byte-order mark before the first object is not part of it.
            if self.line == 1 && line.starts_with('\u{feff}') {
                line.drain(..'\u{feff}'.len_utf8());
            }
            if line.trim().is_empty() {
                continue;
            }
            let parsed = serde_json::from_str(&line).or_else(|e| {
                // Python's json writes lone surrogates (\ud800) of text that was not
                // UTF-8; serde_json refuses them. Read as U+FFFD, as bytes that are not
                // UTF-8 would be.
                match without_lone_surrogates(&line) {
                    Some(repaired) => serde_json::from_str(&repaired),
                    None => Err(e),
                }
            });
            let value: serde_json::Value = parsed.map_err(|e| {
                user_error(format!(
                    "{} is not valid JSON ({e}); a .jsonl corpus has one JSON object per line",
                    where_()
                ))
            })?;
            if !value.is_object() {
                return Err(user_error(format!(
                    "{} is {}, not a JSON object; a .jsonl corpus has one object per line, its text in field \"{}\"",
                    where_(),
                    crate::util::json_kind(&value),
                    self.field
                )));
            }
            let found = field(&value, &self.field);
            self.field_seen |= found.is_some();
            let text = match found {
                Some(serde_json::Value::String(text)) => text.clone(),
                // A record without text has no document, as a parquet row whose text is
                // null (exported datasets hold such records; one should not stop a run).
                // So is one without the field, once others have had it.
                Some(serde_json::Value::Null) => continue,
                None if self.field_seen => continue,
                Some(other) => {
                    return Err(user_error(format!(
                        "{}: field \"{}\" is {}, not a string; set data.text_field to the field holding the text",
                        where_(),
                        self.field,
                        crate::util::json_kind(other)
                    )))
                }
                None => {
                    let fields: Vec<&str> = value
                        .as_object()
                        .map(|o| o.keys().map(String::as_str).collect())
                        .unwrap_or_default();
                    return Err(user_error(format!(
                        "{}: no field \"{}\" (it has: {}); set data.text_field to the field holding the text (a nested one as data.text_field = \"outer.inner\")",
                        where_(),
                        self.field,
                        if fields.is_empty() { "none".to_string() } else { fields.join(", ") }
                    )));
                }
            };
            return Ok(Some(Piece {
                text,
                new_document: true,
            }));
        }
    }

    fn consumed(&self) -> u64 {
        self.bytes_read
    }
}

/// The field `name` of a record: a key of it, or, where there is none and the name
/// has dots, the path through nested objects (`meta.text`), as parquet names a nested
/// column.
fn field<'v>(record: &'v serde_json::Value, name: &str) -> Option<&'v serde_json::Value> {
    record.get(name).or_else(|| {
        name.contains('.')
            .then(|| {
                name.split('.')
                    .try_fold(record, |value, key| value.get(key))
            })
            .flatten()
    })
}

/// `line` with each `\uD800`-`\uDFFF` escape that is not half of a pair written as
/// `\uFFFD`, or None where it has none.
fn without_lone_surrogates(line: &str) -> Option<String> {
    let bytes = line.as_bytes();
    let unit = |at: usize| {
        (bytes.get(at) == Some(&b'\\') && bytes.get(at + 1) == Some(&b'u'))
            .then(|| line.get(at + 2..at + 6))
            .flatten()
            .and_then(|hex| u16::from_str_radix(hex, 16).ok())
    };
    let (high, low) = (0xD800..0xDC00, 0xDC00..0xE000);
    let (mut out, mut copied, mut at) = (String::new(), 0, 0);
    while at < bytes.len() {
        if bytes[at] != b'\\' {
            at += 1;
            continue;
        }
        match unit(at) {
            Some(u) if high.contains(&u) && unit(at + 6).is_some_and(|l| low.contains(&l)) => {
                at += 12;
            }
            Some(u) if high.contains(&u) || low.contains(&u) => {
                out.push_str(&line[copied..at]);
                out.push_str("\\uFFFD");
                at += 6;
                copied = at;
            }
            Some(_) => at += 6,
            // Any other escape, `\\` included: its second byte is not a `\` to look at.
            None => at += 2,
        }
    }
    (copied > 0).then(|| out + &line[copied..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lone_surrogates_become_replacement_characters_and_pairs_stay() {
        let repaired =
            without_lone_surrogates(r#"{"text": "a\ud800b\udc00c \ud83d\ude00 \\ud800"}"#);
        assert_eq!(
            repaired.as_deref(),
            Some(r#"{"text": "a\uFFFDb\uFFFDc \ud83d\ude00 \\ud800"}"#)
        );
        let value: serde_json::Value = serde_json::from_str(&repaired.unwrap()).unwrap();
        assert_eq!(value["text"], "a\u{fffd}b\u{fffd}c \u{1f600} \\ud800");
        assert_eq!(
            without_lone_surrogates(r#"{"text": "\ud83d\ude00 \n"}"#),
            None
        );
    }

    #[test]
    fn a_dotted_name_reaches_a_nested_field_where_no_key_has_it() {
        let record =
            serde_json::json!({"data": {"text": "inner"}, "a.b": "flat", "a": {"b": "deep"}});
        assert_eq!(field(&record, "data.text"), Some(&"inner".into()));
        assert_eq!(field(&record, "a.b"), Some(&"flat".into()));
        assert_eq!(field(&record, "data.none"), None);
    }
}
