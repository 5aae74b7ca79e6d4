//! Leaf utilities: file writes that survive crashes, hashing, and what the operating
//! system says about memory. Nothing here imports anything else of ours but `error`'s
//! user errors (through `user_bail!`; `error` names only `Stopped` back), so every other
//! module may use it without an import circle.

pub mod bars;
mod files;
pub mod stop;
mod system;

pub use files::{
    check_output_file, check_output_folder, file_starts_with, serialize_path_lossy, sha256_hex,
    sha256_hex_of, sha256_hex_of_reader, write_atomic, AtomicFile,
};
pub use stop::{Stop, Stopped};
pub use system::{available_memory_bytes, peak_rss_mb};

/// "s" where a count of `n` takes the plural ("1 layer", "2 layers").
/// What a JSON value is, in words for a message: "an array", "a string".
pub fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

pub fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
