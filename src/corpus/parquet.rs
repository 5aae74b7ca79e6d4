//! Parquet files as the Hugging Face hub serves datasets (FineWeb, TinyStories...): one
//! document per row, from a string column, read row group by row group and a batch of
//! rows at a time, so a file of any size costs a batch of memory.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::Result;
use parquet::basic::Type as PhysicalType;
use parquet::column::reader::ColumnReader;
use parquet::data_type::ByteArray;
use parquet::file::reader::FileReader;
use parquet::file::serialized_reader::SerializedFileReader;

use super::{Piece, Pieces};
use crate::error::user_error;

/// Rows decoded at a time.
const BATCH_ROWS: usize = 1024;

pub struct ParquetFile {
    path: PathBuf,
    reader: SerializedFileReader<File>,
    column: usize,
    /// The column's name (data.text_field), for messages.
    field: String,
    optional: bool,
    next_row_group: usize,
    /// The open row group's column reader; `None` between row groups.
    current: Option<ColumnReader>,
    documents: VecDeque<String>,
    rows_read: u64,
    /// For progress: the file's size and row count.
    bytes: u64,
    rows: u64,
}

impl ParquetFile {
    pub fn open(path: &Path, field: &str) -> Result<Self> {
        let file = super::open_file(path)?;
        let reader = SerializedFileReader::new(file).map_err(|e| {
            user_error(format!(
                "corpus file {} is not a readable parquet file ({e}); if it was cut short, download it again, or give it the extension of what it holds (.jsonl, .txt)",
                path.display()
            ))
        })?;
        let schema = reader.metadata().file_metadata().schema_descr();
        let columns: Vec<String> = (0..schema.num_columns())
            .map(|i| schema.column(i).path().string())
            .collect();
        let Some(column) = columns.iter().position(|name| name == field) else {
            return Err(user_error(format!(
                "parquet file {} has no column \"{field}\" (it has: {}); set data.text_field to the column holding the text",
                path.display(),
                columns.join(", ")
            )));
        };
        let descr = schema.column(column);
        if descr.physical_type() != PhysicalType::BYTE_ARRAY || descr.max_rep_level() > 0 {
            return Err(user_error(format!(
                "parquet file {}: column \"{field}\" is not a string column; set data.text_field to the column holding the text",
                path.display()
            )));
        }
        let rows = reader.metadata().file_metadata().num_rows().max(1) as u64;
        let bytes = std::fs::metadata(path).map_or(0, |m| m.len());
        Ok(Self {
            bytes,
            rows,
            path: path.to_path_buf(),
            optional: descr.max_def_level() > 0,
            reader,
            column,
            field: field.to_string(),
            next_row_group: 0,
            current: None,
            documents: VecDeque::new(),
            rows_read: 0,
        })
    }

    /// Decodes the next batch of rows into `documents`; false at the end of the file.
    fn read_batch(&mut self) -> Result<bool> {
        let path = self.path.clone();
        let bad = |group: usize, e: parquet::errors::ParquetError| {
            let e = e.to_string();
            // "Disabled feature at compile time: flate2": a codec this build leaves out.
            match e.split_once("Disabled feature at compile time: ") {
                Some((_, codec)) => user_error(format!(
                    "corpus file {}: its parquet pages are compressed with {}, which tinygpt does not read (it reads snappy, zstd, lz4 and uncompressed); rewrite it, e.g. pyarrow.parquet.write_table(pyarrow.parquet.read_table(path), new_path, compression=\"zstd\")",
                    path.display(),
                    match codec.trim() {
                        "flate2" => "gzip",
                        other => other,
                    }
                )),
                None => user_error(format!(
                    "corpus file {}: cannot read parquet row group {group} ({e}); the file is damaged or cut short: download it again, or rewrite it with pyarrow",
                    path.display(),
                )),
            }
        };
        loop {
            if self.current.is_none() {
                if self.next_row_group == self.reader.num_row_groups() {
                    return Ok(false);
                }
                let reader = self
                    .reader
                    .get_row_group(self.next_row_group)
                    .and_then(|g| g.get_column_reader(self.column))
                    .map_err(|e| bad(self.next_row_group, e))?;
                self.next_row_group += 1;
                self.current = Some(reader);
            }
            let group = self.next_row_group - 1;
            let Some(ColumnReader::ByteArrayColumnReader(reader)) = &mut self.current else {
                unreachable!("the column was checked to hold byte arrays");
            };
            let mut values: Vec<ByteArray> = Vec::with_capacity(BATCH_ROWS);
            let mut levels: Vec<i16> = Vec::new();
            let (rows, _, _) = reader
                .read_records(
                    BATCH_ROWS,
                    self.optional.then_some(&mut levels),
                    None,
                    &mut values,
                )
                .map_err(|e| bad(group, e))?;
            if rows == 0 {
                self.current = None;
                continue;
            }
            for value in values {
                let text = String::from_utf8(value.data().to_vec()).map_err(|_| {
                    user_error(format!(
                        "corpus file {}: row {} of column \"{}\" is not UTF-8 text; set data.text_field to the column holding the text, or rewrite the column as UTF-8",
                        self.path.display(),
                        self.rows_read,
                        self.field
                    ))
                })?;
                self.documents.push_back(text);
                self.rows_read += 1;
            }
            // Rows whose text is null have no document.
            return Ok(true);
        }
    }
}

impl Pieces for ParquetFile {
    fn next_piece(&mut self) -> Result<Option<Piece>> {
        while self.documents.is_empty() {
            if !self.read_batch()? {
                return Ok(None);
            }
        }
        Ok(self.documents.pop_front().map(|text| Piece {
            text,
            new_document: true,
        }))
    }

    fn consumed(&self) -> u64 {
        (self.bytes as f64 * (self.rows_read as f64 / self.rows as f64).min(1.0)) as u64
    }
}
