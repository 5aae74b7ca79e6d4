//! tokenizer.json loading: any bytes load or fail cleanly; a loaded tokenizer encodes
//! and decodes without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tinygpt::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    if let Ok(tk) = Tokenizer::from_json(data) {
        if let Ok(ids) = tk.encode("To be, or not to be: ünïcödé 🙂") {
            let _ = tk.decode(&ids);
            let mut stream = tk.text_stream();
            for id in ids {
                let _ = stream.push(id);
            }
        }
    }
});
