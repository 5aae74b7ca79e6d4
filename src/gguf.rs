//! GGUF, both ways: `export --format gguf` writes a run as one GGUF file that llama.cpp
//! (and so Ollama and LM Studio) loads; `import --from model.gguf` reads a GPT-2 or
//! Llama GGUF file (f32, f16, bf16, the 32-blocks and the k-quants, dequantized) into a
//! run folder.
//!
//! The mapping, ours -> llama.cpp's (i = layer):
//!
//! | ours | `gpt2` | `llama` |
//! |---|---|---|
//! | wte.weight | token_embd.weight | token_embd.weight |
//! | wpe.weight | position_embd.weight | – (RoPE) |
//! | h.i.ln_1.* | blk.i.attn_norm.* | blk.i.attn_norm.weight |
//! | h.i.attn.c_attn.* | blk.i.attn_qkv.* | blk.i.attn_{q,k,v}.* (row blocks; q, k permuted) |
//! | h.i.attn.c_proj.* | blk.i.attn_output.* | blk.i.attn_output.* |
//! | h.i.ln_2.* | blk.i.ffn_norm.* | blk.i.ffn_norm.weight |
//! | h.i.mlp.c_fc.* | blk.i.ffn_up.* | blk.i.ffn_{gate,up}.* (row blocks) |
//! | h.i.mlp.c_proj.* | blk.i.ffn_down.* | blk.i.ffn_down.* |
//! | ln_f.* | output_norm.* | output_norm.weight |
//!
//! The output layer is tied: no `output.weight`, llama.cpp then reads token_embd. GGUF
//! lists dimensions innermost first, so our (d_out, d_in) matrices appear there as
//! [d_in, d_out], which is what llama.cpp expects; candle's reader and writer reverse
//! them, so in this file shapes are ours.
//!
//! Two conventions differ from ours. llama.cpp's `gpt2` always has biases (zeros are
//! written for a model without them; on import, all-zero biases are dropped again, the
//! same model). llama.cpp's `llama` rotates adjacent pairs (2j, 2j+1) where we (and
//! Hugging Face) rotate j with j + d/2: the q and k rows of each head are permuted as
//! llama.cpp's own converter does, and back on import.

use std::collections::HashMap;
use std::io::Cursor;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value as Json};

use crate::checkpoint::Loaded;
use crate::config::{Arch, Config, MlpKind, ModelConfig, NormKind, PositionKind};
use crate::error::user_error;
use crate::model::spec::ParamId;
use crate::model::ModelSpec;
use crate::tokenizer::{gpt2_byte_chars, Tokenizer};
use crate::user_bail;
use crate::util::write_atomic;

/// The llama.cpp architectures a model maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    Gpt2,
    Llama,
}

impl GgufArch {
    /// `general.architecture`, and the prefix of the architecture's keys.
    pub fn name(self) -> &'static str {
        match self {
            GgufArch::Gpt2 => "gpt2",
            GgufArch::Llama => "llama",
        }
    }
}

/// The number formats export writes the matrices in (norms and biases stay f32, as
/// llama.cpp's converter and quantizer leave them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufDtype {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4K,
}

impl GgufDtype {
    /// The names `--dtype` takes.
    pub const NAMES: [&'static str; 5] = ["f32", "f16", "q8_0", "q4_0", "q4_k"];

    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "f32" => Self::F32,
            "f16" => Self::F16,
            "q8_0" => Self::Q8_0,
            "q4_0" => Self::Q4_0,
            "q4_k" => Self::Q4K,
            other => user_bail!(
                "--dtype {other:?} is not one GGUF export writes; use one of {}",
                Self::NAMES.join(", ")
            ),
        })
    }

    fn ggml(self) -> GgmlDType {
        match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4K => GgmlDType::Q4K,
        }
    }

    /// `general.file_type` (llama.cpp's LLAMA_FTYPE_*): all-q4_k is MOSTLY_Q4_K_S.
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q8_0 => 7,
            Self::Q4K => 14,
        }
    }
}

/// What `export` wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    pub arch: GgufArch,
    pub bytes: usize,
    /// Matrices whose rows do not fill the format's blocks, written in a fallback
    /// format instead (as llama.cpp's quantizer does): (tensor, format).
    pub fallbacks: Vec<(String, String)>,
}

/// The llama.cpp architecture this model is exactly, or an error naming the option
/// that has none.
pub fn arch_for(m: &ModelConfig) -> Result<GgufArch> {
    match (m.positions, m.norm, m.mlp) {
        (PositionKind::Learned, NormKind::LayerNorm, MlpKind::Gelu | MlpKind::GeluTanh) => {
            Ok(GgufArch::Gpt2)
        }
        (PositionKind::Rope, NormKind::RmsNorm, MlpKind::Swiglu) => Ok(GgufArch::Llama),
        (PositionKind::Sinusoidal, _, _) => user_bail!(
            "model.positions = \"sinusoidal\" has no llama.cpp architecture (gpt2 has learned positions, llama RoPE)"
        ),
        (PositionKind::Learned, _, _) => user_bail!(
            "learned positions map to llama.cpp's gpt2, which needs model.norm = \"layernorm\" and model.mlp = \"gelu\" or \"gelu_tanh\" (this model has model.norm = \"{}\", model.mlp = \"{}\")",
            m.norm,
            m.mlp
        ),
        (PositionKind::Rope, _, _) => user_bail!(
            "RoPE maps to llama.cpp's llama, which needs model.norm = \"rmsnorm\" and model.mlp = \"swiglu\" (this model has model.norm = \"{}\", model.mlp = \"{}\")",
            m.norm,
            m.mlp
        ),
    }
}

