//! Hugging Face checkpoints, both ways: `export` writes a run as a `transformers` model
//! folder (config.json, model.safetensors, tokenizer.json); `import` reads one (GPT-2
//! or Llama layout, sharded or not) into a run folder.
//!
//! The mapping, our name <-> Hugging Face's (i = layer):
//!
//! | ours | GPT2LMHeadModel | LlamaForCausalLM |
//! |---|---|---|
//! | wte.weight | transformer.wte.weight | model.embed_tokens.weight |
//! | wpe.weight | transformer.wpe.weight | – (RoPE) |
//! | h.i.ln_1.* | transformer.h.i.ln_1.* | model.layers.i.input_layernorm.weight |
//! | h.i.attn.c_attn.* | transformer.h.i.attn.c_attn.* (transposed) | self_attn.{q,k,v}_proj (row blocks) |
//! | h.i.attn.c_proj.* | transformer.h.i.attn.c_proj.* (transposed) | self_attn.o_proj |
//! | h.i.ln_2.* | transformer.h.i.ln_2.* | post_attention_layernorm.weight |
//! | h.i.mlp.c_fc.* | transformer.h.i.mlp.c_fc.* (transposed) | mlp.{gate,up}_proj (row blocks) |
//! | h.i.mlp.c_proj.* | transformer.h.i.mlp.c_proj.* (transposed) | mlp.down_proj |
//! | ln_f.* | transformer.ln_f.* | model.norm.weight |
//!
//! GPT-2's Conv1D layers store weights as [in, out], the transpose of a linear layer's
//! [out, in]; Llama's are [out, in] like ours. The output layer is tied to wte in both.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::checkpoint::{Loaded, RunDir, TrainState};
use crate::config::{Arch, Config, MlpKind, ModelConfig, NormKind, PositionKind, TokenizerKind};
use crate::error::user_error;
use crate::model::spec::{BlockParams, LinearParams, NormParams, ParamId, Shapes};
use crate::model::{Gpt, ModelSpec};
use crate::serve::chat::JINJA as CHAT_TEMPLATE;
use crate::tokenizer::Tokenizer;
use crate::user_bail;
use crate::util::write_atomic;

/// Which Hugging Face model class a config maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfLayout {
    Gpt2,
    Llama,
}

impl HfLayout {
    /// The family as Hugging Face names it.
    pub fn name(self) -> &'static str {
        match self {
            HfLayout::Gpt2 => "GPT-2",
            HfLayout::Llama => "Llama",
        }
    }
}

