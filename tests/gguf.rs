//! GGUF interop: export -> import gives the same model (f32: same weights and logits;
//! f16 and the block formats: every weight within its format's rounding, logits close),
//! llama.cpp's names, shapes and keys are written, the tokenizer survives, and bad
//! files and models without a llama.cpp architecture are refused in one line.

mod common;

use std::collections::HashMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{stderr, succeeds, tinygpt};
use tinygpt::checkpoint::{Loaded, RunDir, TrainState};
use tinygpt::config::{Arch, Config, MlpKind, NormKind, PositionKind};
use tinygpt::gguf::GgufDtype;
use tinygpt::model::Gpt;
use tinygpt::tokenizer::Tokenizer;

const TEXT: &str = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?\n";

type Edit = fn(&mut Config);

fn gpt2(c: &mut Config) {
    c.model.arch = Arch::Gpt2;
    c.model.mlp = MlpKind::GeluTanh;
    c.model.bias = true;
}

fn llama(c: &mut Config) {
    c.model.arch = Arch::Llama;
    c.model.positions = PositionKind::Rope;
    c.model.norm = NormKind::RmsNorm;
    c.model.mlp = MlpKind::Swiglu;
    c.model.n_kv_head = Some(2);
    c.model.norm_eps = 1e-6;
}

/// A run folder holding a freshly initialised model (width `c`) of this config, with
/// tokenizer `tk`; biases and norm gains non-trivial so a mix-up cannot hide.
fn run_folder(dir: &Path, name: &str, c: usize, tk: &Tokenizer, edit: Edit) -> PathBuf {
    let mut config = Config::default();
    config.model.n_layer = 2;
    config.model.n_head = 4;
    config.model.n_embd = c;
    config.model.block_size = 16;
    config.model.vocab_size = tk.vocab_size();
    config.run.name = name.into();
    edit(&mut config);
    config.validate().unwrap();
    let model = Gpt::new(&config.model, 7, &Device::Cpu).unwrap();
    for (param, var) in model.params().iter() {
        let name = param.name.as_str();
        if name.ends_with(".bias") || name.contains("ln_") {
            let n = var.elem_count();
            let values: Vec<f32> = (0..n).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
            var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    let path = dir.join(name);
    RunDir::new(&path)
        .save(
            &config,
            tk,
            &model.params().to_map(),
            &HashMap::new(),
            &TrainState::default(),
        )
        .unwrap();
    path
}

fn char_tk() -> Tokenizer {
    Tokenizer::train_char(TEXT).unwrap()
}

fn logits(model: &Gpt) -> Vec<f32> {
    let ids = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]], &Device::Cpu).unwrap();
    let out = model.forward(&ids, 0, None, None).unwrap().logits;
    out.flatten_all().unwrap().to_vec1().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Exports `run` as GGUF in `dtype` and imports it back: (original, imported, file).
fn round_trip(dir: &Path, run: &Path, dtype: GgufDtype, tag: &str) -> (Loaded, Loaded, PathBuf) {
    let original = Loaded::load(run, &Device::Cpu).unwrap();
    let file = dir.join(format!("{tag}.gguf"));
    tinygpt::gguf::export(&original, &file, dtype).unwrap();
    let back = dir.join(format!("{tag}-back"));
    tinygpt::gguf::import(&file, &back).unwrap();
    let imported = Loaded::load(&back, &Device::Cpu).unwrap();
    (original, imported, file)
}

fn read_gguf(file: &Path) -> (gguf_file::Content, Vec<u8>) {
    let bytes = std::fs::read(file).unwrap();
    let content = gguf_file::Content::read(&mut Cursor::new(&bytes)).unwrap();
    (content, bytes)
}