/// Llama's rows of head `h`, dimension j < d/2 of the pair (j, j + d/2): llama.cpp's
/// row for our row `r` of a q or k block of `heads` heads of `d` rows each.
fn permuted_row(r: usize, d: usize) -> usize {
    let (head, i) = (r / d, r % d);
    let (half, j) = (i / (d / 2), i % (d / 2));
    head * d + 2 * j + half
}

/// Reorders the rows of `t` (rows = heads x d): to llama.cpp's order (`to_gguf`), or
/// back.
fn permute_rows(t: &Tensor, d: usize, to_gguf: bool) -> Result<Tensor> {
    let rows = t.dim(0)?;
    // index[new] = old
    let mut index = vec![0u32; rows];
    for r in 0..rows {
        let p = permuted_row(r, d);
        if to_gguf {
            index[p] = r as u32;
        } else {
            index[r] = p as u32;
        }
    }
    let index = Tensor::from_vec(index, rows, t.device())?;
    Ok(t.index_select(&index, 0)?.contiguous()?)
}

/// One tensor to write: its name, its values, and whether it is a matrix (quantized).
struct Entry {
    name: String,
    tensor: Tensor,
    matrix: bool,
}

/// Our tensors under llama.cpp's names, the token embedding padded with zero rows to
/// `rows`.
fn gguf_tensors(loaded: &Loaded, arch: GgufArch, rows: usize) -> Result<Vec<Entry>> {
    let spec = loaded.model.spec();
    let ours = loaded.model.params().to_map();
    let get = |id: ParamId| -> Result<Tensor> {
        Ok(ours[&spec[id].name]
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?)
    };
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, &Device::Cpu);
    let s = &spec.shapes;
    let mut out = Vec::new();
    let mut push = |name: String, tensor: Tensor, matrix: bool| {
        out.push(Entry {
            name,
            tensor,
            matrix,
        })
    };
    let wte = get(spec.wte)?;
    let wte = match rows - s.vocab_size {
        0 => wte,
        more => Tensor::cat(
            &[
                wte,
                Tensor::zeros((more, s.n_embd), DType::F32, &Device::Cpu)?,
            ],
            0,
        )?,
    };
    push("token_embd.weight".into(), wte, true);
    if let Some(wpe) = spec.wpe {
        push("position_embd.weight".into(), get(wpe)?, false);
    }
    for (i, b) in spec.blocks.iter().enumerate() {
        let l = format!("blk.{i}");
        let norms = [(b.ln_1, "attn_norm"), (b.ln_2, "ffn_norm")];
        match arch {
            GgufArch::Gpt2 => {
                let c = s.n_embd;
                for (norm, name) in norms {
                    push(format!("{l}.{name}.weight"), get(norm.weight)?, false);
                    let bias = norm.bias.map(get).transpose()?;
                    push(
                        format!("{l}.{name}.bias"),
                        bias.map_or_else(|| zeros(c), Ok)?,
                        false,
                    );
                }
                let linears = [
                    (b.attn_qkv, "attn_qkv"),
                    (b.attn_proj, "attn_output"),
                    (b.mlp_fc, "ffn_up"),
                    (b.mlp_proj, "ffn_down"),
                ];
                for (linear, name) in linears {
                    push(format!("{l}.{name}.weight"), get(linear.weight)?, true);
                    let bias = linear.bias.map(get).transpose()?;
                    let bias = bias.map_or_else(|| zeros(linear.d_out), Ok)?;
                    push(format!("{l}.{name}.bias"), bias, false);
                }
            }
            GgufArch::Llama => {
                for (norm, name) in norms {
                    push(format!("{l}.{name}.weight"), get(norm.weight)?, false);
                }
                let d = s.head_dim;
                let qkv = [
                    ("attn_q", 0, s.n_embd, true),
                    ("attn_k", s.n_embd, s.kv_width, true),
                    ("attn_v", s.n_embd + s.kv_width, s.kv_width, false),
                ];
                let gate_up = [
                    ("ffn_gate", 0, s.mlp_hidden, false),
                    ("ffn_up", s.mlp_hidden, s.mlp_hidden, false),
                ];
                for (linear, parts) in [(b.attn_qkv, &qkv[..]), (b.mlp_fc, &gate_up[..])] {
                    let w = get(linear.weight)?;
                    let bias = linear.bias.map(get).transpose()?;
                    for &(name, start, rows, rope) in parts {
                        let fix = |t: Tensor| -> Result<Tensor> {
                            match rope {
                                true => permute_rows(&t, d, true),
                                false => Ok(t.contiguous()?),
                            }
                        };
                        push(
                            format!("{l}.{name}.weight"),
                            fix(w.narrow(0, start, rows)?)?,
                            true,
                        );
                        if let Some(bias) = &bias {
                            push(
                                format!("{l}.{name}.bias"),
                                fix(bias.narrow(0, start, rows)?)?,
                                false,
                            );
                        }
                    }
                }
                for (linear, name) in [(b.attn_proj, "attn_output"), (b.mlp_proj, "ffn_down")] {
                    push(format!("{l}.{name}.weight"), get(linear.weight)?, true);
                    if let Some(bias) = linear.bias {
                        push(format!("{l}.{name}.bias"), get(bias)?, false);
                    }
                }
            }
        }
    }
    push("output_norm.weight".into(), get(spec.ln_f.weight)?, false);
    if arch == GgufArch::Gpt2 {
        let bias = spec.ln_f.bias.map(get).transpose()?;
        push(
            "output_norm.bias".into(),
            bias.map_or_else(|| zeros(s.n_embd), Ok)?,
            false,
        );
    }
    Ok(out)
}