/// Llama's names for one block's norms (ours: ln_1, ln_2).
fn llama_norms(b: &BlockParams) -> [(NormParams, &'static str); 2] {
    [
        (b.ln_1, "input_layernorm"),
        (b.ln_2, "post_attention_layernorm"),
    ]
}

/// Llama's projections for each of a block's: ours are theirs stacked by rows, in
/// this order, with these row counts (q: C; k, v: the K/V width; gate, up: hidden).
fn llama_projections(
    b: &BlockParams,
    s: &Shapes,
) -> [(LinearParams, Vec<(&'static str, usize)>); 4] {
    [
        (
            b.attn_qkv,
            vec![
                ("self_attn.q_proj", s.n_embd),
                ("self_attn.k_proj", s.kv_width),
                ("self_attn.v_proj", s.kv_width),
            ],
        ),
        (b.attn_proj, vec![("self_attn.o_proj", s.n_embd)]),
        (
            b.mlp_fc,
            vec![
                ("mlp.gate_proj", s.mlp_hidden),
                ("mlp.up_proj", s.mlp_hidden),
            ],
        ),
        (b.mlp_proj, vec![("mlp.down_proj", s.n_embd)]),
    ]
}

/// The spec of `m` as GPT-2 stores it: GPT-2's names are ours under `transformer.`,
/// and its files always hold biases, so this spec names every tensor of the file.
fn gpt2_spec(m: &ModelConfig) -> ModelSpec {
    ModelSpec::new(&ModelConfig {
        bias: true,
        ..m.clone()
    })
}

/// Whether `id` is a linear layer's weight: GPT-2's Conv1D stores those [in, out].
fn is_linear_weight(spec: &ModelSpec, id: ParamId) -> bool {
    spec.blocks
        .iter()
        .any(|b| b.linears().iter().any(|l| l.weight == id))
}

/// The Hugging Face class this model is exactly, or an error naming the option that has
/// no equivalent there.
pub fn layout_for(m: &ModelConfig) -> Result<HfLayout> {
    match (m.positions, m.norm, m.mlp) {
        (PositionKind::Learned, NormKind::LayerNorm, MlpKind::Gelu | MlpKind::GeluTanh) => {
            if m.kv_heads() != m.n_head {
                user_bail!(
                    "model.n_kv_head = {} has no GPT-2 equivalent (GPT-2 has one K/V head per query head); export needs n_kv_head = n_head",
                    m.kv_heads()
                );
            }
            Ok(HfLayout::Gpt2)
        }
        (PositionKind::Rope, NormKind::RmsNorm, MlpKind::Swiglu) => Ok(HfLayout::Llama),
        (PositionKind::Sinusoidal, _, _) => user_bail!(
            "model.positions = \"sinusoidal\" has no Hugging Face equivalent in GPT-2 or Llama; use learned (GPT-2) or rope (Llama)"
        ),
        (PositionKind::Learned, _, _) => user_bail!(
            "learned positions map to GPT-2, which needs model.norm = \"layernorm\" and model.mlp = \"gelu\" or \"gelu_tanh\" (this model has model.norm = \"{}\", model.mlp = \"{}\")",
            m.norm,
            m.mlp
        ),
        (PositionKind::Rope, _, _) => user_bail!(
            "RoPE maps to Llama, which needs model.norm = \"rmsnorm\" and model.mlp = \"swiglu\" (this model has model.norm = \"{}\", model.mlp = \"{}\"); or set model.arch = \"llama\"",
            m.norm,
            m.mlp
        ),
    }
}

fn host(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
}

/// The files `export` writes.
const EXPORT_FILES: [&str; 4] = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

/// Refuses an `--out` that holds anything but an earlier export (only the files export
/// writes, with a config.json of the classes it writes), so no file of the user's is
/// overwritten.
pub fn check_export_folder(out: &Path) -> Result<()> {
    if out.is_file() {
        user_bail!(
            "--out {} is a file; pass a folder to create (e.g. hf/<name>)",
            out.display()
        );
    }
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(());
    };
    let names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    let others: Vec<&String> = names
        .iter()
        .filter(|n| !EXPORT_FILES.contains(&n.as_str()))
        .collect();
    let json = |name: &str| {
        std::fs::read(out.join(name))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    };
    let our_config = json("config.json").is_some_and(|c| {
        c["architectures"] == json!(["GPT2LMHeadModel"])
            || c["architectures"] == json!(["LlamaForCausalLM"])
    });
    // Ours has only these keys (the end-of-text token's where there is one, the chat
    // template since 2026-12-06), its class the fast tokenizer's and its template
    // serve's; transformers' save_pretrained writes many more.
    const OUR_TOKENIZER_KEYS: [&str; 5] = [
        "bos_token",
        "chat_template",
        "eos_token",
        "model_max_length",
        "tokenizer_class",
    ];
    let our_tokenizer_config = json("tokenizer_config.json").is_some_and(|c| {
        c.as_object()
            .is_some_and(|o| o.keys().all(|k| OUR_TOKENIZER_KEYS.contains(&k.as_str())))
            && c["tokenizer_class"] == "PreTrainedTokenizerFast"
            && (c.get("chat_template").is_none() || c["chat_template"] == CHAT_TEMPLATE)
    });
    let ours = our_config && our_tokenizer_config;
    if others.is_empty() && ours && out.join("model.safetensors").is_file() {
        return Ok(());
    }
    let shown: Vec<&str> = match others.is_empty() {
        true => names.iter().map(String::as_str).take(4).collect(),
        false => others.iter().map(|n| n.as_str()).take(4).collect(),
    };
    user_bail!(
        "--out {} holds files that are not an earlier export ({}); pass a new or empty folder, e.g. --out {}-hf",
        out.display(),
        shown.join(", "),
        out.display().to_string().trim_end_matches('/')
    )
}

/// Writes `loaded` as a Hugging Face model folder.
pub fn export(loaded: &Loaded, out: &Path) -> Result<HfLayout> {
    check_export_folder(out)?;
    let m = &loaded.config.model;
    // A trained model's architecture is fixed: say that only training anew helps.
    let layout = layout_for(m).map_err(|e| {
        crate::error::user_error(format!(
            "{e:#}; a trained model cannot change these, so train one with them to export it"
        ))
    })?;
    let spec = loaded.model.spec();
    let ours = loaded.model.params().to_map();
    let get = |id: ParamId| -> Result<Tensor> { host(&ours[&spec[id].name]) };
    let c = m.n_embd;
    let hidden = m.mlp_hidden();
    let mut hf: HashMap<String, Tensor> = HashMap::new();
    match layout {
        HfLayout::Gpt2 => {
            let full = gpt2_spec(m);
            for id in full.ids() {
                let p = &full[id];
                // Biases this model lacks are zeros.
                let t = match ours.get(&p.name) {
                    Some(t) => host(t)?,
                    None => Tensor::zeros(p.shape.as_slice(), DType::F32, &Device::Cpu)?,
                };
                let t = if is_linear_weight(&full, id) {
                    t.t()?.contiguous()?
                } else {
                    t
                };
                hf.insert(format!("transformer.{}", p.name), t);
            }
        }
        HfLayout::Llama => {
            hf.insert("model.embed_tokens.weight".into(), get(spec.wte)?);
            for (i, b) in spec.blocks.iter().enumerate() {
                let l = format!("model.layers.{i}");
                for (norm, hf_norm) in llama_norms(b) {
                    hf.insert(format!("{l}.{hf_norm}.weight"), get(norm.weight)?);
                }
                for (linear, parts) in llama_projections(b, &spec.shapes) {
                    let w = get(linear.weight)?;
                    let bias = linear.bias.map(get).transpose()?;
                    let mut start = 0;
                    for (hf_name, rows) in parts {
                        let w = w.narrow(0, start, rows)?.contiguous()?;
                        hf.insert(format!("{l}.{hf_name}.weight"), w);
                        if let Some(b) = &bias {
                            let b = b.narrow(0, start, rows)?.contiguous()?;
                            hf.insert(format!("{l}.{hf_name}.bias"), b);
                        }
                        start += rows;
                    }
                }
            }
            hf.insert("model.norm.weight".into(), get(spec.ln_f.weight)?);
        }
    }

    std::fs::create_dir_all(out)
        .map_err(|e| user_error(format!("cannot create {}: {e}", out.display())))?;
    let tk = &loaded.tokenizer;
    let eot = tk.end_of_text();
    let config = match layout {
        HfLayout::Gpt2 => json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": m.vocab_size,
            "n_positions": m.block_size,
            "n_ctx": m.block_size,
            "n_embd": c,
            "n_layer": m.n_layer,
            "n_head": m.n_head,
            "n_inner": hidden,
            "activation_function": if m.mlp == MlpKind::GeluTanh { "gelu_new" } else { "gelu" },
            "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "tie_word_embeddings": true,
            "bos_token_id": eot, "eos_token_id": eot,
            "torch_dtype": "float32",
        }),
        HfLayout::Llama => json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": m.vocab_size,
            "hidden_size": c,
            "intermediate_size": hidden,
            "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head,
            "num_key_value_heads": m.kv_heads(),
            "head_dim": m.head_dim(),
            "max_position_embeddings": m.block_size,
            "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta,
            "rope_scaling": null,
            "hidden_act": "silu",
            "attention_bias": m.bias,
            "mlp_bias": m.bias,
            "tie_word_embeddings": true,
            "bos_token_id": eot, "eos_token_id": eot,
            "torch_dtype": "float32",
        }),
    };
    let bytes = crate::checkpoint::serialize_tensors(
        &hf,
        Some(HashMap::from([("format".to_string(), "pt".to_string())])),
    )?;
    write_atomic(&out.join("model.safetensors"), &bytes)?;
    write_atomic(
        &out.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    write_atomic(&out.join("tokenizer.json"), tk.to_json()?.as_bytes())?;
    let mut tok_config =
        json!({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": m.block_size});
    if let Some(eot) = eot.and_then(|id| tk.token_text(id)) {
        tok_config["eos_token"] = json!(eot);
        tok_config["bos_token"] = json!(eot);
    }
    // `apply_chat_template` then builds `tinygpt serve`'s chat prompts.
    tok_config["chat_template"] = json!(CHAT_TEMPLATE);
    write_atomic(
        &out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_config)?.as_bytes(),
    )?;
    Ok(layout)
}

/// Reads the tensors of a Hugging Face folder: model.safetensors, or the shards listed in
/// model.safetensors.index.json.
fn read_hf_tensors(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if single.is_file() {
        vec![single]
    } else if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| user_error(format!("cannot read {}: {e}", index.display())))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| user_error(format!("{} is not valid JSON: {e}", index.display())))?;
        let map = v["weight_map"]
            .as_object()
            .ok_or_else(|| user_error(format!("{} has no weight_map", index.display())))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        files.into_iter().map(|f| dir.join(f)).collect()
    } else {
        user_bail!(
            "{} has no model.safetensors or model.safetensors.index.json (PyTorch .bin files are not read: convert them to safetensors)",
            dir.display()
        );
    };
    let mut tensors = HashMap::new();
    for file in files {
        let bytes = std::fs::read(&file)
            .map_err(|e| user_error(format!("cannot read {}: {e}", file.display())))?;
        let part = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| {
            user_error(format!(
                "{} is not a valid safetensors file ({e})",
                file.display()
            ))
        })?;
        tensors.extend(part);
    }
    Ok(tensors)
}

