//! Hugging Face interop: export -> import is the identity on weights and logits, a
//! GPT-2 file with known values lands in the right places (Conv1D transposes), sharded
//! files load, and what cannot be represented is refused by name.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use tinygpt::checkpoint::{Loaded, RunDir, TrainState};
use tinygpt::config::{Arch, Config, MlpKind, NormKind, PositionKind, TokenizerKind};
use tinygpt::model::Gpt;
use tinygpt::tokenizer::Tokenizer;

/// A change to the default test config.
type Edit = fn(&mut Config);

const TEXT: &str = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?\n";

/// A run folder holding a freshly initialised model of this config.
fn run_folder(dir: &Path, name: &str, edit: impl Fn(&mut Config)) -> std::path::PathBuf {
    let tk = Tokenizer::train_char(TEXT).unwrap();
    let mut config = Config::default();
    config.model.n_layer = 2;
    config.model.n_head = 4;
    config.model.n_embd = 32;
    config.model.block_size = 16;
    config.model.vocab_size = tk.vocab_size();
    edit(&mut config);
    config.validate().unwrap();
    let model = Gpt::new(&config.model, 7, &Device::Cpu).unwrap();
    // Non-trivial biases and norm gains, so a mix-up cannot hide behind zeros and ones.
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
            &tk,
            &model.params().to_map(),
            &HashMap::new(),
            &TrainState::default(),
        )
        .unwrap();
    path
}

fn logits(model: &Gpt) -> Vec<Vec<f32>> {
    let ids = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3]], &Device::Cpu).unwrap();
    let out = model.forward(&ids, 0, None, None).unwrap().logits;
    out.squeeze(0).unwrap().to_vec2().unwrap()
}

fn same_weights(a: &Gpt, b: &Gpt) {
    let (a, b) = (a.params().to_map(), b.params().to_map());
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        let u = b
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing after the round trip"));
        assert_eq!(t.dims(), u.dims(), "{name}");
        assert_eq!(
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            u.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{name}"
        );
    }
}

/// Llama's layout: rotary positions, RMSNorm, SwiGLU.
fn llama(c: &mut Config) {
    c.model.arch = Arch::Llama;
    c.model.positions = PositionKind::Rope;
    c.model.norm = NormKind::RmsNorm;
    c.model.mlp = MlpKind::Swiglu;
}

/// A run folder of this config in `dir`, loaded, and exported to `dir`/hf.
fn exported(dir: &Path, edit: impl Fn(&mut Config)) -> (Loaded, std::path::PathBuf) {
    let run = run_folder(dir, "run", edit);
    let loaded = Loaded::load(&run, &Device::Cpu).unwrap();
    let hf = dir.join("hf");
    tinygpt::interop::export(&loaded, &hf).unwrap();
    (loaded, hf)
}

#[test]
fn export_then_import_is_the_identity() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, Edit); 4] = [
        ("gpt2", |c| {
            c.model.arch = Arch::Gpt2;
            c.model.positions = PositionKind::Learned;
            c.model.norm = NormKind::LayerNorm;
            c.model.mlp = MlpKind::GeluTanh;
            c.model.bias = true;
        }),
        ("gelu-erf-gpt2", |c| {
            c.model.bias = true; // the default custom model: learned, LayerNorm, erf GELU
        }),
        // GPT-2's layout has biases: export writes zeros, import reads them back as none
        // (the model keeps its parameter count and what --init-from would train).
        ("bias-free-gpt2", |c| c.model.bias = false),
        ("llama", |c| {
            llama(c);
            c.model.n_kv_head = Some(2);
            c.model.norm_eps = 1e-6;
        }),
    ];
    for (name, edit) in cases {
        let run = run_folder(dir.path(), name, edit);
        let original = Loaded::load(&run, &Device::Cpu).unwrap();
        let hf = dir.path().join(format!("{name}-hf"));
        tinygpt::interop::export(&original, &hf).unwrap();
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            assert!(hf.join(f).is_file(), "{name}: {f}");
        }
        let back = dir.path().join(format!("{name}-back"));
        tinygpt::interop::import(&hf, &back).unwrap();
        let imported = Loaded::load(&back, &Device::Cpu).unwrap();
        same_weights(&original.model, &imported.model);
        assert_eq!(
            imported.config.model.bias, original.config.model.bias,
            "{name}"
        );
        assert_eq!(logits(&original.model), logits(&imported.model), "{name}");
        assert_eq!(
            imported.tokenizer.vocab_size(),
            original.tokenizer.vocab_size()
        );
    }
}