/// The format a matrix is written in: `dtype`, or llama.cpp's fallback where its rows
/// do not fill whole blocks (q4_k -> q5_0 -> f16; 32-blocks -> f16).
fn format_for(dtype: GgufDtype, row: usize) -> GgmlDType {
    let want = dtype.ggml();
    if row.is_multiple_of(want.block_size()) {
        return want;
    }
    if want == GgmlDType::Q4K && row.is_multiple_of(GgmlDType::Q5_0.block_size()) {
        return GgmlDType::Q5_0;
    }
    GgmlDType::F16
}

fn format_name(t: GgmlDType) -> String {
    format!("{t:?}").to_lowercase()
}

/// Tokens, token types, merges, and whether it is a char vocabulary.
type GgufVocab = (Vec<String>, Vec<i32>, Vec<String>, bool);

/// The GGUF tokenizer of `tk` padded to `vocab` tokens: (tokens, token types, merges,
/// whether it is a char vocabulary). Byte-level BPE as it is; a char vocabulary as the
/// byte-level token of each character, which must be one byte (ASCII).
fn gguf_vocab(tk: &Tokenizer, vocab: usize) -> Result<GgufVocab> {
    let json: Json = serde_json::from_str(&tk.to_json()?)?;
    let special: std::collections::HashSet<u64> = json["added_tokens"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|t| t["special"].as_bool().unwrap_or(false))
                .filter_map(|t| t["id"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    let n = tk.vocab_size();
    let text = |id: usize| {
        tk.token_text(id as u32)
            .ok_or_else(|| user_error(format!("the tokenizer has no token {id} of its {n}")))
    };
    let is_char = tk.kind_name() == "char";
    let mut tokens = Vec::with_capacity(vocab);
    let mut merges = Vec::new();
    if is_char {
        let bytes = gpt2_byte_chars();
        for id in 0..n {
            let t = text(id)?;
            let c = t.chars().next().unwrap_or('\0');
            if !c.is_ascii() {
                user_bail!(
                    "the char vocabulary holds {c:?} (U+{:04X}), which is more than one byte: llama.cpp's byte-level vocabulary has no single token for it; GGUF export takes char vocabularies of ASCII text only (or train a BPE tokenizer)",
                    c as u32
                );
            }
            tokens.push(bytes[c as usize].to_string());
        }
        // llama.cpp reads `tokenizer.ggml.merges` as an array of strings and refuses
        // any other type, and candle's writer types an empty array as u32: so a char
        // vocabulary carries one merge whose result is no token of it (two of its first
        // token). llama.cpp spells a merged symbol that is not in its vocabulary as its
        // bytes' tokens, so the merge never changes a tokenization.
        if let Some(first) = tokens.first() {
            merges.push(format!("{first} {first}"));
        }
    } else {
        let model = &json["model"];
        let byte_level = model["type"] == "BPE"
            && json["normalizer"].is_null()
            && json["pre_tokenizer"]["type"] == "ByteLevel"
            && json["pre_tokenizer"]["use_regex"] != false
            && json["pre_tokenizer"]["add_prefix_space"] != true
            && json["decoder"]["type"] == "ByteLevel";
        if !byte_level {
            user_bail!(
                "this tokenizer is not byte-level BPE with GPT-2's pre-tokenizer (llama.cpp's \"gpt2\" vocabulary); GGUF export takes those and char vocabularies of ASCII text"
            );
        }
        for id in 0..n {
            tokens.push(text(id)?);
        }
        for m in model["merges"].as_array().into_iter().flatten() {
            let merge = match m {
                Json::String(s) => s.clone(),
                Json::Array(pair) => pair
                    .iter()
                    .map(|p| p.as_str().unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join(" "),
                _ => anyhow::bail!("unexpected merge {m} in the tokenizer"),
            };
            merges.push(merge);
        }
    }
    let mut types: Vec<i32> = (0..n as u64)
        .map(|id| if special.contains(&id) { 3 } else { 1 })
        .collect();
    // The model's rows past the tokenizer's: unused tokens, as llama.cpp's converter.
    for id in n..vocab {
        tokens.push(format!("[PAD{id}]"));
        types.push(5);
    }
    Ok((tokens, types, merges, is_char))
}

/// Refuses an `--out` that is a folder, or a file that is not an earlier GGUF export.
pub fn check_export_file(out: &Path) -> Result<()> {
    let shown = out.display().to_string();
    if out.is_dir() || shown.ends_with(['/', std::path::MAIN_SEPARATOR]) {
        user_bail!(
            "--out {} is a folder; --format gguf writes one file, e.g. --out {}.gguf",
            out.display(),
            shown.trim_end_matches(['/', std::path::MAIN_SEPARATOR])
        );
    }
    // Its folder exists.
    crate::util::check_output_file("--out", out, &[])?;
    if out.is_file() && !is_gguf(out) {
        user_bail!(
            "--out {} exists and is not a GGUF file; pass a new path, e.g. model.gguf",
            out.display()
        );
    }
    // A model downloaded for llama.cpp is a GGUF file too, and not ours to replace.
    if out.is_file() && !is_our_export(out) {
        user_bail!(
            "--out {} is a GGUF file tinygpt did not write (another model's?); pass a new path, e.g. model.gguf",
            out.display()
        );
    }
    Ok(())
}

/// Whether `path` is a GGUF file `export` wrote: it alone carries `tinygpt.tokenizer`.
fn is_our_export(path: &Path) -> bool {
    std::fs::File::open(path)
        .ok()
        .and_then(|f| gguf_file::Content::read(&mut std::io::BufReader::new(f)).ok())
        .is_some_and(|c| c.metadata.contains_key("tinygpt.tokenizer"))
}

/// The first bytes of every GGUF file.
const GGUF_MAGIC: &[u8] = b"GGUF";

/// Whether `path` starts with GGUF's magic.
pub fn is_gguf(path: &Path) -> bool {
    crate::util::file_starts_with(path, GGUF_MAGIC)
}

/// Writes `loaded` as one GGUF file for llama.cpp, matrices in `dtype`.
pub fn export(loaded: &Loaded, out: &Path, dtype: GgufDtype) -> Result<Exported> {
    check_export_file(out)?;
    let m = &loaded.config.model;
    let arch = arch_for(m).map_err(|e| {
        user_error(format!(
            "{e:#}; a trained model cannot change these, so train one with them to export it"
        ))
    })?;
    // A char vocabulary has no end-of-text token, and llama.cpp's gpt2 vocabulary takes
    // token 11 as one when none is named: a character (the corpus's '.'), at which it
    // would stop, or which --ignore-eos would ban. Its end is named instead as the first
    // row past the characters: a padding row where the model has them, else one more
    // row, of zeros, which the file's tinygpt.vocab_size tells import to drop.
    let char_end =
        (loaded.tokenizer.kind_name() == "char").then_some(loaded.tokenizer.vocab_size());
    let rows = match char_end {
        Some(end) if end == m.vocab_size => m.vocab_size + 1,
        _ => m.vocab_size,
    };
    let (tokens, types, merges, is_char) = gguf_vocab(&loaded.tokenizer, rows)?;
    let a = arch.name();
    let u32v = |v: usize| Value::U32(v as u32);
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (
            "general.name".into(),
            Value::String(loaded.config.run.name.clone()),
        ),
        ("general.file_type".into(), Value::U32(dtype.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (format!("{a}.context_length"), u32v(m.block_size)),
        (format!("{a}.embedding_length"), u32v(m.n_embd)),
        (format!("{a}.block_count"), u32v(m.n_layer)),
        (format!("{a}.feed_forward_length"), u32v(m.mlp_hidden())),
        (format!("{a}.attention.head_count"), u32v(m.n_head)),
        (format!("{a}.attention.head_count_kv"), u32v(m.kv_heads())),
    ];
    match arch {
        GgufArch::Gpt2 => {
            meta.push((
                format!("{a}.attention.layer_norm_epsilon"),
                Value::F32(m.norm_eps as f32),
            ));
            // llama.cpp's gpt2 computes GELU's tanh form; the exact one is kept here
            // for import.
            let gelu = if m.mlp == MlpKind::Gelu {
                "gelu"
            } else {
                "gelu_tanh"
            };
            meta.push(("tinygpt.mlp".into(), Value::String(gelu.into())));
        }
        GgufArch::Llama => {
            meta.push((
                format!("{a}.attention.layer_norm_rms_epsilon"),
                Value::F32(m.norm_eps as f32),
            ));
            meta.push((
                format!("{a}.rope.freq_base"),
                Value::F32(m.rope_theta as f32),
            ));
            meta.push((format!("{a}.rope.dimension_count"), u32v(m.head_dim())));
            meta.push((format!("{a}.vocab_size"), u32v(rows)));
        }
    }
    meta.push(("tokenizer.ggml.model".into(), Value::String("gpt2".into())));
    meta.push(("tokenizer.ggml.pre".into(), Value::String("gpt-2".into())));
    meta.push(("tokenizer.ggml.tokens".into(), strings(tokens)));
    meta.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array(types.into_iter().map(Value::I32).collect()),
    ));
    meta.push(("tokenizer.ggml.merges".into(), strings(merges)));
    if let Some(eot) = loaded
        .tokenizer
        .end_of_text()
        .or(char_end.map(|end| end as u32))
    {
        for key in ["bos", "eos", "padding"] {
            meta.push((format!("tokenizer.ggml.{key}_token_id"), Value::U32(eot)));
        }
    }
    if rows != m.vocab_size {
        meta.push(("tinygpt.vocab_size".into(), u32v(m.vocab_size)));
    }
    // llama-server's chat then builds `tinygpt serve`'s prompts (without it, its own
    // default format gave the same weights other replies).
    meta.push((
        "tokenizer.chat_template".into(),
        Value::String(crate::serve::chat::JINJA.into()),
    ));
    meta.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
    meta.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)));
    let kind = if is_char { "char" } else { "bpe" };
    meta.push(("tinygpt.tokenizer".into(), Value::String(kind.into())));

    let mut fallbacks = Vec::new();
    let mut qtensors = Vec::new();
    for e in gguf_tensors(loaded, arch, rows)? {
        let format = match (e.matrix, e.name.as_str()) {
            (true, _) => {
                let f = format_for(dtype, e.tensor.dim(1)?);
                if f != dtype.ggml() {
                    fallbacks.push((e.name.clone(), format_name(f)));
                }
                f
            }
            (false, "position_embd.weight") if dtype == GgufDtype::F16 => GgmlDType::F16,
            (false, _) => GgmlDType::F32,
        };
        // A storage of its own: candle quantizes a tensor's whole storage, and ours
        // may be views into one buffer.
        let values = e.tensor.flatten_all()?.to_vec1::<f32>()?;
        let own = Tensor::from_vec(values, e.tensor.shape(), &Device::Cpu)?;
        let q = QTensor::quantize(&own, format)
            .map_err(|err| anyhow::anyhow!("quantizing {} to {format:?}: {err}", e.name))?;
        qtensors.push((e.name, q));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> =
        qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut buf = Cursor::new(Vec::new());
    gguf_file::write(&mut buf, &meta_refs, &tensor_refs)?;
    let bytes = buf.into_inner();
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| user_error(format!("cannot create {}: {e}", parent.display())))?;
    }
    write_atomic(out, &bytes)?;
    Ok(Exported {
        arch,
        bytes: bytes.len(),
        fallbacks,
    })
}