/// Removes tensor `name` (as f32), or fails naming it.
fn take(tensors: &mut HashMap<String, Tensor>, name: &str, dir: &Path) -> Result<Tensor> {
    let t = tensors
        .remove(name)
        .ok_or_else(|| user_error(format!("{}: tensor {name} is missing", dir.display())))?;
    if !t.dtype().is_float() {
        user_bail!(
            "{}: tensor {name} holds {:?} numbers; weights are floating point (f32, f16, bf16)",
            dir.display(),
            t.dtype()
        );
    }
    Ok(t.to_dtype(DType::F32)?)
}

fn usize_field(config: &Value, key: &str, path: &Path) -> Result<usize> {
    config[key].as_u64().map(|v| v as usize).ok_or_else(|| {
        user_error(format!(
            "{}: missing or non-integer \"{key}\"",
            path.display()
        ))
    })
}

/// GPT-2's layout always has biases, so `export` writes zeros for a model without them
/// (as llama.cpp's gpt2 wants them too): biases all zero are read back as a model
/// without biases (`model.bias = false`, which the gpt2 preset does not allow), and
/// removed. An untrained GPT-2 saved by transformers has zero biases too and comes in
/// bias-free: its logits are the same.
pub(crate) fn drop_zero_biases(
    m: &mut ModelConfig,
    ours: &mut HashMap<String, Tensor>,
) -> Result<()> {
    for (name, t) in ours.iter() {
        if name.ends_with(".bias") && t.abs()?.max_all()?.to_scalar::<f32>()? != 0.0 {
            return Ok(());
        }
    }
    m.bias = false;
    m.arch = Arch::Custom;
    ours.retain(|name, _| !name.ends_with(".bias"));
    Ok(())
}