#[test]
fn f32_export_then_import_is_the_identity() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, Edit); 7] = [
        ("gpt2", gpt2),
        // Padding rows past the characters: the first is the end of text.
        ("gpt2-padded", |c| {
            gpt2(c);
            c.model.vocab_size += 3;
        }),
        ("llama-padded", |c| {
            llama(c);
            c.model.vocab_size += 3;
        }),
        // The quick start's model: learned, LayerNorm, erf GELU, no biases.
        ("default", |_| {}),
        ("gpt2-grouped", |c| {
            gpt2(c);
            c.model.arch = Arch::Custom; // the gpt2 preset has no grouped K/V
            c.model.n_kv_head = Some(2);
        }),
        ("llama", llama),
        ("llama-bias", |c| {
            llama(c);
            c.model.arch = Arch::Custom;
            c.model.bias = true;
        }),
    ];
    for (name, edit) in cases {
        let run = run_folder(dir.path(), name, 32, &char_tk(), edit);
        let (a, b, file) = round_trip(dir.path(), &run, GgufDtype::F32, name);
        assert_eq!(
            a.config.model, b.config.model,
            "{name}: the same model config"
        );
        // llama.cpp refuses merges that are not an array of strings (an empty array is
        // written typed u32): a char vocabulary carries one merge that is no token.
        let (content, _) = read_gguf(&file);
        let merges = content.metadata["tokenizer.ggml.merges"].to_vec().unwrap();
        let merged = merges[0].to_string().unwrap().replace(' ', "");
        assert_eq!(merges.len(), 1, "{name}");
        let tokens = content.metadata["tokenizer.ggml.tokens"].to_vec().unwrap();
        assert!(
            tokens.iter().all(|t| t.to_string().unwrap() != &merged),
            "{name}: {merged} is a token"
        );
        // A char vocabulary's end of text, for llama.cpp to stop at (or --ignore-eos to
        // ban) in place of its default token 11, a character: the row past the
        // characters, a padding row where the model has them, else one more row of zeros.
        let chars = a.tokenizer.vocab_size();
        let md = &content.metadata;
        assert_eq!(
            md["tokenizer.ggml.eos_token_id"].to_u32().unwrap() as usize,
            chars,
            "{name}"
        );
        let rows = content.tensor_infos["token_embd.weight"].shape.dims()[0];
        let model_rows = a.config.model.vocab_size;
        match md.get("tinygpt.vocab_size") {
            Some(v) => {
                assert_eq!(
                    (v.to_u32().unwrap() as usize, rows),
                    (model_rows, chars + 1),
                    "{name}"
                );
                assert_eq!(
                    model_rows, chars,
                    "{name}: only an unpadded vocabulary gains a row"
                );
            }
            None => assert_eq!((rows, model_rows), (model_rows, chars + 3), "{name}"),
        }
        assert_eq!(tokens.len(), rows, "{name}");
        let (wa, wb) = (a.model.params().to_map(), b.model.params().to_map());
        assert_eq!(wa.len(), wb.len(), "{name}");
        for (k, t) in &wa {
            let u = wb.get(k).unwrap_or_else(|| panic!("{name}: {k} missing"));
            assert_eq!(
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                u.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "{name}: {k}"
            );
        }
        let err = max_diff(&logits(&a.model), &logits(&b.model));
        assert!(err <= 1e-6, "{name}: logits differ by {err}");
        assert_eq!(b.tokenizer.kind_name(), "char", "{name}");
        assert_eq!(
            b.tokenizer.encode(TEXT).unwrap(),
            a.tokenizer.encode(TEXT).unwrap()
        );
    }
}

/// The most a weight of `block` (its values before rounding) moves in `dtype`: f16
/// keeps 11 significant bits (half an ulp: |w| 2^-11, and subnormals' 2^-25); q8_0
/// stores round(w / d) with d = amax / 127 (half a step); q4_0 stores w / d + 8 in
/// 0..=15 with d = -max / 8, so the value opposite the block's extreme can clamp a
/// whole step. Both store d itself as f16, which moves a value of up to 127 (8) steps
/// by that many times d's rounding, d 2^-11.
fn weight_bound(dtype: GgmlDType, block: &[f32], w: f32) -> f32 {
    let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
    let f16_scale = 2f32.powi(-11);
    match dtype {
        GgmlDType::F32 => 0.0,
        GgmlDType::F16 => w.abs() * f16_scale + 2f32.powi(-25),
        GgmlDType::Q8_0 => {
            let d = amax / 127.0;
            d / 2.0 + 127.0 * d * f16_scale + 1e-9
        }
        GgmlDType::Q4_0 => {
            let d = amax / 8.0;
            d + 8.0 * d * f16_scale + 1e-9
        }
        other => panic!("no bound for {other:?}"),
    }
}