/// A GGUF file opened for reading: its header, and the bytes.
struct Gguf<'a> {
    path: &'a Path,
    content: gguf_file::Content,
    bytes: Vec<u8>,
}

impl<'a> Gguf<'a> {
    fn open(path: &'a Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| user_error(format!("cannot read {}: {e}", path.display())))?;
        let content = gguf_file::Content::read(&mut Cursor::new(&bytes)).map_err(|e| {
            user_error(format!(
                "{} is not a readable GGUF file ({}); export it again or check the download",
                path.display(),
                first_line(&e.to_string())
            ))
        })?;
        Ok(Self {
            path,
            content,
            bytes,
        })
    }

    fn fail(&self, what: String) -> anyhow::Error {
        user_error(format!("{}: {what}", self.path.display()))
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(self.fail(format!("metadata {key} is not a string"))),
        }
    }

    fn uint(&self, key: &str) -> Result<Option<usize>> {
        let v = match self.get(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n = match *v {
            Value::U8(x) => Some(x as u64),
            Value::U16(x) => Some(x as u64),
            Value::U32(x) => Some(x as u64),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        };
        n.map(|n| Some(n as usize))
            .ok_or_else(|| self.fail(format!("metadata {key} is not a non-negative integer")))
    }

    fn need_uint(&self, key: &str) -> Result<usize> {
        self.uint(key)?
            .ok_or_else(|| self.fail(format!("metadata {key} is missing")))
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            // As written (1e-5 stays 1e-5, not the f32 nearest it).
            Some(Value::F32(x)) => Ok(Some(x.to_string().parse().unwrap_or(*x as f64))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(_) => Err(self.fail(format!("metadata {key} is not a number"))),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(self.fail(format!("metadata {key} holds a non-string"))),
                })
                .collect(),
            Some(_) => Err(self.fail(format!("metadata {key} is not an array"))),
        }
    }

    fn ints(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match *v {
                    Value::I32(x) => Ok(x as i64),
                    Value::U32(x) => Ok(x as i64),
                    Value::I8(x) => Ok(x as i64),
                    Value::U8(x) => Ok(x as i64),
                    Value::I64(x) => Ok(x),
                    _ => Err(self.fail(format!("metadata {key} holds a non-integer"))),
                })
                .collect(),
            Some(_) => Err(self.fail(format!("metadata {key} is not an array"))),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor `name` as f32 (dequantized), checked to have `shape` (ours: outermost
    /// first).
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.fail(format!("tensor {name} is missing")))?;
        if info.shape.dims() != shape {
            let rev = |d: &[usize]| d.iter().rev().copied().collect::<Vec<_>>();
            return Err(self.fail(format!(
                "tensor {name} has shape {:?} (GGUF order), but the metadata implies {:?}; the file is inconsistent",
                rev(info.shape.dims()),
                rev(shape)
            )));
        }
        let q = info
            .read(
                &mut Cursor::new(&self.bytes),
                self.content.tensor_data_offset,
                &Device::Cpu,
            )
            .map_err(|e| {
                self.fail(format!(
                    "tensor {name} cannot be read ({}); the file is truncated or damaged",
                    first_line(&e.to_string())
                ))
            })?;
        Ok(q.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

/// Reads a GPT-2 or Llama GGUF file into our config, tensor names and tokenizer.
pub fn read(path: &Path) -> Result<(ModelConfig, HashMap<String, Tensor>, Tokenizer)> {
    let g = Gguf::open(path)?;
    let arch = match g.string("general.architecture")?.as_deref() {
        Some("gpt2") => GgufArch::Gpt2,
        Some("llama") => GgufArch::Llama,
        Some(other) => user_bail!(
            "{}: architecture {other:?} is not supported; import reads gpt2 and llama GGUF files",
            path.display()
        ),
        None => user_bail!(
            "{}: general.architecture is missing; is it a model file?",
            path.display()
        ),
    };
    let a = arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let n_embd = g.need_uint(&key("embedding_length"))?;
    let n_head = g.need_uint(&key("attention.head_count"))?;
    let n_kv = g.uint(&key("attention.head_count_kv"))?.unwrap_or(n_head);
    let hidden = g.need_uint(&key("feed_forward_length"))?;
    let wte_info = g
        .content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| g.fail("tensor token_embd.weight is missing".into()))?;
    let rows = match wte_info.shape.dims() {
        [v, c] if *c == n_embd => *v,
        dims => {
            return Err(g.fail(format!(
            "tensor token_embd.weight has shape {:?} (GGUF order), expected [{n_embd}, vocabulary]",
            dims.iter().rev().collect::<Vec<_>>()
        )))
        }
    };
    // Rows export added past the model's own (a char vocabulary's end of text).
    let vocab_size = g
        .uint("tinygpt.vocab_size")?
        .filter(|&v| v > 0 && v < rows)
        .unwrap_or(rows);
    if n_head == 0 || n_kv == 0 || !n_embd.is_multiple_of(n_head) || !n_head.is_multiple_of(n_kv) {
        user_bail!(
            "{}: {n_head} heads ({n_kv} K/V) do not divide the width {n_embd}",
            path.display()
        );
    }
    let mut m = ModelConfig {
        n_layer: g.need_uint(&key("block_count"))?,
        n_head,
        n_kv_head: (n_kv != n_head).then_some(n_kv),
        n_embd,
        block_size: g.need_uint(&key("context_length"))?,
        vocab_size,
        ..ModelConfig::default()
    };
    let mut ours: HashMap<String, Tensor> = HashMap::new();
    let mut used: Vec<String> = Vec::new();
    let mut take = |name: String, shape: &[usize]| -> Result<Tensor> {
        let t = g.tensor(&name, shape)?;
        used.push(name);
        Ok(t)
    };
    match arch {
        GgufArch::Gpt2 => {
            let mlp = match g.string("tinygpt.mlp")?.as_deref() {
                Some("gelu") => MlpKind::Gelu,
                None | Some("gelu_tanh") => MlpKind::GeluTanh, // what llama.cpp's gpt2 computes
                Some(other) => {
                    return Err(g.fail(format!(
                        "metadata tinygpt.mlp = {other:?} is not an activation tinygpt has (gelu, gelu_tanh)"
                    )))
                }
            };
            // The gpt2 preset fixes one K/V head per query head.
            m.arch = if mlp == MlpKind::GeluTanh && m.n_kv_head.is_none() {
                Arch::Gpt2
            } else {
                Arch::Custom
            };
            m.positions = PositionKind::Learned;
            m.norm = NormKind::LayerNorm;
            m.norm_eps = g
                .float(&key("attention.layer_norm_epsilon"))?
                .unwrap_or(1e-5);
            m.mlp = mlp;
            m.mlp_hidden = (hidden != 4 * n_embd).then_some(hidden);
            m.bias = true;
            crate::interop::check_read_model(&m, path)?;
            let spec = ModelSpec::new(&m);
            let s = spec.shapes;
            let name = |id: ParamId| spec[id].name.clone();
            ours.insert(
                name(spec.wte),
                take("token_embd.weight".into(), &[rows, n_embd])?.narrow(0, 0, vocab_size)?,
            );
            let wpe = spec.wpe.expect("learned positions");
            ours.insert(
                name(wpe),
                take("position_embd.weight".into(), &[m.block_size, n_embd])?,
            );
            for (i, b) in spec.blocks.iter().enumerate() {
                let l = format!("blk.{i}");
                for (norm, n) in [(b.ln_1, "attn_norm"), (b.ln_2, "ffn_norm")] {
                    ours.insert(
                        name(norm.weight),
                        take(format!("{l}.{n}.weight"), &[n_embd])?,
                    );
                    let bias = norm.bias.expect("gpt2 has norm biases");
                    ours.insert(name(bias), take(format!("{l}.{n}.bias"), &[n_embd])?);
                }
                let linears = [
                    (b.attn_qkv, "attn_qkv"),
                    (b.attn_proj, "attn_output"),
                    (b.mlp_fc, "ffn_up"),
                    (b.mlp_proj, "ffn_down"),
                ];
                for (linear, n) in linears {
                    ours.insert(
                        name(linear.weight),
                        take(format!("{l}.{n}.weight"), &[linear.d_out, linear.d_in])?,
                    );
                    let bias = linear.bias.expect("gpt2 has biases");
                    ours.insert(name(bias), take(format!("{l}.{n}.bias"), &[linear.d_out])?);
                }
            }
            ours.insert(
                name(spec.ln_f.weight),
                take("output_norm.weight".into(), &[s.n_embd])?,
            );
            let bias = spec.ln_f.bias.expect("gpt2 has norm biases");
            ours.insert(name(bias), take("output_norm.bias".into(), &[s.n_embd])?);
            crate::interop::drop_zero_biases(&mut m, &mut ours)?;
        }
        GgufArch::Llama => {
            let d = n_embd / n_head;
            if let Some(rot) = g.uint(&key("rope.dimension_count"))? {
                if rot != d {
                    user_bail!(
                        "{}: RoPE over {rot} of each head's {d} dimensions is not supported (only all of them)",
                        path.display()
                    );
                }
            }
            if let Some(kind) = g.string(&key("rope.scaling.type"))? {
                if kind != "none" {
                    user_bail!("{}: RoPE scaling ({kind}) is not supported", path.display());
                }
            }
            if let Some(k) = g.uint(&key("attention.key_length"))? {
                if k != d {
                    user_bail!(
                        "{}: heads of {k} dimensions x {n_head} heads != width {n_embd}; not supported",
                        path.display()
                    );
                }
            }
            if g.uint(&key("expert_count"))?.unwrap_or(0) > 0 {
                user_bail!(
                    "{}: mixture-of-experts models are not supported",
                    path.display()
                );
            }
            m.arch = Arch::Llama;
            m.positions = PositionKind::Rope;
            m.rope_theta = g.float(&key("rope.freq_base"))?.unwrap_or(10000.0);
            m.norm = NormKind::RmsNorm;
            m.norm_eps = g
                .float(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5);
            m.mlp = MlpKind::Swiglu;
            m.mlp_hidden = None;
            m.mlp_hidden = (m.mlp_hidden() != hidden).then_some(hidden);
            m.bias = g.has("blk.0.attn_q.bias");
            if m.bias {
                m.arch = Arch::Custom;
            }
            crate::interop::check_read_model(&m, path)?;
            let spec = ModelSpec::new(&m);
            let s = spec.shapes;
            let name = |id: ParamId| spec[id].name.clone();
            ours.insert(
                name(spec.wte),
                take("token_embd.weight".into(), &[rows, n_embd])?.narrow(0, 0, vocab_size)?,
            );
            for (i, b) in spec.blocks.iter().enumerate() {
                let l = format!("blk.{i}");
                for (norm, n) in [(b.ln_1, "attn_norm"), (b.ln_2, "ffn_norm")] {
                    ours.insert(
                        name(norm.weight),
                        take(format!("{l}.{n}.weight"), &[n_embd])?,
                    );
                }
                let qkv = [
                    ("attn_q", s.n_embd, true),
                    ("attn_k", s.kv_width, true),
                    ("attn_v", s.kv_width, false),
                ];
                let gate_up = [
                    ("ffn_gate", s.mlp_hidden, false),
                    ("ffn_up", s.mlp_hidden, false),
                ];
                for (linear, parts) in [(b.attn_qkv, &qkv[..]), (b.mlp_fc, &gate_up[..])] {
                    let mut ws = Vec::new();
                    let mut bs = Vec::new();
                    for &(n, rows, rope) in parts {
                        let fix = |t: Tensor| -> Result<Tensor> {
                            match rope {
                                true => permute_rows(&t, d, false),
                                false => Ok(t),
                            }
                        };
                        ws.push(fix(take(format!("{l}.{n}.weight"), &[rows, linear.d_in])?)?);
                        if linear.bias.is_some() {
                            bs.push(fix(take(format!("{l}.{n}.bias"), &[rows])?)?);
                        }
                    }
                    ours.insert(name(linear.weight), Tensor::cat(&ws, 0)?);
                    if let Some(bias) = linear.bias {
                        ours.insert(name(bias), Tensor::cat(&bs, 0)?);
                    }
                }
                for (linear, n) in [(b.attn_proj, "attn_output"), (b.mlp_proj, "ffn_down")] {
                    ours.insert(
                        name(linear.weight),
                        take(format!("{l}.{n}.weight"), &[linear.d_out, linear.d_in])?,
                    );
                    if let Some(bias) = linear.bias {
                        ours.insert(name(bias), take(format!("{l}.{n}.bias"), &[linear.d_out])?);
                    }
                }
            }
            ours.insert(
                name(spec.ln_f.weight),
                take("output_norm.weight".into(), &[s.n_embd])?,
            );
        }
    }
    // A separate output layer is read only where it is the token embedding (tied).
    if g.has("output.weight") {
        let head = g
            .tensor("output.weight", &[rows, n_embd])?
            .narrow(0, 0, vocab_size)?;
        let spec = ModelSpec::new(&m);
        let wte = &ours[&spec[spec.wte].name];
        if (head - wte)?.abs()?.max_all()?.to_scalar::<f32>()? != 0.0 {
            user_bail!(
                "{}: output.weight differs from token_embd.weight; only tied output layers are supported",
                path.display()
            );
        }
        used.push("output.weight".into());
    }
    let mut extra: Vec<&String> = g
        .content
        .tensor_infos
        .keys()
        .filter(|k| !used.contains(k))
        .collect();
    extra.sort();
    if let Some(extra) = extra.first() {
        user_bail!(
            "{}: unexpected tensor {extra}; this is not a {a} layout we read",
            path.display()
        );
    }
    let tokenizer = read_tokenizer(&g, rows)?;
    Ok((m, ours, tokenizer))
}