#[test]
fn exported_gpt2_uses_conv1d_layout_and_hf_names() {
    let dir = tempfile::tempdir().unwrap();
    let (loaded, hf) = exported(dir.path(), |c| c.model.bias = true);
    let tensors =
        candle_core::safetensors::load(hf.join("model.safetensors"), &Device::Cpu).unwrap();
    let ours = loaded.model.params().to_map();
    let w = &ours["h.1.mlp.c_fc.weight"]; // [4C, C]
    let theirs = &tensors["transformer.h.1.mlp.c_fc.weight"]; // [C, 4C]
    assert_eq!(theirs.dims(), &[32, 128]);
    assert_eq!(
        theirs
            .t()
            .unwrap()
            .contiguous()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        w.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(
        config["activation_function"], "gelu",
        "erf GELU exports as exact gelu"
    );
    assert_eq!(config["n_positions"], 16);
}

/// A GPT-2 file in the original (prefix-free) naming, written here with known values:
/// every element says where it is, so a transpose or a swap cannot go unnoticed.
#[test]
fn known_gpt2_values_land_where_they_belong() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    let tk = Tokenizer::train_char(TEXT).unwrap();
    tk.save(&hf.join("tokenizer.json")).unwrap();
    let (c, v, t) = (8usize, tk.vocab_size(), 4usize);
    let config = serde_json::json!({
        "model_type": "gpt2", "vocab_size": v, "n_positions": t, "n_embd": c,
        "n_layer": 1, "n_head": 2, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
    });
    std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
    // value(tag, i, j) = tag * 10000 + i * 100 + j
    let known = |tag: usize, rows: usize, cols: usize| -> Tensor {
        let values: Vec<f32> = (0..rows * cols)
            .map(|k| (tag * 10000 + (k / cols) * 100 + k % cols) as f32)
            .collect();
        Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap()
    };
    let vector = |tag: usize, n: usize| known(tag, 1, n).squeeze(0).unwrap();
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("wte.weight".into(), known(1, v, c));
    tensors.insert("wpe.weight".into(), known(2, t, c));
    tensors.insert("h.0.ln_1.weight".into(), vector(3, c));
    tensors.insert("h.0.ln_1.bias".into(), vector(4, c));
    tensors.insert("h.0.attn.c_attn.weight".into(), known(5, c, 3 * c)); // [in, out]
    tensors.insert("h.0.attn.c_attn.bias".into(), vector(6, 3 * c));
    tensors.insert("h.0.attn.c_proj.weight".into(), known(7, c, c));
    tensors.insert("h.0.attn.c_proj.bias".into(), vector(8, c));
    tensors.insert("h.0.ln_2.weight".into(), vector(9, c));
    tensors.insert("h.0.ln_2.bias".into(), vector(10, c));
    tensors.insert("h.0.mlp.c_fc.weight".into(), known(11, c, 4 * c));
    tensors.insert("h.0.mlp.c_fc.bias".into(), vector(12, 4 * c));
    tensors.insert("h.0.mlp.c_proj.weight".into(), known(13, 4 * c, c));
    tensors.insert("h.0.mlp.c_proj.bias".into(), vector(14, c));
    tensors.insert("ln_f.weight".into(), vector(15, c));
    tensors.insert("ln_f.bias".into(), vector(16, c));
    // The causal-mask buffer some GPT-2 files carry is not a weight.
    tensors.insert(
        "h.0.attn.bias".into(),
        Tensor::ones((1, 1, t, t), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, hf.join("model.safetensors")).unwrap();

    let out = dir.path().join("imported");
    let config = tinygpt::interop::import(&hf, &out).unwrap();
    assert_eq!(config.model.arch, Arch::Gpt2);
    let loaded = Loaded::load(&out, &Device::Cpu).unwrap();
    // Its config.toml tells the tokenizer it holds (a char vocabulary here).
    assert_eq!(loaded.config.tokenizer.kind, TokenizerKind::Char);
    assert_eq!(loaded.config.tokenizer.vocab_size, tk.vocab_size());
    let ours = loaded.model.params().to_map();
    let at = |name: &str, i: usize, j: usize| -> f32 {
        ours[name]
            .get(i)
            .unwrap()
            .get(j)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    // Linear weights are [out, in]: ours[o][i] = theirs[i][o].
    assert_eq!(ours["h.0.attn.c_attn.weight"].dims(), &[3 * c, c]);
    assert_eq!(
        at("h.0.attn.c_attn.weight", 17, 3),
        (5 * 10000 + 3 * 100 + 17) as f32
    );
    assert_eq!(
        at("h.0.mlp.c_fc.weight", 30, 7),
        (11 * 10000 + 7 * 100 + 30) as f32
    );
    assert_eq!(
        at("h.0.mlp.c_proj.weight", 5, 31),
        (13 * 10000 + 31 * 100 + 5) as f32
    );
    // Embeddings are not transposed.
    assert_eq!(at("wte.weight", 9, 2), (10000 + 9 * 100 + 2) as f32);
    assert_eq!(at("wpe.weight", 3, 1), (2 * 10000 + 3 * 100 + 1) as f32);
    let bias: Vec<f32> = ours["h.0.attn.c_attn.bias"].to_vec1().unwrap();
    assert_eq!(bias[20], (6 * 10000 + 20) as f32);

    // A tensor missing: named in the error.
    tensors.remove("h.0.mlp.c_fc.bias");
    candle_core::safetensors::save(&tensors, hf.join("model.safetensors")).unwrap();
    let err = tinygpt::interop::import(&hf, &dir.path().join("again")).unwrap_err();
    assert!(format!("{err}").contains("h.0.mlp.c_fc.bias"), "{err}");
}

#[test]
fn sharded_llama_files_load() {
    let dir = tempfile::tempdir().unwrap();
    let (loaded, hf) = exported(dir.path(), llama);
    // Split model.safetensors into two shards plus an index, as large models come.
    let all = candle_core::safetensors::load(hf.join("model.safetensors"), &Device::Cpu).unwrap();
    std::fs::remove_file(hf.join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (k, chunk) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", k + 1);
        let part: HashMap<String, Tensor> = chunk
            .iter()
            .map(|n| ((*n).clone(), all[*n].clone()))
            .collect();
        candle_core::safetensors::save(&part, hf.join(&file)).unwrap();
        for n in chunk {
            weight_map.insert((*n).clone(), serde_json::json!(file));
        }
    }
    std::fs::write(
        hf.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    let back = dir.path().join("back");
    tinygpt::interop::import(&hf, &back).unwrap();
    let imported = Loaded::load(&back, &Device::Cpu).unwrap();
    assert_eq!(logits(&loaded.model), logits(&imported.model));
}

#[test]
fn options_without_a_hugging_face_equivalent_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(Edit, &str); 3] = [
        (
            |c| c.model.positions = PositionKind::Sinusoidal,
            "model.positions",
        ),
        (|c| c.model.n_kv_head = Some(2), "model.n_kv_head"),
        (|c| c.model.positions = PositionKind::Rope, "model.norm"),
    ];
    for (i, (edit, needle)) in cases.into_iter().enumerate() {
        let run = run_folder(dir.path(), &format!("r{i}"), edit);
        let loaded = Loaded::load(&run, &Device::Cpu).unwrap();
        let err =
            tinygpt::interop::export(&loaded, &dir.path().join(format!("out{i}"))).unwrap_err();
        assert!(format!("{err}").contains(needle), "{needle}: {err}");
        assert!(tinygpt::error::find_user_error(&err).is_some());
    }
}

/// Edits `dir`/config.json as `edit` says.
fn edit_config_json(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

#[test]
fn transformers_5_rope_parameters_are_read_and_scaled_rotary_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (loaded, hf) = exported(dir.path(), |c| {
        llama(c);
        c.model.rope_theta = 20.0;
    });
    // What transformers 5 writes: no top-level rope_theta, a rope_parameters block.
    edit_config_json(&hf, |c| {
        let o = c.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.remove("rope_scaling");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_theta": 20.0, "rope_type": "default"}),
        );
    });
    let back = dir.path().join("back");
    let config = tinygpt::interop::import(&hf, &back).unwrap();
    assert_eq!(config.model.rope_theta, 20.0);
    let imported = Loaded::load(&back, &Device::Cpu).unwrap();
    assert_eq!(logits(&loaded.model), logits(&imported.model));
    // Llama 3's scaled rotary positions, either spelling: refused, naming the kind.
    for (key, block) in [
        (
            "rope_parameters",
            serde_json::json!({"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}),
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "linear", "factor": 2.0}),
        ),
    ] {
        edit_config_json(&hf, |c| {
            c.as_object_mut().unwrap().insert(key.into(), block);
        });
        let err = tinygpt::interop::import(&hf, &dir.path().join(format!("no-{key}"))).unwrap_err();
        assert!(tinygpt::error::find_user_error(&err).is_some(), "{err}");
        assert!(format!("{err}").contains(key), "{err}");
        edit_config_json(&hf, |c| {
            c.as_object_mut().unwrap().remove(key);
        });
    }
}