#[test]
fn lower_precisions_round_each_weight_within_their_format_and_keep_the_logits_close() {
    let dir = tempfile::tempdir().unwrap();
    // Width 256 and an MLP of 768 so q4_k's 256-blocks fit every matrix.
    let cases: [(&str, Edit); 2] = [
        ("gpt2", gpt2),
        ("llama", |c| {
            llama(c);
            c.model.mlp_hidden = Some(768);
        }),
    ];
    // (dtype, the bound on max |logit error| / max |logit|)
    let dtypes = [
        (GgufDtype::F16, 2e-3),
        (GgufDtype::Q8_0, 1e-2),
        (GgufDtype::Q4_0, 0.15),
        (GgufDtype::Q4K, 0.1),
    ];
    let mut report = Vec::new();
    for (name, edit) in cases {
        let run = run_folder(dir.path(), name, 256, &char_tk(), edit);
        for (dtype, logit_bound) in dtypes {
            let tag = format!("{name}-{dtype:?}");
            let (a, b, file) = round_trip(dir.path(), &run, dtype, &tag);
            let (content, _) = read_gguf(&file);
            // Matrices are in the format asked for (no fallback at these widths), the
            // rest f32 (f16 position table for f16).
            for (n, info) in &content.tensor_infos {
                let want = match (info.shape.rank(), n.as_str(), dtype) {
                    (2, "position_embd.weight", GgufDtype::F16) => GgmlDType::F16,
                    (2, "position_embd.weight", _) => GgmlDType::F32,
                    (2, _, GgufDtype::F16) => GgmlDType::F16,
                    (2, _, GgufDtype::Q8_0) => GgmlDType::Q8_0,
                    (2, _, GgufDtype::Q4_0) => GgmlDType::Q4_0,
                    (2, _, GgufDtype::Q4K) => GgmlDType::Q4K,
                    _ => GgmlDType::F32,
                };
                assert_eq!(info.ggml_dtype, want, "{tag}: {n}");
            }
            // Every weight within its format's rounding (q4_k's two-level scales have
            // no simple bound: the logits check covers it).
            if dtype != GgufDtype::Q4K {
                let fmt = match dtype {
                    GgufDtype::F16 => GgmlDType::F16,
                    GgufDtype::Q8_0 => GgmlDType::Q8_0,
                    _ => GgmlDType::Q4_0,
                };
                let wb = b.model.params().to_map();
                for (k, t) in a.model.params().to_map() {
                    let x: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                    let y: Vec<f32> = wb[&k].flatten_all().unwrap().to_vec1().unwrap();
                    let matrix = t.rank() == 2 && k != "wpe.weight";
                    let f = match (matrix, k.as_str()) {
                        (true, _) => fmt,
                        (false, "wpe.weight") if fmt == GgmlDType::F16 => fmt,
                        _ => GgmlDType::F32,
                    };
                    // Blocks of 32 along each row (the rows of llama's q and k are
                    // reordered whole).
                    let width = *t.dims().last().unwrap();
                    for (i, (&u, &v)) in x.iter().zip(&y).enumerate() {
                        let s = i - (i % width) % 32;
                        let end = (s + 32).min(i - i % width + width);
                        let bound = weight_bound(f, &x[s..end], u);
                        assert!(
                            (u - v).abs() <= bound,
                            "{tag}: {k}[{i}] {u} -> {v}, bound {bound}"
                        );
                    }
                }
            }
            let (la, lb) = (logits(&a.model), logits(&b.model));
            let scale = la.iter().fold(0f32, |m, x| m.max(x.abs()));
            let rel = max_diff(&la, &lb) / scale;
            report.push(format!(
                "{tag}: {} bytes, logits max rel err {rel:.2e}",
                std::fs::metadata(&file).unwrap().len()
            ));
            assert!(
                rel <= logit_bound,
                "{tag}: logits off by {rel} of their range"
            );
        }
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn blocks_that_do_not_fit_fall_back_as_llama_cpp_does() {
    let dir = tempfile::tempdir().unwrap();
    // Width 32: q4_k's 256-blocks do not fit, q5_0's 32-blocks do.
    let run = run_folder(dir.path(), "small", 32, &char_tk(), llama);
    let loaded = Loaded::load(&run, &Device::Cpu).unwrap();
    let file = dir.path().join("small.gguf");
    let done = tinygpt::gguf::export(&loaded, &file, GgufDtype::Q4K).unwrap();
    assert!(!done.fallbacks.is_empty());
    let (content, _) = read_gguf(&file);
    assert_eq!(
        content.tensor_infos["blk.0.attn_q.weight"].ggml_dtype,
        GgmlDType::Q5_0
    );
    tinygpt::gguf::import(&file, &dir.path().join("back")).unwrap();
}

#[test]
fn llama_cpp_names_shapes_and_keys() {
    let dir = tempfile::tempdir().unwrap();
    let bpe = Tokenizer::train_bpe(&common::random_words(1, 2000, 6), 300).unwrap();
    // gpt2 without biases: llama.cpp's gpt2 needs them, so zeros are written.
    let run = run_folder(dir.path(), "g", 32, &bpe, |_| {});
    let (a, b, file) = round_trip(dir.path(), &run, GgufDtype::F32, "g");
    let (content, _) = read_gguf(&file);
    let md = &content.metadata;
    let s = |k: &str| md[k].to_string().unwrap().clone();
    let u = |k: &str| md[k].to_u32().unwrap();
    assert_eq!(s("general.architecture"), "gpt2");
    assert_eq!(s("tokenizer.ggml.model"), "gpt2");
    assert_eq!(s("tokenizer.ggml.pre"), "gpt-2");
    assert_eq!(u("gpt2.context_length"), 16);
    assert_eq!(u("gpt2.embedding_length"), 32);
    assert_eq!(u("gpt2.block_count"), 2);
    assert_eq!(u("gpt2.feed_forward_length"), 128);
    assert_eq!(u("gpt2.attention.head_count"), 4);
    assert_eq!(u("gpt2.attention.head_count_kv"), 4);
    assert_eq!(
        md["gpt2.attention.layer_norm_epsilon"].to_f32().unwrap(),
        1e-5
    );
    assert_eq!(u("general.file_type"), 0);
    let eot = a.tokenizer.end_of_text().unwrap();
    assert_eq!(u("tokenizer.ggml.eos_token_id"), eot);
    assert_eq!(u("tokenizer.ggml.bos_token_id"), eot);
    let tokens = md["tokenizer.ggml.tokens"].to_vec().unwrap();
    assert_eq!(tokens.len(), a.tokenizer.vocab_size());
    let types = md["tokenizer.ggml.token_type"].to_vec().unwrap();
    assert_eq!(
        types[eot as usize].to_i32().unwrap(),
        3,
        "end-of-text is a control token"
    );
    let control = types.iter().filter(|t| t.to_i32().unwrap() == 3).count();
    assert_eq!(control, 1, "the rest are normal tokens");
    let merges = md["tokenizer.ggml.merges"].to_vec().unwrap();
    assert_eq!(
        merges.len(),
        a.tokenizer.vocab_size() - 257,
        "one merge per learned token"
    );
    // Shapes as candle reads them: ours, (d_out, d_in); GGUF's ne is the reverse.
    let shape = |n: &str| content.tensor_infos[n].shape.dims().to_vec();
    let v = a.tokenizer.vocab_size();
    assert_eq!(shape("token_embd.weight"), [v, 32]);
    assert_eq!(shape("position_embd.weight"), [16, 32]);
    assert_eq!(shape("blk.1.attn_qkv.weight"), [96, 32]);
    assert_eq!(shape("blk.1.attn_qkv.bias"), [96]);
    assert_eq!(shape("blk.1.attn_output.weight"), [32, 32]);
    assert_eq!(shape("blk.1.ffn_up.weight"), [128, 32]);
    assert_eq!(shape("blk.1.ffn_down.weight"), [32, 128]);
    assert_eq!(shape("output_norm.bias"), [32]);
    assert!(!content.tensor_infos.contains_key("output.weight"), "tied");
    assert_eq!(content.tensor_infos.len(), 2 + 2 * 12 + 2);
    // Zero biases came back as no biases: the same model as exported.
    assert!(!b.config.model.bias);
    assert_eq!(b.tokenizer.kind_name(), "bpe");
    let text = common::random_words(9, 200, 8) + "<|endoftext|>zz";
    assert_eq!(
        b.tokenizer.encode(&text).unwrap(),
        a.tokenizer.encode(&text).unwrap()
    );
    assert_eq!(max_diff(&logits(&a.model), &logits(&b.model)), 0.0);

    // Llama: separate projections, RoPE's q/k rows in llama.cpp's pair order.
    let run = run_folder(dir.path(), "l", 32, &bpe, llama);
    let (a, _, file) = round_trip(dir.path(), &run, GgufDtype::F32, "l");
    let (content, bytes) = read_gguf(&file);
    let md = &content.metadata;
    assert_eq!(md["general.architecture"].to_string().unwrap(), "llama");
    assert_eq!(md["llama.attention.head_count_kv"].to_u32().unwrap(), 2);
    assert_eq!(md["llama.rope.freq_base"].to_f32().unwrap(), 10000.0);
    assert_eq!(md["llama.rope.dimension_count"].to_u32().unwrap(), 8);
    assert_eq!(
        md["llama.attention.layer_norm_rms_epsilon"]
            .to_f32()
            .unwrap(),
        1e-6
    );
    let shape = |n: &str| content.tensor_infos[n].shape.dims().to_vec();
    assert_eq!(shape("blk.0.attn_q.weight"), [32, 32]);
    assert_eq!(shape("blk.0.attn_k.weight"), [16, 32]);
    assert_eq!(shape("blk.0.attn_v.weight"), [16, 32]);
    assert_eq!(shape("blk.0.ffn_gate.weight"), [88, 32]);
    assert_eq!(shape("blk.0.ffn_up.weight"), [88, 32]);
    assert_eq!(shape("blk.0.ffn_down.weight"), [32, 88]);
    assert!(!content.tensor_infos.contains_key("position_embd.weight"));
    let k = content
        .tensor(
            &mut Cursor::new(&bytes),
            "blk.0.attn_k.weight",
            &Device::Cpu,
        )
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap();
    let ours = &a.model.params().to_map()["h.0.attn.c_attn.weight"];
    // K head 1 (rows 40..48 of q|k|v), head_dim 8: llama.cpp's rows (2j, 2j + 1) are
    // our (j, j + 4).
    let row = |t: &Tensor, r: usize| -> Vec<f32> { t.get(r).unwrap().to_vec1().unwrap() };
    for j in 0..4 {
        assert_eq!(row(&k, 8 + 2 * j), row(ours, 32 + 8 + j));
        assert_eq!(row(&k, 8 + 2 * j + 1), row(ours, 32 + 8 + j + 4));
    }
}

/// A GGUF file of these metadata and tensors.
fn write_gguf(path: &Path, meta: &[(String, Value)], tensors: &[(String, Tensor)]) {
    let q: Vec<(&str, QTensor)> = tensors
        .iter()
        .map(|(n, t)| {
            // Its own storage: candle quantizes a view's whole buffer.
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let t = Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap();
            (n.as_str(), QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let q: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta, &q).unwrap();
}

/// Runs the binary, asserting exit 2 and one stderr line holding each of `needles`.
fn refused(dir: &Path, args: &[&str], needles: &[&str]) {
    let out = tinygpt(dir, args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err:?} lacks {n:?}");
    }
}

/// A BPE vocabulary without its merges would encode every text as single bytes:
/// refused, not imported as a model that sees text it never saw in training.
#[test]
fn a_bpe_vocabulary_without_its_merges_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bpe = Tokenizer::train_bpe(&common::random_words(1, 2000, 6), 300).unwrap();
    let run = run_folder(d, "g", 32, &bpe, |_| {});
    let (_, _, file) = round_trip(d, &run, GgufDtype::F32, "g");
    let (content, bytes) = read_gguf(&file);
    let tensors: Vec<(String, Tensor)> = content
        .tensor_infos
        .keys()
        .map(|n| {
            let t = content
                .tensor(&mut Cursor::new(&bytes), n, &Device::Cpu)
                .unwrap();
            (n.clone(), t.dequantize(&Device::Cpu).unwrap())
        })
        .collect();
    let meta: Vec<(String, Value)> = content
        .metadata
        .into_iter()
        .filter(|(k, _)| k != "tokenizer.ggml.merges")
        .collect();
    write_gguf(&d.join("merges.gguf"), &meta, &tensors);
    refused(
        d,
        &["import", "--from", "merges.gguf", "--out", "x"],
        &["tokenizer.ggml.merges is missing", "300 tokens"],
    );
}

#[test]
fn bad_files_and_models_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = run_folder(d, "ok", 32, &char_tk(), gpt2);
    succeeds(
        d,
        &[
            "export",
            "--format",
            "gguf",
            "--checkpoint",
            "ok",
            "--out",
            "ok.gguf",
        ],
    );
    let good = std::fs::read(d.join("ok.gguf")).unwrap();
    // A GGUF file where a run folder goes: the import that makes one.
    refused(
        d,
        &["info", "--checkpoint", "ok.gguf"],
        &[
            "is a GGUF file",
            "tinygpt import --from ok.gguf --out checkpoints/ok",
        ],
    );
    // Truncated: in the tensor data, and in the header.
    std::fs::write(d.join("cut.gguf"), &good[..good.len() - 1000]).unwrap();
    refused(
        d,
        &["import", "--from", "cut.gguf", "--out", "x1"],
        &["cut.gguf", "truncated"],
    );
    std::fs::write(d.join("head.gguf"), &good[..200]).unwrap();
    refused(
        d,
        &["import", "--from", "head.gguf", "--out", "x2"],
        &["head.gguf", "not a readable GGUF"],
    );
    std::fs::write(d.join("text.gguf"), "hello").unwrap();
    refused(
        d,
        &["import", "--from", "text.gguf", "--out", "x3"],
        &["text.gguf"],
    );
    // Another architecture.
    let (content, bytes) = read_gguf(&d.join("ok.gguf"));
    let mut meta: Vec<(String, Value)> = content.metadata.clone().into_iter().collect();
    let tensors: Vec<(String, Tensor)> = content
        .tensor_infos
        .keys()
        .map(|n| {
            let t = content
                .tensor(&mut Cursor::new(&bytes), n, &Device::Cpu)
                .unwrap();
            (n.clone(), t.dequantize(&Device::Cpu).unwrap())
        })
        .collect();
    for (k, v) in meta.iter_mut() {
        if k == "general.architecture" {
            *v = Value::String("mamba".into());
        }
    }
    write_gguf(&d.join("mamba.gguf"), &meta, &tensors);
    refused(
        d,
        &["import", "--from", "mamba.gguf", "--out", "x4"],
        &["\"mamba\"", "gpt2 and llama"],
    );
    // A char vocabulary without the key that says so: read as BPE, its one merge
    // makes no token.
    let meta: Vec<(String, Value)> = content
        .metadata
        .clone()
        .into_iter()
        .filter(|(k, _)| k != "tinygpt.tokenizer")
        .collect();
    write_gguf(&d.join("keyless.gguf"), &meta, &tensors);
    refused(
        d,
        &["import", "--from", "keyless.gguf", "--out", "x5"],
        &["which is not one of its tokens", "tinygpt.tokenizer"],
    );
    // Nor is such a file, written by another tool, replaced by an export; an earlier
    // export of ours is.
    let theirs = std::fs::read(d.join("keyless.gguf")).unwrap();
    refused(
        d,
        &[
            "export",
            "--format",
            "gguf",
            "--checkpoint",
            "ok",
            "--out",
            "keyless.gguf",
        ],
        &["keyless.gguf", "tinygpt did not write"],
    );
    assert_eq!(std::fs::read(d.join("keyless.gguf")).unwrap(), theirs);
    // No --format: a name ending in .gguf says it.
    succeeds(d, &["export", "--checkpoint", "ok", "--out", "named.gguf"]);
    assert!(std::fs::read(d.join("named.gguf"))
        .unwrap()
        .starts_with(b"GGUF"));
    succeeds(
        d,
        &[
            "export",
            "--format",
            "gguf",
            "--checkpoint",
            "ok",
            "--out",
            "ok.gguf",
        ],
    );
    // An activation tinygpt does not have, and a block count no real file holds (it
    // was allocated before it was checked).
    let cases = [
        (
            "tinygpt.mlp",
            Value::String("relu".into()),
            &["tinygpt.mlp", "\"relu\""][..],
        ),
        (
            "gpt2.block_count",
            Value::U64(1 << 32),
            &["n_layer = 4294967296 exceeds"][..],
        ),
    ];
    for (key, value, needles) in cases {
        let meta: Vec<(String, Value)> = content
            .metadata
            .clone()
            .into_iter()
            .map(|(k, v)| if k == key { (k, value.clone()) } else { (k, v) })
            .collect();
        write_gguf(&d.join("edited.gguf"), &meta, &tensors);
        refused(
            d,
            &["import", "--from", "edited.gguf", "--out", "x6"],
            needles,
        );
    }
    // A tensor of the wrong shape.
    let meta: Vec<(String, Value)> = content.metadata.clone().into_iter().collect();
    let mut tensors = tensors;
    for (n, t) in tensors.iter_mut() {
        if n == "blk.1.ffn_up.weight" {
            *t = t.narrow(0, 0, 64).unwrap();
        }
    }
    write_gguf(&d.join("shape.gguf"), &meta, &tensors);
    refused(
        d,
        &["import", "--from", "shape.gguf", "--out", "x5"],
        &["blk.1.ffn_up.weight", "shape"],
    );
    // Models without a llama.cpp architecture, and vocabularies without byte tokens.
    run_folder(d, "sin", 32, &char_tk(), |c| {
        c.model.positions = PositionKind::Sinusoidal
    });
    refused(
        d,
        &[
            "export",
            "--format",
            "gguf",
            "--checkpoint",
            "sin",
            "--out",
            "s.gguf",
        ],
        &["sinusoidal", "llama.cpp"],
    );
    let accented = Tokenizer::train_char("abc é\n").unwrap();
    run_folder(d, "acc", 32, &accented, gpt2);
    refused(
        d,
        &[
            "export",
            "--format",
            "gguf",
            "--checkpoint",
            "acc",
            "--out",
            "a.gguf",
        ],
        &["'é'", "ASCII"],
    );
    assert!(!d.join("a.gguf").exists());
    refused(
        d,
        &[
            "export",
            "--checkpoint",
            "ok",
            "--out",
            "hf",
            "--dtype",
            "q8_0",
        ],
        &["--format gguf"],
    );
    std::fs::write(d.join("notes.txt"), "mine").unwrap();
    refused(
        d,
        &[
            "export",
            "--format",
            "gguf",
            "--checkpoint",
            "ok",
            "--out",
            "notes.txt",
        ],
        &["not a GGUF file"],
    );
    assert!(run.is_dir());
}

#[test]
fn the_cli_round_trip_generates_the_same_text() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    run_folder(d, "run", 32, &char_tk(), llama);
    for dtype in ["f32", "q8_0"] {
        let file = format!("m-{dtype}.gguf");
        let back = format!("back-{dtype}");
        let out = succeeds(
            d,
            &[
                "export",
                "--format",
                "gguf",
                "--dtype",
                dtype,
                "--checkpoint",
                "run",
                "--out",
                &file,
            ],
        );
        assert!(stderr(&out).contains("llama"), "{}", stderr(&out));
        succeeds(d, &["import", "--from", &file, "--out", &back]);
        if dtype == "f32" {
            let gen = |ckpt: &str| {
                let args = [
                    "generate",
                    "--checkpoint",
                    ckpt,
                    "--prompt",
                    "abc",
                    "--temperature",
                    "0",
                    "--max-new-tokens",
                    "40",
                ];
                String::from_utf8(succeeds(d, &args).stdout).unwrap()
            };
            let text = gen("run");
            assert!(text.len() > 40, "{text:?}");
            assert_eq!(gen(&back), text);
        }
    }
}