/// Removes `lm_head.weight` where a file carries the output layer as its own copy of
/// the token embedding `wte` (older transformers saves, tied Llamas); an output layer of
/// its own is refused: ours is the embedding, transposed.
fn drop_tied_head(
    tensors: &mut HashMap<String, Tensor>,
    wte: &Tensor,
    wte_name: &str,
    dir: &Path,
) -> Result<()> {
    let Some(head) = tensors.remove("lm_head.weight") else {
        return Ok(());
    };
    let same = head.dims() == wte.dims()
        && (head.to_dtype(DType::F32)? - wte)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?
            == 0.0;
    if !same {
        user_bail!(
            "{}: lm_head.weight differs from {wte_name}; only tied output layers are supported",
            dir.display()
        );
    }
    Ok(())
}

/// The rotary base of a Llama config: transformers 5 writes it in `rope_parameters`
/// (`{"rope_theta": ..., "rope_type": "default"}`), earlier versions as `rope_theta`
/// beside `rope_scaling`. A scaled variant (llama3, linear, yarn, ...) is refused:
/// read as plain rotary positions it would give other logits without a word.
fn rope_theta(hf: &Value, path: &Path) -> Result<f64> {
    for key in ["rope_parameters", "rope_scaling"] {
        let rope = &hf[key];
        if rope.is_null() {
            continue;
        }
        let kind = rope["rope_type"].as_str().or(rope["type"].as_str());
        if kind != Some("default") {
            user_bail!(
                "{}: {key} asks for {} rotary positions; only the default (unscaled) kind is supported",
                path.display(),
                kind.map_or_else(|| "scaled".to_string(), |k| format!("{k:?}"))
            );
        }
        if let Some(theta) = rope["rope_theta"].as_f64() {
            return Ok(theta);
        }
    }
    Ok(hf["rope_theta"].as_f64().unwrap_or(10000.0))
}