#[test]
fn a_gpt2_file_carrying_its_tied_output_layer_imports() {
    let dir = tempfile::tempdir().unwrap();
    let (loaded, hf) = exported(dir.path(), |c| c.model.bias = true);
    // Older transformers saves write lm_head.weight beside the embedding it is tied to.
    let file = hf.join("model.safetensors");
    let mut all = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let wte = all["transformer.wte.weight"].clone();
    all.insert("lm_head.weight".into(), wte.clone());
    candle_core::safetensors::save(&all, &file).unwrap();
    let back = dir.path().join("back");
    tinygpt::interop::import(&hf, &back).unwrap();
    let imported = Loaded::load(&back, &Device::Cpu).unwrap();
    assert_eq!(logits(&loaded.model), logits(&imported.model));
    // An output layer of its own is not ours to read.
    all.insert("lm_head.weight".into(), (wte + 1.0).unwrap());
    candle_core::safetensors::save(&all, &file).unwrap();
    let err = tinygpt::interop::import(&hf, &dir.path().join("untied")).unwrap_err();
    assert!(format!("{err}").contains("lm_head.weight differs"), "{err}");
}

#[test]
fn import_overwrites_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_, hf) = exported(dir.path(), |c| c.model.bias = true);
    let before = std::fs::read(hf.join("model.safetensors")).unwrap();
    // Into the folder it reads, into a folder of the user's, onto a file.
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("config.toml"), "# my notes\n").unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "notes").unwrap();
    for (out, says) in [
        (&hf, "is not empty"),
        (&mine, "config.toml"),
        (&file, "is a file"),
    ] {
        let err = tinygpt::interop::import(&hf, out).unwrap_err();
        assert!(tinygpt::error::find_user_error(&err).is_some(), "{err}");
        assert!(format!("{err}").contains(says), "{says}: {err}");
    }
    assert_eq!(std::fs::read(hf.join("model.safetensors")).unwrap(), before);
    assert_eq!(
        std::fs::read_to_string(mine.join("config.toml")).unwrap(),
        "# my notes\n"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "notes");
    // Nothing to import: a missing source, a checkpoint of ours.
    let err =
        tinygpt::interop::import(&dir.path().join("nope"), &dir.path().join("a")).unwrap_err();
    assert!(format!("{err}").contains("no such file or folder"), "{err}");
    let run = dir.path().join("run");
    let err = tinygpt::interop::import(&run, &dir.path().join("b")).unwrap_err();
    assert!(
        format!("{err}").contains("a tinygpt checkpoint already"),
        "{err}"
    );
    // An empty folder is fine.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    tinygpt::interop::import(&hf, &empty).unwrap();
}