/// Reads a file with the `gguf` package llama.cpp maintains (gguf-py, from PyPI) and
/// checks what it sees against `expect` (JSON: arch, keys, tensors as GGUF shapes).
const GGUF_PY_CHECK: &str = r#"
import json, sys
import gguf
expect = json.loads(sys.argv[1])
r = gguf.GGUFReader(expect["path"])
def value(key):
    f = r.fields[key]
    if hasattr(f, "contents"):
        return f.contents()
    return bytes(f.parts[f.data[0]]).decode()
assert value("general.architecture") == expect["arch"], value("general.architecture")
missing = [k for k in expect["keys"] if k not in r.fields]
assert not missing, f"missing keys {missing}"
assert value("tokenizer.ggml.model") == "gpt2"
assert len(r.fields["tokenizer.ggml.tokens"].data) == expect["vocab"]
seen = {t.name: [int(x) for x in t.shape] for t in r.tensors}
assert seen == expect["tensors"], f"{seen} != {expect['tensors']}"
print("gguf-py read", len(seen), "tensors", len(r.fields), "keys")
"#;

/// A Python with the `gguf` package: target/gguf-venv, made here with pip if missing.
fn gguf_python() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/gguf-venv");
    let python = venv.join("bin/python");
    let ready = |p: &Path| {
        std::process::Command::new(p)
            .args(["-c", "import gguf"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ready(&python) {
        let made = std::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .is_ok_and(|s| s.success())
            && std::process::Command::new(venv.join("bin/pip"))
                .args(["install", "-q", "--disable-pip-version-check", "gguf"])
                .status()
                .is_ok_and(|s| s.success());
        if !made {
            return None;
        }
    }
    ready(&python).then_some(python)
}

#[test]
fn the_gguf_package_from_pypi_reads_the_files() {
    let Some(python) = gguf_python() else {
        eprintln!("SKIPPED: no python3 with pip to make target/gguf-venv (pip install gguf)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let bpe = Tokenizer::train_bpe(&common::random_words(1, 2000, 6), 300).unwrap();
    let cases: [(&str, Edit, GgufDtype); 2] = [
        ("gpt2", gpt2, GgufDtype::Q8_0),
        ("llama", llama, GgufDtype::F16),
    ];
    for (name, edit, dtype) in cases {
        let run = run_folder(dir.path(), name, 32, &bpe, edit);
        let loaded = Loaded::load(&run, &Device::Cpu).unwrap();
        let file = dir.path().join(format!("{name}.gguf"));
        tinygpt::gguf::export(&loaded, &file, dtype).unwrap();
        let (content, _) = read_gguf(&file);
        // `tinygpt serve`'s chat template, for llama-server to build its prompts
        // (tools/gguf-llamacpp-check.sh has llama-server apply it).
        assert_eq!(
            content.metadata["tokenizer.chat_template"]
                .to_string()
                .unwrap(),
            tinygpt::serve::chat::JINJA
        );
        // GGUF's order: innermost first.
        let tensors: serde_json::Map<String, serde_json::Value> = content
            .tensor_infos
            .iter()
            .map(|(n, i)| {
                let ne: Vec<usize> = i.shape.dims().iter().rev().copied().collect();
                (n.clone(), serde_json::json!(ne))
            })
            .collect();
        assert_eq!(tensors["token_embd.weight"], serde_json::json!([32, 300]));
        let a = name;
        let mut keys = vec![
            "general.architecture".to_string(),
            "general.file_type".into(),
            "tokenizer.ggml.pre".into(),
            "tokenizer.ggml.tokens".into(),
            "tokenizer.ggml.token_type".into(),
            "tokenizer.ggml.merges".into(),
            "tokenizer.ggml.eos_token_id".into(),
            "tokenizer.chat_template".into(),
        ];
        for k in [
            "context_length",
            "embedding_length",
            "block_count",
            "feed_forward_length",
            "attention.head_count",
            "attention.head_count_kv",
        ] {
            keys.push(format!("{a}.{k}"));
        }
        keys.push(match name {
            "gpt2" => "gpt2.attention.layer_norm_epsilon".into(),
            _ => "llama.attention.layer_norm_rms_epsilon".into(),
        });
        let expect = serde_json::json!({
            "path": file, "arch": name, "keys": keys, "vocab": 300, "tensors": tensors,
        });
        let out = std::process::Command::new(&python)
            .args(["-c", GGUF_PY_CHECK, &expect.to_string()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{name}: {}", String::from_utf8_lossy(&out.stdout).trim());
    }
}