/// `m`, read from `from` (another tool's files), checked before any size is derived
/// from it: a damaged file's zero heads or trillion layers are its user's error.
pub fn check_read_model(m: &ModelConfig, from: &Path) -> Result<()> {
    m.validate().map_err(|e| {
        let rule = e.to_string();
        user_error(format!(
            "{}: read as {}",
            from.display(),
            rule.trim_start_matches("config: ")
        ))
    })
}

/// Reads a Hugging Face GPT-2 or Llama folder into our config and tensor names.
pub fn read_hf(dir: &Path) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| user_error(format!("cannot read {}: {e}", config_path.display())))?;
    let hf: Value = serde_json::from_str(&text)
        .map_err(|e| user_error(format!("{} is not valid JSON: {e}", config_path.display())))?;
    let model_type = hf["model_type"].as_str().unwrap_or("");
    let mut tensors = read_hf_tensors(dir)?;
    let mut ours: HashMap<String, Tensor> = HashMap::new();
    let m = match model_type {
        "gpt2" => {
            let c = usize_field(&hf, "n_embd", &config_path)?;
            let mlp = match hf["activation_function"].as_str().unwrap_or("gelu_new") {
                "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => MlpKind::GeluTanh,
                "gelu" => MlpKind::Gelu,
                other => user_bail!(
                    "{}: activation_function {other:?} is not supported (gelu_new or gelu)",
                    config_path.display()
                ),
            };
            // Variants of GPT-2's attention this model does not compute.
            for (key, ours) in [
                ("scale_attn_weights", true),
                ("scale_attn_by_inverse_layer_idx", false),
            ] {
                if let Some(theirs) = hf[key].as_bool().filter(|&v| v != ours) {
                    user_bail!(
                        "{}: {key} = {theirs} is not supported (tinygpt's attention scales by 1/sqrt(head size) alone)",
                        config_path.display()
                    );
                }
            }
            let m = ModelConfig {
                arch: if mlp == MlpKind::GeluTanh {
                    Arch::Gpt2
                } else {
                    Arch::Custom
                },
                n_layer: usize_field(&hf, "n_layer", &config_path)?,
                n_head: usize_field(&hf, "n_head", &config_path)?,
                n_kv_head: None,
                n_embd: c,
                block_size: usize_field(&hf, "n_positions", &config_path)?,
                positions: PositionKind::Learned,
                bias: true,
                norm: NormKind::LayerNorm,
                norm_eps: hf["layer_norm_epsilon"].as_f64().unwrap_or(1e-5),
                mlp,
                mlp_hidden: hf["n_inner"]
                    .as_u64()
                    .map(|v| v as usize)
                    .filter(|&h| h != 4 * c),
                vocab_size: usize_field(&hf, "vocab_size", &config_path)?,
                ..ModelConfig::default()
            };
            // save_pretrained writes "transformer.h.0...", the original files "h.0...".
            let prefix = if tensors.contains_key("transformer.wte.weight") {
                "transformer."
            } else {
                ""
            };
            check_read_model(&m, &config_path)?;
            let wte_name = format!("{prefix}wte.weight");
            let wte = take(&mut tensors, &wte_name, dir)?;
            drop_tied_head(&mut tensors, &wte, &wte_name, dir)?;
            tensors.insert(wte_name, wte);
            let spec = gpt2_spec(&m);
            for id in spec.ids() {
                let name = &spec[id].name;
                let t = take(&mut tensors, &format!("{prefix}{name}"), dir)?;
                let t = if is_linear_weight(&spec, id) {
                    t.t()?.contiguous()? // Conv1D's [in, out] -> [out, in]
                } else {
                    t
                };
                ours.insert(name.clone(), t);
            }
            let mut m = m;
            drop_zero_biases(&mut m, &mut ours)?;
            m
        }
        "llama" => {
            let rope_theta = rope_theta(&hf, &config_path)?;
            if hf["hidden_act"].as_str().unwrap_or("silu") != "silu" {
                user_bail!("{}: hidden_act must be silu", config_path.display());
            }
            let attention_bias = hf["attention_bias"].as_bool().unwrap_or(false);
            let mlp_bias = hf["mlp_bias"].as_bool().unwrap_or(false);
            if attention_bias != mlp_bias {
                user_bail!(
                    "{}: attention_bias and mlp_bias must be equal here (model.bias covers both)",
                    config_path.display()
                );
            }
            let c = usize_field(&hf, "hidden_size", &config_path)?;
            let n_head = usize_field(&hf, "num_attention_heads", &config_path)?;
            if let Some(head_dim) = hf["head_dim"].as_u64() {
                if head_dim as usize * n_head != c {
                    user_bail!("{}: head_dim {head_dim} x {n_head} heads != hidden_size {c}; not supported", config_path.display());
                }
            }
            let m = ModelConfig {
                // The preset has no biases; a Llama with them is the same model, custom.
                arch: if attention_bias {
                    Arch::Custom
                } else {
                    Arch::Llama
                },
                n_layer: usize_field(&hf, "num_hidden_layers", &config_path)?,
                n_head,
                n_kv_head: hf["num_key_value_heads"].as_u64().map(|v| v as usize),
                n_embd: c,
                block_size: usize_field(&hf, "max_position_embeddings", &config_path)?,
                positions: PositionKind::Rope,
                rope_theta,
                bias: attention_bias,
                norm: NormKind::RmsNorm,
                norm_eps: hf["rms_norm_eps"].as_f64().unwrap_or(1e-6),
                mlp: MlpKind::Swiglu,
                mlp_hidden: Some(usize_field(&hf, "intermediate_size", &config_path)?),
                vocab_size: usize_field(&hf, "vocab_size", &config_path)?,
                ..ModelConfig::default()
            };
            check_read_model(&m, &config_path)?;
            let wte = take(&mut tensors, "model.embed_tokens.weight", dir)?;
            drop_tied_head(&mut tensors, &wte, "model.embed_tokens.weight", dir)?;
            let spec = ModelSpec::new(&m);
            let mut take = |name: &str| take(&mut tensors, name, dir);
            let name = |id: ParamId| spec[id].name.clone();
            ours.insert(name(spec.wte), wte);
            for (i, b) in spec.blocks.iter().enumerate() {
                let l = format!("model.layers.{i}");
                for (norm, hf_norm) in llama_norms(b) {
                    ours.insert(name(norm.weight), take(&format!("{l}.{hf_norm}.weight"))?);
                }
                for (linear, parts) in llama_projections(b, &spec.shapes) {
                    let mut stack = |what: &str| -> Result<Tensor> {
                        let parts = parts
                            .iter()
                            .map(|(hf_name, _)| take(&format!("{l}.{hf_name}.{what}")))
                            .collect::<Result<Vec<_>>>()?;
                        Ok(Tensor::cat(&parts, 0)?)
                    };
                    ours.insert(name(linear.weight), stack("weight")?);
                    if let Some(bias) = linear.bias {
                        ours.insert(name(bias), stack("bias")?);
                    }
                }
            }
            ours.insert(name(spec.ln_f.weight), take("model.norm.weight")?);
            m
        }
        other => user_bail!(
            "{}: model_type {other:?} is not supported; import reads gpt2 and llama",
            config_path.display()
        ),
    };
    // Buffers some files carry (GPT-2's causal mask, rotary caches) are not weights.
    tensors.retain(|name, _| {
        !(name.ends_with(".attn.bias")
            || name.ends_with(".attn.masked_bias")
            || name.contains("rotary_emb"))
    });
    if let Some(extra) = tensors.keys().next() {
        user_bail!(
            "{}: unexpected tensor {extra}; this is not a {model_type} layout we read",
            dir.display()
        );
    }
    Ok((m, ours))
}

