//! Checkpoint loading: a real small checkpoint with one of its files (config.toml,
//! tokenizer.json, model.safetensors) replaced by fuzz bytes, or mutated, must load or
//! fail with a clean error, never panic.
#![no_main]

use std::sync::OnceLock;

use candle_core::Device;
use libfuzzer_sys::fuzz_target;
use tinygpt::checkpoint::Loaded;
use tinygpt::config::{Config, TokenizerKind};

/// The three files of a tiny model, made once.
fn seed_files() -> &'static [Vec<u8>; 3] {
    static FILES: OnceLock<[Vec<u8>; 3]> = OnceLock::new();
    FILES.get_or_init(|| {
        let tk = tinygpt::tokenizer::Tokenizer::train_char("abcdefgh ijkl\n").unwrap();
        let mut config = Config::default();
        config.tokenizer.kind = TokenizerKind::Char;
        config.model.n_layer = 1;
        config.model.n_head = 2;
        config.model.n_embd = 8;
        config.model.block_size = 8;
        config.model.vocab_size = tk.vocab_size();
        let model = tinygpt::model::Gpt::new(&config.model, 0, &Device::Cpu).unwrap();
        let weights = model.params().to_map();
        let bytes = safetensors::serialize(weights.iter().map(|(k, v)| (k.as_str(), v)), None).unwrap();
        [config.to_toml_string().into_bytes(), tk.to_json().unwrap().into_bytes(), bytes]
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let mut files = seed_files().clone();
    let which = (selector % 3) as usize;
    if selector & 0x80 == 0 {
        files[which] = rest.to_vec();
    } else {
        // Overwrite a stretch of the real file: keeps most of its structure.
        let file = &mut files[which];
        if let Some((&at, patch)) = rest.split_first() {
            let start = (at as usize * file.len()) / 256;
            for (i, b) in patch.iter().enumerate() {
                if let Some(slot) = file.get_mut(start + i) {
                    *slot = *b;
                }
            }
        }
    }
    let _ = Loaded::from_parts(&files[0], &files[1], &files[2], &Device::Cpu, "fuzz");
});
