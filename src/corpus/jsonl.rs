//! JSON Lines: one JSON object per line, the document's text in one of its fields.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::{Piece, Pieces};
use crate::error::user_error;

pub struct JsonlFile {
    path: PathBuf,
    lines: std::io::Lines<BufReader<File>>,
    line: usize,
    field: String,
    bytes_read: u64,
}

impl JsonlFile {
    pub fn open(path: &Path, field: &str) -> Result<Self> {
        let file = super::open_file(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            lines: BufReader::with_capacity(1 << 20, file).lines(),
            line: 0,
            field: field.to_string(),
            bytes_read: 0,
        })
    }
}

impl Pieces for JsonlFile {
    fn next_piece(&mut self) -> Result<Option<Piece>> {
        loop {
            let Some(line) = self.lines.next() else {
                return Ok(None);
            };
            self.line += 1;
            let where_ = || format!("{}:{}", self.path.display(), self.line);
            let mut line =
                line.map_err(|e| user_error(format!("cannot read {}: {e}", where_())))?;
            self.bytes_read += line.len() as u64 + 1;
            // A byte-order mark before the first object is not part of it.
            if self.line == 1 && line.starts_with('\u{feff}') {
                line.drain(..'\u{feff}'.len_utf8());
            }
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
                user_error(format!(
                    "{} is not a JSON object ({e}); a .jsonl corpus has one object per line",
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
            let text = match value.get(&self.field) {
                Some(serde_json::Value::String(text)) => text.clone(),
                // A record without text has no document, as a parquet row whose text is
                // null (exported datasets hold such records; one should not stop a run).
                Some(serde_json::Value::Null) => continue,
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
                        "{}: no field \"{}\" (it has: {}); set data.text_field to the field holding the text",
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