/// Refuses an import's `--from` that is not there, or is a checkpoint of ours already
/// (nothing to import: it is used as it is).
pub fn check_import_source(from: &Path) -> Result<()> {
    if !from.exists() {
        user_bail!(
            "--from {}: no such file or folder; pass a Hugging Face model folder or a GGUF file",
            from.display()
        );
    }
    if RunDir::new(from).has_checkpoint() {
        user_bail!(
            "--from {0} is a tinygpt checkpoint already: use it as it is (--checkpoint {0}, or train --init-from {0})",
            from.display()
        );
    }
    Ok(())
}

/// Refuses an import's `--out` that is a file or a folder holding anything: an import
/// writes config.toml, tokenizer.json and model.safetensors, and must overwrite nothing
/// of the user's (nor the folder it reads from).
pub fn check_import_folder(out: &Path) -> Result<()> {
    if out.is_file() {
        user_bail!(
            "--out {} is a file; pass a folder to create, e.g. --out checkpoints/<name>",
            out.display()
        );
    }
    let Ok(entries) = std::fs::read_dir(out) else {
        return crate::util::check_output_folder("--out", out);
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    names.sort();
    let more = if names.len() > 4 { ", ..." } else { "" };
    names.truncate(4);
    user_bail!(
        "--out {} is not empty (it holds {}{more}); pass a new or empty folder, e.g. --out checkpoints/<name>",
        out.display(),
        names.join(", ")
    )
}

/// Imports a Hugging Face folder as a run folder at `out` (step 0, no optimiser state):
/// ready for generate, eval, info, and `train --init-from`.
pub fn import(from: &Path, out: &Path) -> Result<Config> {
    check_import_source(from)?;
    check_import_folder(out)?;
    let (model_cfg, tensors) = read_hf(from)?;
    let tk_path = from.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&tk_path)?;
    save_imported(from, out, model_cfg, &tensors, tokenizer)
}