/// The tokenizer a GGUF file describes: a char vocabulary we exported, or byte-level
/// BPE (`tokenizer.ggml.model = gpt2` with GPT-2's pre-tokenizer).
fn read_tokenizer(g: &Gguf, vocab_size: usize) -> Result<Tokenizer> {
    let model = g.string("tokenizer.ggml.model")?.unwrap_or_default();
    if model != "gpt2" {
        return Err(g.fail(format!(
            "tokenizer.ggml.model {model:?} is not supported; import reads byte-level BPE vocabularies (\"gpt2\")"
        )));
    }
    let pre = g
        .string("tokenizer.ggml.pre")?
        .unwrap_or_else(|| "gpt-2".into());
    if pre != "gpt-2" && pre != "default" {
        return Err(g.fail(format!(
            "tokenizer.ggml.pre {pre:?} is not supported; import reads GPT-2's pre-tokenizer (\"gpt-2\")"
        )));
    }
    let mut tokens = g.strings("tokenizer.ggml.tokens")?;
    let mut types = g.ints("tokenizer.ggml.token_type")?;
    if tokens.is_empty() {
        return Err(g.fail("tokenizer.ggml.tokens is missing or empty".into()));
    }
    if tokens.len() > vocab_size {
        return Err(g.fail(format!(
            "{} tokens but token_embd.weight has {vocab_size} rows",
            tokens.len()
        )));
    }
    types.resize(tokens.len(), 1);
    // Trailing unused tokens pad the vocabulary to the model's rows.
    while tokens.len() > 1 && types[tokens.len() - 1] == 5 {
        tokens.pop();
        types.pop();
    }
    let json = if g.string("tinygpt.tokenizer")?.as_deref() == Some("char") {
        let of_char: HashMap<char, u8> = gpt2_byte_chars()
            .into_iter()
            .enumerate()
            .map(|(b, c)| (c, b as u8))
            .collect();
        let mut vocab = serde_json::Map::new();
        for (id, t) in tokens.iter().enumerate() {
            let mut chars = t.chars();
            let c = match (chars.next().and_then(|c| of_char.get(&c)), chars.next()) {
                (Some(&b), None) => b as char,
                _ => {
                    return Err(g.fail(format!(
                        "token {id} ({t:?}) of a char vocabulary is not one byte-level character"
                    )))
                }
            };
            vocab.insert(c.to_string(), json!(id));
        }
        let mut json: Json = serde_json::from_str(&Tokenizer::train_char("a")?.to_json()?)?;
        json["model"]["vocab"] = Json::Object(vocab);
        json
    } else {
        // Without its merges a BPE vocabulary encodes every text as single bytes: the
        // model would see text it was never trained on.
        if g.get("tokenizer.ggml.merges").is_none() && tokens.len() > 257 {
            return Err(g.fail(format!(
                "tokenizer.ggml.merges is missing: its BPE vocabulary of {} tokens cannot be used without them",
                tokens.len()
            )));
        }
        let merges: Vec<Json> = g
            .strings("tokenizer.ggml.merges")?
            .iter()
            .map(|m| {
                // As llama.cpp: split at the first space after the first character.
                let first = m.chars().next().map_or(0, char::len_utf8);
                (first, m[first..].find(' '))
            })
            .zip(g.strings("tokenizer.ggml.merges")?)
            .map(|((first, at), m)| match at {
                Some(at) => Ok(json!([&m[..first + at], &m[first + at + 1..]])),
                None => Err(g.fail(format!("merge {m:?} is not two tokens"))),
            })
            .collect::<Result<_>>()?;
        let mut vocab = serde_json::Map::new();
        let mut added = Vec::new();
        for (id, t) in tokens.iter().enumerate() {
            vocab.insert(t.clone(), json!(id));
            // Control and user-defined tokens are matched whole, as llama.cpp does.
            if matches!(types[id], 3 | 4) {
                added.push(json!({
                    "id": id, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": types[id] == 3,
                }));
            }
        }
        if vocab.len() != tokens.len() {
            return Err(g.fail("tokenizer.ggml.tokens repeats a token".into()));
        }
        // A merge makes a token of the vocabulary from two of its tokens: the tokenizers
        // library fails on any other with a message about slices.
        for pair in &merges {
            let (a, b) = (
                pair[0].as_str().unwrap_or(""),
                pair[1].as_str().unwrap_or(""),
            );
            let made = format!("{a}{b}");
            let missing = [a, b, made.as_str()]
                .into_iter()
                .find(|t| !vocab.contains_key(*t))
                .map(str::to_owned);
            if let Some(missing) = missing {
                return Err(g.fail(format!(
                    "merge \"{a} {b}\" uses or makes {missing:?}, which is not one of its tokens{}",
                    match merges.len() {
                        1 => " (a char vocabulary written by tinygpt without its tinygpt.tokenizer key?)",
                        _ => "",
                    }
                )));
            }
        }
        let mut json: Json = serde_json::from_str(&Tokenizer::train_bpe("", 257)?.to_json()?)?;
        json["model"]["vocab"] = Json::Object(vocab);
        json["model"]["merges"] = Json::Array(merges);
        json["added_tokens"] = Json::Array(added);
        json
    };
    Tokenizer::from_json(json.to_string().as_bytes()).map_err(|e| {
        g.fail(format!(
            "its vocabulary does not make a tokenizer ({})",
            first_line(&format!("{e:#}"))
        ))
    })
}

/// Imports a GGUF file as a run folder at `out` (step 0, no optimiser state): ready for
/// generate, eval, info, and `train --init-from`.
pub fn import(from: &Path, out: &Path) -> Result<Config> {
    crate::interop::check_import_folder(out)?;
    let (model_cfg, tensors, tokenizer) = read(from)?;
    crate::interop::save_imported(from, out, model_cfg, &tensors, tokenizer)
}