#[test]
fn a_tokenizer_too_small_for_bpe_and_not_char_is_refused_naming_its_kind() {
    let dir = tempfile::tempdir().unwrap();
    let (_, hf) = exported(dir.path(), |c| c.model.bias = true);
    let word_level = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}
    });
    std::fs::write(hf.join("tokenizer.json"), word_level.to_string()).unwrap();
    let err = tinygpt::interop::import(&hf, &dir.path().join("back")).unwrap_err();
    assert!(tinygpt::error::find_user_error(&err).is_some(), "{err}");
    let message = format!("{err}");
    assert!(
        message.contains("its tokenizer is a WordLevel vocabulary of 3 tokens"),
        "{message}"
    );
}

/// Damaged or foreign configs are refused by name before any size is derived from them
/// (zero heads divided by, a trillion layers allocated), and so are variants of GPT-2
/// this model does not compute and weights that are not numbers of a float kind.
#[test]
fn damaged_and_foreign_folders_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (_, hf) = exported(dir.path(), |c| {
        c.model.arch = Arch::Gpt2;
        c.model.positions = PositionKind::Learned;
        c.model.norm = NormKind::LayerNorm;
        c.model.mlp = MlpKind::GeluTanh;
        c.model.bias = true;
    });
    let original = std::fs::read(hf.join("config.json")).unwrap();
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("n_head", 0.into(), "n_head = 0"),
        (
            "n_layer",
            1_000_000_000_000u64.into(),
            "n_layer = 1000000000000 exceeds",
        ),
        ("n_positions", 1.into(), "block_size = 1 is too small"),
        (
            "scale_attn_by_inverse_layer_idx",
            true.into(),
            "scale_attn_by_inverse_layer_idx = true",
        ),
        (
            "scale_attn_weights",
            false.into(),
            "scale_attn_weights = false",
        ),
    ];
    for (i, (key, value, says)) in cases.into_iter().enumerate() {
        std::fs::write(hf.join("config.json"), &original).unwrap();
        edit_config_json(&hf, |c| {
            c.as_object_mut().unwrap().insert(key.into(), value);
        });
        let err = tinygpt::interop::import(&hf, &dir.path().join(format!("back{i}"))).unwrap_err();
        assert!(
            tinygpt::error::find_user_error(&err).is_some(),
            "{key}: {err:#}"
        );
        assert!(format!("{err}").contains(says), "{key}: {err}");
        assert!(format!("{err}").contains("config.json"), "{key}: {err}");
    }
    std::fs::write(hf.join("config.json"), &original).unwrap();
    // A weight stored as whole numbers is not cast into a model that scores 7e10.
    let file = hf.join("model.safetensors");
    let mut all = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let wpe = all["transformer.wpe.weight"].clone();
    all.insert(
        "transformer.wpe.weight".into(),
        wpe.to_dtype(DType::I64).unwrap(),
    );
    candle_core::safetensors::save(&all, &file).unwrap();
    let err = tinygpt::interop::import(&hf, &dir.path().join("ints")).unwrap_err();
    assert!(tinygpt::error::find_user_error(&err).is_some(), "{err:#}");
    assert!(
        format!("{err}").contains("transformer.wpe.weight holds I64"),
        "{err}"
    );
}