/// Writes a model read from `from` (a Hugging Face folder or a GGUF file) as a run
/// folder at `out`: step 0, no optimiser state, no corpus.
pub fn save_imported(
    from: &Path,
    out: &Path,
    model_cfg: ModelConfig,
    tensors: &HashMap<String, Tensor>,
    tokenizer: Tokenizer,
) -> Result<Config> {
    let mut config = Config::default();
    config.run.name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    config.run.out_dir = out.parent().map(Path::to_path_buf).unwrap_or_default();
    // Trained elsewhere: no corpus of ours (`info` says so; `cache` counts no use).
    config.data.corpus = std::path::PathBuf::new();
    // The tokenizer it holds, described as a trained one would be (so `compare` and
    // `info` agree on what it is).
    config.tokenizer.kind = match tokenizer.kind_name() {
        "char" => TokenizerKind::Char,
        _ => TokenizerKind::Bpe,
    };
    config.tokenizer.vocab_size = tokenizer.vocab_size();
    if config.tokenizer.kind == TokenizerKind::Bpe && tokenizer.vocab_size() < 257 {
        let json: Value = serde_json::from_str(&tokenizer.to_json()?)?;
        user_bail!(
            "{}: its tokenizer is a {} vocabulary of {} tokens, not a char one; tinygpt reads char vocabularies and BPE ones of at least 257 tokens (256 bytes and an end of text)",
            from.display(),
            json["model"]["type"].as_str().unwrap_or("tokenizers"),
            tokenizer.vocab_size()
        );
    }
    config.model = model_cfg;
    config
        .validate()
        .map_err(|e| user_error(format!("{}: {e:#}", from.display())))?;
    if tokenizer.vocab_size() > config.model.vocab_size {
        user_bail!(
            "{}: the tokenizer has {} tokens but the model only {}",
            from.display(),
            tokenizer.vocab_size(),
            config.model.vocab_size
        );
    }
    let model = Gpt::new(&config.model, 0, &Device::Cpu)?;
    model.params().load(tensors, &from.display().to_string())?;
    // Checked again: the folder may have filled while the model was read.
    check_import_folder(out)?;
    let run = RunDir::new(out);
    run.save(
        &config,
        &tokenizer,
        &model.params().to_map(),
        &HashMap::new(),
        &TrainState::default(),
    )?;
    Ok(config)
}
